//! The rules every room asks of a plan, in one place: which tier keeps gradient
//! partitions and in what precision, how stages 1–2 spread updates, how large the
//! reduction's chunks and the swap store's chunks are, how many buffers the NVMe
//! pipeline has and how far ahead fetches run. The engine follows them and the
//! predictions (`memory.rs`, `host_memory.rs`) count by them, so the two cannot drift.

use super::{Plan, Precision, Tier, Wire};

/// Gradients in flight on the reduction lane at most.
pub const REDUCE_DEPTH: usize = 2;

/// The micro-batches whose activations a step holds at once: all of them in a layered
/// step (`train.layered_accumulation`), else one.
pub fn layers(plan: &Plan) -> u64 {
    if plan.train.layered_accumulation {
        plan.batch.gradient_accumulation_steps as u64
    } else {
        1
    }
}

/// The passes a step makes over its units, each fetching every unit (stage 3) and
/// reducing every gradient once: one a micro-batch, or one for all of them in a layered
/// step.
pub fn passes(plan: &Plan) -> usize {
    plan.batch.gradient_accumulation_steps / layers(plan) as usize
}

/// Gradients in flight on the reduction lane at most in this plan's step: one in a
/// layered step (`train.layered_accumulation`), whose unit sums are whole fp32 units held
/// until reduced, and each reduced while the next unit runs every micro-batch's
/// backward; else [`REDUCE_DEPTH`].
pub fn reduce_depth(plan: &Plan) -> usize {
    if plan.train.layered_accumulation {
        1
    } else {
        REDUCE_DEPTH
    }
}

/// Elements of one reduction chunk (all ranks' stretches together) at most: 16 MiB in
/// fp32.
pub const CHUNK_LIMIT: usize = 1 << 22;

/// Elements of one reduction chunk: DeepSpeed's `reduce_bucket_size` ("elements reduced
/// at a time"), at most [`CHUNK_LIMIT`] (its default 5e8 would hold 2 GB in fp32).
pub fn chunk_elements(plan: &Plan) -> usize {
    plan.zero.reduce_bucket_size.clamp(1, CHUNK_LIMIT)
}

/// Elements each core takes at a time in the engine's element-wise passes over gradient
/// accumulators (the add and Σ g²); a stretch no longer is done on one thread.
pub const PARALLEL_CHUNK: usize = 1 << 15;

/// Elements per swap chunk at most, whatever `sub_group_size` says: the NVMe pipeline
/// holds `buffer_count` chunk buffers of fp32 (a sub-group's master, exp_avg, exp_avg_sq
/// and gradient each take one), so DeepSpeed's default sub-group of 1e9 elements would pin
/// 16 GB of host memory with its default `buffer_count` of 4. 2²³ elements (32 MiB per
/// state) keeps them at 128 MiB, and each read or write still moves whole MiBs at once.
/// The chunking never changes the result (the pipeline equals in-memory AdamW bit for bit).
pub const SWAP_CHUNK_LIMIT: usize = 1 << 23;

/// Elements per swap chunk of a store whose largest tensor has `largest` elements:
/// `sub_group_size`, at most [`SWAP_CHUNK_LIMIT`] and at most that tensor (the swap store,
/// the host-memory prediction and the simulated step all chunk by this).
pub fn swap_chunk(plan: &Plan, largest: usize) -> usize {
    plan.zero.sub_group_size.min(SWAP_CHUNK_LIMIT).min(largest.max(1))
}

/// Elements per chunk of the optimizer's swap store: [`swap_chunk`] over a rank's largest
/// optimizer partition (a buffer of the NVMe pipeline holds one in fp32).
pub fn optimizer_swap_chunk(plan: &Plan) -> usize {
    let largest = (plan.model.config.unit_numels().into_iter())
        .map(|n| super::partition::Partition::new(n, plan.world_size).optimizer_len(plan.zero.stage))
        .max()
        .unwrap_or(1);
    swap_chunk(plan, largest)
}

/// Each unit's optimizer-state tier (fp32 master, Adam moments, and at stages 2–3 the
/// gradient partition with them): `offload_optimizer.device`, except that DeepSpeed's
/// partial offload (`offload_optimizer.ratio` below 1) keeps the first
/// `⌊(1 − ratio)·units⌋` units on the device, as DeepSpeed keeps that share of its
/// sub-groups there; and with the state on NVMe the next units whose elements, counted in
/// forward order, fit `train.optimizer_max_in_cpu` stay in host memory. Whole units: the
/// first that does not fit, and every one after it, is on NVMe.
pub fn optimizer_tiers(plan: &Plan) -> Vec<Tier> {
    let offload = &plan.zero.offload_optimizer;
    let numels = plan.model.config.unit_numels();
    let on_device = if offload.tier == Tier::Device {
        numels.len()
    } else {
        ((1.0 - offload.ratio) * numels.len() as f64).floor() as usize
    };
    let mut spill = spill_to_nvme(offload.max_in_cpu);
    numels
        .into_iter()
        .enumerate()
        .map(|(u, numel)| match offload.tier {
            _ if u < on_device => Tier::Device,
            Tier::Nvme => spill(numel),
            tier => tier,
        })
        .collect()
}

/// The tier of each next unit, in forward order, of state kept on NVMe except for the
/// first `max_in_cpu` elements (both `max_in_cpu` keys): host memory while the units'
/// elements, counted from the first, fit; NVMe from the first that does not, and for
/// every unit after it.
fn spill_to_nvme(max_in_cpu: usize) -> impl FnMut(usize) -> Tier {
    let mut in_cpu = 0usize;
    let mut spilled = false;
    move |numel| {
        in_cpu = in_cpu.saturating_add(numel);
        spilled |= in_cpu > max_in_cpu;
        if spilled {
            Tier::Nvme
        } else {
            Tier::Cpu
        }
    }
}

/// Whether each unit's gradient partition lives in the optimizer's swap store on NVMe
/// (stages 2–3, the unit's optimizer state there; `engine/grad_store.rs`), as DeepSpeed's
/// optimizer swapper keeps them, instead of in host memory: where the step's sum is not
/// held on the device for the optimizer ([`held_gradients`]).
pub fn stored_gradients(plan: &Plan) -> Vec<bool> {
    let stage = plan.zero.stage;
    let accumulated = device_accumulation(plan);
    optimizer_tiers(plan)
        .into_iter()
        .map(|tier| stage >= 2 && tier == Tier::Nvme && !accumulated)
        .collect()
}

/// Elements of one block of Σ g² (`engine/grads.rs`, `sum_squares_*`): a divisor of the
/// swap store's chunk alignment (4096 elements), so that a sum continued chunk by chunk
/// is the whole's.
pub const NORM_BLOCK: usize = 4096;

/// Whether each unit's Σ g² is gathered as its step's last contribution is added
/// (`engine/staging.rs`, `Squares`) instead of in a pass over its accumulator after the
/// micro-batches: a shard's accumulator in host memory (stages 2–3; replicas are
/// all-reduced after the adds), reduced in stretches that start on blocks of the sum.
pub fn squares_as_added(plan: &Plan, shards: &[usize]) -> Vec<bool> {
    let step = (chunk_elements(plan) / plan.world_size.max(1)).max(1);
    stored_gradients(plan)
        .into_iter()
        .zip(shards)
        .map(|(stored, &shard)| {
            plan.zero.stage >= 2 && !stored && (step.is_multiple_of(NORM_BLOCK) || shard <= step)
        })
        .collect()
}

/// Whether any unit's gradient partition is in the swap store ([`stored_gradients`]).
pub fn nvme_gradients(plan: &Plan) -> bool {
    stored_gradients(plan).contains(&true)
}

/// Whether any unit's optimizer state is on NVMe.
pub fn nvme_optimizer(plan: &Plan) -> bool {
    optimizer_tiers(plan).contains(&Tier::Nvme)
}

/// Whether gradients accumulate on the device across a step's micro-batches (stages 2–3
/// with gradient accumulation): each micro-batch's reduced stretch is added into a device
/// accumulator of the unit's partition, and only the last micro-batch's sum leaves the
/// device, once per step, for the host accumulator or the swap store (none of a unit
/// whose gradient stays there, [`gradients_on_device`]). The device row of the plan counts
/// these accumulators (4 bytes per partition element) on every tier; a plan whose device
/// budget they would overflow keeps the sums on the host.
pub fn device_accumulation(plan: &Plan) -> bool {
    plan.zero.device_accumulation && plan.zero.stage >= 2 && plan.batch.gradient_accumulation_steps > 1
}

/// Which units' gradients never leave the device (`zero.device_gradients`): those whose
/// optimizer state is there. Their reduced stretches (stages 2–3) or their replica's
/// gradient (stages 0–1, all-reduced there once a step) are summed into a device
/// accumulator even with one micro-batch, the fused AdamW reads it there, and their Σ g²
/// is taken there; nothing of them crosses to the host.
pub fn gradients_on_device(plan: &Plan) -> Vec<bool> {
    let keep = plan.zero.device_gradients;
    optimizer_tiers(plan)
        .into_iter()
        .map(|t| keep && t == Tier::Device)
        .collect()
}

/// Which units' step sums stay on the device until the optimizer reads them: those that
/// never leave it ([`gradients_on_device`]), and with gradient accumulation on the device
/// ([`device_accumulation`]) every other unit's. The optimizer thread takes each of these
/// sums to the host as it reaches the unit, the next unit's copy beside this unit's
/// update (a GPU's into two pinned buffers of the largest such partition, a CPU device's
/// read where it is; `engine/held.rs`), where the last micro-batch would send it to a
/// host accumulator (4 bytes a parameter of host memory through the run) or through the
/// swap store (written in backward order, read back in forward order: twice the
/// gradient's bytes on the disk each step; DeepSpeed's optimizer swapper keeps gradients
/// there). Their Σ g² is taken on the device.
pub fn held_gradients(plan: &Plan) -> Vec<bool> {
    let accumulated = device_accumulation(plan);
    optimizer_tiers(plan)
        .into_iter()
        .zip(gradients_on_device(plan))
        .map(|(tier, kept)| kept || (accumulated && tier != Tier::Device))
        .collect()
}

/// Elements of each of the two pinned buffers a GPU's optimizer thread copies held sums
/// into ([`held_gradients`]) for a host or NVMe update: the largest such of the units'
/// optimizer `partitions` (0 where none is held; a CPU device needs none, its sums read
/// where they are).
pub fn held_copy_elements(plan: &Plan, partitions: &[usize]) -> usize {
    let off_device = optimizer_tiers(plan).into_iter().map(|t| t != Tier::Device);
    let held = held_gradients(plan).into_iter().zip(off_device);
    largest_partition(partitions, held.map(|(held, off)| held && off))
}

/// Elements of each of the two buffers the optimizer thread writes a host update of
/// parameters on the device into before its copy there (`engine/update_copies.rs`): the
/// largest of the units' optimizer `partitions` whose parameters are on the device and
/// optimizer state off it (0 where there is none).
pub fn update_copy_elements(plan: &Plan, partitions: &[usize]) -> usize {
    let tiers = param_tiers(plan).into_iter().zip(optimizer_tiers(plan));
    largest_partition(
        partitions,
        tiers.map(|(param, optimizer)| param == Tier::Device && optimizer != Tier::Device),
    )
}

/// The largest of `partitions` among the units `which` picks (0 for none).
fn largest_partition(partitions: &[usize], which: impl Iterator<Item = bool>) -> usize {
    which
        .zip(partitions)
        .filter_map(|(picked, &len)| picked.then_some(len))
        .max()
        .unwrap_or(0)
}

/// Which units sum their gradient in a device accumulator: every unit with gradient
/// accumulation on the device ([`device_accumulation`]), and those whose gradients stay
/// there ([`gradients_on_device`]).
pub fn device_sums(plan: &Plan) -> Vec<bool> {
    let all = device_accumulation(plan);
    gradients_on_device(plan)
        .into_iter()
        .map(|kept| all || kept)
        .collect()
}

/// Buffer sets of the NVMe optimizer pipeline: DeepSpeed's `offload_optimizer.buffer_count`
/// counts buffers, one per state of a sub-group (the gradient's included when stored).
pub fn pipeline_sets(plan: &Plan) -> usize {
    tierzero_offload::pipeline::sets_for(plan.zero.offload_optimizer.buffer_count, nvme_gradients(plan))
}

/// Sub-groups of NVMe optimizer state the backward reads ahead for the next update
/// (`Optimizer::read_first_ahead`, and the replay's): as many as the pipeline has buffer
/// sets where the backward moves nothing of its own on the disk, one where it does
/// (gradients stored in the swap store, parameters read from NVMe). The store's rings
/// serve their jobs in order, so a batch of read-aheads submitted at the backward's start
/// would hold the backward's own transfers behind gigabytes of state; one sub-group
/// holds them at most that long.
pub fn read_ahead_sets(plan: &Plan) -> usize {
    let sets = pipeline_sets(plan);
    let backward_uses_disk = nvme_gradients(plan) || param_tiers(plan).contains(&Tier::Nvme);
    if backward_uses_disk {
        sets.min(1)
    } else {
        sets
    }
}

/// How the NVMe optimizer pipeline runs: its buffer sets, and whether its reads and its
/// writes overlap the updates (`offload_optimizer.pipeline_read`, `pipeline_write`).
pub fn pipeline(plan: &Plan) -> tierzero_offload::pipeline::PipelineConfig {
    let oo = &plan.zero.offload_optimizer;
    tierzero_offload::pipeline::PipelineConfig {
        sets: pipeline_sets(plan),
        pipeline_read: oo.pipeline_read,
        pipeline_write: oo.pipeline_write,
    }
}

/// Whether the optimizer's swap store keeps gradients in bf16: a bf16 run whose optimizer
/// state is all on NVMe, at stages 2–3, without gradient accumulation (see
/// `engine/grads.rs`); a placement over several tiers keeps fp32, the accumulators of its
/// units in memory as those of a run in memory. With several micro-batches per step a
/// bf16 sum of nearly cancelling micro-batch gradients can flip a sign that Adam then
/// follows at full step size, so those runs keep fp32.
pub fn stored_bf16(plan: &Plan) -> bool {
    one_bf16_contribution(plan) && optimizer_tiers(plan).iter().all(|&t| t == Tier::Nvme)
}

/// A bf16 run at stages 2–3 with one micro-batch per step: each unit's gradient partition
/// receives its step's gradient once per use of the unit.
fn one_bf16_contribution(plan: &Plan) -> bool {
    plan.zero.stage >= 2 && plan.precision == Precision::Bf16 && plan.batch.gradient_accumulation_steps == 1
}

/// Whether each unit's gradient accumulator is kept in bf16: every unit where the swap
/// store keeps them so ([`stored_bf16`]); else, with [`one_bf16_contribution`], the host
/// accumulators (optimizer state in host memory) that receive one bf16 value per element
/// a step, which fp32 would hold exactly as bf16 does: every unit's gradient is in the
/// parameters' kind (the LM head's dW too, rounded once), reduced on a bf16 wire or by
/// one rank; a tied embedding's is the sum of two (the lookup's and the head's), so it
/// stays fp32. Half the host bytes of those accumulators, and the same bits
/// (`bf16_accumulators_train_the_bits_of_fp32_ones`).
pub fn bf16_gradients(plan: &Plan) -> Vec<bool> {
    let tiers = optimizer_tiers(plan);
    if stored_bf16(plan) {
        return vec![true; tiers.len()];
    }
    let exact = one_bf16_contribution(plan)
        && plan.zero.bf16_accumulators
        && (plan.world_size == 1 || plan.communication == Wire::Bf16);
    let tied = plan.model.config.tie_word_embeddings;
    tiers
        .iter()
        .enumerate()
        .map(|(u, &tier)| exact && tier == Tier::Cpu && (u > 0 || !tied))
        .collect()
}

/// Whether a unit's new partition is all-gathered into its replica from a partition of
/// its own (stages 1–2 with several ranks) rather than being all a rank stores: the
/// engine, its reservations and the plan's predictions all follow this rule.
pub fn gathers_updates(stage: u8, world: usize) -> bool {
    matches!(stage, 1 | 2) && world > 1
}

/// Tokens per chunk of the LM head's logits (`model/head.rs`).
pub const HEAD_CHUNK: i64 = 1024;

/// Elements of the LM head's weight converted to fp32 at once (64 MiB): a slice of the
/// vocabulary (`model/head.rs`).
pub const HEAD_SLICE_ELEMENTS: i64 = 1 << 24;

/// Vocabulary rows per slice of the LM head for a `hidden`-wide weight.
pub fn head_slice_rows(vocab: i64, hidden: i64) -> i64 {
    (HEAD_SLICE_ELEMENTS / hidden.max(1)).clamp(1, vocab.max(1))
}

/// Each unit's parameter tier: `offload_param.device`, except that with parameters on
/// NVMe the units whose elements, counted in forward order, fit in
/// `offload_param.max_in_cpu` stay in host memory (DeepSpeed's meaning: it keeps that many
/// 16-bit parameter elements in CPU buffers and swaps the rest; its default 1e9 keeps a
/// model of up to a billion parameters off the disk). Whole units: the first that does
/// not fit, and every one after it, is on NVMe. At stage 3 the shards of the first
/// `offload_param.device_units` units that are fetched for each use (larger than
/// `stage3_param_persistence_threshold`: a unit kept gathered crosses once a step
/// wherever its shard is) stay on the device (`train.shards_on_device`), and with
/// `offload_param.kept_on_device` so do the shards of units kept gathered whose optimizer
/// state is on the device (their update then never crosses) or whose parameters are on
/// NVMe (their update then crosses once, where it went to the disk and back).
pub fn param_tiers(plan: &Plan) -> Vec<Tier> {
    let param = &plan.zero.offload_param;
    let mut spill = spill_to_nvme(param.max_in_cpu);
    let stage3 = plan.zero.stage == 3;
    let mut on_device = if stage3 { param.device_units } else { 0 };
    let kept_state: Vec<bool> = if stage3 && param.kept_on_device {
        optimizer_tiers(plan)
            .into_iter()
            .map(|t| t == Tier::Device)
            .collect()
    } else {
        Vec::new()
    };
    let threshold = plan.zero.param_persistence_threshold;
    plan.model
        .config
        .unit_numels()
        .into_iter()
        .enumerate()
        .map(|(u, numel)| match param.tier {
            // a unit kept gathered whose optimizer state is on the device
            _ if numel <= threshold && kept_state.get(u) == Some(&true) => Tier::Device,
            // one whose parameters are on NVMe (whatever `max_in_cpu` would keep in host
            // memory: the device's room was checked for all of them)
            Tier::Nvme if stage3 && param.kept_on_device && numel <= threshold => Tier::Device,
            // `train.shards_on_device`: the first fetched units' shards stay on the device
            _ if on_device > 0 && numel > threshold => {
                on_device -= 1;
                Tier::Device
            }
            Tier::Nvme => spill(numel),
            tier => tier,
        })
        .collect()
}

/// Stage 3 with one rank: the units whose shard is on the device, which is then the whole
/// unit, used where it is stored (as a replica below stage 3): never fetched, no gathered
/// copy beside it.
pub fn in_place_units(plan: &Plan) -> Vec<bool> {
    let one = plan.zero.stage == 3 && plan.world_size == 1;
    param_tiers(plan)
        .into_iter()
        .map(|t| one && t == Tier::Device)
        .collect()
}

/// [`fetch::schedule`](super::fetch::schedule) of `plan`'s units (its tied head, its
/// persistence threshold) less those used where they are stored ([`in_place_units`]),
/// which are never fetched: the order the engine's prefetcher, the device-memory
/// prediction and the replay follow.
pub fn unit_schedule(plan: &Plan) -> Vec<(usize, super::fetch::Purpose)> {
    let numels = plan.model.config.unit_numels();
    let threshold = plan.zero.param_persistence_threshold;
    let in_place = in_place_units(plan);
    let mut uses = super::fetch::schedule(numels.len(), plan.model.config.tie_word_embeddings, |u| {
        numels[u] <= threshold
    });
    uses.retain(|&(u, _)| !in_place[u]);
    uses
}

/// Which units' parameters live in locked host memory registered with the GPU
/// (`offload_param.pin_memory`): those in host memory, whose h2d copy then reads them in
/// place by DMA (no fill of a pinned staging buffer), and into which a device-tier
/// optimizer copies the new values at the pinned rate (stages 0 and 3, where the update
/// overwrites the unit's own buffer).
pub fn pinned_params(plan: &Plan) -> Vec<bool> {
    let pin = plan.zero.offload_param.pin_memory;
    param_tiers(plan)
        .into_iter()
        .map(|t| pin && t == Tier::Cpu)
        .collect()
}

/// Whether unit `u` keeps its autograd graph from forward to backward (no recompute):
/// kept activations are on, `u` is a block, and its parameters stay on the device
/// from its forward through its backward (a replica on the device below stage 3, at stage
/// 3 a persistent unit, one held for its backward or one used in place), so the graph's
/// references to them stay valid.
pub fn keeps_activations(plan: &Plan, u: usize) -> bool {
    let numels = plan.model.config.unit_numels();
    let block = u > 0 && u + 1 < numels.len();
    if !(plan.train.kept_activations && block) || plan.train.layered_accumulation {
        return false;
    }
    if plan.zero.stage < 3 {
        plan.zero.offload_param.tier == Tier::Device
    } else {
        numels[u] <= plan.zero.param_persistence_threshold
            || in_place_units(plan)[u]
            || held_for_backward(plan, &numels, u)
    }
}

/// Stage 3: the most units held gathered for a later use at once
/// (`stage3_max_reuse_distance`): with the uses of a micro-batch whose persistent units are
/// cached, the fewest elements lie between, so the most are held.
pub fn held_at_once(plan: &Plan) -> usize {
    use super::fetch::Fetches;
    let numels = plan.model.config.unit_numels();
    let threshold = plan.zero.param_persistence_threshold;
    let persistent = |v: usize| numels[v] <= threshold;
    let mut uses = unit_schedule(plan);
    uses.retain(|&(v, _)| !persistent(v));
    let fetches = Fetches::new(uses, &numels, persistent, plan.zero.max_reuse_distance);
    fetches.keep.iter().filter(|&&k| k).count()
}

/// Stage 3: whether block `u`'s forward gather stays for its backward in every
/// micro-batch (`stage3_max_reuse_distance`, `fetch::Fetches`): with every unit's uses in
/// the schedule, as in a step's first micro-batch; later ones leave out cached persistent
/// units, so fewer elements lie between and what is held here is held there too.
fn held_for_backward(plan: &Plan, numels: &[usize], u: usize) -> bool {
    use super::fetch::{kept_until, Purpose};
    let uses = unit_schedule(plan);
    uses.iter()
        .position(|&use_| use_ == (u, Purpose::Forward))
        .and_then(|k| kept_until(&uses, k, numels, plan.zero.max_reuse_distance))
        .is_some()
}

/// Whether micro-batches carry packed rows (a block-diagonal mask and per-sample
/// positions): record data sets with `data.packing` on. A `.jsonl` of `{"text"}` records
/// only is a stream unless `data.packing` is given, which the plan cannot tell without
/// reading it: it is counted as packed (the mask is the larger prediction).
pub fn packs_rows(plan: &Plan) -> bool {
    match &plan.data.source {
        super::DataSource::Text { path, .. } => {
            plan.data.records.packing && path.extension().and_then(|e| e.to_str()) != Some("txt")
        }
        _ => false,
    }
}
