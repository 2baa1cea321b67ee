//! One rank of the ZeRO engine: its state, split between three owners, and the training
//! step that moves state between them.
//!
//! Stages are residency rules over the same code (ZeRO paper, §5):
//! - stage 0: parameters, gradients and optimizer state replicated; gradients all-reduced;
//! - stage 1: optimizer state sharded; gradients all-reduced, each rank updates its shard
//!   and the updated shards are all-gathered into every replica;
//! - stage 2: as 1, with gradients reduce-scattered straight into the shard;
//! - stage 3: as 2, with parameters sharded too: a unit is all-gathered only while it
//!   computes, then released (units below `stage3_param_persistence_threshold` stay).
//!
//! The owners, each with private fields and its residency as a type:
//! - `units.rs` ([`Units`]): the low-precision parameters, `Memory | Nvme` per unit;
//! - `gradients.rs` ([`Gradients`]): the accumulators, `Here | Lent` (to the reduce or
//!   optimizer lane), and the reduce lane's end;
//! - `optimizer.rs` ([`Optimizer`]): master and moments, `Memory | Nvme | Lent`.
//!
//! The step (DESIGN.md, "One training step"), as [`RankEngine::step`] reads: every
//! micro-batch (`micro_batch.rs`) on the step's lanes (`step_lanes.rs`): forward unit by
//! unit keeping each unit's input, the final unit's loss and backward, backward in reverse
//! by recompute (or through kept graphs) with each flat gradient reduced into its
//! accumulator; the replicas' all-reduce (stages 0–1); the global gradient norm, and the
//! optimizer owner's policy on it (fp16 overflow skipping, clipping, the rate); AdamW unit
//! by unit in forward order (`optimize.rs`), overlapping the next step's forward. Stage-3
//! fetches come from the prefetcher (`prefetch.rs`), reduce-scatters from the reducer
//! (`reduce.rs`) with `overlap_comm`, both on the step's collectives lane.

use super::compute_times::ComputeTimes;
use super::context::{Comms, LaneOptions, RankContext, StepReport, Tracks};
use super::error::{EngineError, On};
use super::gradients::Gradients;
use super::optimizer::Optimizer;
use super::setup::{
    device_reservations, device_streams, homes, host_pinning, loss_scaler, param_pinning, staging_pinning,
    unit_start,
};
use super::units::Units;
use crate::comm::{Collective, ReduceOp};
use crate::data::Dataset;
use crate::device::cpu::{CpuDevice, Reservation};
use crate::device::lanes::Streams;
use crate::device::sim::{self, SimStreams};
use crate::metrics::timeline::Phase;
use crate::metrics::trace::TierBytes;
use crate::model::layout::UnitKind;
use crate::model::Model;
use crate::plan::partition::Partition;
use crate::plan::rules::{bf16_gradients, optimizer_tiers, stored_gradients};
use crate::plan::simulate;
use crate::plan::simulate::costs::Work;
use crate::plan::{Plan, Precision};
use crate::torch;
use std::sync::Arc;
use tch::{Kind, TchError};
use tierzero_offload::nvme::swap::SwapStore;

pub struct RankEngine<'a, C: Collective> {
    /// The compute thread's communicator, the gather lane's (stage-3 all-gathers ahead of
    /// compute) and the reduce lane's (`overlap_comm`).
    pub(super) comms: Comms<C>,
    pub(super) plan: &'a Plan,
    pub(super) model: &'a Model,
    pub(super) dataset: &'a Dataset,
    pub(super) units: Units<'a>,
    pub(super) grads: Gradients<'a, C>,
    pub(super) optimizer: Optimizer<'a>,
    pub(super) site: Site<'a>,
    pub(super) tracks: Tracks,
    /// False: every phase blocking (`RankContext::overlap`).
    pub(super) overlap: bool,
    pub(super) lanes: LaneOptions,
    /// The micro-batch being computed (step and index), which checked mode's delays of
    /// compute mix in so they differ from one micro-batch to the next.
    pub(super) checked_round: u64,
    /// On a GPU, the step's compute spans timed by the device.
    pub(super) compute_times: ComputeTimes,
}

/// Where a rank computes and what it holds there: its rank, the compute device with its
/// GPU's streams for the lanes (None on CPU, where lane work is done when its job
/// returns), the device memory counter with the reservations of the state that lives for
/// the whole run, and the swap stores (for their disk bytes).
pub(super) struct Site<'a> {
    pub(super) rank: usize,
    pub(super) compute: tch::Device,
    pub(super) streams: Option<Arc<dyn Streams>>,
    /// The same streams when they are a simulated device's (their virtual clocks).
    pub(super) simulated: Option<Arc<SimStreams>>,
    pub(super) device: Arc<CpuDevice>,
    _held: Vec<Reservation>,
    stores: [Option<&'a SwapStore>; 2],
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    pub(super) fn torch_err(&self) -> impl Fn(TchError) -> EngineError {
        On(self.site.rank).torch()
    }

    pub(super) fn stage(&self) -> u8 {
        self.plan.zero.stage
    }

    /// The rank's simulated streams, when it runs on a simulated device.
    pub fn simulated(&self) -> Option<&SimStreams> {
        self.site.simulated.as_deref()
    }

    /// Builds this rank's state: each unit initialised (a pure function of the seed),
    /// sliced to what this rank keeps, and handed to its owners on their tiers.
    pub fn new(
        comms: Comms<C>,
        context: RankContext<'a>,
        device: Arc<CpuDevice>,
    ) -> Result<Self, EngineError> {
        let RankContext {
            plan,
            model,
            dataset,
            optimizer_store,
            param_store,
            start,
            timeline,
            overlap,
            lanes,
            simulate,
        } = context;
        let (rank, world, stage) = (comms.main.rank(), comms.main.world(), plan.zero.stage);
        let (optimizer_nvme, param_homes) = homes(plan, rank, (optimizer_store, param_store))?;
        let compute = plan.train.compute_device(rank);
        let mut units = Units::new(
            rank,
            stage,
            plan.precision,
            (model.kind, compute),
            plan.zero.param_persistence_threshold,
            (lanes.mode, param_pinning(plan, compute, rank)?),
        );
        let parts: Vec<Partition> = model
            .units
            .iter()
            .map(|l| Partition::new(l.numel, world))
            .collect();
        // each unit's optimizer partition: the whole unit at stage 0, else this rank's slice
        let partitions: Vec<_> = parts
            .iter()
            .map(|p| if stage == 0 { 0..p.padded } else { p.range(rank) })
            .collect();
        // the run-long host state, allocated once: gradients and in-memory optimizer
        // state in arenas, locked (and registered with a GPU's context) with pin_memory
        let pinning = host_pinning(plan, compute, rank)?;
        let bf16_grads = bf16_gradients(plan);
        let grads = Gradients::new(
            (stage, rank, bf16_grads),
            (
                crate::plan::rules::device_sums(plan),
                crate::plan::rules::held_gradients(plan),
                compute,
            ),
            (
                plan.communication,
                crate::plan::rules::chunk_elements(plan),
                crate::plan::rules::reduce_depth(plan),
            ),
            parts.clone(),
            partitions.clone(),
            &pinning,
            (optimizer_store, stored_gradients(plan)),
        )?;
        let adam_steps = start.checkpoint().map_or(0, |c| c.manifest.adam_steps);
        // a GPU's held gradient sums reach an update off it through two pinned buffers
        let held_copy = if compute.is_cuda() {
            let lens: Vec<usize> = partitions.iter().map(|r| r.len()).collect();
            crate::plan::rules::held_copy_elements(plan, &lens)
        } else {
            0
        };
        let held = super::held::HeldCopies::new(rank, held_copy, &staging_pinning(compute, rank)?)?;
        // and host updates reach parameters on the device through two more
        let lens: Vec<usize> = partitions.iter().map(|r| r.len()).collect();
        let update_copies = super::update_copies::UpdateCopies::new(
            rank,
            crate::plan::rules::update_copy_elements(plan, &lens),
            &plan.precision,
            &staging_pinning(compute, rank)?,
        )?;
        // each unit's state on its tier: tensors on the rank's device, slabs of a host
        // arena, or the swap store
        let mut optimizer = Optimizer::new(
            rank,
            (
                optimizer_tiers(plan),
                optimizer_nvme,
                compute,
                (held, update_copies),
            ),
            (adam_steps, loss_scaler(plan, start)),
            partitions.clone(),
            &pinning,
        )?;
        let mut held = Vec::new();
        for (u, (layout, part)) in model.units.iter().zip(&parts).enumerate() {
            let (part, partition) = (*part, partitions[u].clone());
            let state = unit_start(start, plan, (u, layout), part, partition.clone(), rank)?;
            optimizer.init(u, &state.master, &state.exp_avg, &state.exp_avg_sq)?;
            held.extend(device_reservations(
                plan,
                &device,
                u,
                (state.params.len(), part),
                (partition.len(), grads.gradient_bytes(u)),
            )?);
            units.push(part, state.params, param_homes[u])?;
        }
        // on a simulated device the calling thread, which issues the rank's compute,
        // enters its compute stream
        let trace = timeline.is_some_and(|t| t.keeps_for_trace());
        let streams = simulate
            .map(|profile| Arc::new(SimStreams::new(Arc::new(simulate::costs(plan, profile)), trace)));
        Ok(RankEngine {
            comms,
            plan,
            model,
            dataset,
            units,
            grads,
            optimizer,
            site: Site {
                rank,
                compute,
                streams: match &streams {
                    Some(sim) => Some(sim.clone() as Arc<dyn Streams>),
                    None => device_streams(compute, rank)?,
                },
                simulated: streams,
                device,
                _held: held,
                stores: [optimizer_store, param_store],
            },
            tracks: Tracks::new(timeline, rank),
            overlap,
            lanes,
            checked_round: 0,
            compute_times: ComputeTimes::default(),
        })
    }

    /// Checks that every rank starts at `first_step` (each process resolves its own
    /// checkpoint): a rank whose start differs from the ranks' mean stops the run, naming
    /// both, instead of training a different step count from the others.
    pub fn check_same_start(&self, first_step: u64) -> Result<(), EngineError> {
        let mut start = [first_step as f64];
        self.comms.main.all_reduce(&mut start, ReduceOp::Avg)?;
        if start[0] != first_step as f64 {
            return Err(EngineError::StartDiffers {
                rank: self.site.rank,
                mine: first_step,
                mean: start[0],
            });
        }
        Ok(())
    }

    /// One optimizer step: every micro-batch of this rank, the gradients' reduction and
    /// norm, then the update, which runs on a thread of `scope` when one is given (see
    /// [`Self::optimize`]). `stop` says this rank's process was asked to stop; the
    /// report's `preempted` says whether any rank's was.
    pub fn step<'s, 'e>(
        &mut self,
        step: u64,
        scope: Option<&'s std::thread::Scope<'s, 'e>>,
        stop: bool,
    ) -> Result<StepReport, EngineError>
    where
        'a: 'e,
    {
        let plan = self.plan;
        self.grads.zero();
        let loss_scale = self.optimizer.scaler.scale;
        self.begin_compute()?;
        let loss = self.micro_batches(step, loss_scale)?;
        self.end_compute();
        let reduce_start = crate::comm::collective_start();
        self.grads.all_reduce_replicas(&self.comms.main)?;
        // each rank's preemption flag travels with its loss: any rank asked, all stop
        let mut losses = [loss, f64::from(u8::from(stop))];
        self.comms.main.all_reduce(&mut losses, ReduceOp::Avg)?;
        let world = self.comms.main.world();
        if world > 1 {
            sim::charge(Work::Latency);
        }
        // the global gradient norm (of the unscaled gradients)
        let mut sum_sq = [self.grads.sum_squares()?];
        if self.stage() >= 1 {
            self.comms.main.all_reduce(&mut sum_sq, ReduceOp::Sum)?;
            if world > 1 {
                sim::charge(Work::Latency);
            }
        }
        // the step's reductions (replicas at stages 0-1, the loss, the norm), their waits
        // for the other ranks recorded as waits
        crate::comm::record_collective(&self.tracks.compute, (Phase::Reduce, None), reduce_start, 0);
        let grad_norm = sum_sq[0].sqrt() / loss_scale;
        let lr = self.optimizer.learning_rate(plan);
        let mut report = StepReport {
            loss: losses[0],
            grad_norm,
            lr,
            loss_scale,
            skipped: false,
            preempted: losses[1] > 0.0,
        };
        let Some(adam_step) = self.optimizer.next_update(plan, grad_norm, lr) else {
            // no update reads the state read ahead: its buffers go back to the pool
            self.optimizer.ahead.clear();
            report.skipped = true;
            return Ok(report);
        };
        self.install_all()?;
        self.optimize(adam_step, scope)?;
        Ok(report)
    }

    /// fp32 master weights of this rank's optimizer partition of unit `u`, with where
    /// the partition starts in the padded unit.
    pub fn master(&mut self, u: usize) -> Result<(usize, Vec<f32>), EngineError> {
        self.install_all()?;
        Ok((self.optimizer.partition(u).start, self.optimizer.master(u)?))
    }

    pub fn unit_count(&self) -> usize {
        self.units.len()
    }

    pub fn is_embedding(&self, u: usize) -> bool {
        self.model.units[u].kind == UnitKind::Embedding
    }

    /// Peak device bytes this rank has held.
    pub fn device_peak(&self) -> u64 {
        self.site.device.peak()
    }

    /// Bytes on each tier now (device: the peak since the last call; NVMe: the swap
    /// stores' files, every rank's). State lent to a lane counts by its size.
    pub fn tier_bytes(&self) -> TierBytes {
        let optimizer = self.optimizer.memory_bytes();
        // gradient accumulators are host arenas, but those stored on NVMe or held on the
        // device (the copies of held sums out of a GPU count)
        let grads = self.grads.bytes() + self.optimizer.held_bytes();
        let params = self.units.memory_bytes() + self.optimizer.update_copy_bytes();
        TierBytes {
            device: self.site.device.take_window_peak(),
            host: (params + optimizer + grads) as u64,
            nvme: self.site.stores.iter().flatten().map(|s| s.disk_bytes()).sum(),
        }
    }

    pub fn loss_scale(&self) -> f64 {
        self.optimizer.scaler.scale
    }
}

/// The element kind tch uses for a precision (re-exported for the trainer).
pub fn kind_for(precision: &Precision) -> Kind {
    torch::compute_kind(precision)
}
