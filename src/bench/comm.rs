//! `tierzero bench comm`: the collectives against memcpy — `Local` (ranks as threads
//! reading each other's buffers), or `--backend gloo`: c10d's Gloo over a loopback
//! TCPStore, the transport processes of one machine use (here its ranks are threads of
//! this process, each with its own store connection and communicator).
//!
//! Each collective moves a unit-sized buffer between `ranks` threads, as the stage-3
//! engine does per unit; the limit, measured in the same run, is every rank copying the
//! same number of bytes with `copy_from_slice` at once (the memory system shared as the
//! collectives share it). Throughput is NCCL's *algorithm bandwidth*: the bytes one rank
//! receives (all-gather: the gathered buffer; reduce-scatter: the full input it reduces)
//! per second. Rounds alternate (memcpy, all-gather, reduce-scatter) and the report gives
//! medians, since these shared machines' memory bandwidth swings between runs.

use crate::comm::gloo::{join_concurrently, Gloo, Store};
use crate::comm::local::Local;
use crate::comm::{Collective, CommError, ReduceOp};
use serde::Serialize;
use std::sync::Arc;
use std::sync::Barrier;
use std::time::Instant;

/// Which communicator the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Backend {
    Local,
    Gloo,
}

pub struct CommBenchArgs {
    pub backend: Backend,
    pub ranks: usize,
    /// Bytes of fp32 each rank receives per collective.
    pub bytes: usize,
    pub rounds: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct CommReport {
    pub backend: Backend,
    pub ranks: usize,
    pub bytes: usize,
    pub rounds: usize,
    /// GB/s per rank, medians over rounds.
    pub memcpy_gbs: f64,
    pub all_gather_gbs: f64,
    pub reduce_scatter_gbs: f64,
    pub all_gather_ratio: f64,
    pub reduce_scatter_ratio: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Seconds of the slowest rank for `op`, all ranks starting together.
fn timed<R: Send, C: Collective>(
    ranks: &[C],
    start: &Barrier,
    op: &(dyn Fn(&C) -> Result<R, CommError> + Sync),
) -> Result<f64, CommError> {
    let times: Vec<Result<f64, CommError>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    start.wait();
                    let t = Instant::now();
                    op(c)?;
                    Ok(t.elapsed().as_secs_f64())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Ok(f64::NAN)))
            .collect()
    });
    times.into_iter().try_fold(0f64, |m, t| t.map(|t| m.max(t)))
}

pub fn run(args: &CommBenchArgs) -> Result<CommReport, CommError> {
    let world = args.ranks.max(1);
    match args.backend {
        Backend::Local => measure(args, Local::group(world)),
        Backend::Gloo => measure(args, gloo_group(world)?),
    }
}

/// `world` Gloo ranks over a TCPStore on a free loopback port, joined concurrently.
fn gloo_group(world: usize) -> Result<Vec<Arc<Gloo>>, CommError> {
    let failed = |reason: String| CommError::Aborted { rank: 0, reason };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| failed(format!("no free loopback port: {e}")))?
        .port();
    let timeout = std::time::Duration::from_secs(60);
    let server = Store::connect("127.0.0.1", port, true, timeout).map_err(failed)?;
    join_concurrently(0..world, |rank| {
        let store = match rank {
            0 => server.clone(),
            _ => Store::connect("127.0.0.1", port, false, timeout)?,
        };
        Gloo::join(store, "bench", rank, world, timeout).map(Arc::new)
    })
    .map_err(failed)
}

fn measure<C: Collective>(args: &CommBenchArgs, ranks: Vec<C>) -> Result<CommReport, CommError> {
    let world = ranks.len();
    let full = (args.bytes / 4).div_ceil(world) * world;
    let shard = full / world;
    let start = Barrier::new(world);
    // each rank's buffers, allocated and touched once
    let inputs: Vec<Vec<f32>> = (0..world)
        .map(|r| (0..full).map(|i| (i + r) as f32 * 1e-3).collect())
        .collect();
    let outputs: Vec<std::sync::Mutex<Vec<f32>>> = (0..world)
        .map(|_| std::sync::Mutex::new(vec![0f32; full]))
        .collect();
    let lock = |r: usize| outputs[r].lock().unwrap_or_else(|e| e.into_inner());
    let (mut memcpy, mut gather, mut scatter) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds + 1 {
        let copy = timed(&ranks, &start, &|c: &C| {
            lock(c.rank()).copy_from_slice(&inputs[c.rank()]);
            Ok(())
        })?;
        let all_gather = timed(&ranks, &start, &|c: &C| {
            c.all_gather(&inputs[c.rank()][..shard], &mut lock(c.rank()))
        })?;
        let reduce_scatter = timed(&ranks, &start, &|c: &C| {
            c.reduce_scatter(&inputs[c.rank()], &mut lock(c.rank())[..shard], ReduceOp::Avg)
        })?;
        // the first round warms caches and page tables
        if round > 0 {
            let gbs = |s: f64| (4 * full) as f64 / s / 1e9;
            memcpy.push(gbs(copy));
            gather.push(gbs(all_gather));
            scatter.push(gbs(reduce_scatter));
        }
    }
    let (memcpy_gbs, all_gather_gbs, reduce_scatter_gbs) = (median(memcpy), median(gather), median(scatter));
    Ok(CommReport {
        backend: args.backend,
        ranks: world,
        bytes: 4 * full,
        rounds: args.rounds,
        memcpy_gbs,
        all_gather_gbs,
        reduce_scatter_gbs,
        all_gather_ratio: all_gather_gbs / memcpy_gbs,
        reduce_scatter_ratio: reduce_scatter_gbs / memcpy_gbs,
    })
}

impl CommReport {
    pub fn human(&self) -> String {
        format!(
            "comm bench: {:?}, {} ranks, {:.1} MiB per rank per collective, median of {} rounds\n\
             {:<16} {:>9.2} GB/s per rank (the limit: every rank copying at once)\n\
             {:<16} {:>9.2} GB/s per rank  {:.2}× memcpy\n\
             {:<16} {:>9.2} GB/s per rank  {:.2}× memcpy\n",
            self.backend,
            self.ranks,
            self.bytes as f64 / 1048576.0,
            self.rounds,
            "memcpy",
            self.memcpy_gbs,
            "all_gather",
            self.all_gather_gbs,
            self.all_gather_ratio,
            "reduce_scatter",
            self.reduce_scatter_gbs,
            self.reduce_scatter_ratio,
        )
    }
}
