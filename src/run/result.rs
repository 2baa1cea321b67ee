//! What a run reports: each step's metrics (what `metrics.jsonl` holds), the run's
//! result, and a step's scalars under DeepSpeed's monitor names.

use crate::device::sim::SimulatedStep;
use crate::metrics::host::HostUsage;
use crate::metrics::monitor::Scalar;
use crate::metrics::summary::Summary;
use crate::metrics::timeline::Breakdown;
use crate::metrics::trace::TierBytes;
use crate::plan::Plan;
use serde::Serialize;

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
    /// Rank 0's step on the simulated device (`train --simulate PROFILE`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulated: Option<SimulatedStep>,
}

#[derive(Debug, Default)]
pub struct TrainResult {
    /// Every step's metrics, up to `metrics::history::KEPT_STEPS`; a longer run keeps
    /// evenly spaced steps and its latest (`metrics.jsonl` has them all).
    pub steps: Vec<StepMetrics>,
    /// Steps this run made (`steps` may keep fewer).
    pub steps_run: u64,
    /// (step, eval loss) of every evaluation, kept whole (one per `eval_interval` steps).
    pub evals: Vec<(u64, f64)>,
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
    /// `summary.json`: the steady steps' breakdown (the first step, with start-up and the
    /// first gathers, is left out) and its rates, memory measured beside `plan`'s
    /// predictions, losses, throughput and MFU.
    pub fn summary(&self, plan: &Plan) -> Summary {
        let breakdowns = self.breakdowns();
        let steady = breakdowns
            .get(1..)
            .filter(|b| !b.is_empty())
            .unwrap_or(&breakdowns);
        let breakdown = Breakdown::total(steady);
        Summary {
            accelerator: plan.train.accelerator,
            gb_per_s: breakdown
                .rates()
                .into_iter()
                .map(|(p, r)| (p.name().to_string(), r))
                .collect(),
            breakdown,
            cpu_allocator_peak: self.cpu_allocator_peak,
            device_bytes_measured_peak: self.device_peaks.clone(),
            device_bytes_predicted: crate::plan::memory::predict(plan),
            first_loss: self.steps.first().map(|m| m.loss),
            gpu_memory: self.gpu_memory.clone(),
            host: self.host,
            host_bytes_predicted: crate::plan::host_memory::predict_host(plan),
            last_loss: self.steps.last().map(|m| m.loss),
            loss_floor: self.loss_floor,
            memory: self.steps.last().map(|m| m.memory),
            mfu: self.steps.last().map(|m| m.mfu),
            seconds: self.seconds,
            steps: self.steps_run as usize,
            tokens_per_s: self.steps.iter().map(|m| m.tokens_per_s).sum::<f64>()
                / self.steps.len().max(1) as f64,
        }
    }

    /// Rank 0's breakdown of each step in `steps`.
    pub fn breakdowns(&self) -> Vec<Breakdown> {
        self.steps.iter().map(|m| m.breakdown.clone()).collect()
    }
}

/// A step's scalars under DeepSpeed's monitor names (`Train/Samples/…`), then
/// tierzero's own: gradient norm, throughput, MFU, seconds per phase of the breakdown,
/// bytes per memory tier and the process's resident set.
pub(super) fn scalars(m: &StepMetrics, breakdown: &Breakdown, plan: &Plan) -> Vec<Scalar> {
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
