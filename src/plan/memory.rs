//! Device bytes per rank: what `tierzero plan` predicts and the run measures.
//!
//! Counted, per rank, exactly what the engine reserves on its device: parameters on the
//! device tier (the shard at stage 3, the replica below), gradients and optimizer state
//! when the optimizer is not offloaded (fp32 gradient partition; 12 bytes per element of
//! master, exp_avg, exp_avg_sq), gathered units at stage 3 (one at a time, the final
//! unit together with the tied embedding), and the activations kept between forward and
//! backward (the token ids and each block's input). On top of these, what the engine
//! reserves, come the compute temporaries ([`transient`]): the largest of one block's
//! recompute and backward (the tensors autograd saves, the gradients flowing back, the
//! unit's flat gradient), the embedding's backward (its dense weight gradient and the
//! flat one) and the final unit's loss and backward (fp32 hidden states and
//! their gradient, one logits chunk with its softmax and gradient, the fp32 weight slice
//! and its gradient), plus, below stage 3, the copy of the unit in use. These are counted
//! from the code of `model/` (tensor by tensor) and checked against libtorch's own
//! allocator (`tests/memory.rs`), not against the engine's reservations.

use super::fetch::{may_request, Fetches, Limits, Purpose};
use super::partition::Partition;
use super::rules::{chunk_elements, device_sums, gathers_updates, keeps_activations, layers, passes};
use super::{Plan, Tier};
use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeviceBytes {
    pub parameters: u64,
    pub gradients: u64,
    /// Of `gradients`, the accumulators held as device tensors: the partitions a step's
    /// micro-batches add into (`rules::device_sums`).
    pub accumulators: u64,
    pub optimizer: u64,
    /// Peak of gathered units plus kept activations, at the moment they peak together.
    pub working: u64,
    /// Compute temporaries at their peak (not reserved by the engine).
    pub transient: u64,
    pub total: u64,
}

impl DeviceBytes {
    /// What the engine itself reserves (everything but the compute temporaries).
    pub fn reserved(&self) -> u64 {
        self.total - self.transient
    }

    /// What torch tensors hold: device-tier parameters, gathered units, activations,
    /// temporaries, reduction buckets, device-tier optimizer state and the device
    /// accumulators of gradient accumulation (the other gradient accumulators are the
    /// engine's host arenas).
    pub fn in_tensors(&self) -> u64 {
        self.parameters + self.working + self.transient + self.optimizer + self.accumulators
    }
}

/// Per token, what autograd saves in a block's forward for its backward (blocks.rs):
/// fp32 norm inputs and outputs, the 16-bit projections, attention's output and
/// log-sum-exp, the MLP's hidden activations. A recompute holds one block's; kept
/// activations hold every keeping block's.
pub fn saved_per_token(plan: &Plan) -> u64 {
    let c = &plan.model.config;
    let e = plan.precision.bytes() as u64;
    let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
    let kv = (c.num_key_value_heads * c.head_dim()) as u64;
    let heads = c.num_attention_heads as u64;
    match c.architecture {
        crate::config::model::Architecture::Llama => 8 * h + e * (10 * h + 4 * kv + 4 * i) + 4 * heads,
        crate::config::model::Architecture::Gpt2 => 8 * h + e * (7 * h + 2 * i) + 4 * heads,
    }
}

/// Bytes of the autograd graph a keeping unit holds from its forward to its backward
/// (`rules::keeps_activations`). For a Llama block, per token: the fp32 inputs of both
/// norms, the 16-bit normed inputs, q and k before and after RoPE with RoPE's rotated
/// halves, v, attention's output and its contiguous copy, the MLP's four hidden
/// tensors, attention's log-sum-exp (the block's input is the activation checkpoint,
/// counted apart): 2840 bytes per token measured for llama-tiny in bf16 against 3088
/// here. GPT-2's is the recompute's estimate.
pub fn kept_graph_bytes(plan: &Plan) -> u64 {
    let c = &plan.model.config;
    let e = plan.precision.bytes() as u64;
    let (h, i, q) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.q_width() as u64,
    );
    let kv = (c.num_key_value_heads * c.head_dim()) as u64;
    let per_token = match c.architecture {
        crate::config::model::Architecture::Llama => {
            8 * h + e * (2 * h + 5 * q + 4 * kv + 4 * i) + 4 * c.num_attention_heads as u64
        }
        crate::config::model::Architecture::Gpt2 => saved_per_token(plan),
    };
    (plan.batch.micro_batch_per_gpu * plan.data.seq_len) as u64 * per_token
}

/// Compute temporaries at their peak: the largest of a block's recompute-and-backward,
/// the embedding's backward and the final unit's loss-and-backward, plus below stage 3
/// the copy of the unit in use when replicas live off the device (a replica on the
/// device is used in place; at stage 3 the gathered unit is counted in `working`).
pub fn transient(plan: &Plan) -> u64 {
    let c = &plan.model.config;
    let e = plan.precision.bytes() as u64;
    let tokens = (plan.batch.micro_batch_per_gpu * plan.data.seq_len) as u64;
    let (h, i, v) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    let numels = c.unit_numels();
    let block_numel = numels.get(1).copied().unwrap_or(0) as u64;
    // a recompute saves one block's graph here; kept graphs are counted as working
    let recomputes = (1..numels.len().saturating_sub(1)).any(|u| !keeps_activations(plan, u));
    let saved = if recomputes { saved_per_token(plan) } else { 0 };
    // the backward's own: gradients of the widest activations in flight, the flat
    // parameter gradient and one parameter's full-size gradient being added into it
    let flowing = e * i.max(3 * h) + 4 * h;
    let block = tokens * (saved + flowing) + 2 * e * block_numel;
    // the embedding's backward: its dense weight gradient and the flat gradient it is
    // copied into (for a large vocabulary, the largest of the three)
    let embedding = 2 * e * numels[0] as u64 + tokens * e * h;
    // the head (head.rs, per vocabulary slice): fp32 hidden states and their gradient,
    // the final norm's graph, the fp32 weight slice, the weight's gradient in its kind,
    // the final unit's flat gradient,
    // and in `dlogits` three [chunk, slice] fp32 tensors at once; the slice's fp32
    // gradient exists from the first chunk's accumulation on, so with one chunk it
    // meets only two of them
    let rows = super::rules::head_slice_rows(v as i64, h as i64) as u64;
    let chunk_tokens = super::rules::HEAD_CHUNK as u64;
    let logits = 4 * tokens.min(chunk_tokens) * rows;
    let slice_grad = 4 * rows * h;
    let weight_fp32 = if e == 4 { 0 } else { 4 * rows * h };
    let logits_peak = if tokens > chunk_tokens {
        3 * logits + slice_grad
    } else {
        (3 * logits).max(2 * logits + slice_grad)
    };
    let last_numel = *numels.last().unwrap_or(&0) as u64;
    // a 16-bit head (head.rs, `Matmul::Low`) converts no slice to fp32 and keeps no fp32
    // dW: it keeps every token's dlogits of a slice in its kind beside the chunk's three
    // fp32 tensors, and at the slice's end their concatenation and the product
    let (weight_fp32, logits_peak) = if plan.train.low_precision_head {
        let kept = e * tokens * rows;
        (0, (3 * logits + kept).max(2 * kept + e * rows * h))
    } else {
        (weight_fp32, logits_peak)
    };
    let head = tokens * (8 * h + 4 * h + 2 * e * h) + weight_fp32 + e * v * h + logits_peak + e * last_numel;
    // a replica off the device is copied there for each use (on the device it is used
    // in place)
    let in_use = if plan.zero.stage < 3 && plan.zero.offload_param.tier != Tier::Device {
        e * numels.iter().copied().max().unwrap_or(0) as u64
    } else {
        0
    };
    block.max(embedding).max(head) + in_use
}

/// A layered step's own temporaries (`engine/layered.rs`): the fp32 sums over the
/// micro-batches of the unit in backward and of the units whose reductions are in
/// flight (`rules::reduce_depth`, one more: the reduction holds its gradient until it
/// is done), of a tied embedding (from the head to the embedding's backward), and every
/// micro-batch's gradient flowing back (`checkpoint` bytes each).
fn layered_sums(plan: &Plan, checkpoint: u64) -> u64 {
    if !plan.train.layered_accumulation {
        return 0;
    }
    let mut numels = plan.model.config.unit_numels();
    let tied = if plan.model.config.tie_word_embeddings {
        numels[0] as u64
    } else {
        0
    };
    numels.sort_unstable_by(|a, b| b.cmp(a));
    let at_once = super::rules::reduce_depth(plan) + 1;
    let summed: u64 = numels.iter().take(at_once).map(|&n| n as u64).sum();
    4 * (summed + tied) + layers(plan) * checkpoint
}

/// Elements of the gradient reduction's bucket (`reduce.rs`): stages 2–3 with several
/// ranks reduce-scatter every rank's stretches of a chunk of the largest shard.
pub fn reduce_bucket_elements(plan: &Plan, parts: &[Partition]) -> u64 {
    let world = plan.world_size;
    if plan.zero.stage < 2 || world < 2 {
        return 0;
    }
    parts
        .iter()
        .map(|p| (chunk_elements(plan) / world).max(1).min(p.shard) * world)
        .max()
        .unwrap_or(0) as u64
}

/// The gradient reduction's device buffers, kept from the first step on: the bucket and
/// this rank's reduced stretch, in the communication type.
fn reduce_buckets(plan: &Plan, parts: &[Partition]) -> u64 {
    let bucket = reduce_bucket_elements(plan, parts);
    let wire = plan.communication.kind().elt_size_in_bytes() as u64;
    wire * (bucket + bucket / plan.world_size as u64)
}

/// Bytes a rank's device holds at its peak.
pub fn predict(plan: &Plan) -> DeviceBytes {
    let world = plan.world_size;
    let stage = plan.zero.stage;
    let elem = plan.precision.bytes() as u64;
    let numels = plan.model.config.unit_numels();
    let parts: Vec<Partition> = numels.iter().map(|&n| Partition::new(n, world)).collect();
    let opt_len = |p: &Partition| p.optimizer_len(stage) as u64;
    let acc_len = |p: &Partition| p.accumulator_len(stage) as u64;
    let mut bytes = DeviceBytes::default();
    let optimizer_tiers = super::rules::optimizer_tiers(plan);
    let param_tiers = super::rules::param_tiers(plan);
    let sums = device_sums(plan);
    for (((p, &optimizer_tier), &param_tier), &summed) in
        parts.iter().zip(&optimizer_tiers).zip(&param_tiers).zip(&sums)
    {
        if param_tier == Tier::Device {
            bytes.parameters += elem * if stage == 3 { p.shard } else { p.padded } as u64;
            if gathers_updates(stage, world) {
                // the new partition, all-gathered from there into the replica
                bytes.parameters += elem * p.shard as u64;
            }
        }
        if optimizer_tier == Tier::Device {
            bytes.gradients += 4 * acc_len(p);
            bytes.optimizer += 12 * opt_len(p);
        }
        if summed {
            bytes.accumulators += 4 * acc_len(p);
            if optimizer_tier != Tier::Device {
                bytes.gradients += 4 * opt_len(p);
            }
        }
    }
    let (rows, seq) = (plan.batch.micro_batch_per_gpu as u64, plan.data.seq_len as u64);
    // token ids, and packed rows' attention mask (bools) and positions
    let packed = if super::rules::packs_rows(plan) {
        rows * seq * seq + 8 * rows * seq
    } else {
        0
    };
    // a layered step holds every micro-batch's token ids and checkpoints at once
    let layers = layers(plan);
    let tokens = layers * (8 * rows * seq + packed);
    let checkpoint =
        elem * (plan.batch.micro_batch_per_gpu * plan.data.seq_len * plan.model.config.hidden_size) as u64;
    let hidden = layers * checkpoint;
    let last = parts.len() - 1;
    bytes.working = if stage == 3 {
        stage3_working(plan, &parts, elem, tokens, hidden)
    } else {
        // no gathers: the activations of the whole forward at their peak
        tokens + last as u64 * hidden
    };
    // the graphs of units that keep their activations, alive from forward to backward
    let keeping = (0..parts.len()).filter(|&u| keeps_activations(plan, u)).count() as u64;
    bytes.working += keeping * kept_graph_bytes(plan);
    // the reduction's buckets are counted with the temporaries: the engine's own
    // reservation counter does not track them
    bytes.transient = transient(plan) + reduce_buckets(plan, &parts) + layered_sums(plan, checkpoint);
    bytes.total = bytes.parameters + bytes.gradients + bytes.optimizer + bytes.working + bytes.transient;
    bytes
}

/// Stage 3: replays the fetch schedule with the prefetcher's request rule
/// (`Prefetcher::next`: fill, receive, fill again), tracking gathered units requested
/// ahead, in use, held for their next use (`stage3_max_reuse_distance`) and kept, next
/// to the activations alive at each point. Two cases: the
/// first step (nothing gathered yet; the cache of small units survives into the second
/// micro-batch), and a later step, which starts with last step's kept units still
/// gathered; the optimizer runs behind the forward, and each kept unit's old copy is
/// dropped when its update is installed, just before its new gather is requested.
fn stage3_working(plan: &Plan, parts: &[Partition], elem: u64, tokens: u64, hidden: u64) -> u64 {
    let threshold = plan.zero.param_persistence_threshold;
    // units used where they are stored are never gathered
    let in_place = super::rules::in_place_units(plan);
    let small = |u: usize| parts[u].numel <= threshold && !in_place[u];
    let first = replay(
        plan,
        parts,
        elem,
        tokens,
        hidden,
        vec![false; parts.len()],
        passes(plan).min(2),
    );
    let later = replay(
        plan,
        parts,
        elem,
        tokens,
        hidden,
        (0..parts.len()).map(small).collect(),
        1,
    );
    first.max(later)
}

fn replay(
    plan: &Plan,
    parts: &[Partition],
    elem: u64,
    tokens: u64,
    hidden: u64,
    mut kept: Vec<bool>,
    micro_batches: usize,
) -> u64 {
    let threshold = plan.zero.param_persistence_threshold;
    let limits = Limits {
        bucket: plan.zero.prefetch_bucket_size,
        max_live: plan.zero.max_live_parameters,
        persistence_threshold: threshold,
    };
    let gathered = |u: usize| elem * parts[u].padded as u64;
    let numels: Vec<usize> = parts.iter().map(|p| p.numel).collect();
    let last = parts.len() - 1;
    // units kept from a previous step are fetched again once (their update invalidates them)
    let mut stale = kept.clone();
    let mut kept_bytes: u64 = (0..parts.len()).filter(|&u| kept[u]).map(gathered).sum();
    let mut peak = 0u64;
    for _ in 0..micro_batches {
        let mut uses = super::rules::unit_schedule(plan);
        uses.retain(|&(u, _)| stale[u] || !kept[u]);
        let fetches = Fetches::new(
            uses,
            &numels,
            |u| parts[u].numel <= threshold,
            plan.zero.max_reuse_distance,
        );
        let order = fetches.order();
        let mut requested = 0usize;
        let mut received = 0usize;
        let mut outstanding = 0u64;
        let mut in_use = 0u64;
        let mut in_use_numel = 0usize;
        // units held for their next use (`stage3_max_reuse_distance`)
        let mut held = 0u64;
        let mut held_numel = 0usize;
        let fill = |received: usize,
                    live_numel: usize,
                    requested: &mut usize,
                    outstanding: &mut u64,
                    kept_bytes: &mut u64,
                    stale: &mut Vec<bool>| {
            while let Some(&(next, _)) = order.get(*requested) {
                let ahead: usize = order[received..*requested]
                    .iter()
                    .map(|&(v, _)| parts[v].numel)
                    .sum();
                if !may_request(
                    true,
                    *requested - received,
                    ahead,
                    parts[next].numel,
                    live_numel,
                    limits,
                ) {
                    break;
                }
                if stale[next] {
                    // installing the update drops the old gathered copy
                    stale[next] = false;
                    *kept_bytes -= gathered(next);
                }
                *outstanding += gathered(next);
                *requested += 1;
            }
        };
        for (k, &(u, phase)) in fetches.uses.iter().enumerate() {
            // the final unit stays in use until the tied embedding joins it (one used in
            // place is not among the uses)
            let after_final = k > 0 && fetches.uses[k - 1].1 == Purpose::Final;
            if phase != Purpose::Tied || !after_final {
                in_use = 0;
                in_use_numel = 0;
            }
            fill(
                received,
                in_use_numel + held_numel,
                &mut requested,
                &mut outstanding,
                &mut kept_bytes,
                &mut stale,
            );
            if fetches.fetched[k] {
                outstanding -= gathered(u);
                received += 1;
            } else {
                held -= gathered(u);
                held_numel -= parts[u].numel;
            }
            if parts[u].numel <= threshold {
                kept[u] = true;
                kept_bytes += gathered(u);
            } else if fetches.keep[k] {
                held += gathered(u);
                held_numel += parts[u].numel;
            } else {
                in_use += gathered(u);
                in_use_numel += parts[u].numel;
            }
            fill(
                received,
                in_use_numel + held_numel,
                &mut requested,
                &mut outstanding,
                &mut kept_bytes,
                &mut stale,
            );
            let activations = match phase {
                Purpose::Forward => tokens + (u as u64 + 1) * hidden,
                _ => tokens + last as u64 * hidden,
            };
            peak = peak.max(activations + kept_bytes + held + in_use + outstanding);
        }
    }
    peak
}
