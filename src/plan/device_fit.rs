//! Whether a plan fits its device: `"auto"` settings are chosen to fit
//! (`auto_batch.rs`), but settings the config forces are taken as given, so a plan can
//! predict more device memory than the GPU (or `train.device_memory`) has. Then `plan`,
//! `plan --simulate` and `train` warn before anything runs, naming the smallest change,
//! among the ones tried, that makes the prediction fit.

use super::auto_batch::budget;
use super::{DeviceFacts, Plan, Tier};
use crate::config;
use serde_json::Value;

/// When the plan's predicted device bytes exceed its budget: the warning, with the first
/// of these changes (each on top of the ones before) whose plan fits: the forced
/// `train.keep_gathered`, `train.shards_on_device`, `train.keep_activations`,
/// `train.accumulate_on_device` and a given `stage3_param_persistence_threshold` back to
/// `"auto"` (which fits them to the memory), the
/// optimizer state in host memory, stage 3's parameters in host memory, a smaller
/// micro-batch. `json` is the config as read (its `--set`s applied).
pub fn device_fit_warning(json: &Value, plan: &Plan, facts: DeviceFacts) -> Option<String> {
    let (limit, what) = budget(plan, facts);
    let limit = limit?;
    let predicted = super::memory::predict(plan).total;
    if predicted <= limit {
        return None;
    }
    let gib = |b: u64| match b as f64 / f64::from(1u32 << 20) {
        mib if mib < 1024.0 => format!("{mib:.1} MiB"),
        mib => format!("{:.2} GiB", mib / 1024.0),
    };
    let planned = |sets: &[String]| -> Option<u64> {
        let read = config::read(json.clone(), sets).ok()?;
        let p = Plan::build(&read.ds, facts, &mut Vec::new()).ok()?;
        Some(super::memory::predict(&p).total)
    };
    let t = &plan.train;
    let mut sets: Vec<String> = [
        ("train.keep_gathered", t.keep_gathered),
        ("train.shards_on_device", t.shards_on_device),
        ("train.keep_activations", t.keep_activations),
        ("train.accumulate_on_device", t.accumulate_on_device),
    ]
    .into_iter()
    .filter(|(_, forced)| *forced == Some(true))
    .map(|(key, _)| format!("{key}=auto"))
    .collect();
    // a threshold the config gives keeps every unit up to it gathered for the whole step
    let threshold = json
        .pointer("/zero_optimization/stage3_param_persistence_threshold")
        .is_some_and(Value::is_number);
    if plan.zero.stage == 3 && threshold {
        sets.push("zero_optimization.stage3_param_persistence_threshold=auto".into());
    }
    let mut tries: Vec<Vec<String>> = Vec::new();
    if !sets.is_empty() {
        tries.push(sets.clone());
    }
    if plan.zero.stage >= 1 && plan.zero.offload_optimizer.tier == Tier::Device {
        sets.push("zero_optimization.offload_optimizer.device=cpu".into());
        tries.push(sets.clone());
    }
    if plan.zero.stage == 3 && plan.zero.offload_param.tier == Tier::Device {
        sets.push("zero_optimization.offload_param.device=cpu".into());
        tries.push(sets.clone());
    }
    let mut micro = plan.batch.micro_batch_per_gpu;
    while micro > 1 {
        micro /= 2;
        let mut with = sets.clone();
        with.push(format!("train_micro_batch_size_per_gpu={micro}"));
        tries.push(with);
    }
    let mut last = None;
    let fix = tries.iter().find_map(|sets| {
        let bytes = planned(sets)?;
        last = Some((sets, bytes));
        (bytes <= limit).then_some((sets, bytes))
    });
    let flags = |sets: &[String]| {
        sets.iter()
            .map(|s| format!("--set {s}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let fix = match (fix, last) {
        (Some((sets, bytes)), _) => format!("{} plans {}", flags(sets), gib(bytes)),
        (None, Some((sets, bytes))) => format!(
            "even with {} it plans {}: offload more or lower data.seq_len",
            flags(sets),
            gib(bytes)
        ),
        (None, None) => "offload more or lower data.seq_len".into(),
    };
    Some(format!(
        "device memory per rank is predicted at {}, over {what} ({}): the run would fail allocating; {fix}",
        gib(predicted),
        gib(limit)
    ))
}
