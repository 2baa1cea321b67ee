//! The rendezvous of a multi-process run through c10d's TCPStore (the one the Gloo
//! communicators use): it hands every process the 128-byte NCCL unique id process 0
//! created, and checks that the processes agree.
//!
//! Topology comes from `--nnodes/--node-rank/--master-addr/--master-port` (one process
//! per machine, `local` ranks each) or from torchrun's environment (`WORLD_SIZE`, `RANK`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`: one process per GPU). Node 0 serves the
//! store (torchrun's agent does when it says so). Each process claims its node rank (an
//! atomic counter: a second claim is named), publishes its world, and waits for every
//! other's; a mismatch or a missing node (named when the timeout expires) is published
//! under one error key, so every process stops with the same cause. Node 0 keeps the
//! store up until every node has read the id, or a moment after a failure.

use super::gloo::Store;
use std::time::{Duration, Instant};

pub const ID_BYTES: usize = 128;
const ERROR_KEY: &str = "rendezvous/error";

/// Where this process sits in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Number of processes.
    pub processes: usize,
    /// This process's index (node rank, or torchrun's RANK).
    pub index: usize,
    /// Ranks (devices) in each process.
    pub local: usize,
    /// The first local device of this process (torchrun's LOCAL_RANK, else 0).
    pub first_device: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl Topology {
    pub fn world(&self) -> usize {
        self.processes * self.local
    }

    /// Global rank of local device `d`.
    pub fn rank(&self, d: usize) -> usize {
        self.index * self.local + d
    }

    /// From torchrun's variables, when `WORLD_SIZE` is set (`env` looks them up).
    pub fn from_torchrun(env: impl Fn(&str) -> Option<String>) -> Result<Option<Topology>, String> {
        let Some(world) = env("WORLD_SIZE") else {
            return Ok(None);
        };
        let num = |key: &str, value: Option<String>| -> Result<usize, String> {
            let value = value.ok_or_else(|| {
                format!("WORLD_SIZE is set but {key} is not; launch with torchrun or set {key}")
            })?;
            value
                .trim()
                .parse()
                .map_err(|_| format!("environment variable {key}={value:?} is not a number"))
        };
        let processes = num("WORLD_SIZE", Some(world))?;
        let index = num("RANK", env("RANK"))?;
        let first_device = num("LOCAL_RANK", env("LOCAL_RANK").or(Some("0".into())))?;
        let port = num("MASTER_PORT", env("MASTER_PORT").or(Some("29500".into())))?;
        let topo = Topology {
            processes,
            index,
            local: 1,
            first_device,
            master_addr: env("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port: u16::try_from(port).map_err(|_| format!("MASTER_PORT={port} is not a port"))?,
        };
        topo.check().map(|_| Some(topo))
    }

    pub fn check(&self) -> Result<(), String> {
        if self.processes == 0 || self.local == 0 {
            return Err("the world is empty: --nnodes and the devices per node must be at least 1".into());
        }
        if self.index >= self.processes {
            return Err(format!(
                "node rank {} is not below the number of nodes {}; use --node-rank 0..{}",
                self.index,
                self.processes,
                self.processes - 1
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("rendezvous at {addr} (node rank {index}): {message}")]
pub struct RendezvousError {
    pub addr: String,
    pub index: usize,
    pub message: String,
}

/// Exchanges the NCCL id: process 0 calls `make_id` and publishes it; the others fetch it.
pub fn rendezvous(
    topo: &Topology,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], String>,
) -> Result<[u8; ID_BYTES], RendezvousError> {
    let addr = format!("{}:{}", topo.master_addr, topo.master_port);
    let err = |message: String| RendezvousError {
        addr: addr.clone(),
        index: topo.index,
        message,
    };
    topo.check().map_err(err)?;
    let agent = std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Ok("True");
    let serve = !agent && topo.index == 0;
    let store = Store::connect(&topo.master_addr, topo.master_port, serve, timeout).map_err(|e| {
        err(if serve {
            format!("{e}; pick a free --master-port (or MASTER_PORT)")
        } else {
            format!("cannot reach node rank 0: {e}")
        })
    })?;
    let deadline = Instant::now() + timeout;
    let result = exchange(&store, topo, timeout, deadline, make_id);
    if let Err(message) = &result {
        let _ = store.set(ERROR_KEY, message.as_bytes());
        if serve {
            // the others read the cause from this process's store before it goes
            std::thread::sleep(Duration::from_secs(2));
        }
    }
    result.map_err(err)
}

fn exchange(
    store: &Store,
    topo: &Topology,
    timeout: Duration,
    deadline: Instant,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], String>,
) -> Result<[u8; ID_BYTES], String> {
    let world = format!("{} {}", topo.processes, topo.local);
    if store.add(&format!("rendezvous/claim/{}", topo.index), 1)? > 1 {
        return Err(format!(
            "node rank {} is claimed twice; give each node a distinct --node-rank",
            topo.index
        ));
    }
    store.set(&format!("rendezvous/hello/{}", topo.index), world.as_bytes())?;
    // every node's world, as node 0 sees it and as each node sees node 0's
    let mut missing: Vec<usize> = (0..topo.processes).collect();
    while !missing.is_empty() {
        check_error(store)?;
        let mut still = Vec::new();
        for i in missing {
            match store.try_get(&format!("rendezvous/hello/{i}"))? {
                Some(theirs) if theirs != world.as_bytes() && (i == 0 || topo.index == 0) => {
                    let theirs = String::from_utf8_lossy(&theirs).into_owned();
                    // (the node that differs from node 0, its world, node 0's world)
                    let (node, differs, zeros) = if i == 0 {
                        (topo.index, world.as_str(), theirs.as_str())
                    } else {
                        (i, theirs.as_str(), world.as_str())
                    };
                    let (p, l) = differs.split_once(' ').unwrap_or((differs, "?"));
                    let (p0, l0) = zeros.split_once(' ').unwrap_or((zeros, "?"));
                    return Err(format!(
                        "node rank {node} expects {p} node(s) × {l} device(s), node rank 0 has {p0} × {l0}"
                    ));
                }
                Some(_) => {}
                None => still.push(i),
            }
        }
        missing = still;
        if !missing.is_empty() {
            if Instant::now() > deadline {
                let names: Vec<String> = missing.iter().map(usize::to_string).collect();
                return Err(format!(
                    "timed out after {:.0} s waiting for node rank(s) {}",
                    timeout.as_secs_f64(),
                    names.join(", ")
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if topo.index == 0 {
        let id = make_id()?;
        store.set("rendezvous/id", &id)?;
    }
    let id = store
        .wait_for("rendezvous/id", ERROR_KEY, deadline)?
        .ok_or_else(|| {
            format!(
                "timed out after {:.0} s waiting for node rank 0's id",
                timeout.as_secs_f64()
            )
        })?;
    let id: [u8; ID_BYTES] = id
        .try_into()
        .map_err(|v: Vec<u8>| format!("node rank 0 published an id of {} bytes, not {ID_BYTES}", v.len()))?;
    let read = store.add("rendezvous/read", 1)?;
    if topo.index == 0 {
        // the store is this process's: it stays until every node has the id
        let mut read = read;
        while read < topo.processes as i64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            read = store.add("rendezvous/read", 0)?;
        }
    }
    Ok(id)
}

fn check_error(store: &Store) -> Result<(), String> {
    match store.try_get(ERROR_KEY)? {
        Some(message) => Err(String::from_utf8_lossy(&message).into_owned()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_environment_is_read_and_checked() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Topology::from_torchrun(vars(&[])).unwrap(), None);
        let t = Topology::from_torchrun(vars(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.world(), t.rank(0), t.first_device, t.master_port),
            (4, 3, 1, 1234)
        );
        let e = Topology::from_torchrun(vars(&[("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.contains("RANK is not"), "{e}");
        let e = Topology::from_torchrun(vars(&[("WORLD_SIZE", "2"), ("RANK", "2")])).unwrap_err();
        assert!(e.contains("node rank 2 is not below"), "{e}");
        let e = Topology::from_torchrun(vars(&[("WORLD_SIZE", "x"), ("RANK", "0")])).unwrap_err();
        assert!(e.contains("WORLD_SIZE=\"x\""), "{e}");
    }
}
