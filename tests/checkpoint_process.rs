//! Checkpoints through the binary: `kill -9` at random moments never costs the last
//! good checkpoint, and `export` streams in memory bounded by the largest unit.

use serde_json::json;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tierzero::checkpoint::{save, Checkpoint};

pub(crate) fn tierzero() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tierzero"))
}

pub(crate) fn write_config(dir: &Path, model: serde_json::Value, steps: u64) -> std::path::PathBuf {
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4096,
            "offload_optimizer": { "device": "nvme", "nvme_path": dir.join("nvme"), "buffer_count": 2 }
        },
        "model": model,
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": steps, "devices": 2, "save_interval": 1, "keep_last": 3, "output_dir": dir.join("out") }
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// (step, loss bits) of every line of `dir/metrics.jsonl` (empty without one).
pub(crate) fn step_losses(dir: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap().to_bits())
        })
        .collect()
}

/// Byte-identical master weights and optimizer state in two checkpoint directories.
pub(crate) fn same_state(a: &Path, b: &Path) {
    for state in ["master", "exp_avg", "exp_avg_sq"] {
        let file = format!("{state}.safetensors");
        assert!(
            std::fs::read(a.join(&file)).unwrap() == std::fs::read(b.join(&file)).unwrap(),
            "{file} of {} and {} differ",
            a.display(),
            b.display()
        );
    }
}

/// Every complete checkpoint verifies; returns the step `latest` names.
pub(crate) fn check_all(root: &Path) -> Option<u64> {
    for (step, dir) in save::list(root) {
        let checkpoint = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("step-{step}: {e}"));
        checkpoint.verify().unwrap_or_else(|e| panic!("step-{step}: {e}"));
    }
    let latest = save::follow_latest(root).ok()?;
    let checkpoint = Checkpoint::open(&latest).unwrap_or_else(|e| panic!("latest {}: {e}", latest.display()));
    checkpoint.verify().unwrap();
    Some(checkpoint.manifest.step)
}

/// Names under `root` that start with a dot: what interrupted saves left (staging,
/// moved-aside and pruned directories, `latest`'s temporary file).
pub(crate) fn leftovers(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn kill_9_during_saves_never_loses_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let model = json!({ "preset": "llama-tiny", "hidden_size": 64, "num_hidden_layers": 2 });
    let config = write_config(tmp.path(), model, 100_000);
    let root = save::root(&tmp.path().join("out"));
    let mut latest = None;
    let mut during_save = 0;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for round in 0..12 {
        let mut command = tierzero();
        command.arg("train").arg("-c").arg(&config);
        if latest.is_some() {
            command.args(["--resume", "latest"]);
        }
        let log = tmp.path().join(format!("round-{round}.log"));
        let stderr = std::fs::File::create(&log).unwrap();
        let mut child = command.stdout(Stdio::null()).stderr(stderr).spawn().unwrap();
        // wait for training to be under way, then kill at a pseudo-random moment
        let start = Instant::now();
        while save::follow_latest(&root)
            .ok()
            .and_then(|p| save::parse_step(&p.file_name()?.to_string_lossy()))
            <= latest
            && start.elapsed() < Duration::from_secs(60)
        {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "round {round}: exited early ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(seed % 400));
        let staging = std::fs::read_dir(&root)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            })
            .unwrap_or(false);
        child.kill().unwrap();
        child.wait().unwrap();
        during_save += usize::from(staging);
        let now = check_all(&root);
        assert!(
            now.is_some(),
            "round {round}: no checkpoint after {:?}",
            start.elapsed()
        );
        assert!(
            now >= latest,
            "round {round}: latest went back from {latest:?} to {now:?}"
        );
        latest = now;
    }
    println!(
        "12 kills, {during_save} of them with a save in progress; last good checkpoint: step {latest:?}"
    );
    // the last good checkpoint resumes and finishes; leftovers are cleaned up
    let last = latest.unwrap_or(0);
    let status = tierzero()
        .arg("train")
        .arg("-c")
        .arg(&config)
        .args([
            "--resume",
            "latest",
            "--set",
            &format!("train.steps={}", last + 2),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(check_all(&root), Some(last + 2));
    let left = leftovers(&root);
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn export_streams_in_memory_bounded_by_the_largest_unit() {
    let tmp = tempfile::tempdir().unwrap();
    // 24 layers of 1.8 MB (fp32) each: 43 MB of master weights
    let model = json!({ "preset": "llama-tiny", "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 24, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256 });
    let config = write_config(tmp.path(), model, 1);
    let status = tierzero()
        .arg("train")
        .arg("-c")
        .arg(&config)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let out = tierzero()
        .arg("export")
        .arg(save::root(&tmp.path().join("out")))
        .arg("--hf")
        .arg(tmp.path().join("hf"))
        .args(["--dtype", "fp32", "--max-shard-size", "8M"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let number = |after: &str| -> u64 {
        let rest = &text[text.find(after).unwrap_or_else(|| panic!("{text}")) + after.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (growth, largest, params) = (number("grew by "), number("largest unit "), number("units, "));
    let model_bytes = 4 * params;
    println!("export: RSS grew {growth} bytes; largest unit {largest}; model {model_bytes}");
    assert!(
        growth <= 6 * largest,
        "grew {growth} bytes, largest unit {largest}"
    );
    assert!(
        growth * 4 < model_bytes,
        "grew {growth} bytes for a {model_bytes}-byte model"
    );
}
