//! Each rank's three communicators (`Comms`: compute, prefetch, reducer): `Local` for
//! ranks of one process, c10d Gloo (CPU) or NCCL (GPU) over the TCPStore on the master
//! address (served by node 0, or by torchrun's agent) across processes; each node keeps
//! its NVMe files under `<nvme_path>/node-<rank>`.

use super::error::TrainError;
use crate::comm::gloo::{join_concurrently, Gloo, Store};
use crate::comm::local::Local;
use crate::comm::nccl::{watchdog, Nccl, Watched};
use crate::comm::{Collective, Group};
use crate::device::cuda::Cuda;
use crate::engine::context::Comms;
use crate::plan::Plan;
use std::sync::Arc;

/// Three `Local` groups for `world` ranks, as each rank's communicators (or one group
/// serving as all three, with `one`).
pub(super) fn local_comms(world: usize, one: bool) -> Vec<Comms<Local>> {
    if one {
        return Local::group(world)
            .into_iter()
            .map(|c| Comms {
                main: c.clone(),
                gather: c.clone(),
                reduce: c,
            })
            .collect();
    }
    let mut groups = [Local::group(world), Local::group(world), Local::group(world)].map(Vec::into_iter);
    (0..world)
        .filter_map(|_| {
            Some(Comms {
                main: groups[0].next()?,
                gather: groups[1].next()?,
                reduce: groups[2].next()?,
            })
        })
        .collect()
}

/// This process's ranks' communicators: `Local` for CPU ranks in one process, Gloo over
/// c10d's store for CPU ranks across several; NCCL for CUDA ranks, through the same
/// store across processes, or through one served here on a loopback port when the
/// ranks are threads of this process (so gathers and reductions run GPU to GPU, and an
/// abort reaches every rank through the watchdog).
pub(super) fn communicators(plan: &Plan, one: bool, c10d: bool) -> Result<Vec<Comms<Group>>, TrainError> {
    let world = plan.world_size;
    let launch = &plan.train.launch;
    let cuda_ranks = plan.train.accelerator == crate::plan::Accelerator::Cuda && world > 1;
    if launch.nnodes == 1 && !cuda_ranks && !c10d {
        let comms = local_comms(world, one)
            .into_iter()
            .map(|c| Comms {
                main: Group::Local(c.main),
                gather: Group::Local(c.gather),
                reduce: Group::Local(c.reduce),
            })
            .collect();
        return Ok(comms);
    }
    // several processes: c10d's TCPStore on the master address — torchrun's agent serves
    // it when it says so, else node 0 does — and Gloo communicators over it
    let timeout = std::time::Duration::from_secs(launch.timeout_s);
    // the ranks of one process: a store served here on a loopback port the system picks
    let (address, served) = if launch.nnodes == 1 {
        let server = Store::serve_loopback(timeout).map_err(|e| TrainError::Store {
            what: "serving the ranks' store on the loopback interface",
            message: e.into(),
        })?;
        ("127.0.0.1".to_string(), Some(server))
    } else {
        let agent = std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Ok("True");
        let serve = !agent && launch.node_rank == 0;
        let server = serve
            .then(|| Store::connect(&launch.master_addr, launch.master_port, true, timeout))
            .transpose()
            .map_err(|e| TrainError::Store {
                what: "serving the c10d store",
                message: e.into(),
            })?;
        (launch.master_addr.clone(), server)
    };
    let port = match &served {
        Some(server) => server.port().map_err(|e| TrainError::Store {
            what: "reading the store's port",
            message: e.into(),
        })?,
        None => launch.master_port,
    };
    let first = plan.train.local_ranks().start;
    // every rank joins its three communicators in the same order; the ranks of this
    // process join concurrently (each join waits for all ranks), each through its own
    // connection to the store (a client blocks in a wait while Gloo rendezvous); the
    // first uses the server's own
    let comms = join_concurrently(plan.train.local_ranks(), |rank| {
        let store = match (&served, rank == first) {
            (Some(server), true) => server.clone(),
            _ => Store::connect(&address, port, false, timeout)?,
        };
        let joined = (|| {
            // CUDA ranks: NCCL communicators bootstrapped through the same store
            let cuda = match plan.train.compute_device(rank) {
                tch::Device::Cuda(ordinal) => {
                    Some(Cuda::shared(ordinal).map_err(|e| format!("rank {rank}: {e}"))?)
                }
                _ => None,
            };
            let join = |name: &str| -> Result<Group, String> {
                match &cuda {
                    Some(cuda) => Nccl::join(store.clone(), name, cuda.clone(), rank, world, timeout)
                        .map(|n| Group::Nccl(Arc::new(n)))
                        .map_err(|e| e.to_string()),
                    None => Ok(Group::Gloo(Arc::new(Gloo::join(
                        store.clone(),
                        name,
                        rank,
                        world,
                        timeout,
                    )?))),
                }
            };
            Ok(Comms {
                main: join("main")?,
                gather: join("gather")?,
                reduce: join("reduce")?,
            })
        })();
        match joined {
            Ok(comms) => Ok((comms, store)),
            Err(e) => {
                // the other ranks wait for this one's ids or Gloo rendezvous: tell them
                let _ = store.set(
                    crate::comm::gloo::ABORT_KEY,
                    format!("rank {rank}: {e}").as_bytes(),
                );
                Err(e)
            }
        }
    })
    .map_err(|message| TrainError::Store {
        what: "joining the communicators",
        message,
    })?;
    // NCCL neither times out nor hears of a dead peer: a watchdog per process does
    let watched: Vec<(usize, std::sync::Weak<dyn Watched>)> = comms
        .iter()
        .flat_map(|(c, _)| [&c.main, &c.gather, &c.reduce])
        .filter_map(|g| match g {
            Group::Nccl(n) => {
                let weak: std::sync::Weak<dyn Watched> = Arc::downgrade(n) as _;
                Some((n.rank(), weak))
            }
            _ => None,
        })
        .collect();
    if let (false, Some((_, store))) = (watched.is_empty(), comms.first()) {
        drop(watchdog(store.clone(), watched, timeout));
        // eager connect under the watchdog, this process's ranks at once, each on its
        // three communicators in the order every rank joined them
        let comms = &comms;
        join_concurrently(plan.train.local_ranks(), |rank| {
            let (c, store) = &comms[rank - first];
            for group in [&c.main, &c.gather, &c.reduce] {
                if let Group::Nccl(nccl) = group {
                    if let Err(e) = nccl.connect() {
                        let _ = store.set(
                            crate::comm::gloo::ABORT_KEY,
                            format!("rank {rank}: {e}").as_bytes(),
                        );
                        return Err(e.to_string());
                    }
                }
            }
            Ok(())
        })
        .map_err(|message| TrainError::Store {
            what: "connecting the NCCL communicators",
            message,
        })?;
    }
    Ok(comms.into_iter().map(|(c, _)| c).collect())
}
