//! What the multi-process tests share: free loopback ports and the `tierzero` binary
//! started as one node, with torchrun's variables only where a test gives them.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

/// A free loopback port whose successor is free too (training uses both).
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// torchrun's variables for rank `rank` of `world` processes on this machine.
pub fn torchrun_env(world: usize, rank: usize, port: u16) -> [(&'static str, String); 5] {
    [
        ("WORLD_SIZE", world.to_string()),
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", "0".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// Starts `tierzero ARGS` with `env` as its only torchrun variables, output captured.
pub fn spawn_node(args: &[String], env: &[(&str, String)], log: &str) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierzero"));
    cmd.args(args);
    for k in ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", log)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}
