//! Device bytes per rank: what `tierzero plan` predicts and the run measures.
//!
//! Counted, per rank, exactly what the engine reserves on its device: parameters on the
//! device tier (the shard at stage 3, the replica below), gradients and optimizer state
//! when the optimizer is not offloaded (fp32 gradient partition; 12 bytes per element of
//! master, exp_avg, exp_avg_sq), gathered units at stage 3 (one at a time, the final
//! unit together with the tied embedding), and the activations kept between forward and
//! backward (the token ids and each block's input). Compute temporaries inside a unit are
//! not counted, as DeepSpeed's estimator does not count them.

use super::partition::Partition;
use super::prefetch::{may_request, schedule, Limits, Phase};
use crate::config::plan::{Plan, Tier};
use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeviceBytes {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// Peak of gathered units plus kept activations, at the moment they peak together.
    pub working: u64,
    pub total: u64,
}

/// Bytes a rank's device holds at its peak.
pub fn predict(plan: &Plan) -> DeviceBytes {
    let world = plan.world_size;
    let stage = plan.zero.stage;
    let elem = plan.precision.bytes() as u64;
    let numels = plan.model.config.unit_numels();
    let parts: Vec<Partition> = numels.iter().map(|&n| Partition::new(n, world)).collect();
    let opt_len = |p: &Partition| if stage == 0 { p.padded } else { p.shard } as u64;
    let mut bytes = DeviceBytes::default();
    for p in &parts {
        if plan.zero.offload_param.tier == Tier::Device {
            bytes.parameters += elem * if stage == 3 { p.shard } else { p.padded } as u64;
        }
        if plan.zero.offload_optimizer.tier == Tier::Device {
            bytes.gradients += 4 * if stage >= 2 { opt_len(p) } else { p.padded as u64 };
            bytes.optimizer += 12 * opt_len(p);
        }
    }
    let tokens = 8 * (plan.batch.micro_batch_per_gpu * plan.data.seq_len) as u64;
    let hidden =
        elem * (plan.batch.micro_batch_per_gpu * plan.data.seq_len * plan.model.config.hidden_size) as u64;
    let last = parts.len() - 1;
    bytes.working = if stage == 3 {
        stage3_working(plan, &parts, elem, tokens, hidden)
    } else {
        // no gathers: the activations of the whole forward at their peak
        tokens + last as u64 * hidden
    };
    bytes.total = bytes.parameters + bytes.gradients + bytes.optimizer + bytes.working;
    bytes
}

/// Stage 3: replays the fetch schedule with the prefetcher's request rule
/// (`Prefetcher::next`: fill, receive, fill again), tracking gathered units requested
/// ahead, in use and kept, next to the activations alive at each point. Two cases: the
/// first step (nothing gathered yet; the cache of small units survives into the second
/// micro-batch), and a later step, which starts with last step's kept units still
/// gathered; the optimizer runs behind the forward, and each kept unit's old copy is
/// dropped when its update is installed, just before its new gather is requested.
fn stage3_working(plan: &Plan, parts: &[Partition], elem: u64, tokens: u64, hidden: u64) -> u64 {
    let threshold = plan.zero.param_persistence_threshold;
    let small = |u: usize| parts[u].numel <= threshold;
    let first = replay(
        plan,
        parts,
        elem,
        tokens,
        hidden,
        vec![false; parts.len()],
        plan.batch.gradient_accumulation_steps.min(2),
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
    let last = parts.len() - 1;
    let tied = plan.model.config.tie_word_embeddings;
    // units kept from a previous step are fetched again once (their update invalidates them)
    let mut stale = kept.clone();
    let mut kept_bytes: u64 = (0..parts.len()).filter(|&u| kept[u]).map(gathered).sum();
    let mut peak = 0u64;
    for _ in 0..micro_batches {
        let mut order = schedule(parts.len(), tied, |u| parts[u].numel <= threshold);
        order.retain(|&(u, _)| stale[u] || !kept[u]);
        let mut requested = 0usize;
        let mut outstanding = 0u64;
        let mut in_use = 0u64;
        let mut in_use_numel = 0usize;
        let fill = |received: usize,
                    in_use_numel: usize,
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
                    in_use_numel,
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
        for (received, &(u, phase)) in order.iter().enumerate() {
            fill(
                received,
                in_use_numel,
                &mut requested,
                &mut outstanding,
                &mut kept_bytes,
                &mut stale,
            );
            outstanding -= gathered(u);
            if parts[u].numel <= threshold {
                kept[u] = true;
                kept_bytes += gathered(u);
            } else {
                in_use += gathered(u);
                in_use_numel += parts[u].numel;
            }
            fill(
                received + 1,
                in_use_numel,
                &mut requested,
                &mut outstanding,
                &mut kept_bytes,
                &mut stale,
            );
            let activations = match phase {
                Phase::Forward => tokens + (u as u64 + 1) * hidden,
                _ => tokens + last as u64 * hidden,
            };
            peak = peak.max(activations + kept_bytes + in_use + outstanding);
            // the final unit stays in use until the tied embedding joins it
            if !(phase == Phase::Final && tied) {
                in_use = 0;
                in_use_numel = 0;
            }
        }
    }
    peak
}
