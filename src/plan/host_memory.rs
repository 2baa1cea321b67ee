//! Host bytes per process: what `tierzero plan` predicts beside the device row, and what
//! a run's peak resident set (`metrics/host.rs`, measured by the kernel) is checked
//! against in the tests.
//!
//! Counted per rank of the process: parameters kept in host memory (the current
//! partition, which the update overwrites at stages 0 and 3; at stages 1–2 beside the
//! partition the next update is written into), the two buffers host updates of
//! parameters on the device go through, gradient accumulators
//! (host memory, or with the optimizer on NVMe at stages 2–3 one swap chunk per reduction
//! in flight), optimizer state not on NVMe, the NVMe pipelines' buffers, the reduction's chunk buffers, and — on CPU ranks, whose device memory is
//! host memory — the device prediction plus the largest unit's flat gradient tensor
//! (a compute temporary the device row leaves out, as DeepSpeed's estimator does). Per
//! process: [`RUNTIME_BYTES`] of code and libraries, and on a GPU
//! [`CUDA_RUNTIME_BYTES`] of its context and kernels.

use super::fetch::MAX_IN_FLIGHT;
use super::memory::predict;
use super::partition::Partition;
use super::rules::{
    bf16_gradients, chunk_elements, device_sums, gathers_updates, held_at_once, held_copy_elements,
    nvme_gradients, optimizer_swap_chunk, optimizer_tiers, param_tiers, pipeline_sets, stored_bf16,
    stored_gradients, update_copy_elements, REDUCE_DEPTH,
};
use super::{Accelerator, Plan, Tier, Wire};
use serde::Serialize;

/// Resident bytes of a training process before its state: the binary, libtorch and its
/// kernels' libraries, thread stacks and allocator slack (measured on the CI machine's
/// kind: a `llama-tiny` run peaks within 100 MB of it).
pub const RUNTIME_BYTES: u64 = 450 << 20;

/// What a process that computes on a GPU holds beside [`RUNTIME_BYTES`]: the CUDA
/// context and the GPU kernels' libraries as loaded. Measured on the fifth lent H200 at
/// `fe7d962`, one GPU a process: `llama-1b` with nothing in host memory peaked at
/// 2.12–2.15 GB resident against 0.49 GB predicted without it, with parameters and
/// optimizer on NVMe at 2.92 GB against 1.25. Counted once a process: a process driving
/// several GPUs holds a context for each, which no machine lent so far could measure.
pub const CUDA_RUNTIME_BYTES: u64 = 1550 << 20;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostBytes {
    pub runtime: u64,
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// NVMe pipeline buffers, parameter staging and reduction chunks.
    pub buffers: u64,
    /// On CPU ranks: the device prediction (gathered units, activations) and a unit's
    /// flat gradient.
    pub working: u64,
    pub total: u64,
}

/// Host bytes this process holds at its peak (all its ranks).
pub fn predict_host(plan: &Plan) -> HostBytes {
    let world = plan.world_size;
    let stage = plan.zero.stage;
    let elem = plan.precision.bytes() as u64;
    let cpu = plan.train.accelerator == Accelerator::Cpu;
    let in_host = |tier: Tier| tier == Tier::Cpu || (tier == Tier::Device && cpu);
    let parts: Vec<Partition> = plan
        .model
        .config
        .unit_numels()
        .iter()
        .map(|&n| Partition::new(n, world))
        .collect();
    let opt_len = |p: &Partition| p.optimizer_len(stage) as u64;
    let acc_len = |p: &Partition| p.accumulator_len(stage) as u64;
    let kept = |p: &Partition| if stage == 3 { p.shard } else { p.padded } as u64;
    let max_opt = parts.iter().map(opt_len).max().unwrap_or(0);
    let max_numel = parts.iter().map(|p| p.numel).max().unwrap_or(0) as u64;
    let bf16_grads = bf16_gradients(plan);
    let grad_elem = |u: usize| if bf16_grads[u] { 2 } else { 4 };
    let nvme_grads = nvme_gradients(plan);
    let mut rank = HostBytes::default();
    let param_tiers = param_tiers(plan);
    let optimizer_tiers = optimizer_tiers(plan);
    let stored = stored_gradients(plan);
    let sums = device_sums(plan);
    let held_sums = super::rules::held_gradients(plan);
    for (u, (p, &param_tier)) in parts.iter().zip(&param_tiers).enumerate() {
        let optimizer_tier = optimizer_tiers[u];
        if in_host(param_tier) {
            rank.parameters += elem
                * match (param_tier, stage) {
                    // tensors updated in place; stages 1-2 gather from a partition
                    (Tier::Device, _) if gathers_updates(stage, world) => p.padded as u64 + opt_len(p),
                    (Tier::Device, _) => kept(p),
                    // stages 1-2 the replica and the partition an update is written
                    // into; stages 0/3 the partition, which the update overwrites
                    (_, 1 | 2) => p.padded as u64 + opt_len(p),
                    _ => kept(p),
                };
        }
        // a gradient held on the device has no host accumulator (nor a stage-1 copy)
        if !stored[u] && !held_sums[u] {
            rank.gradients += grad_elem(u) * acc_len(p);
        }
        if cpu && sums[u] {
            // the device accumulators of gradient accumulation, in host memory on a CPU
            rank.gradients += 4 * acc_len(p);
        }
        if stage == 1 && !held_sums[u] {
            // the partition copy lent to the optimizer
            rank.gradients += 4 * opt_len(p);
        }
        if in_host(optimizer_tier) {
            rank.optimizer += 12 * opt_len(p);
        }
    }
    // the two buffers the host's optimizer writes new values of parameters on the device
    // into, each copied there before it is written again
    let partitions: Vec<usize> = parts.iter().map(|p| p.optimizer_len(stage)).collect();
    rank.parameters += 2 * elem * update_copy_elements(plan, &partitions) as u64;
    let aligned = |bytes: u64| bytes.div_ceil(4096) * 4096;
    let swap_chunk = optimizer_swap_chunk(plan) as u64;
    if optimizer_tiers.contains(&Tier::Nvme) {
        let sets = pipeline_sets(plan) as u64;
        let per_set = 3 + u64::from(nvme_grads);
        rank.buffers += per_set * sets * aligned(4 * swap_chunk);
    }
    if !cpu {
        // the two pinned buffers held sums are copied into for host or NVMe updates
        rank.gradients += 2 * 4 * held_copy_elements(plan, &partitions) as u64;
    }
    if nvme_grads {
        // one chunk per gradient reduction in flight
        let stored_elem = if stored_bf16(plan) { 2 } else { 4 };
        rank.gradients += REDUCE_DEPTH as u64 * aligned(stored_elem * swap_chunk);
    }
    if param_tiers.contains(&Tier::Nvme) {
        // the optimizer lane's staging partition, and two bounce buffers each for its
        // writes and the h2d lane's reads (two chunks in flight)
        rank.buffers += elem * max_opt + 4 * aligned(elem * swap_chunk);
    }
    // the gradient reduction's host buffers (`reduce.rs`; its device buckets are in the
    // device row's temporaries)
    let bucket = super::memory::reduce_bucket_elements(plan, &parts);
    if bucket > 0 {
        let reduced = bucket / world as u64;
        let wire16 = plan.communication != Wire::Fp32;
        if wire16 || !cpu {
            // the reduced stretch as fp32 for the accumulator
            rank.buffers += 4 * reduced;
        }
        if wire16 && cpu {
            // 16-bit values reduced in fp32 in host memory (`comm/tensors.rs`)
            rank.buffers += 4 * bucket + 6 * reduced;
        }
    } else if elem != 4 || !cpu {
        // a stretch of the gradient as fp32 for the accumulator
        rank.buffers += 4 * (chunk_elements(plan) as u64).min(max_numel);
    }
    if cpu {
        let hidden = plan.model.config.hidden_size as u64;
        let tokens = (plan.batch.micro_batch_per_gpu * plan.data.seq_len) as u64;
        let device = predict(plan);
        let gathered = if stage == 3 {
            let padded: Vec<u64> = parts.iter().map(|p| p.padded as u64).collect();
            let shards: Vec<u64> = parts.iter().map(|p| p.shard as u64).collect();
            // shards on the device are gathered from where they are
            let staging = if world > 1 && plan.zero.offload_param.tier != Tier::Device {
                pool_footprint(&shards, MAX_IN_FLIGHT)
            } else {
                0
            };
            // units held for a later use (`stage3_max_reuse_distance`) keep their buffers
            let held = held_at_once(plan);
            elem * (pool_footprint(&padded, MAX_IN_FLIGHT + 1 + held) + staging)
        } else {
            0
        };
        // the pools keep what each size of unit needed at once (the device row counts
        // what is gathered at the peak moment); the activations kept for backward
        let activations =
            super::rules::layers(plan) * (8 * tokens + (parts.len() as u64 - 1) * elem * tokens * hidden);
        // the compute temporaries (a block's recompute and backward, or the LM head's)
        rank.working = device.working.max(gathered + activations) + device.transient;
    }
    let ranks = plan.train.devices as u64;
    let mut total = HostBytes {
        runtime: RUNTIME_BYTES + if cpu { 0 } else { CUDA_RUNTIME_BYTES },
        parameters: ranks * rank.parameters,
        gradients: ranks * rank.gradients,
        optimizer: ranks * rank.optimizer,
        buffers: ranks * rank.buffers,
        working: ranks * rank.working,
        total: 0,
    };
    total.total =
        total.runtime + total.parameters + total.gradients + total.optimizer + total.buffers + total.working;
    total
}

/// When the process's predicted host bytes exceed `train.host_memory`: what `plan` says,
/// with the smallest change that makes the prediction fit, trying in turn (each on top
/// of the ones before) what the config allows of: the optimizer state on NVMe, every
/// parameter unit on NVMe (stage 3, the optimizer off the device), and on CPU ranks —
/// whose activations are host memory — a smaller micro-batch; or, when even all of them
/// do not fit, what the model needs at least.
pub fn host_fit_warning(plan: &Plan) -> Option<String> {
    let memory = plan.train.host_memory?;
    let predicted = predict_host(plan).total;
    if predicted <= memory {
        return None;
    }
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30));
    let fits = |p: &Plan| predict_host(p).total <= memory;
    let mut p = plan.clone();
    let mut sets: Vec<String> = Vec::new();
    let fix = 'fix: {
        if p.zero.offload_optimizer.tier == Tier::Cpu {
            p.zero.offload_optimizer.tier = Tier::Nvme;
            sets.push("zero_optimization.offload_optimizer.device=nvme".into());
            if fits(&p) {
                break 'fix true;
            }
        }
        let optimizer_off_device = p.zero.offload_optimizer.tier != Tier::Device;
        let params_in_host = param_tiers(&p).contains(&Tier::Cpu);
        if p.zero.stage == 3 && optimizer_off_device && params_in_host {
            if p.zero.offload_param.tier == Tier::Cpu {
                p.zero.offload_param.tier = Tier::Nvme;
                sets.push("zero_optimization.offload_param.device=nvme".into());
            }
            p.zero.offload_param.max_in_cpu = 0;
            sets.push("zero_optimization.offload_param.max_in_cpu=0".into());
            if fits(&p) {
                break 'fix true;
            }
        }
        while p.train.accelerator == Accelerator::Cpu && p.batch.micro_batch_per_gpu > 1 {
            p.batch.micro_batch_per_gpu /= 2;
            if fits(&p) {
                sets.push(format!(
                    "train_micro_batch_size_per_gpu={}",
                    p.batch.micro_batch_per_gpu
                ));
                break 'fix true;
            }
        }
        false
    };
    let sets: Vec<String> = sets.iter().map(|s| format!("--set {s}")).collect();
    let fix = if fix {
        format!(
            "{} plans {} (with nvme_path set)",
            sets.join(" "),
            gib(predict_host(&p).total)
        )
    } else if sets.is_empty() {
        format!(
            "no offload the config allows makes it fit: it needs {}",
            gib(predicted)
        )
    } else {
        format!(
            "even with {} it needs {}",
            sets.join(" "),
            gib(predict_host(&p).total)
        )
    };
    Some(format!(
        "host memory per process is predicted at {}, over train.host_memory {}: the run would be killed or swap; {fix}",
        gib(predicted),
        gib(memory)
    ))
}

/// Elements a best-fit pool (`device/pool.rs`: a buffer serves requests down to half its
/// size) keeps for buffers of these sizes when up to `at_once` of them are out together:
/// per size class (sizes within 2× of the class's largest), `at_once` of its largest, or
/// as many as the class has units.
fn pool_footprint(sizes: &[u64], at_once: usize) -> u64 {
    let mut sorted = sizes.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let mut total = 0;
    let mut i = 0;
    while i < sorted.len() {
        let largest = sorted[i];
        let members = sorted[i..].iter().take_while(|&&s| 2 * s >= largest).count();
        total += members.min(at_once) as u64 * largest;
        i += members;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_keeps_at_once_buffers_per_size_class() {
        // two embedding-sized units, four blocks, a tiny norm
        let sizes = [100, 4, 30, 30, 30, 30, 90];
        assert_eq!(pool_footprint(&sizes, 3), 2 * 100 + 3 * 30 + 4);
        assert_eq!(pool_footprint(&sizes, 1), 100 + 30 + 4);
        assert_eq!(pool_footprint(&[], 3), 0);
    }
}
