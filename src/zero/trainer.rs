//! `tierzero train`: this process's ranks as threads, the shared swap store, and what a
//! run writes.
//!
//! One worker thread per local rank (DESIGN.md, "Processes and ranks"); the ranks share
//! one swap store (one I/O engine per NVMe path) and the CPU cores are split between
//! their libtorch intra-op threads. Each rank has three communicators (`Comms`: compute,
//! prefetch, reducer). One process: they are `Local`. Several (`train.nnodes`, or
//! torchrun): c10d Gloo communicators over the TCPStore on the master address (served
//! by node 0, or by torchrun's agent); each node keeps its NVMe files under
//! `<nvme_path>/node-<rank>`. A rank that fails or panics aborts its
//! communicators, so every other rank, in any process, returns an error instead of
//! hanging. Global rank 0
//! reports each step; its process writes `<output_dir>/metrics.jsonl` and the progress.

use super::context::{Comms, LaneOptions, RankContext, StepReport};
use super::error::EngineError;
use super::rank::{kind_for, RankEngine};
use super::start::Start;
use crate::checkpoint::{save, Checkpoint, CheckpointError};
use crate::comm::gloo::{join_concurrently, Gloo, Store};
use crate::comm::local::Local;
use crate::comm::nccl::{watchdog, Nccl, Watched};
use crate::comm::{Collective, Group};
use crate::data::{DataError, Dataset};
use crate::device::cpu::CpuDevice;
use crate::device::cuda::Cuda;
use crate::metrics::host::{Span, Usage};
use crate::metrics::monitor::{Monitors, Scalar};
use crate::metrics::timeline::{Breakdown, Timeline};
use crate::metrics::trace::TierBytes;
use crate::model::Model;
use crate::plan::partition::Partition;
use crate::plan::rules::SWAP_CHUNK_LIMIT;
use crate::plan::{Plan, Tier};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey, TensorSpec};
use tierzero_offload::nvme::{open_engine, EngineChoice, EngineConfig, IoError};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("swap store under {path}: {source}")]
    Swap { path: PathBuf, source: IoError },
    #[error("cannot write {path}: {source}")]
    Output { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Copy, Debug, Default)]
pub struct TrainOptions<'a> {
    /// Create the output directory and write metrics.jsonl; print progress.
    pub write_outputs: bool,
    /// Return the final fp32 master weights (tests, export).
    pub collect_master: bool,
    /// Run each optimizer phase to completion before the next step (a debug switch;
    /// the default runs it behind the next step's forward).
    pub blocking_optimizer: bool,
    /// Save checkpoints under `<output_dir>/checkpoints`: every `train.save_interval`
    /// steps and after the last.
    pub save_checkpoints: bool,
    /// Continue from this checkpoint directory.
    pub resume: Option<&'a std::path::Path>,
    /// Write `<output_dir>/trace.json` (also `train.trace`).
    pub trace: bool,
    /// Make every phase blocking (no prefetch worker, optimizer phase and NVMe legs
    /// one after another): a debug switch for the breakdown's `overlap`.
    pub no_overlap: bool,
    /// How the ranks' lanes run; None: as the environment says (`TIERZERO_CHECKED_LANES=1`
    /// checks them, see `Mode::from_env`), plain otherwise.
    pub lanes: Option<LaneOptions>,
    /// Ranks in one process share one communicator for everything (tests: `Local` fails
    /// any collective issued out of the ranks' common order or two at once by one rank,
    /// so a run that passes issues them as NCCL needs, from one thread per rank).
    pub one_communicator: bool,
    /// Ranks in one process talk through c10d as CUDA ranks do (a store served here on a
    /// loopback port; Gloo for CPU ranks): tests of that path without a GPU.
    pub c10d_in_process: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub loss_scale: f64,
    pub skipped: bool,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub step_seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Rank 0's breakdown of the step (see `metrics/timeline.rs`), written as its JSON.
    #[serde(serialize_with = "Breakdown::serialize_json")]
    pub breakdown: Breakdown,
    /// Bytes per tier after the step (device: the step's peak).
    pub memory: TierBytes,
    /// The process's resident set after the step, bytes (all ranks of this process).
    pub host_rss: u64,
}

#[derive(Debug, Default)]
pub struct TrainResult {
    /// Every step's metrics, up to `metrics::history::KEPT_STEPS`; a longer run keeps
    /// evenly spaced steps and its latest (`metrics.jsonl` has them all).
    pub steps: Vec<StepMetrics>,
    /// The data's known loss floor (synthetic corpora).
    pub loss_floor: Option<f64>,
    /// Peak device bytes of each rank.
    pub device_peaks: Vec<u64>,
    /// On CUDA, torch's allocator statistics of each rank's GPU (peaks over the run).
    pub gpu_memory: Vec<crate::torch::shim::MemoryStats>,
    /// On the CPU, the most bytes libtorch's CPU tensors held during the steps (all ranks
    /// of this process; counted by the bridge's allocator, not by the engine).
    pub cpu_allocator_peak: Option<u64>,
    /// Per unit, the fp32 master weights (unpadded), when collected.
    pub master: Vec<Vec<f32>>,
    pub seconds: f64,
    /// The matmul peak of one rank, FLOP/s, measured in the run (`metrics/peak.rs`; 0
    /// when outputs are off). MFU divides by it times the world size.
    pub rank_peak_flops: f64,
    /// The run stopped early on a preemption signal (`run/preempt.rs`), after saving
    /// the last step in `steps` when checkpoints are on.
    pub preempted: bool,
    /// This process's host usage: peak resident set of start-up, and CPU time and peak
    /// resident set of the steps (checkpoint saves between steps included, the final
    /// one not).
    pub host: HostUsage,
}

impl TrainResult {
    /// Rank 0's breakdown of each step in `steps`.
    pub fn breakdowns(&self) -> Vec<Breakdown> {
        self.steps.iter().map(|m| m.breakdown.clone()).collect()
    }
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct HostUsage {
    pub startup_peak_rss: u64,
    pub steps: Span,
}

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
struct RankOutcome {
    device_peak: u64,
    gpu_memory: Option<crate::torch::shim::MemoryStats>,
    master: Vec<(usize, Vec<f32>)>,
}

struct RankMessage {
    step: u64,
    saved: Option<PathBuf>,
    report: StepReport,
    seconds: f64,
    eval_loss: Option<f64>,
    breakdown: Breakdown,
    memory: TierBytes,
    /// The process's usage when the steps began (peak: that of start-up), and after this
    /// step's update was issued (peak: of the steps so far).
    host_start: Usage,
    host: Usage,
}

/// A step's scalars under DeepSpeed's monitor names (`Train/Samples/…`), then
/// tierzero's own: gradient norm, throughput, MFU, seconds per phase of the breakdown,
/// bytes per memory tier and the process's resident set.
fn scalars(m: &StepMetrics, breakdown: &Breakdown, plan: &Plan) -> Vec<Scalar> {
    let scalar = |tag: &str, value: f64| Scalar {
        tag: format!("Train/Samples/{tag}"),
        value,
    };
    let mut out = vec![scalar("train_loss", m.loss), scalar("lr", m.lr)];
    if matches!(plan.precision, crate::plan::Precision::Fp16(_)) {
        out.push(scalar("loss_scale", m.loss_scale));
    }
    out.push(scalar("grad_norm", m.grad_norm));
    out.push(scalar("tokens_per_s", m.tokens_per_s));
    out.push(scalar("mfu", m.mfu));
    if let Some(eval) = m.eval_loss {
        out.push(scalar("eval_loss", eval));
    }
    out.push(scalar("step_seconds", m.step_seconds));
    for (phase, seconds) in &breakdown.phases {
        out.push(scalar(&format!("seconds/{}", phase.name()), *seconds));
    }
    for (tier, bytes) in [
        ("device", m.memory.device),
        ("host", m.memory.host),
        ("nvme", m.memory.nvme),
        ("host_rss", m.host_rss),
    ] {
        out.push(scalar(&format!("memory/{tier}_bytes"), bytes as f64));
    }
    out
}

fn swap_specs(plan: &Plan, model: &Model, states: &[State], elem_bytes: usize) -> Vec<TensorSpec> {
    let world = plan.world_size;
    let mut specs = Vec::new();
    for (u, layout) in model.units.iter().enumerate() {
        let part = Partition::new(layout.numel, world);
        for rank in plan.train.local_ranks() {
            let numel = match states[0] {
                State::Param => part.shard,
                _ if plan.zero.stage == 0 => part.padded,
                _ => part.shard,
            };
            for &state in states {
                specs.push(TensorSpec {
                    key: TensorKey {
                        unit: u as u32,
                        rank: rank as u32,
                        state,
                    },
                    numel,
                    elem_bytes,
                });
            }
        }
    }
    specs
}

fn open_store(
    plan: &Plan,
    path: &std::path::Path,
    name: &str,
    specs: &[TensorSpec],
) -> Result<SwapStore, TrainError> {
    // nodes of one run may share a file system: each keeps its own directory
    let node_path;
    let path = if plan.train.launch.nnodes > 1 {
        node_path = path.join(format!("node-{}", plan.train.launch.node_rank));
        std::fs::create_dir_all(&node_path).map_err(|source| TrainError::Output {
            path: node_path.clone(),
            source,
        })?;
        node_path.as_path()
    } else {
        path
    };
    let engine_config = EngineConfig {
        block_size: plan.aio.block_size,
        queue_depth: plan.aio.queue_depth,
        parallelism: plan.aio.intra_op_parallelism,
        single_submit: plan.aio.single_submit,
        overlap_events: plan.aio.overlap_events,
    };
    let swap = |source| TrainError::Swap {
        path: path.to_path_buf(),
        source,
    };
    let (engine, _) = open_engine(path, engine_config, None, EngineChoice::Auto).map_err(swap)?;
    // TIERZERO_IO_FAULT (tests of a failing disk) fails one transfer of the process
    let engine = tierzero_offload::nvme::fault::wrap(engine);
    let chunk = plan
        .zero
        .sub_group_size
        .min(SWAP_CHUNK_LIMIT)
        .min(specs.iter().map(|s| s.numel).max().unwrap_or(1));
    SwapStore::create(path, name, engine, specs, chunk).map_err(swap)
}

/// The model's starting weights per unit: `model.hf_dir`'s, or the seeded init.
pub fn initial_weights(plan: &Plan) -> Result<Vec<Vec<f32>>, TrainError> {
    if let Some(dir) = &plan.model.hf_dir {
        return crate::model::hf::load(dir, &plan.model.config)
            .map_err(|e| TrainError::Invalid(e.to_string()));
    }
    Ok(crate::model::layout::units(&plan.model.config)
        .iter()
        .map(|u| {
            let mut flat = vec![0f32; u.numel];
            u.init(plan.train.seed, &mut flat);
            flat
        })
        .collect())
}

/// Trains `plan.train.steps` steps on `plan.world_size` CPU ranks.
/// What every rank of a run shares, built once per run.
struct Prepared {
    model: Model,
    dataset: Dataset,
    optimizer_store: Option<SwapStore>,
    param_store: Option<SwapStore>,
    start: Start,
}

impl Prepared {
    fn new(plan: &Plan, resume: Option<&std::path::Path>) -> Result<Prepared, TrainError> {
        let model = Model::new(plan.model.config.clone(), kind_for(&plan.precision));
        let dataset = Dataset::open(plan)?;
        if dataset.vocab_needed() > model.config.vocab_size {
            return Err(TrainError::Invalid(format!(
                "the synthetic corpus uses {} token ids but model.vocab_size is {}; raise model.vocab_size",
                dataset.vocab_needed(),
                model.config.vocab_size
            )));
        }
        let (optimizer_store, param_store) = open_stores(plan, &model)?;
        let start = match (resume, &plan.model.hf_dir) {
            (Some(dir), _) => {
                let checkpoint = Checkpoint::open(dir)?;
                checkpoint.manifest.check_model(dir, &model.config)?;
                let saved = &checkpoint.manifest.data;
                if saved.train_batch_size != plan.batch.train_batch_size || saved.seq_len != plan.data.seq_len
                {
                    tracing::warn!(
                        "{} was saved with {} sequences × {} tokens per step; this run uses {} × {}, so the data after step {} differs from the original run's",
                        dir.display(),
                        saved.train_batch_size,
                        saved.seq_len,
                        plan.batch.train_batch_size,
                        plan.data.seq_len,
                        saved.step
                    );
                }
                Start::Checkpoint(Box::new(checkpoint))
            }
            (None, Some(hf_dir)) => Start::Hf(
                crate::model::hf::HfWeights::open(hf_dir, &model.config)
                    .map_err(|e| TrainError::Invalid(e.to_string()))?,
            ),
            (None, None) => Start::Init {
                seed: plan.train.seed,
            },
        };
        Ok(Prepared {
            model,
            dataset,
            optimizer_store,
            param_store,
            start,
        })
    }

    fn context<'a>(
        &'a self,
        plan: &'a Plan,
        timeline: Option<&'a Timeline>,
        overlap: bool,
        lanes: LaneOptions,
    ) -> RankContext<'a> {
        RankContext {
            plan,
            model: &self.model,
            dataset: &self.dataset,
            optimizer_store: self.optimizer_store.as_ref(),
            param_store: self.param_store.as_ref(),
            start: &self.start,
            timeline,
            overlap,
            lanes,
        }
    }
}

pub fn train(plan: &Plan, options: TrainOptions<'_>) -> Result<TrainResult, TrainError> {
    let start = Instant::now();
    // only global rank 0's process reports and writes the run's outputs
    let options = TrainOptions {
        write_outputs: options.write_outputs && plan.train.launch.node_rank == 0,
        lanes: Some(options.lanes.unwrap_or_else(LaneOptions::from_env)),
        ..options
    };
    if options.collect_master && plan.train.launch.nnodes > 1 {
        return Err(TrainError::Invalid(
            "collecting the master weights needs every rank in this process; run on one node".into(),
        ));
    }
    // libtorch's CPU bytes, where the process counts them (the binary installs the
    // counting allocator at start-up)
    let on_cpu = plan.train.accelerator == crate::plan::Accelerator::Cpu
        && crate::torch::shim::counting_cpu_allocations();
    let prepared = Prepared::new(plan, options.resume)?;
    let first_step = prepared.start.first_step();
    if let (Some(c), true) = (prepared.start.checkpoint(), options.write_outputs) {
        println!(
            "resuming from {} at step {first_step} (saved by {} ranks)",
            c.dir.display(),
            c.manifest.world_size
        );
    }
    let model = &prepared.model;
    let world = plan.world_size;
    let loss_floor = prepared.dataset.loss_floor(plan.data.seq_len);
    if let (Some(floor), true) = (loss_floor, options.write_outputs) {
        println!("synthetic data: a perfect model reaches a loss of {floor:.4}");
    }
    crate::metrics::host::reuse_freed_memory();
    tch::set_num_threads(rank_threads(plan) as i32);

    let mut metrics_file = None;
    let peak = if options.write_outputs {
        let dir = &plan.train.output_dir;
        std::fs::create_dir_all(dir).map_err(|source| TrainError::Output {
            path: dir.clone(),
            source,
        })?;
        let path = dir.join("metrics.jsonl");
        // a resumed run continues the metrics of the run it resumes
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(first_step > 0)
            .truncate(first_step == 0)
            .open(&path)
            .map_err(|source| TrainError::Output {
                path: path.clone(),
                source,
            })?;
        metrics_file = Some((file, path));
        crate::metrics::peak::peak_flops(plan)
    } else {
        0.0
    };
    // DeepSpeed's monitors, from node 0 only
    let mut monitors = match options.write_outputs && plan.train.launch.node_rank == 0 {
        true => Some(
            Monitors::open(
                plan.monitors.tensorboard.as_deref(),
                plan.monitors.csv.as_deref(),
                plan.steps_per_print,
            )
            .map_err(|(path, source)| TrainError::Output { path, source })?,
        ),
        false => None,
    };
    let flops_per_token = model.config.flops_per_token(plan.data.seq_len);
    let tokens_per_step = plan.tokens_per_step() as u64;

    let trace = options.trace || plan.train.trace;
    let timeline = Timeline::new(trace);
    let (tx, rx) = crossbeam_channel::unbounded::<RankMessage>();
    let comms = communicators(plan, options.one_communicator, options.c10d_in_process)?;
    let mut result = TrainResult {
        loss_floor,
        rank_peak_flops: peak,
        ..TrainResult::default()
    };
    let outcomes: Vec<Result<RankOutcome, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comms| {
                let tx = tx.clone();
                let context = prepared.context(
                    plan,
                    Some(&timeline),
                    !options.no_overlap,
                    options.lanes.unwrap_or_default(),
                );
                std::thread::Builder::new()
                    .name(format!("tierzero-rank-{}", comms.main.rank()))
                    .spawn_scoped(scope, move || {
                        let guards = comms.clone();
                        let rank = comms.main.rank();
                        let body = std::panic::AssertUnwindSafe(|| run_rank(comms, context, &tx, options));
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
                                Err(TrainError::Invalid(format!("rank {rank} panicked: {message}")))
                            }
                        }
                    })
            })
            .collect();
        drop(tx);
        let mut last = Instant::now();
        let mut thinning = crate::metrics::history::Thinning::default();
        let progress = options
            .write_outputs
            .then(|| crate::metrics::Progress::new(plan.train.steps));
        if let Some(progress) = &progress {
            progress.update(first_step, String::new());
        }
        for message in rx {
            let seconds = message.seconds;
            let tokens_per_s = tokens_per_step as f64 / seconds.max(1e-9);
            let metrics = StepMetrics {
                step: message.step + 1,
                loss: message.report.loss,
                lr: message.report.lr,
                grad_norm: message.report.grad_norm,
                loss_scale: message.report.loss_scale,
                skipped: message.report.skipped,
                tokens: tokens_per_step * (message.step + 1),
                tokens_per_s,
                mfu: crate::metrics::peak::mfu(flops_per_token * tokens_per_s, peak, world),
                step_seconds: seconds,
                eval_loss: message.eval_loss,
                breakdown: message.breakdown,
                memory: message.memory,
                host_rss: message.host.rss,
            };
            result.preempted |= message.report.preempted;
            result.host = HostUsage {
                startup_peak_rss: message.host_start.peak_rss,
                steps: Span::between(message.host_start, message.host),
            };
            if plan.wall_clock_breakdown
                && plan.steps_per_print > 0
                && metrics.step.is_multiple_of(plan.steps_per_print)
            {
                let line = format!("step {:>6} {}", metrics.step, metrics.breakdown.line());
                match &progress {
                    Some(progress) => progress.line(&line),
                    None => tracing::info!("{line}"),
                }
            }
            if let Some(monitors) = monitors.as_mut() {
                let samples = metrics.step * plan.batch.train_batch_size as u64;
                if let Err(e) = monitors.record(samples, &scalars(&metrics, &metrics.breakdown, plan)) {
                    tracing::warn!("writing the tensorboard/csv monitors: {e}");
                }
            }
            if let Some((file, _)) = metrics_file.as_mut() {
                if let Ok(line) = serde_json::to_string(&metrics) {
                    let _ = writeln!(file, "{line}");
                }
                let done = metrics.step;
                if let Some(progress) = &progress {
                    progress.update(
                        done,
                        format!("loss {:.4}  {:.0} tok/s", metrics.loss, metrics.tokens_per_s),
                    );
                    if done.is_multiple_of(plan.train.log_interval)
                        || done == plan.train.steps
                        || last.elapsed().as_secs() >= 10
                    {
                        last = Instant::now();
                        let eta = seconds * (plan.train.steps - done) as f64;
                        let eval = metrics
                            .eval_loss
                            .map(|l| format!("  eval {l:.4}"))
                            .unwrap_or_default();
                        progress.line(&format!(
                            "step {done:>6}/{}  loss {:.4}{eval}  lr {:.2e}  grad_norm {:.3}  {:.0} tok/s  mfu {:.1}%  eta {:.0}s{}",
                            plan.train.steps,
                            metrics.loss,
                            metrics.lr,
                            metrics.grad_norm,
                            metrics.tokens_per_s,
                            100.0 * metrics.mfu,
                            eta,
                            if metrics.skipped { "  (skipped: overflow)" } else { "" }
                        ));
                    }
                    if let Some(saved) = &message.saved {
                        progress.line(&format!("saved checkpoint {}", saved.display()));
                    }
                }
            }
            thinning.push(&mut result.steps, metrics, |m| m.step - 1);
        }
        if let Some(progress) = &progress {
            progress.finish();
        }
        handles
            .into_iter()
            .map(|h| match h {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|_| Err(TrainError::Invalid("a rank thread panicked".into()))),
                Err(e) => Err(TrainError::Invalid(format!("cannot start a rank thread: {e}"))),
            })
            .collect()
    });
    // the root cause is the first error that is not another rank's abort
    let mut partitions = Vec::new();
    let mut first_error = None;
    for outcome in outcomes {
        match outcome {
            Ok(p) => {
                result.device_peaks.push(p.device_peak);
                result.gpu_memory.extend(p.gpu_memory);
                partitions.push(p.master);
            }
            Err(e) => {
                // a rank that saw a collective fail, or that learnt through `agree` that
                // another rank failed, echoes the cause; the cause itself names it
                let echo = |e: &TrainError| {
                    matches!(
                        e,
                        TrainError::Engine(EngineError::Comm(_) | EngineError::Peer { .. })
                    )
                };
                if first_error.as_ref().is_none_or(|first| echo(first) && !echo(&e)) {
                    first_error = Some(e);
                }
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    if on_cpu {
        result.cpu_allocator_peak = Some(crate::torch::shim::cpu_memory().1);
    }
    if options.collect_master {
        result.master = model
            .units
            .iter()
            .enumerate()
            .map(|(u, layout)| {
                let part = Partition::new(layout.numel, world);
                let mut full = vec![0f32; part.padded];
                for rank_parts in &partitions {
                    let (start, values) = &rank_parts[u];
                    full[*start..*start + values.len()].copy_from_slice(values);
                }
                full.truncate(layout.numel);
                full
            })
            .collect();
    }
    result.seconds = start.elapsed().as_secs_f64();
    if trace {
        let path = plan.train.output_dir.join("trace.json");
        std::fs::create_dir_all(&plan.train.output_dir)
            .and_then(|()| crate::metrics::trace::write_trace(&path, &timeline))
            .map_err(|source| TrainError::Output { path, source })?;
    }
    if metrics_file.is_some() {
        let per_step: Vec<(u64, Breakdown, TierBytes)> = result
            .steps
            .iter()
            .map(|m| (m.step, m.breakdown.clone(), m.memory))
            .collect();
        let path = plan.train.output_dir.join("breakdown.png");
        if let Err(e) = crate::metrics::trace::plot_breakdown(&path, &per_step) {
            tracing::warn!("no breakdown plot: {e}");
        }
        let losses: Vec<(u64, f64)> = result.steps.iter().map(|m| (m.step, m.loss)).collect();
        let evals: Vec<(u64, f64)> = result
            .steps
            .iter()
            .filter_map(|m| m.eval_loss.map(|l| (m.step, l)))
            .collect();
        let path = plan.train.output_dir.join("loss.png");
        if let Err(e) = crate::metrics::plot_loss(&path, &losses, &evals, result.loss_floor) {
            tracing::warn!("no loss plot: {e}");
        }
    }
    Ok(result)
}

/// Three `Local` groups for `world` ranks, as each rank's communicators (or one group
/// serving as all three, with `one`).
fn local_comms(world: usize, one: bool) -> Vec<Comms<Local>> {
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
fn communicators(plan: &Plan, one: bool, c10d: bool) -> Result<Vec<Comms<Group>>, TrainError> {
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
        let server = Store::serve_loopback(timeout).map_err(|e| {
            TrainError::Invalid(format!("serving the ranks' store on the loopback interface: {e}"))
        })?;
        ("127.0.0.1".to_string(), Some(server))
    } else {
        let agent = std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Ok("True");
        let serve = !agent && launch.node_rank == 0;
        let server = serve
            .then(|| Store::connect(&launch.master_addr, launch.master_port, true, timeout))
            .transpose()
            .map_err(TrainError::Invalid)?;
        (launch.master_addr.clone(), server)
    };
    let port = match &served {
        Some(server) => server.port().map_err(TrainError::Invalid)?,
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
                    None => Gloo::join(store.clone(), name, rank, world, timeout)
                        .map(|g| Group::Gloo(Arc::new(g))),
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
    .map_err(TrainError::Invalid)?;
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
    }
    Ok(comms.into_iter().map(|(c, _)| c).collect())
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
    std::thread::scope(|scope| -> Result<(), TrainError> {
        let first_step = context.start.first_step();
        let root = save::root(&plan.train.output_dir);
        let host_start = Usage::now();
        if rank == 0 {
            crate::metrics::host::reset_peak();
            crate::torch::shim::reset_cpu_peak();
        }
        for step in first_step..plan.train.steps {
            let start = Instant::now();
            let concurrent = !(options.blocking_optimizer || options.no_overlap);
            let report = engine.step(step, concurrent.then_some(scope))?;
            let host = Usage::now();
            let end = Instant::now();
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
                engine.save_checkpoint(&root, done, report.lr, plan.train.keep_last)?
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
                });
            }
            if preempted {
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
    })
}

/// Mean loss over `train.eval_batches` held-out batches, on every rank, without training.
pub fn evaluate(plan: &Plan) -> Result<f64, TrainError> {
    if plan.train.launch.nnodes > 1 {
        return Err(TrainError::Invalid(
            "tierzero eval runs in one process; drop --nnodes (or train.nnodes)".into(),
        ));
    }
    let prepared = Prepared::new(plan, None)?;
    let world = plan.world_size;
    let losses: Vec<Result<f64, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = local_comms(world, false)
            .into_iter()
            .map(|comms| {
                let context = prepared.context(plan, None, true, LaneOptions::from_env());
                scope.spawn(move || -> Result<f64, TrainError> {
                    let guard = comms.clone();
                    let run = || -> Result<f64, TrainError> {
                        let device =
                            CpuDevice::new(comms.main.rank(), plan.train.device_memory.unwrap_or(u64::MAX));
                        let mut engine = RankEngine::new(comms, context, device)?;
                        Ok(engine.eval(plan.train.eval_batches)?)
                    };
                    run().inspect_err(|e| guard.abort(&e.to_string()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(TrainError::Invalid("a rank panicked".into())))
            })
            .collect()
    });
    losses.into_iter().next().unwrap_or(Ok(f64::NAN))
}

/// The swap stores the plan's NVMe tiers need (optimizer state, parameters).
fn open_stores(plan: &Plan, model: &Model) -> Result<(Option<SwapStore>, Option<SwapStore>), TrainError> {
    let optimizer = match (
        &plan.zero.offload_optimizer.tier,
        &plan.zero.offload_optimizer.nvme_path,
    ) {
        (Tier::Nvme, Some(path)) => {
            let mut specs = swap_specs(plan, model, &State::OPTIMIZER, 4);
            if crate::plan::rules::nvme_gradients(plan) {
                let elem = if crate::plan::rules::bf16_gradients(plan) {
                    2
                } else {
                    4
                };
                specs.extend(swap_specs(plan, model, &[State::Grad], elem));
            }
            Some(open_store(plan, path, "tierzero-optimizer", &specs)?)
        }
        _ => None,
    };
    let params = match (&plan.zero.offload_param.tier, &plan.zero.offload_param.nvme_path) {
        (Tier::Nvme, Some(path)) => Some(open_store(
            plan,
            path,
            "tierzero-params",
            &swap_specs(plan, model, &[State::Param], plan.precision.bytes()),
        )?),
        _ => None,
    };
    Ok((optimizer, params))
}
