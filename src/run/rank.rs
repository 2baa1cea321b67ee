//! One rank's thread: its engine, its steps, its checkpoints, and what it tells the
//! metrics loop. A rank that fails or panics aborts its communicators, so every other
//! rank, in any process, returns an error instead of hanging.

use super::error::TrainError;
use super::options::TrainOptions;
use crate::checkpoint::save;
use crate::comm::{Collective, Group};
use crate::device::cpu::CpuDevice;
use crate::device::sim::SimulatedStep;
use crate::engine::context::{Comms, RankContext, StepReport};
use crate::engine::error::EngineError;
use crate::engine::rank::RankEngine;
use crate::metrics::host::Usage;
use crate::metrics::timeline::Breakdown;
use crate::metrics::trace::TierBytes;
use crate::plan::Plan;
use std::path::PathBuf;
use std::time::Instant;

/// torch threads of each rank: torchrun sets OMP_NUM_THREADS (to 1 for several
/// processes per machine) and, as in PyTorch, it wins; else the cores are split between
/// this process's ranks.
pub fn rank_threads(plan: &Plan) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::env::var("OMP_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or((cores / plan.train.devices).max(1))
}

/// What a rank hands back at the end: its device peak and master partitions.
pub(super) struct RankOutcome {
    pub(super) device_peak: u64,
    pub(super) gpu_memory: Option<crate::torch::shim::MemoryStats>,
    pub(super) master: Vec<(usize, Vec<f32>)>,
    /// The run stopped on a preemption signal (every rank knows it from the step's
    /// all-reduce; only rank 0 reports steps).
    pub(super) preempted: bool,
    /// On a simulated device with a trace: the rank's streams' spans in virtual time.
    pub(super) simulated_trace: Vec<serde_json::Value>,
}

pub(super) struct RankMessage {
    pub(super) step: u64,
    pub(super) saved: Option<PathBuf>,
    pub(super) report: StepReport,
    pub(super) seconds: f64,
    pub(super) eval_loss: Option<f64>,
    pub(super) breakdown: Breakdown,
    pub(super) memory: TierBytes,
    /// The process's usage when the steps began (peak: that of start-up), and after this
    /// step's update was issued (peak: of the steps so far).
    pub(super) host_start: Usage,
    pub(super) host: Usage,
    /// The step on the simulated device's clocks (`train --simulate`).
    pub(super) simulated: Option<SimulatedStep>,
}

/// A rank's thread: [`run_rank`], and on its failure or panic every communicator of the
/// rank aborted with the cause, so no peer waits for it.
pub(super) fn guarded_rank(
    comms: Comms<Group>,
    context: RankContext<'_>,
    tx: &crossbeam_channel::Sender<RankMessage>,
    options: TrainOptions,
) -> Result<RankOutcome, TrainError> {
    let guards = comms.clone();
    let rank = comms.main.rank();
    let body = std::panic::AssertUnwindSafe(|| run_rank(comms, context, tx, options));
    match std::panic::catch_unwind(body) {
        Ok(Ok(master)) => Ok(master),
        Ok(Err(e)) => {
            guards.abort(&format!("rank {rank} failed: {e}"));
            Err(e)
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            guards.abort(&format!("rank {rank} panicked: {message}"));
            Err(TrainError::RankPanicked { rank, message })
        }
    }
}

fn run_rank(
    comms: Comms<Group>,
    context: RankContext<'_>,
    tx: &crossbeam_channel::Sender<RankMessage>,
    options: TrainOptions,
) -> Result<RankOutcome, TrainError> {
    let plan = context.plan;
    let rank = comms.main.rank();
    let device = CpuDevice::new(rank, plan.train.device_memory.unwrap_or(u64::MAX));
    let gpu = match plan.train.compute_device(rank) {
        tch::Device::Cuda(d) => Some(d),
        _ => None,
    };
    let gpu_err = |e: tch::TchError| TrainError::Engine(EngineError::Torch { rank, source: e });
    if let Some(d) = gpu {
        crate::torch::shim::reset_peak(d).map_err(gpu_err)?;
    }
    let mut engine = RankEngine::new(comms, context, device)?;
    // the optimizer phase of each step runs on a thread of this scope, overlapping the
    // next step's forward
    let mut stopped = false;
    std::thread::scope(|scope| -> Result<(), TrainError> {
        let first_step = context.start.first_step();
        engine.check_same_start(first_step)?;
        // every rank of this process has read its state (the check is a collective)
        if rank == plan.train.local_ranks().start {
            context.start.release_pages();
        }
        // from the first step on, a signal asks for a checkpoint first
        super::preempt::arm();
        let root = save::root(&plan.train.output_dir);
        let host_start = Usage::now();
        if rank == 0 {
            crate::metrics::host::reset_peak();
            crate::torch::shim::reset_cpu_peak();
        }
        for step in first_step..plan.train.steps {
            let start = Instant::now();
            let clocks = engine.simulated().map(|s| s.figures());
            let concurrent = !(options.blocking_optimizer || options.no_overlap);
            let report = engine.step(step, concurrent.then_some(scope), super::preempt::requested())?;
            let host = Usage::now();
            let end = Instant::now();
            let simulated = engine
                .simulated()
                .zip(clocks)
                .map(|(sim, before)| sim.step(&before, &sim.figures()));
            let seconds = (end - start).as_secs_f64();
            let breakdown = context
                .timeline
                .map(|t| t.breakdown(rank, start, end))
                .unwrap_or_default();
            let memory = engine.tier_bytes();
            let eval_loss = if plan.train.eval_interval > 0 && (step + 1) % plan.train.eval_interval == 0 {
                Some(engine.eval(plan.train.eval_batches)?)
            } else {
                None
            };
            let done = step + 1;
            let preempted = report.preempted;
            let due = (plan.train.save_interval > 0 && done.is_multiple_of(plan.train.save_interval))
                || done == plan.train.steps
                || preempted;
            let saved = if options.save_checkpoints && due {
                // the final save takes the NVMe swap files as they are
                let last = done == plan.train.steps || preempted;
                engine.save_checkpoint(&root, (done, report.lr), plan.train.keep_last, last)?
            } else {
                None
            };
            if rank == 0 {
                let _ = tx.send(RankMessage {
                    step,
                    saved,
                    breakdown,
                    memory,
                    report,
                    seconds,
                    eval_loss,
                    host_start,
                    host,
                    simulated,
                });
            }
            if preempted {
                stopped = true;
                break;
            }
        }
        Ok(engine.install_all()?)
    })?;
    let master = if options.collect_master {
        (0..engine.unit_count())
            .map(|u| engine.master(u).map_err(TrainError::from))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let gpu_memory = match gpu {
        Some(d) => Some(crate::torch::shim::memory_stats(d).map_err(gpu_err)?),
        None => None,
    };
    Ok(RankOutcome {
        gpu_memory,
        device_peak: engine.device_peak(),
        master,
        preempted: stopped,
        simulated_trace: engine
            .simulated()
            .map(|s| s.trace_events(rank))
            .unwrap_or_default(),
    })
}
