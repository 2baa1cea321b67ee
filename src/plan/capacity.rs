//! The largest model a machine trains: the config's model grown or shrunk by its number
//! of layers (its hidden size, heads, FFN and vocabulary kept), the most layers whose
//! plan fits every tier — the device budget (`memory::predict`), the process's host
//! memory (`host_memory::predict_host` within `train.host_memory`) and the NVMe path's
//! room (`report::nvme_bytes` within `train.nvme_space`) — beside the most that DeepSpeed's
//! own rules place on the same capacities: its ZeRO-3 estimator
//! (`estimate_zero3_model_states_mem_needs`, `estimate.rs`), each offload combination
//! it lists, the largest whose host and per-GPU bytes both fit; and, since the estimator
//! has no NVMe row, ZeRO-Infinity's swap files (its optimizer swapper keeps fp32
//! parameters, both moments and fp32 gradients, 16 bytes per parameter, beside the 2-byte
//! parameters: 18 bytes per parameter on the disk). `plan --largest` prints both, and
//! tierzero's largest without the disk.

use super::auto_batch::budget;
use super::estimate::{estimate_row, EstimateRow};
use super::{DeviceFacts, Plan};
use crate::config::model::ModelConfig;
use crate::config::ConfigError;
use serde::Serialize;

/// A plan's bytes on each tier beside its capacities (None: unknown, not checked).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TierFit {
    pub device: u64,
    pub device_budget: Option<u64>,
    pub host: u64,
    pub host_memory: Option<u64>,
    pub nvme: u64,
    pub nvme_space: Option<u64>,
}

impl TierFit {
    pub fn of(plan: &Plan, facts: DeviceFacts) -> TierFit {
        TierFit {
            device: super::memory::predict(plan).total,
            device_budget: budget(plan, facts).0,
            host: super::host_memory::predict_host(plan).total,
            host_memory: plan.train.host_memory,
            nvme: super::report::nvme_bytes(plan),
            nvme_space: plan.train.nvme_space,
        }
    }

    pub fn fits(&self) -> bool {
        let within = |bytes: u64, cap: Option<u64>| cap.is_none_or(|c| bytes <= c);
        within(self.device, self.device_budget)
            && within(self.host, self.host_memory)
            && within(self.nvme, self.nvme_space)
    }
}

/// The largest model found: its layers, parameters and what it holds on each tier.
#[derive(Clone, Debug, Serialize)]
pub struct Largest {
    pub layers: usize,
    pub parameters: u64,
    pub fit: TierFit,
}

/// DeepSpeed's largest by its estimator: the layers, parameters and the estimator row
/// that places it.
#[derive(Clone, Debug, Serialize)]
pub struct DeepSpeedLargest {
    pub layers: usize,
    pub parameters: u64,
    pub row: EstimateRow,
}

/// The most layers, up to `max_layers`, for which `fits` holds (fitting shrinks with
/// layers); None when not even one layer fits.
fn most_layers(
    max_layers: usize,
    mut fits: impl FnMut(usize) -> Result<bool, ConfigError>,
) -> Result<Option<usize>, ConfigError> {
    if !fits(1)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (1, max_layers + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// tierzero's largest: `plan_with(layers)` builds the config's plan with that many layers
/// (its `"auto"` placements decided for that model).
pub fn largest(
    max_layers: usize,
    facts: DeviceFacts,
    plan_with: impl Fn(usize) -> Result<Plan, ConfigError>,
) -> Result<Option<Largest>, ConfigError> {
    let Some(layers) = most_layers(max_layers, |l| Ok(TierFit::of(&plan_with(l)?, facts).fits()))? else {
        return Ok(None);
    };
    let plan = plan_with(layers)?;
    Ok(Some(Largest {
        layers,
        parameters: plan.model.config.num_parameters() as u64,
        fit: TierFit::of(&plan, facts),
    }))
}

/// (parameters, largest unit) of `model` with `layers` layers: the model DeepSpeed's
/// rules are asked about (its shape alone; no plan is resolved for it).
fn shape(model: &ModelConfig, layers: usize) -> (u64, u64) {
    let numels = ModelConfig {
        num_hidden_layers: layers,
        ..model.clone()
    }
    .unit_numels();
    (
        numels.iter().sum::<usize>() as u64,
        numels.iter().copied().max().unwrap_or(0) as u64,
    )
}

/// DeepSpeed's largest `model` (its layers varied) on `device` bytes per GPU and `host`
/// bytes: the most layers for which a row of its estimator (1 node, `gpus` GPUs; the
/// largest layer is the largest unit, the embedding or the LM head) needs at most both —
/// on a CPU device (`device` None) the GPU's bytes and the CPU's together at most `host`;
/// the row with the most layers wins.
pub fn deepspeed_largest(
    max_layers: usize,
    (device, host, gpus): (Option<u64>, u64, u64),
    model: &ModelConfig,
) -> Option<DeepSpeedLargest> {
    let mut best: Option<DeepSpeedLargest> = None;
    for (offload_param, offload_optimizer) in [(true, true), (false, true), (false, false)] {
        for zero_init in [true, false] {
            let row = |l: usize| {
                let (params, largest) = shape(model, l);
                estimate_row(
                    params,
                    largest,
                    gpus,
                    1,
                    offload_param,
                    offload_optimizer,
                    zero_init,
                )
            };
            let fits = |l: usize| {
                let r = row(l);
                Ok(match device {
                    Some(device) => r.gpu_bytes <= device && r.cpu_bytes <= host,
                    None => r.gpu_bytes * gpus + r.cpu_bytes <= host,
                })
            };
            let Ok(Some(layers)) = most_layers(max_layers, fits) else {
                continue;
            };
            if best.as_ref().is_none_or(|b| layers > b.layers) {
                best = Some(DeepSpeedLargest {
                    layers,
                    parameters: shape(model, layers).0,
                    row: row(layers),
                });
            }
        }
    }
    best
}

/// Bytes per parameter of ZeRO-Infinity's swap files: fp32 parameters, exp_avg,
/// exp_avg_sq and gradients (its `PartitionedOptimizerSwapper`) and the 16-bit
/// parameters (its parameter swapper).
pub const DEEPSPEED_NVME_BYTES: u64 = 18;

/// DeepSpeed's largest `model` on the disk alone: the most layers whose swap files
/// ([`DEEPSPEED_NVME_BYTES`] per parameter) fit `nvme_space`.
pub fn deepspeed_nvme_largest(
    max_layers: usize,
    nvme_space: u64,
    model: &ModelConfig,
) -> Option<(usize, u64)> {
    let params = |l: usize| shape(model, l).0;
    let fits = |l: usize| Ok(params(l) * DEEPSPEED_NVME_BYTES <= nvme_space);
    let layers = most_layers(max_layers, fits).ok().flatten()?;
    Some((layers, params(layers)))
}

/// Everything `plan --largest` found.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub tierzero: Option<Largest>,
    /// tierzero on the device and host memory alone (`train.nvme_space` 1 byte).
    pub tierzero_without_nvme: Option<Largest>,
    pub deepspeed_estimator: Option<DeepSpeedLargest>,
    /// (layers, parameters) of ZeRO-Infinity's swap files on the disk.
    pub deepspeed_nvme: Option<(usize, u64)>,
}

/// `plan --largest` as text: the capacities, then each side's largest model.
pub fn render(base: &Plan, found: &Comparison, caps: TierFit) -> String {
    let (ours, theirs) = (found.tierzero.as_ref(), found.deepspeed_estimator.as_ref());
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30));
    let cap = |c: Option<u64>| c.map_or("unknown (not checked)".to_string(), gib);
    let m = &base.model.config;
    let b = |p: u64| format!("{:.2} B parameters", p as f64 / 1e9);
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("  {k:<22} {v}\n"));
    line(
        "shape",
        format!(
            "{:?}: hidden {}, heads {} (kv {}), ffn {}, vocab {}; layers varied",
            m.architecture,
            m.hidden_size,
            m.num_attention_heads,
            m.num_key_value_heads,
            m.intermediate_size,
            m.vocab_size
        ),
    );
    line(
        "device per rank",
        match caps.device_budget {
            Some(b) => gib(b),
            None => "host memory (a CPU device; no budget of its own)".into(),
        },
    );
    line(
        "host memory",
        format!("{} (train.host_memory)", cap(caps.host_memory)),
    );
    line(
        "nvme space",
        format!("{} (train.nvme_space)", cap(caps.nvme_space)),
    );
    line(
        "tierzero",
        match ours {
            Some(l) => format!(
                "{} layers, {}: device {}, host {}, nvme {}",
                l.layers,
                b(l.parameters),
                gib(l.fit.device),
                gib(l.fit.host),
                gib(l.fit.nvme)
            ),
            None => "not even one layer fits".into(),
        },
    );
    if let Some(l) = &found.tierzero_without_nvme {
        line(
            "tierzero without nvme",
            format!(
                "{} layers, {}: device {}, host {}",
                l.layers,
                b(l.parameters),
                gib(l.fit.device),
                gib(l.fit.host)
            ),
        );
    }
    let device = |on: bool| if on { "cpu" } else { "none" };
    line(
        "DeepSpeed's estimator",
        match theirs {
            Some(d) => format!(
                "{} layers, {}: per GPU {}, per CPU {} (offload_param={}, offload_optimizer={}, zero_init={})",
                d.layers,
                b(d.parameters),
                gib(d.row.gpu_bytes),
                gib(d.row.cpu_bytes),
                device(d.row.offload_param),
                device(d.row.offload_optimizer),
                u8::from(d.row.zero_init)
            ),
            None => "not even one layer fits".into(),
        },
    );
    if caps.nvme_space.is_some() {
        line(
            "DeepSpeed on nvme",
            match found.deepspeed_nvme {
                Some((layers, p)) => format!(
                    "{layers} layers, {}: its swap files, {DEEPSPEED_NVME_BYTES} bytes per parameter",
                    b(p)
                ),
                None => "not even one layer fits".into(),
            },
        );
    }
    let best = theirs
        .map(|d| d.parameters)
        .max(found.deepspeed_nvme.map(|(_, p)| p));
    if let (Some(l), Some(d)) = (ours, best) {
        line(
            "ratio",
            format!("{:.2}× DeepSpeed's largest", l.parameters as f64 / d as f64),
        );
    }
    format!("largest model\n{out}")
}
