//! What one rank's engine starts from, apart from its owners: each unit's starting
//! state (seeded init, Hugging Face weights or a checkpoint), what of it is reserved on
//! the device for the whole run, how the host arenas are held (locked, registered with a
//! GPU) and the rank's device streams. `RankEngine::new` (`rank.rs`) puts them together.

use super::error::{EngineError, On};
use super::optimizer::NvmeTier;
use super::params::LowParams;
use super::start::Start;
use super::units::Home;
use crate::device::cpu::{CpuDevice, Reservation};
use crate::device::cuda::{Cuda, CudaStreams};
use crate::device::lanes::Streams;
use crate::plan::partition::Partition;
use crate::plan::rules::{nvme_gradients, nvme_optimizer, param_tiers, pipeline_sets, read_ahead_sets};
use crate::plan::schedule::LossScaler;
use crate::plan::{Plan, Precision, Tier};
use std::sync::Arc;
use tierzero_offload::arena::Pinning;
use tierzero_offload::nvme::swap::SwapStore;
use tierzero_offload::pipeline;

/// Where the rank's optimizer state and parameters live: the NVMe tier of optimizer state
/// (the swap store and the pipeline's buffers) when any unit's is there
/// (`rules::optimizer_tiers`), and each unit's parameter home (`rules::param_tiers`);
/// `stores` are the optimizer's and the parameters' swap stores.
pub(super) fn homes<'a>(
    plan: &Plan,
    rank: usize,
    stores: (Option<&'a SwapStore>, Option<&'a SwapStore>),
) -> Result<(Option<NvmeTier<'a>>, Vec<Home<'a>>), EngineError> {
    let missing = |what| EngineError::Invariant { rank, what };
    let optimizer = match (nvme_optimizer(plan), stores.0) {
        (true, Some(store)) => Some(NvmeTier {
            store,
            pool: pipeline::buffer_pool_for(store, pipeline_sets(plan), nvme_gradients(plan))
                .map_err(On(rank).io())?,
            read_ahead: read_ahead_sets(plan),
        }),
        (true, None) => return Err(missing("optimizer on nvme without a swap store")),
        (false, _) => None,
    };
    let params = param_tiers(plan)
        .into_iter()
        .map(|tier| match (tier, stores.1) {
            (Tier::Nvme, Some(store)) => Ok(Home::Nvme(store)),
            (Tier::Nvme, None) => Err(missing("parameters on nvme without a swap store")),
            (Tier::Cpu, _) => Ok(Home::Host),
            (Tier::Device, _) => Ok(Home::Device),
        })
        .collect::<Result<_, _>>()?;
    Ok((optimizer, params))
}

/// The fp16 loss scaler (a fixed scale of 1 in other precisions), as a checkpoint left it.
pub(super) fn loss_scaler(plan: &Plan, start: &Start) -> LossScaler {
    let mut scaler = LossScaler::new(match &plan.precision {
        Precision::Fp16(s) => Some(s),
        _ => None,
    });
    if let Some(checkpoint) = start.checkpoint() {
        scaler.restore(&checkpoint.manifest.loss_scaler);
    }
    scaler
}

/// Where one unit of a rank starts: its stored low-precision parameters (its shard at
/// stage 3, else the whole unit), and the fp32 master weights and Adam moments of its
/// optimizer partition.
pub(super) struct UnitStart {
    pub(super) params: LowParams,
    pub(super) master: Vec<f32>,
    pub(super) exp_avg: Vec<f32>,
    pub(super) exp_avg_sq: Vec<f32>,
}

/// Reads unit `u`'s starting state from `start` (seeded init, Hugging Face weights or a
/// checkpoint) for rank `rank`, whose optimizer partition is `partition`.
pub(super) fn unit_start(
    start: &Start,
    plan: &Plan,
    (u, layout): (usize, &crate::model::layout::UnitLayout),
    part: Partition,
    partition: std::ops::Range<usize>,
    rank: usize,
) -> Result<UnitStart, EngineError> {
    let start_err = |source| EngineError::Start {
        rank,
        unit: u,
        source,
    };
    // the elements this rank keeps: its shard at stage 3, else the whole unit
    let kept_range = if plan.zero.stage == 3 {
        part.range(rank)
    } else {
        0..part.padded
    };
    let real = kept_range.start.min(part.numel)..kept_range.end.min(part.numel);
    let mut kept = vec![0f32; kept_range.len()];
    start
        .master(u, layout, real.clone(), &mut kept[..real.len()])
        .map_err(start_err)?;
    let params = match start
        .params(u, real.clone(), &plan.precision)
        .map_err(start_err)?
    {
        Some(bytes) => {
            let mut params = LowParams::zeros(kept.len(), &plan.precision);
            params.bytes_mut()[..bytes.len()].copy_from_slice(&bytes);
            params
        }
        None => LowParams::rounded(&kept, &plan.precision),
    };
    let master = kept[partition.start - kept_range.start..][..partition.len()].to_vec();
    let (mut exp_avg, mut exp_avg_sq) = (vec![0f32; partition.len()], vec![0f32; partition.len()]);
    let opt_real = partition.start.min(part.numel)..partition.end.min(part.numel);
    start
        .moments(
            u,
            opt_real.clone(),
            &mut exp_avg[..opt_real.len()],
            &mut exp_avg_sq[..opt_real.len()],
        )
        .map_err(start_err)?;
    Ok(UnitStart {
        params,
        master,
        exp_avg,
        exp_avg_sq,
    })
}

/// What of unit `u` sits on the device for the whole run, reserved: its stored
/// parameters (`params_len` elements, plus the partition stages 1–2 gather each update
/// from) on the device tier, and its gradients and optimizer state (a partition of
/// `partition_len` elements, gradients of `grad_bytes`) when its optimizer state is on
/// the device (`rules::optimizer_tiers`).
pub(super) fn device_reservations(
    plan: &Plan,
    device: &Arc<CpuDevice>,
    u: usize,
    (params_len, part): (usize, Partition),
    (partition_len, grad_bytes): (usize, usize),
) -> Result<Vec<Reservation>, EngineError> {
    let mut held = Vec::new();
    if param_tiers(plan)[u] == Tier::Device {
        // stages 1-2 gather each update from a partition of its own (`units.rs`)
        let gathered_from = if crate::plan::rules::gathers_updates(plan.zero.stage, part.world) {
            part.shard
        } else {
            0
        };
        let bytes = ((params_len + gathered_from) * plan.precision.bytes()) as u64;
        held.push(device.reserve(bytes, &format!("parameters of unit {u}"))?);
    }
    if crate::plan::rules::optimizer_tiers(plan)[u] == Tier::Device {
        held.push(device.reserve(grad_bytes as u64, &format!("gradients of unit {u}"))?);
        let state_bytes = 12 * partition_len as u64;
        held.push(device.reserve(state_bytes, &format!("optimizer state of unit {u}"))?);
    } else if crate::plan::rules::device_accumulation(plan) {
        // gradient accumulation's fp32 sums of this rank's partition (`gradients.rs`)
        held.push(device.reserve(4 * partition_len as u64, &format!("gradient sums of unit {u}"))?);
    }
    Ok(held)
}

/// How the rank's host arenas are held: locked in RAM with
/// `offload_optimizer.pin_memory` (DeepSpeed's key for the optimizer state and gradients
/// it offloads), and on a CUDA rank also registered with its context (`cuMemHostRegister`)
/// so copies from them are asynchronous.
pub(super) fn host_pinning(plan: &Plan, compute: tch::Device, rank: usize) -> Result<Pinning, EngineError> {
    // as in DeepSpeed, pin_memory concerns state offloaded from the device
    if !plan.zero.offload_optimizer.pin_memory || plan.zero.offload_optimizer.tier == Tier::Device {
        return Ok(Pinning::default());
    }
    pinning(compute, rank)
}

/// How the rank's parameters in host memory are held: each unit's in an arena of its
/// own, locked and on a CUDA rank registered, with `offload_param.pin_memory`
/// (`rules::pinned_params`); else in plain `Vec`s (None).
pub(super) fn param_pinning(
    plan: &Plan,
    compute: tch::Device,
    rank: usize,
) -> Result<Option<Pinning>, EngineError> {
    let pinned = crate::plan::rules::pinned_params(plan).contains(&true);
    pinned.then(|| pinning(compute, rank)).transpose()
}

/// How staging buffers of a CUDA rank are held whatever `pin_memory` says (as the
/// reduction's staging is pinned): registered with its context, which pins their pages,
/// so that DMA copies into them run beside the host's work (not locked as well: that is
/// `pin_memory`'s, and fails under a small `ulimit -l`). A CPU rank's are plain memory.
pub(super) fn staging_pinning(compute: tch::Device, rank: usize) -> Result<Pinning, EngineError> {
    let mut pinning = pinning(compute, rank)?;
    pinning.lock = false;
    Ok(pinning)
}

/// Locked, and registered with a CUDA rank's context.
fn pinning(compute: tch::Device, rank: usize) -> Result<Pinning, EngineError> {
    let register = match compute {
        tch::Device::Cuda(ordinal) => {
            let cuda = Cuda::shared(ordinal).map_err(|source| EngineError::Cuda { rank, source })?;
            Some(Arc::new(cuda.pinner()) as Arc<dyn tierzero_offload::pool::HostRegister>)
        }
        _ => None,
    };
    Ok(Pinning { lock: true, register })
}

/// A CUDA rank's streams for its lanes (torch pool streams of its GPU); none on CPU.
pub(super) fn device_streams(
    compute: tch::Device,
    rank: usize,
) -> Result<Option<Arc<dyn Streams>>, EngineError> {
    match compute {
        tch::Device::Cuda(ordinal) => {
            let cuda = Cuda::shared(ordinal).map_err(|source| EngineError::Cuda { rank, source })?;
            Ok(Some(Arc::new(CudaStreams(cuda))))
        }
        _ => Ok(None),
    }
}
