//! `tierzero bench step`: tokens/s and MFU of a config, against a dense baseline.
//!
//! Runs the config as given (N ranks, its stage and tiers), then the dense single-rank
//! run of the same model and global batch (stage 0, nothing offloaded, N× the
//! accumulation steps) on the same machine, and reports the median step time of each
//! (the first step is a warm-up) and their ratio: what ZeRO's sharding, offload and
//! collectives cost over plain training. It prints the ZeRO run's per-step breakdown
//! (rank 0, steady state) with `overlap` and `bound_ratio`, the same breakdown with
//! every phase blocking, and what writing a trace costs: the ZeRO run again with
//! tracing on, as a ratio of median step times.

use super::median;
use crate::metrics::peak::{mfu, peak_flops};
use crate::metrics::timeline::Breakdown;
use crate::plan::{Plan, Tier};
use crate::run::{rank_threads, train, TrainError, TrainOptions};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct StepRun {
    pub devices: usize,
    pub stage: u8,
    pub offload_param: String,
    pub offload_optimizer: String,
    pub step_seconds: f64,
    pub tokens_per_s: f64,
    /// Model FLOP/s ÷ (ranks × one rank's matmul peak).
    pub mfu: f64,
    /// One rank's matmul peak, FLOP/s, with a rank's torch threads.
    pub peak_flops: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub parameters: usize,
    pub tokens_per_step: usize,
    /// One rank's matmul peak of the ZeRO run, FLOP/s.
    pub peak_flops: f64,
    pub zero: StepRun,
    pub dense: StepRun,
    pub ratio_to_dense: f64,
    /// Rank 0's steady-state breakdown of the ZeRO run, and with every phase blocking.
    pub breakdown: serde_json::Value,
    pub blocking_breakdown: serde_json::Value,
    #[serde(skip)]
    tables: (String, String),
    pub blocking_step_seconds: f64,
    /// Median step time with tracing on ÷ off, minus 1.
    pub trace_overhead: f64,
}

/// One rank's matmul peak with the torch threads a rank of `plan` runs with.
fn rank_peak(plan: &Plan) -> f64 {
    tch::set_num_threads(rank_threads(plan) as i32);
    peak_flops(plan)
}

fn measure(plan: &Plan, options: TrainOptions<'_>) -> Result<(StepRun, Breakdown), TrainError> {
    let peak = rank_peak(plan);
    let result = train(plan, options)?;
    let breakdown = Breakdown::total(result.breakdowns().get(1..).unwrap_or(&[]));
    let step_seconds = median(result.steps.iter().skip(1).map(|s| s.step_seconds).collect());
    let tokens_per_s = plan.tokens_per_step() as f64 / step_seconds;
    let run = StepRun {
        devices: plan.world_size,
        stage: plan.zero.stage,
        // per-unit placements name every tier they use ("cpu+nvme")
        offload_param: crate::plan::report::tiers_name(&crate::plan::rules::param_tiers(plan)),
        offload_optimizer: crate::plan::report::tiers_name(&crate::plan::rules::optimizer_tiers(plan)),
        step_seconds,
        tokens_per_s,
        mfu: mfu(
            plan.model.config.flops_per_token(plan.data.seq_len) * tokens_per_s,
            peak,
            plan.world_size,
        ),
        peak_flops: peak,
    };
    Ok((run, breakdown))
}

pub fn run(plan: &Plan, steps: u64) -> Result<StepReport, TrainError> {
    let mut zero_plan = plan.clone();
    zero_plan.train.steps = steps.max(2);
    let mut dense = zero_plan.clone();
    dense.world_size = 1;
    dense.train.devices = 1;
    dense.batch.gradient_accumulation_steps *= plan.world_size;
    dense.zero.stage = 0;
    dense.zero.offload_param.tier = Tier::Device;
    dense.zero.offload_optimizer.tier = Tier::Device;
    let (zero, breakdown) = measure(&zero_plan, TrainOptions::default())?;
    let (dense, _) = measure(&dense, TrainOptions::default())?;
    let blocking = TrainOptions {
        no_overlap: true,
        ..TrainOptions::default()
    };
    let (blocking_run, blocking_breakdown) = measure(&zero_plan, blocking)?;
    // tracing writes <output_dir>/trace.json: keep it out of the user's directory
    let scratch = std::env::temp_dir().join(format!("tierzero-bench-trace-{}", std::process::id()));
    let mut traced_plan = zero_plan.clone();
    traced_plan.train.output_dir = scratch.clone();
    let traced = TrainOptions {
        trace: true,
        ..TrainOptions::default()
    };
    let (traced_run, _) = measure(&traced_plan, traced)?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(StepReport {
        breakdown: breakdown.json(),
        blocking_breakdown: blocking_breakdown.json(),
        tables: (breakdown.table(), blocking_breakdown.table()),
        blocking_step_seconds: blocking_run.step_seconds,
        trace_overhead: traced_run.step_seconds / zero.step_seconds - 1.0,
        parameters: plan.model.config.num_parameters(),
        tokens_per_step: plan.tokens_per_step(),
        peak_flops: zero.peak_flops,
        ratio_to_dense: zero.step_seconds / dense.step_seconds,
        zero,
        dense,
    })
}

impl StepReport {
    pub fn human(&self) -> String {
        let line = |name: &str, r: &StepRun| {
            format!(
                "  {name:<6} {} rank(s), stage {}, params on {}, optimizer on {}: {:.4} s/step  {:.0} tokens/s  MFU {:.1}% (of {} × {:.1} GFLOP/s)\n",
                r.devices,
                r.stage,
                r.offload_param,
                r.offload_optimizer,
                r.step_seconds,
                r.tokens_per_s,
                100.0 * r.mfu,
                r.devices,
                r.peak_flops / 1e9
            )
        };
        format!(
            "step bench: {} parameters, {} tokens/step, peak {:.1} GFLOP/s per rank (the model's matmul shapes, measured)\n{}{}  ratio_to_dense {:.3}",
            self.parameters,
            self.tokens_per_step,
            self.peak_flops / 1e9,
            line("zero", &self.zero),
            line("dense", &self.dense),
            self.ratio_to_dense
        ) + &format!(
            "\n\nbreakdown of the zero run (rank 0, steps after the first):\n{}\nsame with every phase blocking ({:.4} s/step):\n{}\ntracing on: step time {:+.1}%",
            self.tables.0,
            self.blocking_step_seconds,
            self.tables.1,
            100.0 * self.trace_overhead
        )
    }
}
