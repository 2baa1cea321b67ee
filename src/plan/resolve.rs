//! Building a [`Plan`] from the [`DsConfig`] mirror.
//!
//! DeepSpeed's defaults filled in, `"auto"` resolved the way the Hugging Face integration
//! resolves it (bucket sizes from the hidden size, precision from the device, schedule
//! length from `train.steps`) or refused where only the user knows the value, the batch
//! triple completed as DeepSpeed's `_set_batch_related_parameters` does, and
//! contradictions refused with the keys and the fix.

use super::auto_batch::AutoBatch;
use super::resolve_data::build_data;
use super::resolve_optimizer::{build_optimizer, build_scheduler};
use super::types::*;
use crate::config::ds::*;
use crate::config::model::{ModelConfig, PRESETS};
use crate::config::value::{count, count_or_auto, number, positive, Flag, Num};
use crate::config::ConfigError;
use std::path::PathBuf;

/// A monitor's directory as DeepSpeed forms it: `output_path` joined with `job_name`
/// (default `DeepSpeedJobName`; an empty `output_path`, DeepSpeed's default, leaves it
/// relative to the working directory). None unless `enabled`.
fn monitor_dir(section: Option<&MonitorSection>) -> Option<PathBuf> {
    let section = section.filter(|s| s.enabled == Some(true))?;
    let job = section.job_name.as_deref().unwrap_or("DeepSpeedJobName");
    Some(section.output_path.clone().unwrap_or_default().join(job))
}

impl Plan {
    /// Validates the mirror into a plan. `warnings` receives what the user should hear at
    /// start-up (deprecated spellings).
    pub fn build(ds: &DsConfig, facts: DeviceFacts, warnings: &mut Vec<String>) -> Result<Plan, ConfigError> {
        let train = build_train(ds.train.clone().unwrap_or_default(), facts)?;
        let model = build_model(ds.model.clone().unwrap_or_default())?;
        let data = build_data(ds.data.clone().unwrap_or_default(), &model)?;
        let world_size = train.devices * train.launch.nnodes;
        let (batch, auto) = build_batch(ds, world_size)?;
        let precision = build_precision(ds, facts)?;
        let optimizer = build_optimizer(ds.optimizer.clone().unwrap_or_default())?;
        let scheduler = build_scheduler(ds.scheduler.clone(), &optimizer, train.steps, warnings)?;
        let gradient_clipping = match ds.gradient_clipping {
            // the HF integration maps "auto" to TrainingArguments.max_grad_norm (1.0)
            Some(Num::Auto) => 1.0,
            other => number("gradient_clipping", other, 0.0)?,
        };
        if gradient_clipping < 0.0 {
            return Err(ConfigError::invalid(
                "gradient_clipping",
                "must not be negative",
                "use 0 to disable clipping",
            ));
        }
        let communication = match ds
            .communication_data_type
            .as_deref()
            .map(str::to_lowercase)
            .as_deref()
        {
            None => Wire::of(&precision),
            Some("fp32") => Wire::Fp32,
            Some("bf16") => Wire::Bf16,
            Some("fp16") => Wire::Fp16,
            Some(other) => {
                return Err(ConfigError::invalid(
                    "communication_data_type",
                    format!("is {other:?}; DeepSpeed's values are \"fp16\", \"bf16\" and \"fp32\""),
                    "use one of them, or leave the key out to reduce in the training precision",
                ))
            }
        };
        let mut zero = super::resolve_zero::build_zero(
            ds.zero_optimization.clone().unwrap_or_default(),
            &model.config,
            warnings,
        )?;
        let t = ds.train.clone().unwrap_or_default();
        zero.offload_optimizer.max_in_cpu = count_or_auto(
            "train.optimizer_max_in_cpu",
            t.optimizer_max_in_cpu,
            0,
            // "auto" is decided after the parameters' placement (`auto_tiers.rs`)
            0,
        )?;
        zero.offload_optimizer.max_in_cpu_auto = matches!(t.optimizer_max_in_cpu, Some(Num::Auto));
        if t.optimizer_max_in_cpu.is_some() && zero.offload_optimizer.tier != Tier::Nvme {
            warnings.push(
                "train.optimizer_max_in_cpu has no effect: it places optimizer state between host memory and NVMe, \
                 and zero_optimization.offload_optimizer.device is not \"nvme\""
                    .into(),
            );
        }
        let aio = super::resolve_zero::build_aio(ds.aio.clone().unwrap_or_default(), warnings)?;
        let mut train = train;
        if train.nvme_space.is_none() {
            // "auto": the room on the NVMe path the swap files go to
            let on_nvme = |tier: Tier, path: &Option<PathBuf>| path.clone().filter(|_| tier == Tier::Nvme);
            let mut paths: Vec<PathBuf> = [
                on_nvme(zero.offload_optimizer.tier, &zero.offload_optimizer.nvme_path),
                on_nvme(zero.offload_param.tier, &zero.offload_param.nvme_path),
            ]
            .into_iter()
            .flatten()
            .collect();
            paths.dedup();
            let paths: Vec<&std::path::Path> = paths.iter().map(PathBuf::as_path).collect();
            train.nvme_space = super::disk::nvme_room(&paths);
        }
        let mut plan = Plan {
            world_size,
            batch,
            precision,
            optimizer,
            scheduler,
            gradient_clipping,
            communication,
            steps_per_print: count("steps_per_print", ds.steps_per_print, 10)? as u64,
            wall_clock_breakdown: ds.wall_clock_breakdown.unwrap_or(false),
            monitors: Monitors {
                tensorboard: monitor_dir(ds.tensorboard.as_ref()),
                csv: monitor_dir(ds.csv_monitor.as_ref()),
            },
            zero,
            aio,
            model,
            data,
            train,
            auto: Vec::new(),
        };
        plan.train.activation_checkpointing = ds.activation_checkpointing.is_some();
        if plan.train.layered_accumulation && plan.train.keep_activations == Some(true) {
            return Err(ConfigError::invalid(
                "train.keep_activations",
                "a layered step (train.layered_accumulation) recomputes every unit's forward in backward: \
                 it keeps no activations",
                "drop train.keep_activations, or train.layered_accumulation",
            ));
        }
        plan.train.low_precision_head = plan.precision.bytes() == 2
            && match plan.train.accelerator {
                Accelerator::Cuda => true,
                Accelerator::Cpu => facts.cpu_bf16,
            };
        // the micro-batch is sized with activations kept where they will be asked to
        plan.train.kept_activations = plan
            .train
            .keep_activations
            .unwrap_or(!plan.train.activation_checkpointing);
        super::auto_batch::decide(&mut plan, auto, facts);
        // one micro-batch a step is already unit by unit
        plan.train.layered_accumulation &= plan.batch.gradient_accumulation_steps > 1;
        // the device's memory goes first to what speeds every micro-batch (gradient sums,
        // kept units, kept activations), then to optimizer state ("auto" partial offload:
        // those units need neither the CPU optimizer nor PCIe), the rest to host memory
        // and NVMe; where that leaves more than host memory and the disk hold, optimizer
        // state takes the device first, the speed-ups what is left (if that fits)
        let fits = |p: &Plan| super::capacity::TierFit::of(p, facts).fits();
        let mut fast = plan.clone();
        fill_device(&mut fast, facts, false);
        let plan = if fits(&fast) {
            fast
        } else {
            fill_device(&mut plan, facts, true);
            if fits(&plan) {
                plan
            } else {
                fast
            }
        };
        warnings.extend(one_buffer_set(&plan));
        Ok(plan)
    }

    /// Bytes of tokens one optimizer step consumes on all ranks.
    pub fn tokens_per_step(&self) -> usize {
        self.batch.train_batch_size * self.data.seq_len
    }
}

/// `pipeline_read`/`pipeline_write` asked for where `buffer_count` holds one sub-group's
/// buffers: each sub-group's reads wait for the writes of the one before, so next to
/// nothing overlaps; said once, with the count DeepSpeed 0.19.8's pipelined swapper needs
/// for those flags (two sets for one flag, three for both; it stops at an assertion with
/// fewer) and the pinned memory it costs.
fn one_buffer_set(plan: &Plan) -> Option<String> {
    let oo = &plan.zero.offload_optimizer;
    let (asked, sets) = match (oo.pipeline_read, oo.pipeline_write) {
        (false, false) => return None,
        (true, false) => ("pipeline_read has", 2),
        (false, true) => ("pipeline_write has", 2),
        (true, true) => ("pipeline_read and pipeline_write have", 3),
    };
    if !super::rules::nvme_optimizer(plan) || super::rules::pipeline_sets(plan) > 1 {
        return None;
    }
    let per_set = if super::rules::nvme_gradients(plan) { 4 } else { 3 };
    let chunk_bytes = (4 * super::rules::optimizer_swap_chunk(plan)).div_ceil(4096) * 4096;
    Some(format!(
        "zero_optimization.offload_optimizer.{asked} next to no effect with buffer_count {}: the buffers hold \
         one sub-group's {per_set} tensors (master, exp_avg, exp_avg_sq{}), so each sub-group's reads wait for \
         the writes of the one before; set buffer_count to {} ({sets} sets, as DeepSpeed's pipelined swapper \
         needs for these flags; {:.1} MiB more pinned host memory per rank)",
        oo.buffer_count,
        if per_set == 4 { " and the gradient" } else { "" },
        sets * per_set,
        ((sets - 1) * per_set * chunk_bytes) as f64 / (1u64 << 20) as f64,
    ))
}

fn build_train(t: TrainSection, facts: DeviceFacts) -> Result<Train, ConfigError> {
    let devices = positive("train.devices", t.devices, 1)?;
    let accelerator = match t.accelerator.as_deref().unwrap_or("auto") {
        "auto" if facts.cuda_devices > 0 => Accelerator::Cuda,
        "auto" | "cpu" => Accelerator::Cpu,
        "cuda" if facts.cuda_devices == 0 => {
            return Err(ConfigError::invalid(
                "train.accelerator",
                "\"cuda\" but torch sees no GPU on this machine",
                "use \"auto\" or \"cpu\", or run where a GPU and its driver are visible",
            ))
        }
        "cuda" => Accelerator::Cuda,
        other => {
            return Err(ConfigError::invalid(
                "train.accelerator",
                format!("unknown accelerator {other:?}"),
                "use \"auto\", \"cpu\" or \"cuda\"",
            ))
        }
    };
    let mut launch = build_launch(&t)?;
    // LOCAL_RANK (first_device) numbers the node's GPUs; where each task sees only its own
    // (per-task CUDA_VISIBLE_DEVICES, as SLURM and Kubernetes set it), they are 0, 1, …
    if accelerator == Accelerator::Cuda
        && launch.first_device + devices > facts.cuda_devices
        && devices == facts.cuda_devices
    {
        launch.first_device = 0;
    }
    if accelerator == Accelerator::Cuda && launch.first_device + devices > facts.cuda_devices {
        return Err(ConfigError::invalid(
            "train.devices",
            format!(
                "{devices} ranks from GPU {} on, but this machine has {} GPU(s)",
                launch.first_device, facts.cuda_devices
            ),
            format!(
                "use --devices {} or fewer (one rank per GPU)",
                facts.cuda_devices.saturating_sub(launch.first_device)
            ),
        ));
    }
    Ok(Train {
        accelerator,
        launch,
        steps: count("train.steps", t.steps, 100)? as u64,
        seed: count("train.seed", t.seed, 1234)? as u64,
        devices,
        output_dir: t.output_dir.unwrap_or_else(|| PathBuf::from("runs/default")),
        log_interval: positive("train.log_interval", t.log_interval, 10)? as u64,
        save_interval: count("train.save_interval", t.save_interval, 0)? as u64,
        eval_interval: count("train.eval_interval", t.eval_interval, 0)? as u64,
        eval_batches: positive("train.eval_batches", t.eval_batches, 8)?,
        keep_last: positive("train.keep_last", t.keep_last, 2)?,
        trace: t.trace.unwrap_or(false),
        device_memory: match t.device_memory {
            None | Some(Num::Auto) => None,
            some => Some(positive("train.device_memory", some, 1)? as u64),
        },
        host_memory: match t.host_memory {
            None | Some(Num::Auto) => facts.host_memory,
            some => Some(positive("train.host_memory", some, 1)? as u64),
        },
        // "auto" is read from the NVMe path's file system once the zero section is built
        nvme_space: match t.nvme_space {
            None | Some(Num::Auto) => None,
            some => Some(positive("train.nvme_space", some, 1)? as u64),
        },
        accumulate_on_device: match t.accumulate_on_device {
            None | Some(Flag::Auto) => None,
            Some(Flag::Value(on)) => Some(on),
        },
        keep_gathered: match t.keep_gathered {
            None | Some(Flag::Auto) => None,
            Some(Flag::Value(on)) => Some(on),
        },
        shards_on_device: match t.shards_on_device {
            None | Some(Flag::Auto) => None,
            Some(Flag::Value(on)) => Some(on),
        },
        keep_activations: match t.keep_activations {
            None | Some(Flag::Auto) => None,
            Some(Flag::Value(on)) => Some(on),
        },
        layered_accumulation: t.layered_accumulation.unwrap_or(false),
        activation_checkpointing: false,
        kept_activations: false,
        low_precision_head: false,
    })
}

fn build_launch(t: &TrainSection) -> Result<Launch, ConfigError> {
    let nnodes = positive("train.nnodes", t.nnodes, 1)?;
    let node_rank = count("train.node_rank", t.node_rank, 0)?;
    if node_rank >= nnodes {
        return Err(ConfigError::invalid(
            "train.node_rank",
            format!("{node_rank} is not below train.nnodes ({nnodes})"),
            format!("give each node a distinct --node-rank from 0 to {}", nnodes - 1),
        ));
    }
    let port = count("train.master_port", t.master_port, 29500)?;
    let master_port = u16::try_from(port).ok().filter(|p| *p > 0).ok_or_else(|| {
        ConfigError::invalid(
            "train.master_port",
            format!("{port} is not a port"),
            "use 1..65535 (the c10d store listens there on node 0)",
        )
    })?;
    Ok(Launch {
        nnodes,
        node_rank,
        master_addr: t.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into()),
        master_port,
        first_device: count("train.first_device", t.first_device, 0)?,
        timeout_s: positive("train.rendezvous_timeout", t.rendezvous_timeout, 300)? as u64,
    })
}

fn build_model(m: ModelSection) -> Result<ModelPlan, ConfigError> {
    let (source, hf_dir, mut config) = match (&m.preset, &m.hf_dir) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::invalid(
                "model.preset",
                "both model.preset and model.hf_dir are set",
                "keep one: a preset for random init, or hf_dir for pretrained weights",
            ))
        }
        (None, Some(dir)) => {
            let config = ModelConfig::from_hf_dir(dir).map_err(ConfigError::Model)?;
            (dir.display().to_string(), Some(dir.clone()), config)
        }
        (preset, None) => {
            let name = preset.clone().unwrap_or_else(|| "llama-tiny".into());
            let config = ModelConfig::preset(&name).ok_or_else(|| {
                let hint = crate::config::keys::closest(&name, PRESETS)
                    .map(|c| format!("did you mean \"{c}\"? "))
                    .unwrap_or_default();
                ConfigError::invalid(
                    "model.preset",
                    format!("unknown preset {name:?}"),
                    format!("{hint}presets: {}", PRESETS.join(", ")),
                )
            })?;
            (name, None, config)
        }
    };
    let overrides = [
        ("model.hidden_size", m.hidden_size, &mut config.hidden_size),
        (
            "model.num_hidden_layers",
            m.num_hidden_layers,
            &mut config.num_hidden_layers,
        ),
        (
            "model.num_attention_heads",
            m.num_attention_heads,
            &mut config.num_attention_heads,
        ),
        (
            "model.num_key_value_heads",
            m.num_key_value_heads,
            &mut config.num_key_value_heads,
        ),
        (
            "model.intermediate_size",
            m.intermediate_size,
            &mut config.intermediate_size,
        ),
        ("model.vocab_size", m.vocab_size, &mut config.vocab_size),
        (
            "model.max_position_embeddings",
            m.max_position_embeddings,
            &mut config.max_position_embeddings,
        ),
    ];
    for (key, value, field) in overrides {
        if value.is_some() {
            *field = positive(key, value, *field)?;
        }
    }
    if let Some(tie) = m.tie_word_embeddings {
        config.tie_word_embeddings = tie;
    }
    if m.rope_theta.is_some() {
        config.rope_theta = number("model.rope_theta", m.rope_theta, config.rope_theta)?;
    }
    if m.rms_norm_eps.is_some() {
        config.norm_eps = number("model.rms_norm_eps", m.rms_norm_eps, config.norm_eps)?;
    }
    config
        .validate()
        .map_err(|message| ConfigError::invalid("model", message, "adjust the model overrides"))?;
    Ok(ModelPlan {
        source,
        hf_dir,
        config,
    })
}

/// DeepSpeed's `_set_batch_related_parameters`. `"auto"` means "not given", except that
/// an `"auto"` micro-batch that the other two do not determine is left for
/// `auto_batch::decide` (returned as [`AutoBatch`], with a placeholder of 1).
fn build_batch(ds: &DsConfig, world: usize) -> Result<(Batch, AutoBatch), ConfigError> {
    let given = |key: &str, v: Option<Num>| -> Result<Option<usize>, ConfigError> {
        match v {
            None | Some(Num::Auto) => Ok(None),
            some => positive(key, some, 1).map(Some),
        }
    };
    let is_auto = |v: Option<Num>| matches!(v, Some(Num::Auto));
    let tbs = given("train_batch_size", ds.train_batch_size)?;
    let micro = given(
        "train_micro_batch_size_per_gpu",
        ds.train_micro_batch_size_per_gpu,
    )?;
    let accumulation = given("gradient_accumulation_steps", ds.gradient_accumulation_steps)?;
    let auto = AutoBatch {
        micro: micro.is_none()
            && is_auto(ds.train_micro_batch_size_per_gpu)
            && (tbs.is_none() || accumulation.is_none()),
        accumulation: accumulation.is_none() && is_auto(ds.gradient_accumulation_steps),
        tbs: tbs.is_none() && is_auto(ds.train_batch_size),
        tbs_given: tbs,
        accumulation_given: accumulation,
    };
    // an "auto" micro-batch starts at 1; `auto_batch::decide` grows it
    let micro = if auto.micro { Some(1) } else { micro };
    let tbs = if auto.micro { None } else { tbs };
    let divide = |total: usize, by: usize, what: &str| -> Result<usize, ConfigError> {
        if !total.is_multiple_of(by) || total < by {
            return Err(ConfigError::invalid(
                "train_batch_size",
                format!("{total} is not divisible by {what} ({by})"),
                "make train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × devices",
            ));
        }
        Ok(total / by)
    };
    let (tbs, micro, accumulation) = match (tbs, micro, accumulation) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => (t, m, divide(t, m * world, "micro batch × devices")?),
        (Some(t), None, Some(g)) => (t, divide(t, g * world, "accumulation steps × devices")?, g),
        (None, Some(m), Some(g)) => (m * g * world, m, g),
        (Some(t), None, None) => (t, divide(t, world, "devices")?, 1),
        (None, Some(m), None) => (m * world, m, 1),
        (None, None, _) => {
            return Err(ConfigError::invalid(
                "train_micro_batch_size_per_gpu",
                "neither train_batch_size nor train_micro_batch_size_per_gpu is given",
                "--set train_micro_batch_size_per_gpu=4 (or set train_batch_size, or \"auto\")",
            ))
        }
    };
    if let Some(t) = auto.tbs_given.filter(|_| auto.micro) {
        // the micro-batch will be a power of two dividing this; 1 always does
        divide(t, world * accumulation, "gradient_accumulation_steps × devices")?;
    }
    if tbs != micro * accumulation * world {
        return Err(ConfigError::invalid(
            "train_batch_size",
            format!(
                "{tbs} != train_micro_batch_size_per_gpu ({micro}) × gradient_accumulation_steps ({accumulation}) × devices ({world}) = {}",
                micro * accumulation * world
            ),
            "fix one of the three, or leave one out and it is derived",
        ));
    }
    Ok((
        Batch {
            train_batch_size: tbs,
            micro_batch_per_gpu: micro,
            gradient_accumulation_steps: accumulation,
        },
        auto,
    ))
}

fn build_precision(ds: &DsConfig, facts: DeviceFacts) -> Result<Precision, ConfigError> {
    let bf16 = match ds.bf16.as_ref().and_then(|b| b.enabled) {
        Some(Flag::Auto) => facts.cuda_bf16,
        Some(Flag::Value(v)) => v,
        None => false,
    };
    let fp16_section = ds.fp16.clone().unwrap_or_default();
    let fp16 = match fp16_section.enabled {
        // the HF integration turns fp16 on only when asked; the device decides bf16
        Some(Flag::Auto) => false,
        Some(Flag::Value(v)) => v,
        None => false,
    };
    if fp16 && bf16 {
        return Err(ConfigError::invalid(
            "fp16.enabled",
            "fp16.enabled and bf16.enabled are both true",
            "turn one of them off",
        ));
    }
    if fp16_section.auto_cast == Some(true) {
        return Err(ConfigError::invalid(
            "fp16.auto_cast",
            "autocast is not supported: tierzero keeps whole units in one precision",
            "remove fp16.auto_cast or set it to false",
        ));
    }
    if bf16 {
        return Ok(Precision::Bf16);
    }
    if !fp16 {
        return Ok(Precision::Fp32);
    }
    let f = fp16_section;
    let static_scale = number("fp16.loss_scale", f.loss_scale, 0.0)?;
    if static_scale < 0.0 {
        return Err(ConfigError::invalid(
            "fp16.loss_scale",
            "must not be negative",
            "use 0 for dynamic loss scaling",
        ));
    }
    Ok(Precision::Fp16(LossScale {
        static_scale,
        initial_scale_power: count("fp16.initial_scale_power", f.initial_scale_power, 16)?.min(64) as u32,
        window: positive("fp16.loss_scale_window", f.loss_scale_window, 1000)? as u64,
        hysteresis: positive("fp16.hysteresis", f.hysteresis, 2)? as u32,
        consecutive_hysteresis: f.consecutive_hysteresis.unwrap_or(false),
        min_scale: number("fp16.min_loss_scale", f.min_loss_scale, 1.0)?,
    }))
}

/// The device's `"auto"` uses, then the host's: optimizer state before or after the
/// micro-batches' speed-ups.
fn fill_device(plan: &mut Plan, facts: DeviceFacts, optimizer_first: bool) {
    if optimizer_first {
        super::auto_tiers::fit_optimizer_on_device(plan, facts, false);
    }
    super::auto_batch::fit_device_sums(plan, facts);
    super::auto_batch::fit_gathered(plan, facts);
    super::auto_batch::fit_kept_activations(plan, facts);
    if !optimizer_first {
        super::auto_batch::fit_shards(plan, facts);
        super::auto_tiers::fit_optimizer_on_device(plan, facts, true);
    }
    super::auto_batch::fit_kept_shards(plan, facts);
    super::auto_tiers::fit_params_in_host(plan);
    super::auto_tiers::fit_optimizer_in_host(plan);
}
