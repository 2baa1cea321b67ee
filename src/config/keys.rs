//! What to do with keys the serde mirror does not name.
//!
//! A user's existing ds_config must load as-is, so keys DeepSpeed knows but tierzero does
//! not act on are accepted and listed in one start-up warning. Anything else is a typo or
//! a key from another tool: an error naming it and the closest valid key at that level.
//! The valid keys are read from the mirror's own serde field lists, so suggestions can
//! never drift from what the parser accepts.

use super::ds::*;
use serde::de::{self, Deserialize, Deserializer, Visitor};
use std::fmt;

/// Top-level DeepSpeed sections accepted and not acted on.
const DEEPSPEED_UNACTED_TOP: &[&str] = &[
    "amp",
    "autotuning",
    "checkpoint",
    "comet",
    "comms_config",
    "comms_logger",
    "compression_training",
    "curriculum_learning",
    "data_efficiency",
    "data_types",
    "disable_allgather",
    "dump_state",
    "elasticity",
    "flops_profiler",
    "gradient_predivide_factor",
    "memory_breakdown",
    "monitor_config",
    "nebula",
    "pipeline",
    "prescale_gradients",
    "seq_parallel_communication_data_type",
    "sparse_attention",
    "sparse_gradients",
    "wandb",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
];

/// Keys inside `zero_optimization` accepted and not acted on.
const DEEPSPEED_UNACTED_ZERO: &[&str] = &[
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "legacy_stage1",
    "load_from_fp32_weights",
    "memory_efficient_linear",
    "mics_hierarchical_params_gather",
    "mics_shard_size",
    "round_robin_gradients",
    "stage3_module_granularity_threshold",
    "use_multi_rank_bucket_allreduce",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_weights",
    "log_trace_cache_warnings",
    "pipeline_loading_checkpoint",
    "override_module_apply",
];

/// Keys inside `bf16`/`fp16` accepted and not acted on (newer DeepSpeed options).
const DEEPSPEED_UNACTED_PRECISION: &[&str] = &[
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
    "fp16_master_weights_and_grads",
];

/// Keys inside `zero_optimization.offload_optimizer` accepted and not acted on: DeepSpeed's
/// SuperOffload for Superchips (since 0.18), whose CPU AdamW runs in a process of its own
/// on `cpuadam_cores_perc` of the cores and, without gradient clipping, starts during the
/// last backward; with clipping it steps after the norm, as tierzero does.
const DEEPSPEED_UNACTED_OFFLOAD_OPTIMIZER: &[&str] = &["super_offload", "cpuadam_cores_perc"];

/// How an unnamed key is treated.
#[derive(Debug, PartialEq, Eq)]
pub enum Unnamed {
    /// DeepSpeed knows it; tierzero accepts it and warns once.
    DeepSpeedUnacted,
    /// Nobody knows it: an error, with the closest valid key if one is close.
    Unknown { suggestion: Option<String> },
}

/// Classifies a key path (`zero_optimization.stage3_prefetch_bukcet_size`).
pub fn classify(path: &str) -> Unnamed {
    let (parent, leaf) = match path.rsplit_once('.') {
        Some((p, l)) => (p, l),
        None => ("", path),
    };
    let unacted: &[&str] = match parent {
        "" => DEEPSPEED_UNACTED_TOP,
        "zero_optimization" => DEEPSPEED_UNACTED_ZERO,
        "bf16" | "bfloat16" | "fp16" => DEEPSPEED_UNACTED_PRECISION,
        "zero_optimization.offload_optimizer" => DEEPSPEED_UNACTED_OFFLOAD_OPTIMIZER,
        _ => &[],
    };
    if unacted.contains(&leaf) {
        return Unnamed::DeepSpeedUnacted;
    }
    let candidates: Vec<&str> = valid_keys(parent).iter().chain(unacted).copied().collect();
    let suggestion = closest(leaf, &candidates).map(|best| {
        if parent.is_empty() {
            best.to_string()
        } else {
            format!("{parent}.{best}")
        }
    });
    Unnamed::Unknown { suggestion }
}

/// The keys the mirror names at `parent`.
pub fn valid_keys(parent: &str) -> &'static [&'static str] {
    match parent {
        "" => fields::<DsConfig>(),
        "optimizer" => fields::<OptimizerSection>(),
        "optimizer.params" => fields::<OptimizerParams>(),
        "scheduler" => fields::<SchedulerSection>(),
        "scheduler.params" => fields::<SchedulerParams>(),
        "fp16" => fields::<Fp16Section>(),
        "bf16" | "bfloat16" => fields::<Bf16Section>(),
        "zero_optimization" => fields::<ZeroSection>(),
        "zero_optimization.offload_param" => fields::<OffloadParamSection>(),
        "zero_optimization.offload_optimizer" => fields::<OffloadOptimizerSection>(),
        "aio" => fields::<AioSection>(),
        "model" => fields::<ModelSection>(),
        "data" => fields::<DataSection>(),
        "train" => fields::<TrainSection>(),
        _ => &[],
    }
}

/// The closest candidate by edit distance, if it is close enough to be a typo.
pub fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let word = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| (edit_distance(&word, c), *c))
        .filter(|(d, c)| *d <= (c.len().max(word.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Levenshtein distance over bytes.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// The field names serde derive generated for `T`, read by asking `T` to deserialize
/// from a deserializer that only records the list it is handed.
fn fields<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
    struct FieldGrabber<'a>(&'a mut &'static [&'static str]);

    #[derive(Debug)]
    struct Stop;
    impl fmt::Display for Stop {
        fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("field list recorded")
        }
    }
    impl std::error::Error for Stop {}
    impl de::Error for Stop {
        fn custom<M: fmt::Display>(_: M) -> Self {
            Stop
        }
    }

    impl<'de> Deserializer<'de> for FieldGrabber<'_> {
        type Error = Stop;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            *self.0 = fields;
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }

    let mut found: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldGrabber(&mut found));
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_the_closest_key_at_the_same_level() {
        assert_eq!(
            classify("zero_optimization.stage3_prefetch_bukcet_size"),
            Unnamed::Unknown {
                suggestion: Some("zero_optimization.stage3_prefetch_bucket_size".into())
            }
        );
        assert_eq!(
            classify("train_batch_szie"),
            Unnamed::Unknown {
                suggestion: Some("train_batch_size".into())
            }
        );
        assert_eq!(
            classify("completely_unrelated_thing"),
            Unnamed::Unknown { suggestion: None }
        );
    }

    #[test]
    fn deepspeed_keys_are_accepted() {
        assert_eq!(classify("wandb"), Unnamed::DeepSpeedUnacted);
        assert_eq!(
            classify("zero_optimization.offload_optimizer.super_offload"),
            Unnamed::DeepSpeedUnacted
        );
        assert_eq!(
            classify("zero_optimization.round_robin_gradients"),
            Unnamed::DeepSpeedUnacted
        );
    }

    #[test]
    fn field_lists_come_from_serde() {
        assert!(fields::<ZeroSection>().contains(&"offload_param"));
        assert!(fields::<DsConfig>().contains(&"zero_optimization"));
    }
}
