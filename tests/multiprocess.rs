//! Training split over processes (`--nnodes`, or torchrun's environment) computes the
//! bits of the same run with its ranks as threads of one process: the same losses and
//! byte-identical checkpoints. A node that dies takes the run down with the cause
//! instead of leaving the others waiting.

use crate::launch::{free_port, spawn_node, torchrun_env};
use std::path::Path;
use std::process::{Child, Output};

fn train(dir: &Path, extra: &[String], env: &[(&str, String)]) -> Child {
    spawn_node(&args_for(dir, extra), env, "warn")
}

fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

/// (step, loss, grad_norm) of every line of metrics.jsonl, as bits.
fn losses(dir: &Path) -> Vec<(u64, u64, u64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let bits = |k: &str| v[k].as_f64().unwrap().to_bits();
            (v["step"].as_u64().unwrap(), bits("loss"), bits("grad_norm"))
        })
        .collect()
}

fn same_checkpoints(a: &Path, b: &Path) {
    for step in ["step-4", "step-8"] {
        for state in ["master", "exp_avg", "exp_avg_sq", "param"] {
            let file = format!("checkpoints/{step}/{state}.safetensors");
            assert!(
                std::fs::read(a.join(&file)).unwrap() == std::fs::read(b.join(&file)).unwrap(),
                "{file} differs"
            );
        }
    }
}

#[test]
fn two_nodes_train_the_bits_of_two_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    ok(train(&one, &args("--devices 2"), &[]).wait_with_output().unwrap());
    let port = free_port();
    let nodes: Vec<Child> = (0..2)
        .map(|n| {
            train(
                &two,
                &args(&format!(
                    "--devices 1 --nnodes 2 --node-rank {n} --master-port {port}"
                )),
                &[],
            )
        })
        .collect();
    let outs: Vec<Output> = nodes
        .into_iter()
        .map(|c| ok(c.wait_with_output().unwrap()))
        .collect();
    assert!(String::from_utf8_lossy(&outs[1].stdout).contains("node 1 of 2: done"));
    assert_eq!(losses(&one), losses(&two));
    assert_eq!(losses(&two).len(), 8);
    same_checkpoints(&one, &two);
    assert!(two.join("nvme/node-0").is_dir() && two.join("nvme/node-1").is_dir());
}

#[test]
fn torchrun_environment_launches_the_same_run() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let tiers = "--set zero_optimization.stage=2 --set zero_optimization.offload_optimizer.device=cpu";
    ok(train(&one, &args(&format!("--devices 2 {tiers}")), &[])
        .wait_with_output()
        .unwrap());
    let port = free_port();
    let nodes: Vec<Child> = (0..2)
        .map(|r| {
            let env = torchrun_env(2, r, port);
            train(&two, &args(tiers), &env)
        })
        .collect();
    for c in nodes {
        ok(c.wait_with_output().unwrap());
    }
    assert_eq!(losses(&one), losses(&two));
    same_checkpoints(&one, &two);
}

#[test]
fn a_node_that_dies_stops_the_others_with_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let long = format!(
        "--devices 1 --nnodes 2 --master-port {port} --set train.steps=100000 --set train.save_interval=0"
    );
    let mut n0 = train(tmp.path(), &args(&format!("{long} --node-rank 0")), &[]);
    let mut n1 = train(tmp.path(), &args(&format!("{long} --node-rank 1")), &[]);
    // wait until training is under way (node 0 writes metrics), then kill node 1
    let metrics = tmp.path().join("metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::metadata(&metrics).map_or(0, |m| m.len()) == 0 {
        assert!(start.elapsed().as_secs() < 60, "training never started");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    n1.kill().unwrap();
    let _ = n1.wait();
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = n0.try_wait().unwrap() {
            assert!(!status.success());
            break;
        }
        assert!(start.elapsed().as_secs() < 60, "node 0 hung after node 1 died");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = n0.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1"), "{err}");
}

/// `.venv/bin/torchrun --nproc_per_node N --no-python tierzero train …`: the real
/// launcher, its agent serving the c10d store every process joins as a client.
fn torchrun(dir: &Path, nproc: usize, extra: &[String]) -> Output {
    let mut args = vec![
        "--nproc_per_node".to_string(),
        nproc.to_string(),
        "--master_addr".into(),
        "127.0.0.1".into(),
        "--master_port".into(),
        free_port().to_string(),
        "--no-python".into(),
        env!("CARGO_BIN_EXE_tierzero").into(),
    ];
    args.extend(args_for(dir, extra));
    let mut cmd = std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/torchrun"));
    for k in ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        cmd.env_remove(k);
    }
    cmd.args(&args).env("RUST_LOG", "warn").output().unwrap()
}

/// The arguments `train` gets in these tests (8 steps, checkpoints at 4 and 8).
fn args_for(dir: &Path, extra: &[String]) -> Vec<String> {
    let mut args = args(
        "train --config configs/default.json --set train.steps=8 --set scheduler.params.warmup_num_steps=2 \
         --set train.save_interval=4 --set train.rendezvous_timeout=60",
    );
    args.push("--set".into());
    args.push(format!("train.output_dir={}", dir.display()));
    args.push("--set".into());
    args.push(format!(
        "zero_optimization.offload_optimizer.nvme_path={}",
        dir.join("nvme").display()
    ));
    args.extend_from_slice(extra);
    args
}

/// Losses as numbers, for runs whose sums may differ in the last bits.
fn loss_values(dir: &Path) -> Vec<f64> {
    losses(dir).iter().map(|&(_, l, _)| f64::from_bits(l)).collect()
}

#[test]
fn the_real_torchrun_launches_processes_that_train_the_run_of_threads() {
    let tmp = tempfile::tempdir().unwrap();
    // 2 processes × 1 rank: two-rank sums are exact both ways, so the bits agree
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    ok(train(&one, &args("--devices 2"), &[]).wait_with_output().unwrap());
    ok(torchrun(&two, 2, &[]));
    assert_eq!(losses(&one), losses(&two));
    assert_eq!(losses(&two).len(), 8);
    same_checkpoints(&one, &two);
    // the checkpoint the processes wrote resumes in one process
    let resumed = tmp.path().join("resumed");
    std::fs::create_dir_all(&resumed).unwrap();
    let mut resume = args_for(&resumed, &args("--devices 2"));
    resume.push("--resume".into());
    resume.push(two.join("checkpoints/step-4").display().to_string());
    ok(crate::launch::spawn_node(&resume, &[], "warn")
        .wait_with_output()
        .unwrap());
    assert_eq!(losses(&resumed), losses(&two)[4..].to_vec());

    // 3 processes × 1 rank: Gloo sums three ranks in ring order, tierzero in rank order
    let (one3, three) = (tmp.path().join("one3"), tmp.path().join("three"));
    let extra = args("--set train.steps=4 --set train.save_interval=0");
    let mut threads3 = extra.clone();
    threads3.extend(args("--devices 3"));
    ok(train(&one3, &threads3, &[]).wait_with_output().unwrap());
    ok(torchrun(&three, 3, &extra));
    let (a, b) = (loss_values(&one3), loss_values(&three));
    assert_eq!(a.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "{a:?} vs {b:?}");
    }
}

#[test]
fn two_processes_of_two_ranks_train_the_run_of_four_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let extra =
        args("--set train.steps=4 --set train.save_interval=0 --set train_micro_batch_size_per_gpu=4");
    let mut four = extra.clone();
    four.extend(args("--devices 4"));
    ok(train(&one, &four, &[]).wait_with_output().unwrap());
    let port = free_port();
    let nodes: Vec<Child> = (0..2)
        .map(|n| {
            let mut a = extra.clone();
            a.extend(args(&format!(
                "--devices 2 --nnodes 2 --node-rank {n} --master-port {port}"
            )));
            // the interface named as torch.distributed users name it
            train(&two, &a, &[("GLOO_SOCKET_IFNAME", "lo".to_string())])
        })
        .collect();
    for c in nodes {
        ok(c.wait_with_output().unwrap());
    }
    let (a, b) = (loss_values(&one), loss_values(&two));
    assert_eq!(a.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "{a:?} vs {b:?}");
    }
}

/// `bench comm --backend gloo-processes` measures Gloo between two real processes of the
/// binary: the second rank's process joins through the first's store, both finish, and
/// the report holds positive rates beside memcpy's.
#[test]
fn the_comm_bench_runs_gloo_between_processes() {
    let out = ok(std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(args(
            "bench comm --backend gloo-processes --ranks 2 --size 256K --rounds 2 --json",
        ))
        .output()
        .unwrap());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["backend"], "GlooProcesses");
    assert_eq!(report["ranks"], 2);
    for key in ["memcpy_gbs", "all_gather_gbs", "reduce_scatter_gbs"] {
        let rate = report[key].as_f64().unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{key}: {rate}");
    }
}
