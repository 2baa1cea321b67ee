//! `Plan`: the validated configuration, the only form the engine reads.
//!
//! The types live here; `resolve.rs` builds a `Plan` from the [`super::DsConfig`]
//! mirror (defaults, `"auto"`, batch math, contradictions).

use crate::config::model::ModelConfig;
use serde::Serialize;
use std::path::PathBuf;
use tierzero_offload::adam::{AdamHyper, WeightDecay};

/// Where a piece of state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// On the (GPU or CPU-simulated) device.
    Device,
    /// Host memory (pinned on CUDA).
    Cpu,
    /// NVMe files.
    Nvme,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Cpu => "cpu",
            Tier::Nvme => "nvme",
        }
    }
}

/// The element type of gradients between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Wire {
    Fp32,
    Bf16,
    Fp16,
}

impl Wire {
    pub fn name(self) -> &'static str {
        match self {
            Wire::Fp32 => "fp32",
            Wire::Bf16 => "bf16",
            Wire::Fp16 => "fp16",
        }
    }

    pub fn kind(self) -> tch::Kind {
        match self {
            Wire::Fp32 => tch::Kind::Float,
            Wire::Bf16 => tch::Kind::BFloat16,
            Wire::Fp16 => tch::Kind::Half,
        }
    }

    /// DeepSpeed's default: gradients travel in the training precision.
    pub fn of(precision: &Precision) -> Wire {
        match precision {
            Precision::Fp32 => Wire::Fp32,
            Precision::Bf16 => Wire::Bf16,
            Precision::Fp16(_) => Wire::Fp16,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16(LossScale),
}

impl Precision {
    pub fn name(&self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16(_) => "fp16",
        }
    }
    /// Bytes per element of the low-precision parameters and gradients.
    pub fn bytes(&self) -> usize {
        match self {
            Precision::Fp32 => 4,
            _ => 2,
        }
    }
}

/// DeepSpeed's fp16 loss scaling (`runtime/fp16/loss_scaler.py`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LossScale {
    /// 0 = dynamic.
    pub static_scale: f64,
    pub initial_scale_power: u32,
    pub window: u64,
    pub hysteresis: u32,
    pub consecutive_hysteresis: bool,
    pub min_scale: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Batch {
    pub train_batch_size: usize,
    pub micro_batch_per_gpu: usize,
    pub gradient_accumulation_steps: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Optimizer {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Decoupled (AdamW) or L2 (Adam with `adam_w_mode: false`).
    pub decoupled: bool,
}

impl Optimizer {
    pub fn hyper(&self, lr: f32) -> AdamHyper {
        AdamHyper {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            mode: if self.decoupled {
                WeightDecay::Decoupled
            } else {
                WeightDecay::L2
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    Log,
    Linear,
}

/// DeepSpeed's schedulers (`runtime/lr_schedules.py`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum Scheduler {
    Constant,
    WarmupLR {
        min_lr: f64,
        max_lr: f64,
        warmup_steps: u64,
        warmup_type: WarmupType,
    },
    WarmupDecayLR {
        min_lr: f64,
        max_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
        warmup_type: WarmupType,
    },
    WarmupCosineLR {
        warmup_min_ratio: f64,
        cos_min_ratio: f64,
        warmup_steps: u64,
        total_steps: u64,
        warmup_type: WarmupType,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamOffload {
    pub tier: Tier,
    pub nvme_path: Option<PathBuf>,
    pub pin_memory: bool,
    pub buffer_count: usize,
    pub buffer_size: usize,
    pub max_in_cpu: usize,
    /// `max_in_cpu` was `"auto"`: the plan fills host memory (`auto_tiers::fit_params_in_host`).
    pub max_in_cpu_auto: bool,
    /// Stage 3 with the parameters off the device: how many of the units fetched for each
    /// use (not kept gathered), from the first, keep their shard on the device instead
    /// (`train.shards_on_device`).
    pub device_units: usize,
    /// Stage 3 with the parameters off the device: the units kept gathered whose
    /// optimizer state is on the device keep their shard there too (`train.shards_on_device`),
    /// so their update never crosses; so do those whose parameters are on NVMe, whose
    /// update then crosses once instead of through the NVMe parameter store.
    pub kept_on_device: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OptimizerOffload {
    pub tier: Tier,
    pub nvme_path: Option<PathBuf>,
    pub pin_memory: bool,
    pub buffer_count: usize,
    pub pipeline_read: bool,
    pub pipeline_write: bool,
    /// DeepSpeed's partial offload: the fraction of units (sub-groups in DeepSpeed) whose
    /// optimizer state is offloaded; the first `(1 - ratio)` of them stay on the device
    /// (`rules::optimizer_tiers`).
    pub ratio: f64,
    /// `ratio` was `"auto"`: the plan keeps as many units on the device as fit its memory
    /// (`auto_tiers::fit_optimizer_on_device`).
    pub ratio_auto: bool,
    /// With the state on NVMe: parameter elements (whole units in forward order, after
    /// those on the device) whose optimizer state stays in host memory
    /// (`train.optimizer_max_in_cpu`).
    pub max_in_cpu: usize,
    /// `max_in_cpu` was `"auto"` (`auto_tiers::fit_optimizer_in_host`).
    pub max_in_cpu_auto: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Zero {
    pub stage: u8,
    pub overlap_comm: bool,
    pub contiguous_gradients: bool,
    pub reduce_bucket_size: usize,
    pub allgather_bucket_size: usize,
    pub sub_group_size: usize,
    pub prefetch_bucket_size: usize,
    pub param_persistence_threshold: usize,
    pub max_live_parameters: usize,
    pub max_reuse_distance: usize,
    /// tierzero's own choice (`train.accumulate_on_device`, no DeepSpeed key): gradient
    /// accumulation keeps its sums on the device (`rules::device_accumulation`); decided
    /// by `auto_batch::fit_device_sums`.
    pub device_accumulation: bool,
    /// The gradients of device-tier optimizer state stay on the device
    /// (`rules::gradients_on_device`): as `train.accumulate_on_device` says, on by default
    /// on a GPU (the device row counts them either way); decided by
    /// `auto_batch::fit_device_sums`.
    pub device_gradients: bool,
    /// Host accumulators in bf16 wherever that is exact (`rules::bf16_gradients`): on
    /// unless a test compares them with fp32 ones.
    pub bf16_accumulators: bool,
    pub gather_16bit_weights_on_model_save: bool,
    pub offload_param: ParamOffload,
    pub offload_optimizer: OptimizerOffload,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Aio {
    pub block_size: usize,
    pub queue_depth: usize,
    pub intra_op_parallelism: usize,
    pub single_submit: bool,
    pub overlap_events: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DataSource {
    Synthetic { name: String },
    Tokens { path: PathBuf, dtype: TokenDtype },
    Text { path: PathBuf, tokenizer: PathBuf },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    U16,
    U32,
}

/// Built-in synthetic corpora.
pub const SYNTHETIC: &[&str] = &["markov", "addition", "recall"];

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Data {
    pub source: DataSource,
    pub seq_len: usize,
    pub records: Records,
}

/// How record data sets (prompt/completion, chat) become samples.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Records {
    pub train_on_prompt: bool,
    pub packing: bool,
    /// `data.packing` was given: a `.jsonl` of `{"text"}` records is then read as
    /// samples, not as a stream of documents.
    pub packing_given: bool,
    pub eval: EvalSplit,
    pub chat_template: Option<PathBuf>,
}

/// What `eval` reads.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum EvalSplit {
    /// The training data (no held-out split).
    Train,
    /// A fraction of the samples, held out of training.
    Fraction { fraction: f64 },
    /// A data set of its own.
    Path { path: PathBuf },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Train {
    pub steps: u64,
    pub seed: u64,
    pub devices: usize,
    pub output_dir: PathBuf,
    pub log_interval: u64,
    pub save_interval: u64,
    pub eval_interval: u64,
    pub eval_batches: usize,
    pub keep_last: usize,
    pub trace: bool,
    /// Where the ranks compute; on CUDA a process's ranks use GPUs first_device, +1, …
    pub accelerator: Accelerator,
    pub launch: Launch,
    /// Per-rank device memory budget in bytes (CPU devices); None = unlimited.
    pub device_memory: Option<u64>,
    /// Host memory this process may hold, bytes (`train.host_memory`, by default what the
    /// machine had available at plan time); None = unknown.
    pub host_memory: Option<u64>,
    /// Bytes the swap files may take on the NVMe path (`train.nvme_space`, by default its
    /// file system's free space at plan time); None = unknown.
    pub nvme_space: Option<u64>,
    /// `train.accumulate_on_device`: None for "auto".
    pub accumulate_on_device: Option<bool>,
    /// `train.keep_gathered`: None for "auto".
    pub keep_gathered: Option<bool>,
    /// `train.shards_on_device`: None for "auto".
    pub shards_on_device: Option<bool>,
    /// `train.keep_activations`: None for "auto".
    pub keep_activations: Option<bool>,
    /// `train.layered_accumulation`: the step's micro-batches run unit by unit
    /// (`engine/layered.rs`).
    pub layered_accumulation: bool,
    /// A ds_config `activation_checkpointing` section is present (recompute asked for).
    pub activation_checkpointing: bool,
    /// Resolved: units whose parameters stay on the device keep their activations for
    /// backward (`rules::keeps_activations`); decided by `auto_batch::fit_kept_activations`.
    pub kept_activations: bool,
    /// Resolved: the LM head's products run in the 16-bit training precision
    /// (`model/head.rs`, `Matmul::Low`): on a GPU, or on a CPU with bf16 units; else fp32.
    pub low_precision_head: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelPlan {
    /// Preset name or the Hugging Face directory it came from.
    pub source: String,
    pub hf_dir: Option<PathBuf>,
    pub config: ModelConfig,
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub world_size: usize,
    pub batch: Batch,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub scheduler: Scheduler,
    /// Clip the global gradient norm to this; 0 = off.
    pub gradient_clipping: f64,
    /// What gradients travel as between ranks (`communication_data_type`; DeepSpeed's
    /// default: the training precision).
    pub communication: Wire,
    pub steps_per_print: u64,
    pub wall_clock_breakdown: bool,
    /// Directories of DeepSpeed's monitors (`<output_path>/<job_name>`), when enabled.
    pub monitors: Monitors,
    pub zero: Zero,
    pub aio: Aio,
    pub model: ModelPlan,
    pub data: Data,
    pub train: Train,
    /// Each `"auto"` batch key and what it became, with why (printed by `plan`).
    pub auto: Vec<AutoChoice>,
}

/// A `"auto"` value tierzero decided (the Hugging Face Trainer fills these in; tierzero is
/// the trainer here).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AutoChoice {
    pub key: &'static str,
    pub value: f64,
    pub why: String,
}

/// `tensorboard` and `csv_monitor`: where each writes, None when off.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Monitors {
    pub tensorboard: Option<PathBuf>,
    pub csv: Option<PathBuf>,
}

/// Where this process sits in a multi-process run (one process: nnodes 1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Launch {
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub first_device: usize,
    pub timeout_s: u64,
}

impl Train {
    /// Global ranks that run in this process.
    pub fn local_ranks(&self) -> std::ops::Range<usize> {
        let first = self.launch.node_rank * self.devices;
        first..first + self.devices
    }

    /// The tch device global rank `rank` (one of this process's) computes on.
    pub fn compute_device(&self, rank: usize) -> tch::Device {
        let local = rank - self.local_ranks().start;
        self.accelerator.device(self.launch.first_device + local)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accelerator {
    Cpu,
    Cuda,
}

impl Accelerator {
    /// The tch device rank `rank` computes on.
    pub fn device(self, rank: usize) -> tch::Device {
        match self {
            Accelerator::Cpu => tch::Device::Cpu,
            Accelerator::Cuda => tch::Device::Cuda(rank),
        }
    }
}

/// What the device side offers when resolving `"auto"` precision and accelerator.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceFacts {
    pub cuda_bf16: bool,
    /// This CPU has bf16 matrix units (AVX-512 BF16 or AMX): its 16-bit products are fast.
    pub cpu_bf16: bool,
    /// GPUs torch can use (0 on machines without a driver).
    pub cuda_devices: usize,
    /// Bytes of the first GPU's memory (the budget of an `"auto"` micro-batch on CUDA).
    pub cuda_memory: Option<u64>,
    /// Bytes of host memory available now (`MemAvailable`), the default `train.host_memory`.
    pub host_memory: Option<u64>,
}
