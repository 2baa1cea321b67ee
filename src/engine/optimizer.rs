//! The owner of a rank's optimizer state: fp32 master, exp_avg and exp_avg_sq of each
//! unit's optimizer partition — tensors on the rank's device (`offload_optimizer: none`;
//! CPU tensors on a CPU run), slabs of a host arena (`cpu`) or the NVMe swap store — lent
//! to the optimizer lane while an update runs; the channel its updates come back on; the
//! applied-step count, the fp16 loss scaler, and the step's policy on its gradients
//! (skip on overflow, clip by the global norm, the learning rate of the applied steps).

use super::error::{EngineError, On};
use super::gradients::FinalGrad;
use super::params::LowParams;
use super::units::NewParams;
use crate::device::lanes::Mark;
use crate::plan::schedule::{learning_rate, LossScaler};
use crate::plan::{Plan, Tier};
use crate::torch::{pod_bytes, pod_bytes_mut};
use std::ops::Range;
use std::sync::Arc;
use tch::{Kind, Tensor};
use tierzero_offload::adam;
use tierzero_offload::arena::{self, Pinning, Slab};
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pipeline;
use tierzero_offload::pool::{BufferPool, IoBuf};

/// Receives a slice's bytes with the unit element they start at.
pub(super) type Sink<'s> = dyn FnMut(usize, &[u8]) -> Result<(), EngineError> + 's;

/// fp32 optimizer state of one partition, in memory: slabs of the rank's optimizer arena.
pub(super) struct OptimizerState {
    pub(super) master: Slab<f32>,
    pub(super) exp_avg: Slab<f32>,
    pub(super) exp_avg_sq: Slab<f32>,
}

/// fp32 optimizer state of one partition on the rank's device, updated there by torch's
/// fused AdamW.
pub(super) struct DeviceState {
    pub(super) master: Tensor,
    pub(super) exp_avg: Tensor,
    pub(super) exp_avg_sq: Tensor,
}

/// The NVMe tier of optimizer state: the swap store, the pipeline's buffers, and how many
/// sub-groups the backward reads ahead (`rules::read_ahead_sets`).
#[derive(Clone)]
pub(super) struct NvmeTier<'a> {
    pub(super) store: &'a SwapStore,
    pub(super) pool: BufferPool,
    pub(super) read_ahead: usize,
}

/// Where a unit's optimizer state is.
pub(super) enum Moments<'a> {
    Device(DeviceState),
    Memory(OptimizerState),
    /// In the swap store under (unit, rank, state), streamed through the pipeline.
    Nvme(NvmeTier<'a>),
    /// With the optimizer lane until its update is installed.
    Lent,
}

/// An update ready to install: unit, new low-precision partition, its optimizer state
/// and the gradient buffer back.
pub(super) type Update<'a> = (usize, NewParams, Moments<'a>, FinalGrad);

/// An update as the optimizer lane sends it: on a device (a GPU's, a simulated one) with
/// the mark of its stream after the update, which compute's stream waits for.
pub(super) type Sent<'a> = (Update<'a>, Option<Mark>);

pub(super) struct Optimizer<'a> {
    moments: Vec<Moments<'a>>,
    /// Each unit's tier (`rules::optimizer_tiers`).
    tiers: Vec<Tier>,
    /// Each unit's optimizer partition within its padded buffer.
    partitions: Vec<Range<usize>>,
    on: On,
    nvme: Option<NvmeTier<'a>>,
    /// The optimizer lane's updates, in forward order, while it runs.
    updates: Option<crossbeam_channel::Receiver<Result<Sent<'a>, EngineError>>>,
    /// The next unit whose update is to be installed.
    next: usize,
    /// Optimizer steps applied (skipped steps do not count, as in DeepSpeed).
    pub(super) adam_steps: u64,
    /// fp16 loss scaling (a fixed scale of 1 in other precisions).
    pub(super) scaler: LossScaler,
    /// The optimizer lane's buffers for writing parameters to NVMe, kept between steps.
    pub(super) staging: SharedStaging,
    /// The first sub-groups of NVMe state, in the updates' order, read during the
    /// backward ([`Self::read_first_ahead`]) for the next update.
    pub(super) ahead: Vec<Ahead>,
    /// The copies of held gradient sums out of the device (`held.rs`).
    pub(super) held: super::held::SharedHeld,
    held_bytes: usize,
    /// The copies of host updates into device parameters (`update_copies.rs`).
    pub(super) update_copies: super::update_copies::SharedUpdateCopies,
    update_copy_bytes: usize,
}

/// A read-ahead of NVMe state, and on a simulated device when its reads were in
/// virtual time.
pub(super) struct Ahead {
    pub(super) reads: pipeline::ReadAhead,
    pub(super) at: Option<AheadClock>,
}

/// A read-ahead in virtual time.
#[derive(Clone, Copy, Debug)]
pub(super) enum AheadClock {
    /// Submitted at this time, during the backward: the update that uses it places its
    /// reads on the disk from then (`optimize.rs`'s `LegClock`).
    Submitted(f64),
    /// On the disk already, done at this time: the update before read it ahead and
    /// placed it.
    Done(f64),
}

impl<'a> Optimizer<'a> {
    /// The state of every unit's `partitions` entry on the unit's tier: in `nvme`, zeroed
    /// tensors on `device`, or zeroed slabs of one arena allocated here for the run (a
    /// unit's three side by side); with the copies of held gradient sums (`held.rs`)
    /// and of host updates into device parameters (`update_copies.rs`).
    pub(super) fn new(
        rank: usize,
        (tiers, nvme, device, (held, update_copies)): (
            Vec<Tier>,
            Option<NvmeTier<'a>>,
            tch::Device,
            (super::held::HeldCopies, super::update_copies::UpdateCopies),
        ),
        (adam_steps, scaler): (u64, LossScaler),
        partitions: Vec<Range<usize>>,
        pinning: &Pinning,
    ) -> Result<Self, EngineError> {
        let zeros = |len: usize| {
            Tensor::f_zeros([len as i64], (Kind::Float, device))
                .map_err(|source| EngineError::Torch { rank, source })
        };
        let in_memory: Vec<usize> = (0..partitions.len())
            .filter(|&u| tiers[u] == Tier::Cpu)
            .flat_map(|u| [partitions[u].len(); 3])
            .collect();
        let mut slabs = if in_memory.is_empty() {
            Vec::new()
        } else {
            arena::carve::<f32>(&in_memory, pinning).map_err(|source| EngineError::Arena {
                rank,
                what: "optimizer state",
                source,
            })?
        }
        .into_iter();
        let missing = |what| EngineError::Invariant { rank, what };
        let moments = partitions
            .iter()
            .zip(&tiers)
            .map(|(r, tier)| match tier {
                Tier::Nvme => match &nvme {
                    Some(tier) => Ok(Moments::Nvme(tier.clone())),
                    None => Err(missing("optimizer state on nvme without a swap store")),
                },
                Tier::Device => Ok(Moments::Device(DeviceState {
                    master: zeros(r.len())?,
                    exp_avg: zeros(r.len())?,
                    exp_avg_sq: zeros(r.len())?,
                })),
                Tier::Cpu => match (slabs.next(), slabs.next(), slabs.next()) {
                    (Some(master), Some(exp_avg), Some(exp_avg_sq)) => Ok(Moments::Memory(OptimizerState {
                        master,
                        exp_avg,
                        exp_avg_sq,
                    })),
                    _ => Err(missing("fewer optimizer slabs carved than units in memory")),
                },
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        Ok(Optimizer {
            moments,
            tiers,
            partitions,
            on: On(rank),
            nvme,
            updates: None,
            next: 0,
            adam_steps,
            scaler,
            staging: SharedStaging::default(),
            ahead: Vec::new(),
            held_bytes: held.bytes(),
            held: Arc::new(std::sync::Mutex::new(held)),
            update_copy_bytes: update_copies.bytes(),
            update_copies: Arc::new(std::sync::Mutex::new(update_copies)),
        })
    }

    /// Submits the reads of the tier's first `read_ahead` sub-groups of optimizer state in
    /// the updates' order (the leading units' whose state is on NVMe, back from their last
    /// update): the next update reads them first, and only after the backward and the
    /// gradient norm, while the pipeline's buffers and the disk are idle until then
    /// (`pipeline::read_ahead`). A failed submission is left to the update, which reads
    /// the same chunks and reports it.
    pub(super) fn read_first_ahead(&mut self) {
        if !self.ahead.is_empty() {
            return;
        }
        let at = crate::device::sim::entered().map(|s| AheadClock::Submitted(s.now()));
        for group in self.first_groups() {
            let Some(Moments::Nvme(tier)) = self.moments.get(group.0 as usize) else {
                return;
            };
            let read = match self.ahead.last() {
                Some(previous) => pipeline::read_ahead_after(tier.store, &tier.pool, group, &previous.reads),
                None => pipeline::read_ahead(tier.store, &tier.pool, group),
            };
            match read {
                Ok(reads) => self.ahead.push(Ahead { reads, at }),
                Err(_) => return,
            }
        }
    }

    /// The first `read_ahead` (unit, rank, chunk) sub-groups the next update reads, at
    /// most as many as the pipeline's pool holds sets of state: the chunks of the leading
    /// units whose state is on NVMe, up to the first unit that is not (or holds nothing).
    fn first_groups(&self) -> Vec<pipeline::Group> {
        let Some(tier) = self.nvme.as_ref() else {
            return Vec::new();
        };
        let chunk = tier.store.chunk_elems().max(1);
        let most = tier.read_ahead.min(tier.pool.count() / 3);
        let rank = self.on.0 as u32;
        self.moments
            .iter()
            .zip(&self.partitions)
            .enumerate()
            .take_while(|(_, (m, p))| matches!(m, Moments::Nvme(_)) && !p.is_empty())
            .flat_map(|(u, (_, p))| (0..p.len().div_ceil(chunk)).map(move |c| (u as u32, rank, c)))
            .take(most)
            .collect()
    }

    /// Unit `u`'s initial state (each slice its partition's length): copied into its
    /// slabs, or written to the swap store.
    pub(super) fn init(
        &mut self,
        u: usize,
        master: &[f32],
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
    ) -> Result<(), EngineError> {
        let initial = [
            (self.key(u, State::Master), master),
            (self.key(u, State::ExpAvg), exp_avg),
            (self.key(u, State::ExpAvgSq), exp_avg_sq),
        ];
        match &mut self.moments[u] {
            Moments::Device(state) => {
                let on = self.on;
                for (tensor, values) in [
                    (&mut state.master, master),
                    (&mut state.exp_avg, exp_avg),
                    (&mut state.exp_avg_sq, exp_avg_sq),
                ] {
                    tensor
                        .f_copy_(&Tensor::from_slice(values))
                        .map_err(|source| EngineError::Torch { rank: on.0, source })?;
                }
                Ok(())
            }
            Moments::Memory(state) => {
                state.master.copy_from_slice(master);
                state.exp_avg.copy_from_slice(exp_avg);
                state.exp_avg_sq.copy_from_slice(exp_avg_sq);
                Ok(())
            }
            Moments::Nvme(tier) => {
                let (store, mut scratch) = (tier.store, [tier.pool.lease(), tier.pool.lease()]);
                for (key, data) in initial {
                    scratch = store
                        .write_tensor_ahead(key, pod_bytes(data), scratch)
                        .map_err(self.on.io())?;
                }
                Ok(())
            }
            Moments::Lent => Err(EngineError::Invariant {
                rank: self.on.0,
                what: "optimizer state initialised while lent",
            }),
        }
    }

    fn key(&self, u: usize, state: State) -> TensorKey {
        TensorKey {
            unit: u as u32,
            rank: self.on.0 as u32,
            state,
        }
    }

    /// Whether unit `u`'s state is on the device.
    pub(super) fn on_device(&self, u: usize) -> bool {
        self.tiers[u] == Tier::Device
    }

    /// The swap store holding unit `u`'s state, when it is on NVMe.
    pub(super) fn nvme_store(&self, u: usize) -> Option<&'a SwapStore> {
        self.swap_store().filter(|_| self.tiers[u] == Tier::Nvme)
    }

    /// The swap store of the units whose state is on NVMe, if any are.
    pub(super) fn swap_store(&self) -> Option<&'a SwapStore> {
        self.nvme.as_ref().map(|t| t.store)
    }

    /// Unit `u`'s optimizer partition within its padded buffer.
    pub(super) fn partition(&self, u: usize) -> Range<usize> {
        self.partitions[u].clone()
    }

    /// Unit `u`'s state for the optimizer lane; [`Self::restore`] takes it back.
    pub(super) fn lend(&mut self, u: usize) -> Moments<'a> {
        std::mem::replace(&mut self.moments[u], Moments::Lent)
    }

    pub(super) fn restore(&mut self, u: usize, moments: Moments<'a>) {
        self.moments[u] = moments;
    }

    /// The optimizer lane runs: its updates arrive on `updates`, unit 0 first.
    pub(super) fn running(&mut self, updates: crossbeam_channel::Receiver<Result<Sent<'a>, EngineError>>) {
        self.updates = Some(updates);
        self.next = 0;
    }

    /// Whether unit `u`'s update (or an earlier one) is still to be installed.
    pub(super) fn pending_through(&self, u: usize) -> bool {
        self.updates.is_some() && self.next <= u
    }

    pub(super) fn any_pending(&self) -> bool {
        self.updates.is_some()
    }

    /// The next update from the lane (waiting for it), with the unit it is for.
    pub(super) fn receive(&mut self) -> Result<Sent<'a>, EngineError> {
        let unit = self.next;
        let received = self.updates.as_ref().map(|rx| rx.recv());
        let update = match received {
            Some(Ok(update)) => update?,
            // the lane ended early: it sent its error first, so this is a stop without one
            _ => {
                return Err(EngineError::LaneStopped {
                    rank: self.on.0,
                    lane: "optimizer",
                    unit,
                })
            }
        };
        self.next = update.0 .0 + 1;
        if self.next == self.moments.len() {
            self.updates = None;
        }
        Ok(update)
    }

    pub(super) fn rank(&self) -> usize {
        self.on.0
    }

    /// The next unit whose update is awaited.
    pub(super) fn next_unit(&self) -> usize {
        self.next
    }

    /// Calls `sink` with the fp32 `state` of elements `real` (unit coordinates) of unit
    /// `u`: from memory in one piece, or chunk by chunk from the swap store.
    pub(super) fn read(
        &self,
        state: State,
        u: usize,
        real: Range<usize>,
        sink: &mut Sink<'_>,
    ) -> Result<(), EngineError> {
        if !State::OPTIMIZER.contains(&state) {
            return Err(EngineError::Invariant {
                rank: self.on.0,
                what: "the optimizer asked for a state it does not hold",
            });
        }
        let offset = self.partitions[u].start;
        let local = real.start - offset..real.end - offset;
        match &self.moments[u] {
            Moments::Device(opt) => {
                let values = match state {
                    State::Master => &opt.master,
                    State::ExpAvg => &opt.exp_avg,
                    _ => &opt.exp_avg_sq,
                };
                let host: Vec<f32> = values
                    .f_narrow(0, local.start as i64, local.len() as i64)
                    .and_then(|t| t.f_to(tch::Device::Cpu))
                    .and_then(|t| Vec::<f32>::try_from(&t))
                    .map_err(|source| EngineError::Torch {
                        rank: self.on.0,
                        source,
                    })?;
                sink(real.start, pod_bytes(&host))
            }
            Moments::Memory(opt) => {
                let values = match state {
                    State::Master => &opt.master,
                    State::ExpAvg => &opt.exp_avg,
                    _ => &opt.exp_avg_sq,
                };
                sink(real.start, pod_bytes(&values[local]))
            }
            Moments::Nvme(tier) => {
                let key = self.key(u, state);
                let chunk = tier.store.chunk_elems();
                let mut buf = IoBuf::new(tier.store.chunk_bytes(4)).map_err(self.on.alloc())?;
                for c in local.start / chunk..local.end.div_ceil(chunk) {
                    buf = tier
                        .store
                        .read_async(key, c, buf)
                        .map_err(|(e, _)| self.on.io()(e))?
                        .wait()
                        .map_err(self.on.io())?;
                    let lo = local.start.max(c * chunk);
                    let hi = local.end.min((c + 1) * chunk);
                    sink(
                        offset + lo,
                        &buf.as_bytes()[(lo - c * chunk) * 4..(hi - c * chunk) * 4],
                    )?;
                }
                Ok(())
            }
            Moments::Lent => Err(EngineError::Invariant {
                rank: self.on.0,
                what: "optimizer state read while lent to the optimizer lane",
            }),
        }
    }

    /// fp32 master weights of unit `u`'s optimizer partition.
    pub(super) fn master(&self, u: usize) -> Result<Vec<f32>, EngineError> {
        let mut master = vec![0f32; self.partitions[u].len()];
        let start = self.partitions[u].start;
        self.read(State::Master, u, self.partitions[u].clone(), &mut |at, bytes| {
            let from = at - start;
            pod_bytes_mut(&mut master[from..from + bytes.len() / 4]).copy_from_slice(bytes);
            Ok(())
        })?;
        Ok(master)
    }

    /// The learning rate of the next update. DeepSpeed steps its scheduler only when the
    /// update is applied: the rate is that of the number of applied steps, so
    /// overflow-skipped steps do not advance it.
    pub(super) fn learning_rate(&self, plan: &Plan) -> f64 {
        learning_rate(&plan.scheduler, f64::from(plan.optimizer.lr), self.adam_steps)
    }

    /// The step's policy on its gradients, whose global norm (unscaled) is `grad_norm`:
    /// a non-finite norm (fp16 overflow, or a non-finite gradient in any precision) skips
    /// the update (None) and lowers the loss scale; else the update's coefficients at
    /// rate `lr`, the gradients unscaled and clipped to `gradient_clipping`.
    pub(super) fn next_update(&mut self, plan: &Plan, grad_norm: f64, lr: f64) -> Option<AdamStep> {
        let loss_scale = self.scaler.scale;
        if !grad_norm.is_finite() {
            self.scaler.update(true);
            return None;
        }
        self.scaler.update(false);
        let mut grad_scale = 1.0 / loss_scale;
        if plan.gradient_clipping > 0.0 {
            let coefficient = plan.gradient_clipping / (grad_norm + 1e-6);
            if coefficient < 1.0 {
                grad_scale *= coefficient;
            }
        }
        self.adam_steps += 1;
        let hyper = plan.optimizer.hyper(lr as f32);
        Some(AdamStep {
            coefficients: hyper.coefficients(self.adam_steps, grad_scale as f32),
            hyper,
            step: self.adam_steps,
        })
    }

    /// Host bytes of optimizer state in memory (counted by size while lent: a unit's tier
    /// is `tiers`'), and of the NVMe pipeline's buffers.
    pub(super) fn memory_bytes(&self) -> usize {
        let pipeline = self
            .nvme
            .as_ref()
            .map_or(0, |t| t.pool.count() * t.pool.buffer_bytes());
        let in_memory: usize = (0..self.partitions.len())
            .filter(|&u| self.tiers[u] == Tier::Cpu)
            .map(|u| 12 * self.partitions[u].len())
            .sum();
        pipeline + in_memory
    }

    /// Host bytes of the copies of held gradient sums (`held.rs`), fixed for the run (the
    /// optimizer thread holds them while it updates).
    pub(super) fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Host bytes of the copies of host updates into device parameters
    /// (`update_copies.rs`), fixed for the run.
    pub(super) fn update_copy_bytes(&self) -> usize {
        self.update_copy_bytes
    }
}

/// The optimizer lane's buffers for parameters on NVMe: the new partition (sized to the
/// largest unit once, resized within its capacity) and the two bounce buffers of its
/// write (two chunks in flight). Kept by the engine between steps, so the step allocates
/// nothing for them.
pub(super) struct ParamStaging {
    pub(super) values: LowParams,
    pub(super) scratch: [IoBuf; 2],
}

pub(super) type SharedStaging = Arc<std::sync::Mutex<Option<ParamStaging>>>;

/// One optimizer step: the kernels' coefficients (the gradient multiplier among them),
/// and for torch's fused kernel on the device the hyper-parameters and the 1-based step.
#[derive(Clone, Copy, Debug)]
pub(super) struct AdamStep {
    pub(super) coefficients: adam::Coefficients,
    pub(super) hyper: adam::AdamHyper,
    pub(super) step: u64,
}
