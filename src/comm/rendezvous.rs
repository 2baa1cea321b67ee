//! The TCP rendezvous of a multi-process run: it only hands every process the 128-byte
//! NCCL unique id that process 0 created, and checks that the processes agree.
//!
//! Topology comes from `--nnodes/--node-rank/--master-addr/--master-port` (one process
//! per machine, `local` ranks each) or from torchrun's environment (`WORLD_SIZE`, `RANK`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`: one process per GPU). Process 0 listens
//! on the master address, waits for every other process's hello (magic, version, index,
//! process count, local ranks), then answers each with the id, or with an error naming
//! the mismatch (a duplicate node rank, a different world) so every process stops with
//! the same cause. A process that never arrives is named when the timeout expires.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"TZRV";
const VERSION: u32 = 1;
pub const ID_BYTES: usize = 128;

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

/// Exchanges the NCCL id: process 0 calls `make_id` and serves it; the others fetch it.
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
    if topo.index == 0 {
        serve(topo, &addr, timeout, make_id).map_err(err)
    } else {
        join(topo, &addr, timeout).map_err(err)
    }
}

fn hello(topo: &Topology) -> Vec<u8> {
    let mut m = MAGIC.to_vec();
    for v in [
        VERSION,
        topo.index as u32,
        topo.processes as u32,
        topo.local as u32,
    ] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    m
}

fn serve(
    topo: &Topology,
    addr: &str,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], String>,
) -> Result<[u8; ID_BYTES], String> {
    let listener = TcpListener::bind(resolve(addr)?)
        .map_err(|e| format!("cannot listen: {e}; pick a free --master-port (or MASTER_PORT)"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<(usize, TcpStream)> = Vec::new();
    let mut problem: Option<String> = None;
    while peers.len() + 1 < topo.processes {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream.set_nonblocking(false).map_err(|e| e.to_string())?;
                stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
                let mut h = [0u8; 20];
                if stream.read_exact(&mut h).is_err() || &h[..4] != MAGIC {
                    continue; // not one of ours (a port scanner, a stale client)
                }
                let field = |i: usize| {
                    u32::from_le_bytes(h[4 + 4 * i..8 + 4 * i].try_into().unwrap_or_default()) as usize
                };
                let (version, index, processes, local) = (field(0), field(1), field(2), field(3));
                let mismatch = if version != VERSION as usize {
                    Some(format!("node {from} speaks rendezvous version {version}, this one {VERSION}: run the same tierzero everywhere"))
                } else if processes != topo.processes || local != topo.local {
                    Some(format!(
                        "node rank {index} at {from} expects {processes} node(s) × {local} device(s), node rank 0 has {} × {}",
                        topo.processes, topo.local
                    ))
                } else if index == 0 || index >= topo.processes || peers.iter().any(|(i, _)| *i == index) {
                    Some(format!("node rank {index} (from {from}) is claimed twice or out of range; give each node a distinct --node-rank"))
                } else {
                    None
                };
                if let Some(m) = mismatch {
                    problem.get_or_insert(m);
                }
                peers.push((index, stream));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<String> = (1..topo.processes)
                        .filter(|i| !peers.iter().any(|(p, _)| p == i))
                        .map(|i| i.to_string())
                        .collect();
                    let message = format!(
                        "timed out after {:.0} s waiting for node rank(s) {}",
                        timeout.as_secs_f64(),
                        missing.join(", ")
                    );
                    for (_, s) in &mut peers {
                        let _ = reply(s, Err(&message));
                    }
                    return Err(message);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("accept failed: {e}")),
        }
    }
    let id = match problem {
        Some(p) => Err(p),
        None => make_id(),
    };
    for (_, s) in &mut peers {
        let _ = reply(s, id.as_ref().map_err(String::as_str));
    }
    id
}

fn reply(stream: &mut TcpStream, id: Result<&[u8; ID_BYTES], &str>) -> std::io::Result<()> {
    match id {
        Ok(id) => {
            stream.write_all(b"OK")?;
            stream.write_all(id)
        }
        Err(message) => {
            stream.write_all(b"ER")?;
            stream.write_all(&(message.len() as u32).to_le_bytes())?;
            stream.write_all(message.as_bytes())
        }
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("cannot resolve the master address: {e}"))?
        .next()
        .ok_or_else(|| "the master address resolves to nothing".into())
}

fn join(topo: &Topology, addr: &str, timeout: Duration) -> Result<[u8; ID_BYTES], String> {
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        let target = resolve(addr);
        match target.and_then(|t| TcpStream::connect_timeout(&t, Duration::from_secs(2)).map_err(|e| e.to_string())) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!(
                    "cannot reach node rank 0 within {:.0} s ({e}); is it running, and is --master-addr its address?",
                    timeout.as_secs_f64()
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    stream.write_all(&hello(topo)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(
            deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(10),
        ))
        .ok();
    let lost = |e: std::io::Error| format!("node rank 0 went away during the rendezvous: {e}");
    let mut tag = [0u8; 2];
    stream.read_exact(&mut tag).map_err(lost)?;
    if &tag == b"OK" {
        let mut id = [0u8; ID_BYTES];
        stream.read_exact(&mut id).map_err(lost)?;
        return Ok(id);
    }
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(lost)?;
    let mut message = vec![0u8; (u32::from_le_bytes(len) as usize).min(1 << 16)];
    stream.read_exact(&mut message).map_err(lost)?;
    Err(format!(
        "node rank 0 refused: {}",
        String::from_utf8_lossy(&message)
    ))
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
