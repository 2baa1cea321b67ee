//! What clusters do to a run: SLURM and Kubernetes send SIGTERM before they kill a job
//! (the run saves the step under way and exits "preempted"), and torchrun restarts a
//! worker group whose member died (`--max-restarts`): the new incarnation joins through
//! the same agent store, resumes from the newest checkpoint with `--resume auto`, and
//! ends with the weights of a run that was never interrupted.

use crate::checkpoint_process::{same_state, step_losses};
use crate::launch::free_port;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tierzero::checkpoint::save;

/// `train` on the default config into `dir`: 2 ranks, a schedule that does not depend on
/// `train.steps` (so runs of different lengths share their first steps), `extra` on top.
fn train_args(dir: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--config",
        "configs/default.json",
        "--set",
        "scheduler.params.total_num_steps=1000",
        "--set",
        "train.rendezvous_timeout=60",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend([
        "--set".into(),
        format!("train.steps={steps}"),
        "--set".into(),
        format!("train.output_dir={}", dir.display()),
        "--set".into(),
        format!(
            "zero_optimization.offload_optimizer.nvme_path={}",
            dir.join("nvme").display()
        ),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn tierzero(args: &[String], log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(std::fs::File::create(log.with_extension("out")).unwrap())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Waits for `child`, at most `limit`; its exit status.
fn wait(child: &mut Child, limit: Duration, what: &str, log: &Path) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} still running after {limit:?}: {}", read(log));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Polls until `ready` holds, at most `limit`.
fn until(limit: Duration, what: &str, ready: impl Fn() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn checkpoint(dir: &Path, step: u64) -> PathBuf {
    save::root(dir).join(format!("step-{step}"))
}

#[test]
fn sigterm_saves_the_step_under_way_and_the_resumed_run_continues_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let log = tmp.path().join("run.log");
    // `--resume auto` with nothing saved yet is a fresh start, said in one line
    let mut child = tierzero(&train_args(&run, 100_000, &["--resume", "auto"]), &log);
    until(Duration::from_secs(120), "three steps", || {
        step_losses(&run).len() >= 3
    });
    // twice at once, as a worker gets it from SLURM and from torchrun: one request
    for _ in 0..2 {
        // SAFETY: kill(2) on a child we spawned and have not reaped
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    }
    let status = wait(&mut child, Duration::from_secs(60), "the preempted run", &log);
    let stderr = read(&log);
    let stdout = read(&log.with_extension("out"));
    assert_eq!(status.code(), Some(75), "{stdout}\n{stderr}");
    assert!(stdout.contains("--resume auto: no checkpoint under"), "{stdout}");
    let stopped = step_losses(&run).last().unwrap().0;
    assert!(
        stderr.contains(&format!("preempted by SIGTERM: stopped after step {stopped}")),
        "{stderr}"
    );
    // the step it stopped after is saved and `latest`
    assert_eq!(
        save::follow_latest(&save::root(&run)).unwrap(),
        checkpoint(&run, stopped)
    );

    // resumed with the same command, it continues the uninterrupted run's losses
    let end = stopped + 3;
    let mut child = tierzero(&train_args(&run, end, &["--resume", "auto"]), &log);
    let status = wait(&mut child, Duration::from_secs(120), "the resumed run", &log);
    assert!(status.success(), "{}", read(&log));
    let out = read(&log.with_extension("out"));
    assert!(
        out.contains(&format!("resuming from {}", checkpoint(&run, stopped).display())),
        "{out}"
    );
    let whole = tmp.path().join("whole");
    let mut child = tierzero(&train_args(&whole, end, &[]), &tmp.path().join("whole.log"));
    assert!(wait(&mut child, Duration::from_secs(120), "the whole run", &log).success());
    assert_eq!(step_losses(&run)[..end as usize], step_losses(&whole)[..]);
    same_state(&checkpoint(&run, end), &checkpoint(&whole, end));
}

/// The pids of the `tierzero` processes whose parent is `parent`.
fn workers(parent: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = read(Path::new(&format!("/proc/{pid}/stat")));
            // pid (comm) state ppid …: the comm may hold spaces, the fields after it do not
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            ppid == Some(parent) && stat.contains("(tierzero)")
        })
        .collect()
}

#[test]
fn torchrun_restarts_a_killed_worker_and_the_job_ends_with_the_uninterrupted_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let steps = 60;
    let every = ["--set", "train.save_interval=10", "--set", "train.keep_last=10"];
    let whole = tmp.path().join("whole");
    let mut child = tierzero(&train_args(&whole, steps, &every), &tmp.path().join("whole.log"));
    let status = wait(
        &mut child,
        Duration::from_secs(300),
        "the whole run",
        &tmp.path().join("whole.log"),
    );
    assert!(status.success(), "{}", read(&tmp.path().join("whole.log")));

    // the same run as two torchrun workers, one of which dies after the first save
    let job = tmp.path().join("job");
    let log = tmp.path().join("job.log");
    let mut args: Vec<String> = [
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--no-python",
        env!("CARGO_BIN_EXE_tierzero"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.insert(6, "--master_port".into());
    args.insert(7, free_port().to_string());
    let mut every_auto = every.to_vec();
    every_auto.extend(["--resume", "auto"]);
    args.extend(train_args(&job, steps, &every_auto));
    let mut torchrun = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/torchrun"));
    for k in ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        torchrun.env_remove(k);
    }
    let mut torchrun = torchrun
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(std::fs::File::create(log.with_extension("out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    until(Duration::from_secs(300), "the job's first checkpoint", || {
        save::follow_latest(&save::root(&job)).is_ok()
    });
    let first = workers(torchrun.id());
    assert_eq!(first.len(), 2, "torchrun's workers: {first:?}");
    let last_before = step_losses(&job).last().map_or(0, |l| l.0);
    assert!(
        last_before < steps,
        "the job ended before the kill: {}",
        read(&log)
    );
    // SAFETY: kill(2) on a process of the job's own (a worker of the torchrun we spawned)
    assert_eq!(unsafe { libc::kill(first[1], libc::SIGKILL) }, 0);
    let status = wait(&mut torchrun, Duration::from_secs(300), "the restarted job", &log);
    let text = read(&log);
    assert!(status.success(), "{text}");
    // the second incarnation resumed from a checkpoint and finished the steps
    let out = read(&log.with_extension("out"));
    assert!(out.contains("resuming from"), "{out}");
    same_state(&checkpoint(&job, steps), &checkpoint(&whole, steps));
    // what the dead incarnation left (staging, pruned copies) is gone after the final save
    let leftovers: Vec<String> = std::fs::read_dir(save::root(&job))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Before the first step there is nothing to save: a signal ends the run at once (as a
/// kill would), and no checkpoint is written. The run is node 0 of two whose second node
/// never comes, so it is still waiting at the rendezvous (before its first step, however
/// slow or fast the machine) when the signal arrives.
#[test]
fn a_signal_before_the_first_step_ends_the_run_at_once() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let log = tmp.path().join("run.log");
    let port = free_port().to_string();
    let waiting = ["--nnodes", "2", "--node-rank", "0", "--master-port", &port];
    let mut child = tierzero(&train_args(&run, 100_000, &waiting), &log);
    // the plan table is printed just before the run meets its peers
    until(Duration::from_secs(60), "the plan table", || {
        read(&log.with_extension("out")).contains("parameters")
    });
    // SAFETY: kill(2) on a child we spawned and have not reaped
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = wait(&mut child, Duration::from_secs(10), "the signalled run", &log);
    assert!(
        status.code() == Some(128 + libc::SIGTERM) || status.signal() == Some(libc::SIGTERM),
        "{status}: {}",
        read(&log)
    );
    assert!(!save::root(&run).join("latest").exists());
}
