//! Resolving `zero_optimization` and `aio`: stages, tiers, nvme paths and buffer sizes.
//!
//! DeepSpeed's rules: parameter offload needs stage 3, optimizer offload stage 1 or
//! more, parameters on NVMe need the optimizer state off the device; `"auto"` bucket
//! sizes follow the Hugging Face integration (hidden², 10·hidden), but the prefetch
//! bucket covers at least two of tierzero's units (Hugging Face's 0.9·hidden² is sized
//! for one module's parameters, less than one unit).

use super::types::*;
use crate::config::ds::*;
use crate::config::model::ModelConfig;
use crate::config::value::{count, count_or_auto, number, positive, Num};
use crate::config::ConfigError;
use std::path::Path;

fn tier(key: &str, value: Option<&str>) -> Result<Tier, ConfigError> {
    match value.map(|s| s.to_ascii_lowercase()).as_deref() {
        None | Some("none") => Ok(Tier::Device),
        Some("cpu") => Ok(Tier::Cpu),
        Some("nvme") => Ok(Tier::Nvme),
        Some(other) => Err(ConfigError::invalid(
            key,
            format!("unknown device {other:?}"),
            "use \"none\", \"cpu\" or \"nvme\"",
        )),
    }
}

/// An nvme_path must be a directory we can create and write, checked without writing.
fn check_nvme_path(key: &str, path: &Path) -> Result<(), ConfigError> {
    let mut probe = path;
    loop {
        match std::fs::metadata(probe) {
            Ok(meta) if meta.is_dir() => {
                if meta.permissions().readonly() {
                    return Err(ConfigError::invalid(
                        key,
                        format!(
                            "{} is not writable ({} is read-only)",
                            path.display(),
                            probe.display()
                        ),
                        "point it at a writable directory on an NVMe drive",
                    ));
                }
                return Ok(());
            }
            Ok(_) => {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "{} cannot be a directory: {} is a file",
                        path.display(),
                        probe.display()
                    ),
                    "point it at a directory",
                ))
            }
            Err(_) => match probe.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => probe = parent,
                _ => return Ok(()),
            },
        }
    }
}

pub(super) fn build_zero(
    z: ZeroSection,
    model: &ModelConfig,
    warnings: &mut Vec<String>,
) -> Result<Zero, ConfigError> {
    let stage = count("zero_optimization.stage", z.stage, 0)?;
    if stage > 3 {
        return Err(ConfigError::invalid(
            "zero_optimization.stage",
            format!("stage {stage} does not exist"),
            "use 0, 1, 2 or 3",
        ));
    }
    let hidden = model.hidden_size;
    let largest_unit = model.unit_numels().into_iter().max().unwrap_or(0);
    let (op, oo, gather_16bit) = deprecated_keys(&z, warnings);
    let param_tier = tier("zero_optimization.offload_param.device", op.device.as_deref())?;
    let optimizer_tier = tier("zero_optimization.offload_optimizer.device", oo.device.as_deref())?;
    let ratio = check_tiers(stage, (param_tier, &op), (optimizer_tier, &oo))?;
    let bucket = |key: &str, v: Option<Num>, default: usize, auto: usize| {
        let v = count_or_auto(&format!("zero_optimization.{key}"), v, default, auto)?;
        if v == 0 {
            return Err(ConfigError::invalid(
                format!("zero_optimization.{key}"),
                "must be positive",
                format!("use e.g. {default}"),
            ));
        }
        Ok(v)
    };
    let zero = Zero {
        stage: stage as u8,
        // DeepSpeed turns overlap_comm on by default for stage 3
        overlap_comm: z.overlap_comm.unwrap_or(stage == 3),
        contiguous_gradients: z.contiguous_gradients.unwrap_or(true),
        reduce_bucket_size: bucket(
            "reduce_bucket_size",
            z.reduce_bucket_size,
            500_000_000,
            hidden * hidden,
        )?,
        allgather_bucket_size: bucket(
            "allgather_bucket_size",
            z.allgather_bucket_size,
            500_000_000,
            hidden * hidden,
        )?,
        sub_group_size: bucket("sub_group_size", z.sub_group_size, 1_000_000_000, 1_000_000_000)?,
        // 0 is DeepSpeed's "no prefetch": only the unit needed now is gathered. "auto":
        // Hugging Face's 0.9·hidden² is sized for per-module parameters, smaller than one
        // of tierzero's units (a whole block), so it would fetch nothing ahead; auto
        // covers the next two units (the most that are in flight, `fetch::MAX_IN_FLIGHT`)
        prefetch_bucket_size: count_or_auto(
            "zero_optimization.stage3_prefetch_bucket_size",
            z.stage3_prefetch_bucket_size,
            50_000_000,
            ((0.9 * (hidden * hidden) as f64) as usize).max(super::fetch::MAX_IN_FLIGHT * largest_unit),
        )?,
        param_persistence_threshold: count_or_auto(
            "zero_optimization.stage3_param_persistence_threshold",
            z.stage3_param_persistence_threshold,
            100_000,
            10 * hidden,
        )?,
        max_live_parameters: bucket(
            "stage3_max_live_parameters",
            z.stage3_max_live_parameters,
            1_000_000_000,
            1_000_000_000,
        )?,
        max_reuse_distance: count_or_auto(
            "zero_optimization.stage3_max_reuse_distance",
            z.stage3_max_reuse_distance,
            1_000_000_000,
            1_000_000_000,
        )?,
        device_accumulation: true,
        device_gradients: true,
        bf16_accumulators: true,
        gather_16bit_weights_on_model_save: gather_16bit.unwrap_or(false),
        offload_param: param_offload(param_tier, op)?,
        offload_optimizer: optimizer_offload((optimizer_tier, ratio), oo)?,
    };
    // a bucket under one unit fetches nothing ahead of compute (0 says so on purpose)
    if zero.stage == 3 && zero.prefetch_bucket_size > 0 && zero.prefetch_bucket_size < largest_unit {
        warnings.push(format!(
            "zero_optimization.stage3_prefetch_bucket_size {} is smaller than the largest unit ({largest_unit} elements): units larger than the bucket are never gathered ahead of compute; set it to at least {} (two units) or \"auto\"",
            zero.prefetch_bucket_size,
            super::fetch::MAX_IN_FLIGHT * largest_unit
        ));
    }
    Ok(zero)
}

/// The offload sections with DeepSpeed's deprecated keys translated (each warned about),
/// and `stage3_gather_16bit_weights_on_model_save` under either of its names.
fn deprecated_keys(
    z: &ZeroSection,
    warnings: &mut Vec<String>,
) -> (OffloadParamSection, OffloadOptimizerSection, Option<bool>) {
    let mut deprecated =
        |old: &str, new: &str| warnings.push(format!("zero_optimization.{old} is deprecated; use {new}"));
    let mut op = z.offload_param.clone().unwrap_or_default();
    let mut oo = z.offload_optimizer.clone().unwrap_or_default();
    if z.cpu_offload == Some(true) {
        deprecated("cpu_offload", "offload_optimizer.device = \"cpu\"");
        oo.device.get_or_insert_with(|| "cpu".into());
    }
    if z.cpu_offload_params == Some(true) {
        deprecated("cpu_offload_params", "offload_param.device = \"cpu\"");
        op.device.get_or_insert_with(|| "cpu".into());
    }
    if let Some(pin) = z.cpu_offload_use_pin_memory {
        deprecated("cpu_offload_use_pin_memory", "offload_*.pin_memory");
        op.pin_memory.get_or_insert(pin);
        oo.pin_memory.get_or_insert(pin);
    }
    let mut gather_16bit = z.stage3_gather_16bit_weights_on_model_save;
    if let Some(g) = z.stage3_gather_fp16_weights_on_model_save {
        deprecated(
            "stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
        );
        gather_16bit.get_or_insert(g);
    }
    (op, oo, gather_16bit)
}

/// DeepSpeed's rules on where state may live for a stage, an nvme_path wherever a tier
/// is NVMe, and the whole optimizer state offloaded (`offload_optimizer.ratio`, returned).
fn check_tiers(
    stage: usize,
    (param_tier, op): (Tier, &OffloadParamSection),
    (optimizer_tier, oo): (Tier, &OffloadOptimizerSection),
) -> Result<f64, ConfigError> {
    if param_tier != Tier::Device && stage != 3 {
        return Err(ConfigError::invalid(
            "zero_optimization.offload_param.device",
            format!("parameter offload needs ZeRO stage 3, the config has stage {stage}"),
            "set zero_optimization.stage to 3, or offload_param.device to \"none\"",
        ));
    }
    if optimizer_tier != Tier::Device && stage == 0 {
        return Err(ConfigError::invalid(
            "zero_optimization.offload_optimizer.device",
            "optimizer offload needs ZeRO stage 1, 2 or 3, the config has stage 0",
            "set zero_optimization.stage to 1 or higher, or offload_optimizer.device to \"none\"",
        ));
    }
    if param_tier == Tier::Nvme && optimizer_tier == Tier::Device {
        // DeepSpeed: "nvme param offload requires optimizer offload to cpu or nvme"
        return Err(ConfigError::invalid(
            "zero_optimization.offload_param.device",
            "parameters on nvme need the optimizer state off the device",
            "set zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"",
        ));
    }
    for (section, t, path) in [
        ("offload_param", param_tier, &op.nvme_path),
        ("offload_optimizer", optimizer_tier, &oo.nvme_path),
    ] {
        let key = format!("zero_optimization.{section}.nvme_path");
        match (t, path) {
            (Tier::Nvme, None) => {
                return Err(ConfigError::invalid(
                    key,
                    format!("zero_optimization.{section}.device is \"nvme\" but no nvme_path is given"),
                    format!(
                        "--set {}=/path/on/nvme",
                        format_args!("zero_optimization.{section}.nvme_path")
                    ),
                ))
            }
            (Tier::Nvme, Some(p)) => check_nvme_path(&key, p)?,
            _ => {}
        }
    }
    let key = "zero_optimization.offload_optimizer.ratio";
    let ratio = match oo.ratio {
        Some(Num::Auto) => 1.0,
        other => number(key, other, 1.0)?,
    };
    if !(0.0..=1.0).contains(&ratio) {
        return Err(ConfigError::invalid(
            key,
            format!("{ratio} is not a fraction"),
            "DeepSpeed's partial offload: the fraction of the optimizer state offloaded, from 0 to 1 (default 1.0)",
        ));
    }
    if ratio < 1.0 && optimizer_tier == Tier::Device {
        return Err(ConfigError::invalid(
            key,
            "partial offload needs the optimizer state offloaded; the config keeps it on the device",
            "set zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\", or leave ratio out",
        ));
    }
    Ok(ratio)
}

fn param_offload(tier: Tier, op: OffloadParamSection) -> Result<ParamOffload, ConfigError> {
    Ok(ParamOffload {
        tier,
        nvme_path: op.nvme_path,
        pin_memory: op.pin_memory.unwrap_or(false),
        buffer_count: positive("zero_optimization.offload_param.buffer_count", op.buffer_count, 5)?,
        buffer_size: positive(
            "zero_optimization.offload_param.buffer_size",
            op.buffer_size,
            100_000_000,
        )?,
        max_in_cpu: count_or_auto(
            "zero_optimization.offload_param.max_in_cpu",
            op.max_in_cpu,
            1_000_000_000,
            1_000_000_000,
        )?,
        max_in_cpu_auto: matches!(op.max_in_cpu, Some(Num::Auto)),
        // decided with the device's other uses (`auto_batch::fit_shards`)
        device_units: 0,
        kept_on_device: false,
    })
}

fn optimizer_offload(
    (tier, ratio): (Tier, f64),
    oo: OffloadOptimizerSection,
) -> Result<OptimizerOffload, ConfigError> {
    Ok(OptimizerOffload {
        tier,
        nvme_path: oo.nvme_path,
        pin_memory: oo.pin_memory.unwrap_or(false),
        buffer_count: positive(
            "zero_optimization.offload_optimizer.buffer_count",
            oo.buffer_count,
            4,
        )?,
        pipeline_read: oo.pipeline_read.unwrap_or(false),
        pipeline_write: oo.pipeline_write.unwrap_or(false),
        ratio,
        ratio_auto: matches!(oo.ratio, Some(Num::Auto)),
        // `train.optimizer_max_in_cpu`, read with the train section (`resolve.rs`)
        max_in_cpu: 0,
        max_in_cpu_auto: false,
    })
}

pub(super) fn build_aio(a: AioSection, warnings: &mut Vec<String>) -> Result<Aio, ConfigError> {
    let mut parallelism = a.intra_op_parallelism;
    if a.thread_count.is_some() {
        warnings.push("aio.thread_count is DeepSpeed's older name; use aio.intra_op_parallelism".into());
        parallelism = parallelism.or(a.thread_count);
    }
    if a.use_gds == Some(true) {
        return Err(ConfigError::invalid(
            "aio.use_gds",
            "GPUDirect Storage is not supported",
            "remove it or set it to false",
        ));
    }
    let block_size = positive("aio.block_size", a.block_size, 1_048_576)?;
    if !block_size.is_multiple_of(4096) {
        return Err(ConfigError::invalid(
            "aio.block_size",
            format!("{block_size} is not a multiple of 4096, which O_DIRECT needs"),
            "use e.g. 1048576",
        ));
    }
    Ok(Aio {
        block_size,
        queue_depth: positive("aio.queue_depth", a.queue_depth, 8)?,
        intra_op_parallelism: positive("aio.intra_op_parallelism", parallelism, 1)?,
        single_submit: a.single_submit.unwrap_or(false),
        overlap_events: a.overlap_events.unwrap_or(true),
    })
}
