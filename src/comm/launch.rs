//! Launching a multi-process run: the topology from flags or torchrun's environment, and
//! `tierzero rendezvous`, which checks that every node reaches node 0 and receives the
//! same NCCL id before a long job is started.

use super::rendezvous::{rendezvous, Topology, ID_BYTES};
use serde::Serialize;
use std::time::Duration;

/// The torchrun-style flags; `None` where the user gave none.
#[derive(Clone, Debug, Default)]
pub struct LaunchFlags {
    pub nnodes: Option<usize>,
    pub node_rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    /// Ranks (devices) per node.
    pub devices: usize,
}

/// Flags win; without `--nnodes`, torchrun's variables when `WORLD_SIZE` is set; else
/// a single process.
pub fn topology(flags: &LaunchFlags, env: impl Fn(&str) -> Option<String>) -> Result<Topology, String> {
    if flags.nnodes.is_none() {
        if let Some(t) = Topology::from_torchrun(env)? {
            return Ok(t);
        }
    }
    let topo = Topology {
        processes: flags.nnodes.unwrap_or(1),
        index: flags.node_rank.unwrap_or(0),
        local: flags.devices,
        first_device: 0,
        master_addr: flags.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into()),
        master_port: flags.master_port.unwrap_or(29500),
    };
    topo.check()?;
    Ok(topo)
}

#[derive(Clone, Debug, Serialize)]
pub struct RendezvousReport {
    pub processes: usize,
    pub index: usize,
    pub world: usize,
    pub first_rank: usize,
    /// "nccl" (ncclGetUniqueId) or "random" when NCCL cannot be loaded here.
    pub id_source: String,
    /// crc32c of the 128-byte id: equal on every node after a good rendezvous.
    pub id_crc32c: String,
}

impl RendezvousReport {
    pub fn human(&self) -> String {
        format!(
            "node {} of {} · ranks {}..{} of {} · NCCL id {} ({})",
            self.index,
            self.processes,
            self.first_rank,
            self.first_rank + self.world / self.processes,
            self.world,
            self.id_crc32c,
            self.id_source
        )
    }
}

/// Runs the rendezvous of `topo` and reports the id every node received.
pub fn check(topo: &Topology, timeout: Duration) -> Result<RendezvousReport, String> {
    let mut source = "nccl";
    let id = rendezvous(topo, timeout, || match super::nccl::unique_id() {
        Ok(id) => Ok(id),
        Err(reason) => {
            tracing::warn!("{reason}; the rendezvous check exchanges a random id instead");
            source = "random";
            random_id()
        }
    })
    .map_err(|e| e.to_string())?;
    if topo.index != 0 {
        source = "node 0";
    }
    Ok(RendezvousReport {
        processes: topo.processes,
        index: topo.index,
        world: topo.world(),
        first_rank: topo.rank(0),
        id_source: source.into(),
        id_crc32c: format!("{:08x}", crc32c::crc32c(&id)),
    })
}

fn random_id() -> Result<[u8; ID_BYTES], String> {
    use std::io::Read;
    let mut id = [0u8; ID_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut id))
        .map_err(|e| format!("/dev/urandom: {e}"))?;
    Ok(id)
}
