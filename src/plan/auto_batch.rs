//! `"auto"` batch sizes. The ds_configs Hugging Face and LLaMA-Factory publish set the
//! batch keys to `"auto"` for their Trainer to fill in; tierzero is the trainer here, so
//! it decides: the micro-batch is the largest power of two whose planned device bytes
//! (`plan::memory::predict`) fit the device budget; accumulation is 1 unless
//! `train_batch_size` is set (then it makes up the rest); `train_batch_size` follows.
//! `plan` prints each with what it became and why. The same budget decides whether
//! gradient accumulation may keep its sums on the device (`fit_device_sums`).

use super::{Accelerator, AutoChoice, DeviceFacts, Plan, Tier};

/// Which batch keys were `"auto"`, and the numbers given beside them.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct AutoBatch {
    /// The micro-batch is tierzero's to decide.
    pub micro: bool,
    pub accumulation: bool,
    pub tbs: bool,
    pub tbs_given: Option<usize>,
    pub accumulation_given: Option<usize>,
}

/// The micro-batch when no device budget bounds it: the Hugging Face Trainer's default
/// `per_device_train_batch_size`.
pub const UNBOUNDED_MICRO: usize = 8;

/// The largest micro-batch tried against a budget.
pub const MAX_MICRO: usize = 1 << 12;

/// Replaces the placeholder batch of an `"auto"` config with tierzero's choice.
pub(super) fn decide(plan: &mut Plan, auto: AutoBatch, facts: DeviceFacts) {
    let world = plan.world_size;
    let gib = |b: u64| format!("{:.4} GiB", b as f64 / f64::from(1u32 << 30));
    if auto.micro {
        // with train_batch_size set, the micro-batch divides each rank's share of it
        // (and the given accumulation, if any)
        let share = auto
            .tbs_given
            .map(|t| t / world / auto.accumulation_given.unwrap_or(1));
        let candidates: Vec<usize> = (0..=MAX_MICRO.trailing_zeros())
            .map(|k| 1usize << k)
            .filter(|m| share.is_none_or(|s| s.is_multiple_of(*m)))
            .collect();
        // the accumulation that makes up the batch with a micro-batch of `micro`
        let accumulation_for = |micro: usize| match auto.tbs_given {
            Some(t) => t / (micro * world),
            None => auto.accumulation_given.unwrap_or(1),
        };
        let planned = |micro: usize| {
            let mut p = plan.clone();
            p.batch.micro_batch_per_gpu = micro;
            if p.train.layered_accumulation {
                // a layered step holds the activations of every micro-batch
                p.batch.gradient_accumulation_steps = accumulation_for(micro).max(1);
            }
            crate::plan::memory::predict(&p).total
        };
        let (budget, budget_key) = budget(plan, facts);
        let (micro, why) = match budget {
            None => {
                let micro = candidates
                    .iter()
                    .copied()
                    .filter(|&m| m <= UNBOUNDED_MICRO)
                    .max()
                    .unwrap_or(1);
                (
                    micro,
                    format!(
                        "no device budget bounds it ({budget_key} unset): the Hugging Face Trainer's default \
                         per-device batch, {UNBOUNDED_MICRO}{}",
                        if micro < UNBOUNDED_MICRO { ", or the largest power of two dividing train_batch_size's share" } else { "" }
                    ),
                )
            }
            Some(budget) => match candidates
                .iter()
                .map(|&m| (m, planned(m)))
                .filter(|&(_, bytes)| bytes <= budget)
                .max_by_key(|&(m, _)| m)
            {
                Some((micro, bytes)) => (
                    micro,
                    format!(
                        "the largest power of two whose planned device bytes ({}) fit {budget_key} ({})",
                        gib(bytes),
                        gib(budget)
                    ),
                ),
                None => (
                    1,
                    format!(
                        "even 1 plans {}, over {budget_key} ({}): lower seq_len or offload more",
                        gib(planned(1)),
                        gib(budget)
                    ),
                ),
            },
        };
        let accumulation = accumulation_for(micro);
        plan.batch.micro_batch_per_gpu = micro;
        plan.batch.gradient_accumulation_steps = accumulation;
        plan.batch.train_batch_size = micro * accumulation * world;
        plan.auto.push(AutoChoice {
            key: "train_micro_batch_size_per_gpu",
            value: micro as f64,
            why,
        });
    }
    let b = plan.batch;
    if auto.accumulation {
        plan.auto.push(AutoChoice {
            key: "gradient_accumulation_steps",
            value: b.gradient_accumulation_steps as f64,
            why: match auto.tbs_given {
                Some(t) => format!(
                    "train_batch_size {t} / (micro {} × devices {world})",
                    b.micro_batch_per_gpu
                ),
                None => "no train_batch_size to make up".into(),
            },
        });
    }
    if auto.tbs {
        plan.auto.push(AutoChoice {
            key: "train_batch_size",
            value: b.train_batch_size as f64,
            why: format!(
                "micro {} × accumulation {} × devices {world}",
                b.micro_batch_per_gpu, b.gradient_accumulation_steps
            ),
        });
    }
}

/// A rank's device memory budget, and what sets it.
pub(super) fn budget(plan: &Plan, facts: DeviceFacts) -> (Option<u64>, &'static str) {
    match plan.train.accelerator {
        Accelerator::Cuda => (facts.cuda_memory, "the GPU's memory"),
        Accelerator::Cpu => (plan.train.device_memory, "train.device_memory"),
    }
}

/// Whether the plan's predicted device bytes fit its budget (always, without one).
pub(super) fn fits_budget(plan: &Plan, facts: DeviceFacts) -> bool {
    budget(plan, facts)
        .0
        .is_none_or(|budget| crate::plan::memory::predict(plan).total <= budget)
}

/// Whether gradient accumulation keeps its sums on the device
/// (`rules::device_accumulation`): as `train.accumulate_on_device` says, and for "auto"
/// on a GPU where the plan still fits its memory with them. A CPU device's memory is the
/// host's, where the accumulators already are: "auto" keeps the sums there once. The
/// gradients of device-tier optimizer state (`rules::gradients_on_device`) stay on the
/// device on a GPU either way, unless the key says false.
pub(super) fn fit_device_sums(plan: &mut Plan, facts: DeviceFacts) {
    // the gradients of device-tier state take no memory beyond what the device row
    // counts for them: kept there whether or not every unit's sum fits
    plan.zero.device_gradients = plan
        .train
        .accumulate_on_device
        .unwrap_or(plan.train.accelerator != Accelerator::Cpu);
    plan.zero.device_accumulation = match plan.train.accumulate_on_device {
        Some(on) => on,
        None if plan.train.accelerator == Accelerator::Cpu => false,
        None => {
            plan.zero.device_accumulation = true;
            let fits = fits_budget(plan, facts);
            if fits && crate::plan::rules::device_accumulation(plan) {
                plan.auto.push(AutoChoice {
                    key: "train.accumulate_on_device",
                    value: 1.0,
                    why: "on: gradient sums stay on the GPU over the micro-batches and leave it once per step; its memory has room"
                        .into(),
                });
            }
            fits
        }
    };
}

/// Whether units whose parameters stay on the device keep their activations for backward
/// (no recompute), as `train.keep_activations` says: for "auto", unless the config has an
/// `activation_checkpointing` section, where the device budget has room for them.
pub(super) fn fit_kept_activations(plan: &mut Plan, facts: DeviceFacts) {
    plan.train.kept_activations = match plan.train.keep_activations {
        Some(on) => on,
        None if plan.train.activation_checkpointing => false,
        None => {
            plan.train.kept_activations = true;
            let fits = fits_budget(plan, facts);
            let any = (0..plan.model.config.unit_numels().len())
                .any(|u| crate::plan::rules::keeps_activations(plan, u));
            if fits && any {
                plan.auto.push(AutoChoice {
                    key: "train.keep_activations",
                    value: 1.0,
                    why: "on: units whose parameters stay on the device keep their activations for backward instead of recomputing the forward; the device has room"
                        .into(),
                });
            }
            fits
        }
    };
}

/// Stage 3 with parameters off the device: how many units, from the first, keep their
/// shard on the device (`train.shards_on_device`), of the units fetched for each use (a
/// unit kept gathered crosses PCIe once a step wherever its shard is): all for true, none
/// for false, and for "auto", on a GPU, as many as fit its memory beside what the plan
/// holds there. Such a unit is gathered from its shard with no copy across PCIe, and its
/// update crosses once a step.
pub(super) fn fit_shards(plan: &mut Plan, facts: DeviceFacts) {
    if plan.zero.stage != 3 || plan.zero.offload_param.tier == Tier::Device {
        return;
    }
    // the units fetched for each use: a unit kept gathered crosses once a step anyway
    let threshold = plan.zero.param_persistence_threshold;
    let units = plan
        .model
        .config
        .unit_numels()
        .into_iter()
        .filter(|&n| n > threshold)
        .count();
    if units == 0 {
        return;
    }
    let k = match plan.train.shards_on_device {
        Some(false) => return,
        Some(true) => units,
        None if plan.train.accelerator == Accelerator::Cpu => return,
        None => {
            let fits = |k: usize| {
                let mut p = plan.clone();
                p.zero.offload_param.device_units = k;
                fits_budget(&p, facts)
            };
            (0..=units).rev().find(|&k| fits(k)).unwrap_or(0)
        }
    };
    plan.zero.offload_param.device_units = k;
    if plan.train.shards_on_device.is_none() && k > 0 {
        plan.auto.push(AutoChoice {
            key: "train.shards_on_device",
            value: k as f64,
            why: format!(
                "of the {units} units fetched for each use keep their parameter shard on the GPU, the most \
                 that fit its memory: gathered from there, updated there once a step"
            ),
        });
    }
}

/// Stage 3 with parameters off the device: whether the units kept gathered whose optimizer
/// state is on the device, or whose parameters are on NVMe, keep their shard there too
/// (`offload_param.kept_on_device`), as `train.shards_on_device` says; for "auto", on a
/// GPU, where its memory has room. The first kind's update is made on the device and stays
/// there: no copy out of it, none back in; the second's new values cross once from the
/// host's optimizer, where they went to the NVMe parameter store and came back.
pub(super) fn fit_kept_shards(plan: &mut Plan, facts: DeviceFacts) {
    if plan.zero.stage != 3 || plan.zero.offload_param.tier == Tier::Device {
        return;
    }
    let before = crate::plan::rules::param_tiers(plan);
    let on = match plan.train.shards_on_device {
        Some(on) => on,
        None if plan.train.accelerator == Accelerator::Cpu => false,
        None => {
            let mut p = plan.clone();
            p.zero.offload_param.kept_on_device = true;
            fits_budget(&p, facts)
        }
    };
    plan.zero.offload_param.kept_on_device = on;
    let optimizer = crate::plan::rules::optimizer_tiers(plan);
    let (mut with_state, mut from_nvme) = (0, 0);
    for (u, (now, was)) in crate::plan::rules::param_tiers(plan)
        .iter()
        .zip(&before)
        .enumerate()
    {
        match (now != was, optimizer[u] == Tier::Device) {
            (true, true) => with_state += 1,
            (true, false) => from_nvme += 1,
            (false, _) => {}
        }
    }
    let moved = with_state + from_nvme;
    if plan.train.shards_on_device.is_none() && moved > 0 {
        let mut kinds = Vec::new();
        if with_state > 0 {
            kinds.push(format!(
                "{with_state} units kept gathered whose optimizer state is on the GPU keep their parameter shard \
                 there too: updated there, nothing crosses"
            ));
        }
        if from_nvme > 0 {
            kinds.push(format!(
                "{from_nvme} units kept gathered whose parameters are on NVMe keep their shard on the GPU: the \
                 host's update crosses once, with no trip through the NVMe parameter store"
            ));
        }
        let why = format!("{}; its memory has room", kinds.join("; "));
        // one line for the key, beside what `fit_shards` chose
        match plan.auto.iter_mut().find(|c| c.key == "train.shards_on_device") {
            Some(choice) => {
                choice.value += moved as f64;
                choice.why = format!("{}; {why}", choice.why);
            }
            None => plan.auto.push(AutoChoice {
                key: "train.shards_on_device",
                value: moved as f64,
                why,
            }),
        }
    }
}

/// Stage 3: which gathered units stay on the device for the whole step (gathered once per
/// step, after the update, instead of for every forward and backward), as
/// `train.keep_gathered` says: for "auto", on a GPU, the largest units that fit its memory
/// beside everything else the plan holds there. The engine keeps units of at most
/// `stage3_param_persistence_threshold` elements gathered, so the choice raises that
/// threshold (never lowers it) and says so beside the batch keys.
pub(super) fn fit_gathered(plan: &mut Plan, facts: DeviceFacts) {
    if plan.zero.stage != 3 {
        return;
    }
    let numels = plan.model.config.unit_numels();
    let largest = numels.iter().copied().max().unwrap_or(0);
    let given = plan.zero.param_persistence_threshold;
    let threshold = match plan.train.keep_gathered {
        Some(false) => return,
        Some(true) => largest,
        None if plan.train.accelerator == Accelerator::Cpu => return,
        None => {
            let mut sizes: Vec<usize> = numels.iter().copied().filter(|&n| n > given).collect();
            sizes.sort_unstable();
            sizes.dedup();
            let fits = |t: usize| {
                let mut p = plan.clone();
                p.zero.param_persistence_threshold = t;
                fits_budget(&p, facts)
            };
            match sizes.into_iter().rev().find(|&t| fits(t)) {
                Some(t) => t,
                None => return,
            }
        }
    };
    if threshold <= given {
        return;
    }
    plan.zero.param_persistence_threshold = threshold;
    if plan.train.keep_gathered.is_none() {
        let kept = numels.iter().filter(|&&n| n <= threshold).count();
        plan.auto.push(AutoChoice {
            key: "train.keep_gathered",
            value: kept as f64,
            why: format!(
                "of {} units stay gathered for the whole step, the most that fit the GPU's memory: \
                 stage3_param_persistence_threshold {given} → {threshold}",
                numels.len()
            ),
        });
    }
}
