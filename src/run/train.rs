//! `tierzero train`: this process's ranks as threads (DESIGN.md, "Processes and
//! ranks"), the CPU cores split between their libtorch intra-op threads, and what the run
//! writes. Global rank 0 reports each step; its process writes
//! `<output_dir>/metrics.jsonl`, the monitors, the progress and the plots.

use super::comms::communicators;
use super::error::TrainError;
use super::options::TrainOptions;
use super::prepare::Prepared;
use super::rank::{rank_threads, run_rank, RankMessage, RankOutcome};
use super::result::{scalars, StepMetrics, TrainResult};
use crate::comm::Collective;
use crate::engine::context::LaneOptions;
use crate::engine::error::EngineError;
use crate::metrics::host::{HostUsage, Span};
use crate::metrics::monitor::Monitors;
use crate::metrics::timeline::{Breakdown, Timeline};
use crate::metrics::trace::TierBytes;
use crate::plan::partition::Partition;
use crate::plan::Plan;
use std::io::Write;
use std::time::Instant;

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
