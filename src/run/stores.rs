//! The NVMe swap stores of this process's ranks: one store per state kind and NVMe path,
//! shared by the ranks, with one I/O engine each (DESIGN.md, "Processes and ranks").

use super::error::TrainError;
use crate::model::Model;
use crate::plan::partition::Partition;
use crate::plan::rules::swap_chunk;
use crate::plan::{Plan, Tier};
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey, TensorSpec};
use tierzero_offload::nvme::{open_engine, EngineChoice, EngineConfig};

pub(super) fn swap_specs(plan: &Plan, model: &Model, states: &[State], elem_bytes: usize) -> Vec<TensorSpec> {
    let world = plan.world_size;
    let mut specs = Vec::new();
    for (u, layout) in model.units.iter().enumerate() {
        let part = Partition::new(layout.numel, world);
        for rank in plan.train.local_ranks() {
            let numel = match states[0] {
                State::Param => part.shard,
                _ if plan.zero.stage == 0 => part.padded,
                _ => part.shard,
            };
            for &state in states {
                specs.push(TensorSpec {
                    key: TensorKey {
                        unit: u as u32,
                        rank: rank as u32,
                        state,
                    },
                    numel,
                    elem_bytes,
                });
            }
        }
    }
    specs
}

pub(super) fn open_store(
    plan: &Plan,
    path: &std::path::Path,
    name: &str,
    specs: &[TensorSpec],
) -> Result<SwapStore, TrainError> {
    // nodes of one run may share a file system: each keeps its own directory
    let node_path;
    let path = if plan.train.launch.nnodes > 1 {
        node_path = path.join(format!("node-{}", plan.train.launch.node_rank));
        std::fs::create_dir_all(&node_path).map_err(|source| TrainError::Output {
            path: node_path.clone(),
            source,
        })?;
        node_path.as_path()
    } else {
        path
    };
    let engine_config = engine_config(plan);
    let swap = |source| TrainError::Swap {
        path: path.to_path_buf(),
        source,
    };
    let (engine, _) = open_engine(path, engine_config, None, EngineChoice::Auto).map_err(swap)?;
    // TIERZERO_IO_FAULT (tests of a failing disk) fails one transfer of the process
    let engine = tierzero_offload::nvme::fault::wrap(engine);
    let chunk = swap_chunk(plan, specs.iter().map(|s| s.numel).max().unwrap_or(1));
    SwapStore::create(path, name, engine, specs, chunk).map_err(swap)
}

/// The NVMe engine of the plan's `aio` section, shared by this process's ranks.
/// DeepSpeed gives each rank, a process of its own, an aio handle with `queue_depth`
/// requests in flight; the one engine of ranks that share a process keeps that many for
/// each of them, so that two ranks in one process have the disk's queue that two
/// processes have.
pub fn engine_config(plan: &Plan) -> EngineConfig {
    let ranks = plan.train.local_ranks().len().max(1);
    EngineConfig {
        block_size: plan.aio.block_size,
        queue_depth: plan.aio.queue_depth * ranks,
        parallelism: plan.aio.intra_op_parallelism,
        single_submit: plan.aio.single_submit,
        overlap_events: plan.aio.overlap_events,
    }
}

/// The swap stores the plan's NVMe tiers need (optimizer state, parameters).
pub(super) fn open_stores(
    plan: &Plan,
    model: &Model,
) -> Result<(Option<SwapStore>, Option<SwapStore>), TrainError> {
    // the units whose optimizer state (and at stages 2-3 gradient) lives on NVMe
    // (`offload_optimizer.ratio` and `train.optimizer_max_in_cpu` keep the first on the
    // device and in host memory)
    let optimizer_tiers = crate::plan::rules::optimizer_tiers(plan);
    let optimizer = match (
        optimizer_tiers.contains(&Tier::Nvme),
        &plan.zero.offload_optimizer.nvme_path,
    ) {
        (true, Some(path)) => {
            let mut specs = swap_specs(plan, model, &State::OPTIMIZER, 4);
            if crate::plan::rules::nvme_gradients(plan) {
                let elem = if crate::plan::rules::stored_bf16(plan) {
                    2
                } else {
                    4
                };
                specs.extend(swap_specs(plan, model, &[State::Grad], elem));
            }
            specs.retain(|spec| optimizer_tiers[spec.key.unit as usize] == Tier::Nvme);
            Some(open_store(plan, path, "tierzero-optimizer", &specs)?)
        }
        _ => None,
    };
    // the units whose parameters live on NVMe (`offload_param.max_in_cpu` keeps the first
    // in host memory)
    let tiers = crate::plan::rules::param_tiers(plan);
    let params = match (tiers.contains(&Tier::Nvme), &plan.zero.offload_param.nvme_path) {
        (true, Some(path)) => {
            let mut specs = swap_specs(plan, model, &[State::Param], plan.precision.bytes());
            specs.retain(|spec| tiers[spec.key.unit as usize] == Tier::Nvme);
            Some(open_store(plan, path, "tierzero-params", &specs)?)
        }
        _ => None,
    };
    Ok((optimizer, params))
}
