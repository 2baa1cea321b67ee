//! The TCP rendezvous between real processes on loopback: every node gets node 0's NCCL
//! id; a duplicate node rank, a different world and a missing node are errors that every
//! process reports with the cause; torchrun's environment works like the flags.

use crate::launch::{free_port, spawn_node, torchrun_env};
use std::process::{Child, Output};

fn spawn(args: &[String], env: &[(&str, String)]) -> Child {
    let mut all = vec!["rendezvous".to_string()];
    all.extend_from_slice(args);
    all.push("--json".into());
    spawn_node(&all, env, "error")
}

fn node(port: u16, nnodes: usize, rank: usize, timeout: u64) -> Child {
    let args =
        format!("--nnodes {nnodes} --node-rank {rank} --master-port {port} --devices 2 --timeout {timeout}");
    spawn(&args.split(' ').map(String::from).collect::<Vec<_>>(), &[])
}

fn finish(children: Vec<Child>) -> Vec<Output> {
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

fn report(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn four_processes_share_node_zeros_id() {
    let port = free_port();
    // node 0 starts last: the others retry until it listens
    let mut children: Vec<Child> = (1..4).map(|r| node(port, 4, r, 30)).collect();
    std::thread::sleep(std::time::Duration::from_millis(300));
    children.insert(0, node(port, 4, 0, 30));
    let reports: Vec<_> = finish(children).iter().map(report).collect();
    for (i, r) in reports.iter().enumerate() {
        assert_eq!(
            (r["index"].as_u64(), r["world"].as_u64()),
            (Some(i as u64), Some(8))
        );
        assert_eq!(r["first_rank"].as_u64(), Some(2 * i as u64));
        assert_eq!(r["id_crc32c"], reports[0]["id_crc32c"]);
    }
    println!("id source on node 0: {}", reports[0]["id_source"]);
}

#[test]
fn torchrun_environment_is_a_rendezvous_too() {
    let port = free_port();
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let env = torchrun_env(2, r, port);
            spawn(&["--timeout".into(), "30".into()], &env)
        })
        .collect();
    let reports: Vec<_> = finish(children).iter().map(report).collect();
    assert_eq!(reports[0]["id_crc32c"], reports[1]["id_crc32c"]);
    assert_eq!(reports[1]["world"].as_u64(), Some(2));
}

fn failure(out: &Output) -> String {
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[test]
fn a_duplicate_node_rank_fails_every_process_with_the_cause() {
    let port = free_port();
    let children = vec![node(port, 3, 0, 30), node(port, 3, 1, 30), node(port, 3, 1, 30)];
    for out in finish(children) {
        let e = failure(&out);
        assert!(e.contains("node rank 1") && e.contains("claimed twice"), "{e}");
    }
}

#[test]
fn a_different_world_fails_every_process_with_the_cause() {
    let port = free_port();
    let children = vec![node(port, 2, 0, 30), node(port, 3, 1, 30)];
    for out in finish(children) {
        let e = failure(&out);
        assert!(
            e.contains("expects 3 node(s)") && e.contains("node rank 0 has 2"),
            "{e}"
        );
    }
}

#[test]
fn a_missing_node_is_named_when_the_timeout_expires() {
    let port = free_port();
    let children = vec![node(port, 3, 0, 2), node(port, 3, 2, 30)];
    let outs = finish(children);
    let e = failure(&outs[0]);
    assert!(e.contains("timed out") && e.contains("node rank(s) 1"), "{e}");
    assert!(failure(&outs[1]).contains("timed out"));
    // a node whose master never comes
    let e = failure(&finish(vec![node(free_port(), 2, 1, 1)])[0]);
    assert!(e.contains("cannot reach node rank 0"), "{e}");
    // a bad node rank is refused before any network
    let e = failure(&finish(vec![node(port, 2, 5, 1)])[0]);
    assert!(e.contains("node rank 5 is not below"), "{e}");
}
