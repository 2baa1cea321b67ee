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
    // stage-3 gathers: persistent units stay; others one at a time
    let persistent = |n: usize| stage == 3 && n <= plan.zero.param_persistence_threshold;
    let gathered: Vec<u64> = parts
        .iter()
        .map(|p| if stage == 3 { elem * p.padded as u64 } else { 0 })
        .collect();
    let held: u64 = parts
        .iter()
        .zip(&gathered)
        .filter(|(p, _)| persistent(p.numel))
        .map(|(_, g)| g)
        .sum();
    let transient = |u: usize| {
        if persistent(parts[u].numel) {
            0
        } else {
            gathered[u]
        }
    };
    let last = parts.len() - 1;
    let tokens = 8 * (plan.batch.micro_batch_per_gpu * plan.data.seq_len) as u64;
    let hidden =
        elem * (plan.batch.micro_batch_per_gpu * plan.data.seq_len * plan.model.config.hidden_size) as u64;
    let tied = if plan.model.config.tie_word_embeddings {
        transient(0)
    } else {
        0
    };
    let forward = (0..last)
        .map(|u| (u as u64 + 1) * hidden + transient(u))
        .max()
        .unwrap_or(0);
    let final_unit = last as u64 * hidden + transient(last) + tied;
    let backward = last as u64 * hidden + (0..last).map(transient).max().unwrap_or(0);
    bytes.working = held + tokens + forward.max(final_unit).max(backward);
    bytes.total = bytes.parameters + bytes.gradients + bytes.optimizer + bytes.working;
    bytes
}
