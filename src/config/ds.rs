//! `DsConfig`: the serde mirror of a DeepSpeed ds_config plus tierzero's own sections.
//!
//! Every field is optional here: the mirror records what the user wrote, spelled any way
//! DeepSpeed accepts (`stage3_prefetch_bucket_size` or `prefetch_bucket_size`, numbers as
//! strings, `"auto"`). Defaults, `"auto"` resolution and cross-key checks live in
//! `plan.rs`; keys this mirror does not name are classified in `keys.rs`.
//! Field names and defaults follow DeepSpeed's `runtime/config.py`,
//! `runtime/zero/config.py`, `runtime/zero/offload_config.py` and `ops/aio` configs.

use super::value::{Flag, Num};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct DsConfig {
    pub train_batch_size: Option<Num>,
    pub train_micro_batch_size_per_gpu: Option<Num>,
    pub gradient_accumulation_steps: Option<Num>,
    pub gradient_clipping: Option<Num>,
    /// The element type gradients are reduced in: "fp32", "fp16" or "bf16".
    pub communication_data_type: Option<String>,
    pub steps_per_print: Option<Num>,
    pub wall_clock_breakdown: Option<bool>,
    pub optimizer: Option<OptimizerSection>,
    pub scheduler: Option<SchedulerSection>,
    pub fp16: Option<Fp16Section>,
    #[serde(alias = "bfloat16")]
    pub bf16: Option<Bf16Section>,
    pub zero_optimization: Option<ZeroSection>,
    pub aio: Option<AioSection>,
    /// DeepSpeed's activation checkpointing settings: present, tierzero recomputes each
    /// unit's forward in backward instead of keeping its activations (the settings
    /// themselves tune DeepSpeed's checkpointing API, which tierzero does not have).
    pub activation_checkpointing: Option<serde_json::Value>,
    pub tensorboard: Option<MonitorSection>,
    pub csv_monitor: Option<MonitorSection>,
    pub model: Option<ModelSection>,
    pub data: Option<DataSection>,
    pub train: Option<TrainSection>,
}

/// `tensorboard` / `csv_monitor`: DeepSpeed's monitor sections.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct MonitorSection {
    pub enabled: Option<bool>,
    pub output_path: Option<PathBuf>,
    pub job_name: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct OptimizerSection {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub params: Option<OptimizerParams>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct OptimizerParams {
    pub lr: Option<Num>,
    pub betas: Option<BetasOrAuto>,
    pub eps: Option<Num>,
    pub weight_decay: Option<Num>,
    pub adam_w_mode: Option<bool>,
    pub bias_correction: Option<bool>,
    pub amsgrad: Option<bool>,
    pub torch_adam: Option<bool>,
    pub fused: Option<bool>,
}

/// `"betas": [0.9, 0.95]` or `"betas": "auto"`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum BetasOrAuto {
    Pair([Num; 2]),
    Auto(Num),
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct SchedulerSection {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub params: Option<SchedulerParams>,
}

/// The union of the three warmup schedulers' parameters; which ones a type accepts is
/// checked in the plan, as DeepSpeed's constructors would.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct SchedulerParams {
    pub warmup_min_lr: Option<Num>,
    pub warmup_max_lr: Option<Num>,
    pub warmup_num_steps: Option<Num>,
    pub warmup_type: Option<String>,
    pub total_num_steps: Option<Num>,
    pub warmup_min_ratio: Option<Num>,
    pub cos_min_ratio: Option<Num>,
    pub last_batch_iteration: Option<Num>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Fp16Section {
    pub enabled: Option<Flag>,
    pub auto_cast: Option<bool>,
    pub loss_scale: Option<Num>,
    pub initial_scale_power: Option<Num>,
    pub loss_scale_window: Option<Num>,
    pub hysteresis: Option<Num>,
    pub consecutive_hysteresis: Option<bool>,
    pub min_loss_scale: Option<Num>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Bf16Section {
    pub enabled: Option<Flag>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ZeroSection {
    pub stage: Option<Num>,
    pub overlap_comm: Option<bool>,
    pub contiguous_gradients: Option<bool>,
    pub reduce_scatter: Option<bool>,
    pub reduce_bucket_size: Option<Num>,
    pub allgather_partitions: Option<bool>,
    pub allgather_bucket_size: Option<Num>,
    pub sub_group_size: Option<Num>,
    #[serde(alias = "prefetch_bucket_size")]
    pub stage3_prefetch_bucket_size: Option<Num>,
    #[serde(alias = "param_persistence_threshold")]
    pub stage3_param_persistence_threshold: Option<Num>,
    #[serde(alias = "max_live_parameters")]
    pub stage3_max_live_parameters: Option<Num>,
    #[serde(alias = "max_reuse_distance")]
    pub stage3_max_reuse_distance: Option<Num>,
    #[serde(alias = "gather_16bit_weights_on_model_save")]
    pub stage3_gather_16bit_weights_on_model_save: Option<bool>,
    pub offload_param: Option<OffloadParamSection>,
    pub offload_optimizer: Option<OffloadOptimizerSection>,
    // DeepSpeed's deprecated spellings, accepted with a warning
    pub cpu_offload: Option<bool>,
    pub cpu_offload_params: Option<bool>,
    pub cpu_offload_use_pin_memory: Option<bool>,
    pub stage3_gather_fp16_weights_on_model_save: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct OffloadParamSection {
    pub device: Option<String>,
    pub nvme_path: Option<PathBuf>,
    pub pin_memory: Option<bool>,
    pub buffer_count: Option<Num>,
    pub buffer_size: Option<Num>,
    pub max_in_cpu: Option<Num>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct OffloadOptimizerSection {
    pub device: Option<String>,
    pub nvme_path: Option<PathBuf>,
    pub pin_memory: Option<bool>,
    pub buffer_count: Option<Num>,
    pub pipeline_read: Option<bool>,
    pub pipeline_write: Option<bool>,
    pub fast_init: Option<bool>,
    pub ratio: Option<Num>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct AioSection {
    pub block_size: Option<Num>,
    pub queue_depth: Option<Num>,
    pub intra_op_parallelism: Option<Num>,
    /// DeepSpeed's older name for `intra_op_parallelism`.
    pub thread_count: Option<Num>,
    pub single_submit: Option<bool>,
    pub overlap_events: Option<bool>,
    pub use_gds: Option<bool>,
}

/// tierzero: which model, with Hugging Face field names for overrides.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ModelSection {
    pub preset: Option<String>,
    pub hf_dir: Option<PathBuf>,
    pub hidden_size: Option<Num>,
    pub num_hidden_layers: Option<Num>,
    pub num_attention_heads: Option<Num>,
    pub num_key_value_heads: Option<Num>,
    pub intermediate_size: Option<Num>,
    pub vocab_size: Option<Num>,
    pub max_position_embeddings: Option<Num>,
    pub tie_word_embeddings: Option<bool>,
    pub rope_theta: Option<Num>,
    pub rms_norm_eps: Option<Num>,
}

/// tierzero: where the tokens come from.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct DataSection {
    pub synthetic: Option<String>,
    pub path: Option<PathBuf>,
    pub dtype: Option<String>,
    pub tokenizer: Option<PathBuf>,
    pub seq_len: Option<Num>,
    /// Records: count prompt tokens in the loss too (default: only completions and
    /// assistant turns count).
    pub train_on_prompt: Option<bool>,
    /// Records: pack samples into rows, each attending only to itself (default true);
    /// false pads one sample per row.
    pub packing: Option<bool>,
    /// Records: the fraction of samples held out for evaluation.
    pub eval_fraction: Option<f64>,
    /// Records: a data set of its own for evaluation.
    pub eval_path: Option<PathBuf>,
    /// A chat template (a Jinja file, or a tokenizer_config.json with `chat_template`)
    /// in place of the tokenizer's.
    pub chat_template: Option<PathBuf>,
}

/// tierzero: the run itself.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct TrainSection {
    pub steps: Option<Num>,
    pub seed: Option<Num>,
    pub devices: Option<Num>,
    pub output_dir: Option<PathBuf>,
    pub log_interval: Option<Num>,
    pub save_interval: Option<Num>,
    pub eval_interval: Option<Num>,
    pub eval_batches: Option<Num>,
    pub keep_last: Option<Num>,
    pub trace: Option<bool>,
    /// Where the ranks compute: "auto" (CUDA when a GPU is visible), "cpu" or "cuda".
    pub accelerator: Option<String>,
    /// Processes (nodes) of a multi-process run, each with `devices` ranks.
    pub nnodes: Option<Num>,
    /// This process's node rank.
    pub node_rank: Option<Num>,
    /// Where node 0 listens.
    pub master_addr: Option<String>,
    pub master_port: Option<Num>,
    /// GPU index of this process's first rank (torchrun's LOCAL_RANK).
    pub first_device: Option<Num>,
    /// Seconds to wait for every node to connect.
    pub rendezvous_timeout: Option<Num>,
    /// Bytes of "device" memory per CPU rank (the budget `CpuDevice` enforces).
    pub device_memory: Option<Num>,
    /// Bytes of host memory this process may hold ("auto": what the machine has
    /// available when the plan is made), the budget of `"auto"` placements.
    pub host_memory: Option<Num>,
    /// Parameter elements whose optimizer state (fp32 master, Adam moments and gradient)
    /// stays in host memory when `offload_optimizer.device` is "nvme": the first units in
    /// forward order that fit, the rest on NVMe (DeepSpeed has no such key: it swaps all;
    /// the default 0 does the same). "auto": as many as fit `host_memory`.
    pub optimizer_max_in_cpu: Option<Num>,
    /// Bytes the NVMe swap files may take on `nvme_path` ("auto": its file system's free
    /// space when the plan is made), the budget of `"auto"` placements and plan's disk row.
    pub nvme_space: Option<Num>,
    /// Gradient accumulation's sums on the device: "auto" (on a GPU, where they fit the
    /// budget), true or false.
    pub accumulate_on_device: Option<Flag>,
    /// Stage 3: gathered units stay on the device for the whole step instead of being
    /// gathered again for backward and every micro-batch: "auto" (on a GPU, as many as
    /// fit its memory), true or false.
    pub keep_gathered: Option<Flag>,
    /// Stage 3 with parameters in host memory or on NVMe: the first units' shards stay on
    /// the device instead, each gathered from there and updated there once a step:
    /// "auto" (on a GPU, as many as fit its memory beside the micro-batches' speed-ups),
    /// true (every unit's) or false.
    pub shards_on_device: Option<Flag>,
    /// Backward from each unit's kept activations instead of recomputing its forward
    /// (DeepSpeed's behaviour without activation checkpointing), where the unit's
    /// parameters stay on the device through the step: "auto" (where the device budget
    /// has room and no `activation_checkpointing` section asks for recompute), true or
    /// false.
    pub keep_activations: Option<Flag>,
    /// Gradient accumulation unit by unit: each unit runs the forward (and later the
    /// backward) of every micro-batch of the step while it is fetched, its gradient summed
    /// over them on the device and reduced once a step; false (the default: micro-batch
    /// by micro-batch, as DeepSpeed) or true.
    pub layered_accumulation: Option<bool>,
}
