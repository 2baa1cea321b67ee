//! Training split over processes (`--nnodes`, or torchrun's environment) computes the
//! bits of the same run with its ranks as threads of one process: the same losses and
//! byte-identical checkpoints. A node that dies takes the run down with the cause
//! instead of leaving the others waiting.

use crate::launch::{free_port, spawn_node, torchrun_env};
use std::path::Path;
use std::process::{Child, Output};

fn train(dir: &Path, extra: &[String], env: &[(&str, String)]) -> Child {
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
    spawn_node(&args, env, "warn")
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
