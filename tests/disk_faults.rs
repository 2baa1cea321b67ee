//! A full or failing disk under a run: ENOSPC while a checkpoint is written (a real full
//! file system: a size-limited tmpfs the test mounts), ENOSPC and EIO on the NVMe tier
//! mid-step (injected in the BlockIo seam with `TIERZERO_IO_FAULT`, as the kernel would
//! report them). Each ends the run within seconds on every rank with an error naming the
//! operation and the file, leaves the last good checkpoint as `latest` and nothing
//! half-written, and a resume from that checkpoint continues the uninterrupted run bit
//! for bit.

use crate::checkpoint_process::{check_all, leftovers, same_state, step_losses};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tierzero::checkpoint::save;

/// A tmpfs of `bytes` mounted at `dir` for the guard's lifetime (CI runs as root).
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, bytes: u64) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "cannot mount a {bytes}-byte tmpfs at {} (needs root)",
            dir.display()
        );
        SmallDisk(dir.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A config of a tiny Llama over 2 ranks saving every step, the optimizer on `optimizer`
/// (its NVMe files under `nvme`), outputs under `out`.
fn write_config(dir: &Path, out: &Path, optimizer: &str, nvme: &Path) -> PathBuf {
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4096,
            "offload_optimizer": { "device": optimizer, "nvme_path": nvme, "buffer_count": 2 }
        },
        "model": { "preset": "llama-tiny", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96 },
        "data": { "synthetic": "markov", "seq_len": 16 },
        "train": { "steps": 8, "devices": 2, "save_interval": 1, "keep_last": 20, "output_dir": out }
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// `tierzero train -c config ARGS` with `env`, at most `limit`: (status, stderr).
fn train(
    config: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> (std::process::ExitStatus, String) {
    let log = config.with_extension(format!("{}.log", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .arg("train")
        .arg("-c")
        .arg(config)
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!(
                "still running {limit:?} after a disk fault: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(&log).unwrap_or_default())
}

/// Bytes under `dir`.
fn size_of(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

#[test]
fn a_full_disk_during_a_save_keeps_the_last_checkpoint_and_ends_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    // how large one checkpoint is, on an ordinary disk
    let probe = write_config(
        tmp.path(),
        &tmp.path().join("probe"),
        "cpu",
        &tmp.path().join("nvme"),
    );
    let (status, log) = train(&probe, &["--set", "train.steps=1"], &[], Duration::from_secs(120));
    assert!(status.success(), "{log}");
    let checkpoint = size_of(&save::root(&tmp.path().join("probe")).join("step-1"));
    // room for two checkpoints and the metrics, not three
    let disk = SmallDisk::mount(
        &tmp.path().join("small"),
        (checkpoint * 5 / 2).div_ceil(4096) * 4096,
    );
    let config = write_config(tmp.path(), &disk.0.join("out"), "cpu", &tmp.path().join("nvme"));
    let (status, log) = train(&config, &[], &[], Duration::from_secs(60));
    assert!(!status.success(), "the run outlived a full disk: {log}");
    assert!(
        log.contains("No space left on device") && log.contains(".tmp-step-3"),
        "the error names the cause and the file: {log}"
    );
    assert!(
        ["writing", "creating", "syncing"]
            .iter()
            .any(|op| log.contains(op)),
        "the error names the operation: {log}"
    );
    let root = save::root(&disk.0.join("out"));
    assert_eq!(check_all(&root), Some(2), "step-2 is whole and still latest");
    assert_eq!(
        leftovers(&root),
        Vec::<String>::new(),
        "the failed save's staging is gone"
    );
}

/// `TIERZERO_IO_FAULT` on the optimizer's NVMe files: the run stops with the error, and
/// the last checkpoint resumes to the uninterrupted run's losses and state. The run makes
/// about 90 NVMe reads and 70 writes a step (both ranks), so the faults below land
/// mid-run, after a few checkpoints.
fn nvme_fault_case(fault: &str, words: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let nvme = tmp.path().join("nvme");
    let whole = write_config(tmp.path(), &tmp.path().join("whole"), "nvme", &nvme);
    let (status, log) = train(&whole, &[], &[], Duration::from_secs(120));
    assert!(status.success(), "{log}");

    let faulty = tmp.path().join("faulty");
    std::fs::create_dir_all(&faulty).unwrap();
    let config = write_config(&faulty, &faulty.join("out"), "nvme", &nvme);
    let (status, log) = train(
        &config,
        &[],
        &[("TIERZERO_IO_FAULT", fault)],
        Duration::from_secs(60),
    );
    assert!(!status.success(), "{fault}: the run went on: {log}");
    for word in words {
        assert!(log.contains(word), "{fault}: the error lacks {word:?}: {log}");
    }
    let root = save::root(&faulty.join("out"));
    let last = check_all(&root).unwrap_or_else(|| panic!("{fault}: no checkpoint before the fault: {log}"));
    assert!(last < 8, "{fault}: the fault came after the last step");
    assert_eq!(leftovers(&root), Vec::<String>::new(), "{fault}");

    // resumed from the last good checkpoint, without the fault: the uninterrupted run
    let (status, log) = train(&config, &["--resume", "latest"], &[], Duration::from_secs(120));
    assert!(status.success(), "{log}");
    let resumed: Vec<(u64, u64)> = step_losses(&faulty.join("out"))
        .into_iter()
        .filter(|m| m.0 > last)
        .collect();
    let expected: Vec<(u64, u64)> = step_losses(&tmp.path().join("whole"))
        .into_iter()
        .filter(|m| m.0 > last)
        .collect();
    assert_eq!(resumed, expected, "{fault}: resumed from step {last}");
    same_state(
        &root.join("step-8"),
        &save::root(&tmp.path().join("whole")).join("step-8"),
    );
}

#[test]
fn an_io_error_on_an_nvme_read_stops_the_run_and_the_last_checkpoint_resumes_bit_exact() {
    nvme_fault_case("read@400:eio", &["Input/output error", "read", "offset", "nvme"]);
}

#[test]
fn no_space_on_an_nvme_write_stops_the_run_and_the_last_checkpoint_resumes_bit_exact() {
    nvme_fault_case(
        "write@300:enospc",
        &["no space left on the device holding", "nvme"],
    );
}

/// A real full disk under the NVMe tier: the swap files are made at their full size when
/// the run starts, so it stops there, naming the directory, before any step.
#[test]
fn an_nvme_path_too_small_for_the_swap_files_is_an_error_at_start_up() {
    let tmp = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&tmp.path().join("small"), 64 << 10);
    let config = write_config(tmp.path(), &tmp.path().join("out"), "nvme", &disk.0);
    let (status, log) = train(&config, &[], &[], Duration::from_secs(60));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("no space left on the device holding") && log.contains(&disk.0.display().to_string()),
        "{log}"
    );
    assert!(
        !tmp.path().join("out/metrics.jsonl").exists()
            || std::fs::read_to_string(tmp.path().join("out/metrics.jsonl"))
                .unwrap()
                .is_empty()
    );
}

/// `plan` (and `train`, at start-up) says when the checkpoints `keep_last` keeps do not
/// fit beside the NVMe swap files on `output_dir`'s file system, and still plans.
#[test]
fn plan_warns_when_the_checkpoints_do_not_fit_beside_the_swap_files() {
    let tmp = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&tmp.path().join("small"), 256 << 10);
    let config = write_config(tmp.path(), &disk.0.join("out"), "nvme", &disk.0.join("nvme"));
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["plan", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("21 checkpoints of")
            && err.contains("NVMe swap files on the same file system")
            && err.contains("lower train.keep_last"),
        "{err}"
    );
    // with room to spare, nothing is said
    let roomy = write_config(
        tmp.path(),
        &tmp.path().join("out"),
        "nvme",
        &tmp.path().join("nvme"),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["plan", "-c"])
        .arg(&roomy)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("checkpoints of"), "{err}");
}
