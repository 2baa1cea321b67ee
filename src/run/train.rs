//! `tierzero train`: this process's ranks as threads (DESIGN.md, "Processes and
//! ranks"), the CPU cores split between their libtorch intra-op threads, and what the run
//! writes. Global rank 0 reports each step; its process writes
//! `<output_dir>/metrics.jsonl`, the monitors, the progress and the plots.

use super::comms::communicators;
use super::error::TrainError;
use super::options::TrainOptions;
use super::prepare::Prepared;
use super::rank::{guarded_rank, rank_threads, RankMessage, RankOutcome};
use super::report::Reporter;
use super::result::TrainResult;
use crate::comm::Collective;
use crate::engine::context::LaneOptions;
use crate::engine::error::EngineError;
use crate::metrics::timeline::Timeline;
use crate::model::Model;
use crate::plan::partition::Partition;
use crate::plan::Plan;
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
        return Err(TrainError::OneProcess(
            "collecting the master weights needs every rank in this process; run on one node",
        ));
    }
    // libtorch's CPU bytes, where the process counts them (the binary installs the
    // counting allocator at start-up)
    let on_cpu = plan.train.accelerator == crate::plan::Accelerator::Cpu
        && crate::torch::shim::counting_cpu_allocations();
    let prepared = Prepared::new(plan, options.resume)?;
    let first_step = prepared.start.first_step();
    let model = &prepared.model;
    let world = plan.world_size;
    let loss_floor = prepared.dataset.loss_floor(plan.data.seq_len);
    if options.write_outputs {
        announce(&prepared, first_step, loss_floor);
    }
    crate::metrics::host::reuse_freed_memory();
    tch::set_num_threads(rank_threads(plan) as i32);

    let mut reporter = Reporter::open(plan, options.write_outputs, first_step)?;

    let trace = options.trace || plan.train.trace;
    let timeline = Timeline::new(trace);
    let (tx, rx) = crossbeam_channel::unbounded::<RankMessage>();
    let comms = communicators(plan, options.one_communicator, options.c10d_in_process)?;
    let mut result = TrainResult {
        loss_floor,
        rank_peak_flops: reporter.peak,
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
                    options.simulate,
                );
                std::thread::Builder::new()
                    .name(format!("tierzero-rank-{}", comms.main.rank()))
                    .spawn_scoped(scope, move || guarded_rank(comms, context, &tx, options))
            })
            .collect();
        drop(tx);
        for message in rx {
            reporter.record(message, &mut result);
        }
        reporter.finish();

        handles
            .into_iter()
            .map(|h| match h {
                Ok(handle) => handle.join().unwrap_or(Err(TrainError::ThreadPanicked)),
                Err(e) => Err(TrainError::Spawn(e)),
            })
            .collect()
    });
    let mut simulated_trace = Vec::new();
    let partitions = outcomes
        .into_iter()
        .map(|outcome| {
            outcome.map(|mut p| {
                simulated_trace.append(&mut p.simulated_trace);
                result.device_peaks.push(p.device_peak);
                result.gpu_memory.extend(p.gpu_memory);
                result.preempted |= p.preempted;
                p.master
            })
        })
        .collect::<Vec<_>>();
    let partitions = root_cause(partitions)?;
    if on_cpu {
        result.cpu_allocator_peak = Some(crate::torch::shim::cpu_memory().1);
    }
    if options.collect_master {
        result.master = whole_master(model, world, &partitions);
    }
    result.seconds = start.elapsed().as_secs_f64();
    if trace {
        let path = plan.train.output_dir.join("trace.json");
        std::fs::create_dir_all(&plan.train.output_dir)
            .and_then(|()| crate::metrics::trace::write_trace(&path, &timeline))
            .map_err(|source| TrainError::Output { path, source })?;
        if !simulated_trace.is_empty() {
            // the simulated device's streams, in virtual seconds from the run's start
            let path = plan.train.output_dir.join("trace_simulated.json");
            let json = serde_json::json!({ "traceEvents": simulated_trace, "displayTimeUnit": "ms" });
            std::fs::write(&path, json.to_string()).map_err(|source| TrainError::Output { path, source })?;
        }
    }
    reporter.plots(&result);
    Ok(result)
}

/// What the run starts from, for the person who launched it: the checkpoint it resumes,
/// the synthetic data's loss floor, the data set.
fn announce(prepared: &Prepared, first_step: u64, loss_floor: Option<f64>) {
    if let Some(c) = prepared.start.checkpoint() {
        println!(
            "resuming from {} at step {first_step} (saved by {} ranks)",
            c.dir.display(),
            c.manifest.world_size
        );
    }
    if let Some(floor) = loss_floor {
        println!("synthetic data: a perfect model reaches a loss of {floor:.4}");
    }
    if let Some(line) = prepared.dataset.describe() {
        println!("{line}");
    }
}

/// Every unit's whole fp32 master weights from each rank's partitions of it.
fn whole_master(model: &Model, world: usize, partitions: &[Vec<(usize, Vec<f32>)>]) -> Vec<Vec<f32>> {
    model
        .units
        .iter()
        .enumerate()
        .map(|(u, layout)| {
            let part = Partition::new(layout.numel, world);
            let mut full = vec![0f32; part.padded];
            for rank_parts in partitions {
                let (start, values) = &rank_parts[u];
                full[*start..*start + values.len()].copy_from_slice(values);
            }
            full.truncate(layout.numel);
            full
        })
        .collect()
}

/// The outcomes of every rank, or the root cause of a failure: the first error that is not
/// another rank's echo of it (a rank that saw a collective fail, or that learnt through
/// `agree` that another rank failed, names no cause of its own).
fn root_cause<T>(outcomes: Vec<Result<T, TrainError>>) -> Result<Vec<T>, TrainError> {
    let echo = |e: &TrainError| {
        matches!(
            e,
            TrainError::Engine(EngineError::Comm(_) | EngineError::Peer { .. })
        )
    };
    let mut first_error: Option<TrainError> = None;
    let mut ok = Vec::with_capacity(outcomes.len());
    for outcome in outcomes {
        match outcome {
            Ok(value) => ok.push(value),
            Err(e) => {
                if first_error.as_ref().is_none_or(|first| echo(first) && !echo(&e)) {
                    first_error = Some(e);
                }
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(ok),
    }
}
