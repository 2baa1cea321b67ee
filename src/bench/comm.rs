//! `tierzero bench comm`: the collectives against memcpy — `Local` (ranks as threads
//! reading each other's buffers), `--backend gloo`: c10d's Gloo over a loopback
//! TCPStore, the transport processes of one machine use (ranks as threads of this
//! process, each with its own store connection and communicator), or `--backend
//! gloo-processes`: the same between real processes (rank 0 here serves the store, ranks
//! 1.. are processes of this binary; rounds start together at a Gloo barrier and each
//! rank's times are gathered, the slowest counting).
//!
//! Each collective moves a unit-sized buffer between `ranks` threads, as the stage-3
//! engine does per unit; the limit, measured in the same run, is every rank copying the
//! same number of bytes with `copy_from_slice` at once (the memory system shared as the
//! collectives share it). Throughput is NCCL's *algorithm bandwidth*: the bytes one rank
//! receives (all-gather: the gathered buffer; reduce-scatter: the full input it reduces)
//! per second. Rounds alternate (memcpy, all-gather, reduce-scatter) and the report gives
//! medians, since these shared machines' memory bandwidth swings between runs.

use crate::comm::gloo::{free_loopback_port, join_concurrently, Gloo, Store};
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
    GlooProcesses,
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
        Backend::GlooProcesses => processes(args),
    }
}

fn free_port() -> Result<u16, CommError> {
    free_loopback_port().map_err(|e| CommError::Aborted {
        rank: 0,
        reason: format!("no free loopback port: {e}"),
    })
}

/// `gloo-processes`: ranks 1.. as processes of this binary (`--worker-rank`), rank 0
/// here, serving the store.
fn processes(args: &CommBenchArgs) -> Result<CommReport, CommError> {
    let world = args.ranks.max(1);
    let port = free_port()?;
    let failed = |rank: usize, reason: String| CommError::Aborted { rank, reason };
    let exe = std::env::current_exe().map_err(|e| failed(0, format!("this binary: {e}")))?;
    let mut children = Vec::new();
    for rank in 1..world {
        let child = std::process::Command::new(&exe)
            .args(["bench", "comm", "--backend", "gloo-processes"])
            .args(["--ranks", &world.to_string(), "--size", &args.bytes.to_string()])
            .args([
                "--rounds",
                &args.rounds.to_string(),
                "--worker-rank",
                &rank.to_string(),
            ])
            .args(["--master-port", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .map_err(|e| failed(rank, format!("starting {}: {e}", exe.display())))?;
        children.push((rank, child));
    }
    let report = worker(args, 0, port);
    for (rank, mut child) in children {
        let status = child.wait().map_err(|e| failed(rank, e.to_string()))?;
        if !status.success() {
            return Err(failed(rank, format!("the rank's process ended with {status}")));
        }
    }
    report?.ok_or_else(|| failed(0, "rank 0 made no report".into()))
}

/// One rank of `gloo-processes` (this process's only rank): joins through the store on
/// `port`, times each collective from a Gloo barrier, gathers every rank's times; rank 0
/// returns the report.
pub fn worker(args: &CommBenchArgs, rank: usize, port: u16) -> Result<Option<CommReport>, CommError> {
    let world = args.ranks.max(1);
    let failed = |reason: String| CommError::Aborted { rank, reason };
    let timeout = std::time::Duration::from_secs(60);
    let store = Store::connect("127.0.0.1", port, rank == 0, timeout).map_err(|e| failed(e.into()))?;
    let comm = Arc::new(Gloo::join(store, "bench", rank, world, timeout).map_err(|e| failed(e.into()))?);
    let full = (args.bytes / 4).div_ceil(world) * world;
    let shard = full / world;
    let input: Vec<f32> = (0..full).map(|i| (i + rank) as f32 * 1e-3).collect();
    let (mut out, mut copy) = (vec![0f32; full], vec![0f32; full]);
    let (mut memcpy, mut gather, mut scatter) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds + 1 {
        let mut times = [0f64; 3];
        comm.barrier()?;
        let t = Instant::now();
        copy.copy_from_slice(&input);
        times[0] = t.elapsed().as_secs_f64();
        comm.barrier()?;
        let t = Instant::now();
        comm.all_gather(&input[..shard], &mut out)?;
        times[1] = t.elapsed().as_secs_f64();
        comm.barrier()?;
        let t = Instant::now();
        comm.reduce_scatter(&input, &mut out[..shard], ReduceOp::Avg)?;
        times[2] = t.elapsed().as_secs_f64();
        let mut all = vec![0f64; 3 * world];
        comm.all_gather(&times, &mut all)?;
        let slowest = |op: usize| all.chunks(3).map(|t| t[op]).fold(0f64, f64::max);
        // the first round warms caches and page tables
        if round > 0 {
            let gbs = |s: f64| (4 * full) as f64 / s / 1e9;
            memcpy.push(gbs(slowest(0)));
            gather.push(gbs(slowest(1)));
            scatter.push(gbs(slowest(2)));
        }
    }
    Ok((rank == 0).then(|| report(args, world, full, memcpy, gather, scatter)))
}

/// `world` Gloo ranks over a TCPStore on a free loopback port, joined concurrently.
fn gloo_group(world: usize) -> Result<Vec<Arc<Gloo>>, CommError> {
    let failed = |reason: String| CommError::Aborted { rank: 0, reason };
    let port = free_port()?;
    let timeout = std::time::Duration::from_secs(60);
    let server = Store::connect("127.0.0.1", port, true, timeout).map_err(|e| failed(e.into()))?;
    join_concurrently(0..world, |rank| {
        let store = match rank {
            0 => server.clone(),
            _ => Store::connect("127.0.0.1", port, false, timeout)?,
        };
        Ok(Arc::new(Gloo::join(store, "bench", rank, world, timeout)?))
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
    Ok(report(args, world, full, memcpy, gather, scatter))
}

/// The report of per-round GB/s: medians, and the collectives ÷ memcpy.
fn report(
    args: &CommBenchArgs,
    world: usize,
    full: usize,
    memcpy: Vec<f64>,
    gather: Vec<f64>,
    scatter: Vec<f64>,
) -> CommReport {
    let (memcpy_gbs, all_gather_gbs, reduce_scatter_gbs) = (median(memcpy), median(gather), median(scatter));
    CommReport {
        backend: args.backend,
        ranks: world,
        bytes: 4 * full,
        rounds: args.rounds,
        memcpy_gbs,
        all_gather_gbs,
        reduce_scatter_gbs,
        all_gather_ratio: all_gather_gbs / memcpy_gbs,
        reduce_scatter_ratio: reduce_scatter_gbs / memcpy_gbs,
    }
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
