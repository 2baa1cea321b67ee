//! One rank of the ZeRO engine: its state per unit, on its tiers, and the training step.
//!
//! Stages are residency rules over the same code (ZeRO paper, §5):
//! - stage 0: parameters, gradients and optimizer state replicated; gradients all-reduced;
//! - stage 1: optimizer state sharded; gradients all-reduced, each rank updates its shard
//!   and the updated shards are all-gathered into every replica;
//! - stage 2: as 1, with gradients reduce-scattered straight into the shard;
//! - stage 3: as 2, with parameters sharded too: a unit is all-gathered only while it
//!   computes, then released (units below `stage3_param_persistence_threshold` stay).
//!
//! Per unit and rank: the low-precision parameters (the shard at stage 3, else the full
//! replica) in memory or in the swap store (`offload_param: nvme`); the fp32 gradient
//! accumulator for the optimizer partition; fp32 master, exp_avg and exp_avg_sq in memory
//! (`offload_optimizer: none|cpu`) or streamed through the NVMe pipeline (`nvme`).
//!
//! The step (DESIGN.md, "One training step"): forward unit by unit under no_grad keeping
//! each unit's input; the final unit's loss and backward; backward in reverse by
//! recompute, each flat gradient reduced into the shard; then the global gradient norm by
//! all-reduce, clipping and fp16 overflow skipping, and AdamW unit by unit in forward
//! order (`optimize.rs`), overlapping the next step's forward. Stage-3 fetches come
//! from the prefetch worker (`prefetch.rs`), gradient reduce-scatters from the reducer
//! (`reduce.rs`) with `overlap_comm`.

use super::grads::Grads;
use super::partition::Partition;
use super::prefetch::{self, DroppedWait, FetchLanes, Fetcher, GatherBuffers, Prefetcher, Source};
use super::reduce::{reduce_into, ChunkBuffers, Reducer, Target, CHUNK_LIMIT};
use super::schedule::{learning_rate, LossScaler};
use super::start::Start;
use crate::comm::{Collective, CommError, ReduceOp};
use crate::config::plan::{Plan, Precision, Tier};
use crate::data::Dataset;
use crate::device::cpu::{CpuDevice, Reservation};
use crate::device::lanes::{Lane, LaneError, Mode};
use crate::device::OutOfMemory;
use crate::metrics::timeline::{Phase, Timeline, Track};
use crate::metrics::trace::TierBytes;
use crate::model::layout::UnitKind;
use crate::model::Model;
use crate::torch;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, TchError, Tensor};
use tierzero_offload::adam::LowPrecisionOut;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::nvme::IoError;
use tierzero_offload::pipeline;
use tierzero_offload::pool::{BufferPool, IoBuf};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("rank {rank}: torch: {source}")]
    Torch { rank: usize, source: TchError },
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("rank {rank}: nvme: {source}")]
    Io { rank: usize, source: IoError },
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    #[error(transparent)]
    Lane(#[from] LaneError),
    #[error("rank {rank}: {message}")]
    Other { rank: usize, message: String },
}

/// Low-precision parameters as stored: fp32 values or 16-bit float bits.
#[derive(Clone, Debug)]
pub enum LowParams {
    F32(Vec<f32>),
    U16(Vec<u16>),
}

impl Default for LowParams {
    fn default() -> Self {
        LowParams::F32(Vec::new())
    }
}

impl LowParams {
    pub(crate) fn zeros(len: usize, precision: &Precision) -> LowParams {
        match precision {
            Precision::Fp32 => LowParams::F32(vec![0.0; len]),
            _ => LowParams::U16(vec![0; len]),
        }
    }

    fn out(&mut self) -> LowPrecisionOut<'_> {
        match self {
            LowParams::F32(v) => LowPrecisionOut::F32(v),
            LowParams::U16(v) => LowPrecisionOut::Bf16(v),
        }
    }

    pub(super) fn out_as(&mut self, precision: &Precision) -> LowPrecisionOut<'_> {
        match (self, precision) {
            (LowParams::U16(v), Precision::Fp16(_)) => LowPrecisionOut::F16(v),
            (other, _) => other.out(),
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: f32/u16 have no padding; any byte view is valid.
        unsafe {
            match self {
                LowParams::F32(v) => std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 4),
                LowParams::U16(v) => std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2),
            }
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: any byte pattern is a valid f32/u16.
        unsafe {
            match self {
                LowParams::F32(v) => std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 4),
                LowParams::U16(v) => std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 2),
            }
        }
    }

    /// Sets the length to `len` (new elements zero); within the capacity nothing is
    /// allocated, beyond it exactly `len` elements are.
    pub(crate) fn resize(&mut self, len: usize) {
        match self {
            LowParams::F32(v) => {
                v.reserve_exact(len.saturating_sub(v.len()));
                v.resize(len, 0.0)
            }
            LowParams::U16(v) => {
                v.reserve_exact(len.saturating_sub(v.len()));
                v.resize(len, 0)
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            LowParams::F32(v) => v.len(),
            LowParams::U16(v) => v.len(),
        }
    }

    pub(crate) fn elem_bytes(&self) -> usize {
        match self {
            LowParams::F32(_) => 4,
            LowParams::U16(_) => 2,
        }
    }
}

/// Where a unit's low-precision parameters live between uses.
#[derive(Clone)]
pub enum Params {
    /// In memory (the host tier, or device memory on CPU devices), shared with the lanes
    /// that read it: an update replaces it, it is never written in place.
    Memory(Arc<LowParams>),
    /// In the NVMe parameter store (`offload_param: nvme`).
    Nvme,
}

/// fp32 optimizer state of one partition, in memory.
pub(super) struct OptimizerState {
    pub(super) master: Vec<f32>,
    pub(super) exp_avg: Vec<f32>,
    pub(super) exp_avg_sq: Vec<f32>,
}

pub(super) struct UnitState {
    pub(super) part: Partition,
    /// Stage 3: this rank's shard; else the padded replica; where it lives.
    pub(super) params: Params,
    /// Stage 3 units at or below the persistence threshold keep their gathered form.
    pub(super) persistent: Option<(Tensor, Reservation)>,
    /// Offset and length of the optimizer partition within the padded buffer.
    pub(super) opt_start: usize,
    pub(super) opt_len: usize,
    /// fp32 gradient accumulator: the optimizer partition at stage ≥ 2, else the whole
    /// padded unit.
    /// Moves into the optimizer phase's job and comes back, zeroed, with its update.
    pub(super) grad: Grads,
    pub(super) optimizer: Option<OptimizerState>,
    /// Buffers back from the last optimizer phase, reused by the next: the gradient
    /// accumulator the optimizer read, and a low-precision partition to write into.
    pub(super) spare_grad: Grads,
    pub(super) spare_params: Option<LowParams>,
}

/// Per-step numbers one rank reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepReport {
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub loss_scale: f64,
    pub skipped: bool,
}

/// What every rank of a run shares: the plan, the model, the data, the swap stores and
/// where the state starts.
#[derive(Clone, Copy)]
pub struct RankContext<'a> {
    pub plan: &'a Plan,
    pub model: &'a Model,
    pub dataset: &'a Dataset,
    pub optimizer_store: Option<&'a SwapStore>,
    pub param_store: Option<&'a SwapStore>,
    pub start: &'a Start,
    /// Where the rank's threads record their spans (None: not recorded).
    pub timeline: Option<&'a Timeline>,
    /// False: every phase blocking (no prefetch worker, no NVMe read/write pipelining);
    /// a debug switch that makes the breakdown's `overlap` 1.0.
    pub overlap: bool,
    /// How the rank's lanes run (checked in tests), and a wait left out on purpose.
    pub lanes: LaneOptions,
}

/// How a rank's lanes run: [`Mode::Checked`] in tests; `dropped` leaves one wait out on
/// purpose (a test shows the checked mode then fails the run's equivalence).
#[derive(Clone, Copy, Debug, Default)]
pub struct LaneOptions {
    pub mode: Mode,
    pub dropped: DroppedWait,
}

impl LaneOptions {
    /// Plain lanes, or checked ones when the environment asks (`Mode::from_env`).
    pub fn from_env() -> LaneOptions {
        LaneOptions {
            mode: Mode::from_env(),
            dropped: DroppedWait::None,
        }
    }
}

/// A rank's communicators: the compute thread's, the prefetch worker's (stage-3
/// gathers ahead of compute) and the reducer's (`overlap_comm` reduce-scatters). Each
/// thread has its own, so their collectives never interleave.
#[derive(Clone)]
pub struct Comms<C> {
    pub main: C,
    pub gather: C,
    pub reduce: C,
}

impl<C: Collective> Comms<C> {
    /// Fails every rank's pending and future collectives on all three.
    pub fn abort(&self, reason: &str) {
        for c in [&self.main, &self.gather, &self.reduce] {
            c.abort(reason);
        }
    }
}

/// The tracks of one rank's threads.
#[derive(Clone, Default)]
pub(super) struct Tracks {
    pub compute: Track,
    /// The gather lane (stage-3 all-gathers).
    pub prefetch: Track,
    /// The h2d lane (shards into device staging, parameter NVMe reads).
    pub h2d: Track,
    pub optimizer: Track,
    pub nvme_read: Track,
    pub nvme_write: Track,
    pub reduce: Track,
}

impl Tracks {
    fn new(timeline: Option<&Timeline>, rank: usize) -> Tracks {
        let Some(t) = timeline else {
            return Tracks::default();
        };
        Tracks {
            compute: t.track(rank, "compute"),
            prefetch: t.track(rank, "gather"),
            optimizer: t.track(rank, "optimizer"),
            nvme_read: t.track(rank, "nvme read"),
            nvme_write: t.track(rank, "nvme write"),
            reduce: t.track(rank, "reduce"),
            h2d: t.track(rank, "h2d"),
        }
    }
}

pub struct RankEngine<'a, C: Collective> {
    pub comm: C,
    /// The prefetch worker's communicator (stage-3 all-gathers ahead of compute).
    pub(super) gather_comm: C,
    /// The reducer's communicator (`overlap_comm`).
    pub(super) reduce_comm: C,
    /// The reduce lane of the step in progress, when gradients are reduced off-thread.
    pub(super) reducer: Option<Reducer<'a, C>>,
    /// The chunk buffers of gradient reductions, reused across units and steps.
    pub(super) chunk_buffers: ChunkBuffers,
    pub(super) plan: &'a Plan,
    pub(super) model: &'a Model,
    pub(super) dataset: &'a Dataset,
    /// Optimizer state on NVMe.
    pub(super) store: Option<&'a SwapStore>,
    /// Parameters on NVMe.
    pub(super) param_store: Option<&'a SwapStore>,
    pub(super) pool: Option<BufferPool>,
    pub(super) units: Vec<UnitState>,
    pub(super) scaler: LossScaler,
    /// Optimizer steps applied (skipped steps do not count, as in DeepSpeed).
    pub(super) adam_steps: u64,
    pub(super) rank: usize,
    pub(super) device: Arc<CpuDevice>,
    /// Device memory of the state that lives for the whole run.
    pub(super) _held: Vec<Reservation>,
    /// Updates from the optimizer thread, in forward order, while it runs.
    pub(super) updates: Option<crossbeam_channel::Receiver<Result<super::optimize::Update, EngineError>>>,
    /// The next unit whose update is to be installed.
    pub(super) next_update: usize,
    pub(super) tracks: Tracks,
    pub(super) overlap: bool,
    pub(super) lanes: LaneOptions,
    /// Stage-3 gather buffers, reused across micro-batches (lent to the prefetcher).
    pub(super) gather_buffers: Option<GatherBuffers>,
    /// The optimizer lane's buffers for writing parameters to NVMe, kept between steps.
    pub(super) param_staging: super::optimize::SharedStaging,
    /// Where this rank computes (CPU, or its GPU).
    pub(super) compute: tch::Device,
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    fn torch_err(&self) -> impl Fn(TchError) -> EngineError {
        let rank = self.rank;
        move |source| EngineError::Torch { rank, source }
    }

    pub(super) fn io_err(&self) -> impl Fn(IoError) -> EngineError {
        let rank = self.rank;
        move |source| EngineError::Io { rank, source }
    }

    /// Waits for the GPU's queued work, so a compute span ends when the kernels did
    /// (torch launches asynchronously); nothing to wait for on CPU.
    fn settle(&self) -> Result<(), TchError> {
        match self.compute {
            tch::Device::Cuda(d) => torch::shim::synchronize(d),
            _ => Ok(()),
        }
    }

    pub(super) fn stage(&self) -> u8 {
        self.plan.zero.stage
    }

    /// Builds this rank's state: each unit initialised (a pure function of the seed),
    /// sliced to what this rank keeps, and written to its tier.
    pub fn new(
        comms: Comms<C>,
        context: RankContext<'a>,
        device: Arc<CpuDevice>,
    ) -> Result<Self, EngineError> {
        let Comms {
            main: comm,
            gather: gather_comm,
            reduce: reduce_comm,
        } = comms;
        let RankContext {
            plan,
            model,
            dataset,
            optimizer_store: store,
            param_store,
            start,
            timeline,
            overlap,
            lanes,
        } = context;
        let rank = comm.rank();
        let mut held = Vec::new();
        let world = comm.world();
        let stage = plan.zero.stage;
        let param_nvme = plan.zero.offload_param.tier == Tier::Nvme;
        let optimizer_nvme = plan.zero.offload_optimizer.tier == Tier::Nvme;
        let pool = match (store, optimizer_nvme) {
            (Some(store), true) => Some(
                pipeline::buffer_pool_for(store, plan.zero.offload_optimizer.buffer_count)
                    .map_err(|source| EngineError::Io { rank, source })?,
            ),
            _ => None,
        };
        let mut units = Vec::with_capacity(model.units.len());
        for (u, layout) in model.units.iter().enumerate() {
            let part = Partition::new(layout.numel, world);
            let start_err = |message: String| EngineError::Other { rank, message };
            // the elements this rank keeps: its shard at stage 3, else the whole unit
            let kept_range = if stage == 3 {
                part.range(rank)
            } else {
                0..part.padded
            };
            let real = kept_range.start.min(part.numel)..kept_range.end.min(part.numel);
            let mut kept = vec![0f32; kept_range.len()];
            start
                .master(u, layout, real.clone(), &mut kept[..real.len()])
                .map_err(start_err)?;
            let (opt_start, opt_len) = if stage == 0 {
                (0, part.padded)
            } else {
                (part.range(rank).start, part.shard)
            };
            let mut params = LowParams::zeros(kept.len(), &plan.precision);
            match start
                .params(u, real.clone(), &plan.precision)
                .map_err(start_err)?
            {
                Some(bytes) => params.bytes_mut()[..bytes.len()].copy_from_slice(&bytes),
                None => round_into(&kept, &mut params, &plan.precision),
            }
            // the master weights: the kept elements themselves where they are the
            // optimizer partition (stage 3), else a copy of the partition
            let master = if kept_range == (opt_start..opt_start + opt_len) {
                kept
            } else {
                kept[opt_start - kept_range.start..][..opt_len].to_vec()
            };
            let (mut exp_avg, mut exp_avg_sq) = (vec![0f32; opt_len], vec![0f32; opt_len]);
            let opt_real = opt_start.min(part.numel)..(opt_start + opt_len).min(part.numel);
            start
                .moments(
                    u,
                    opt_real.clone(),
                    &mut exp_avg[..opt_real.len()],
                    &mut exp_avg_sq[..opt_real.len()],
                )
                .map_err(start_err)?;
            let bf16_grads = bf16_gradients(plan);
            let grad = Grads::zeros(if stage >= 2 { opt_len } else { part.padded }, bf16_grads);
            let optimizer = if optimizer_nvme {
                let (Some(store), Some(pool)) = (store, pool.as_ref()) else {
                    return Err(EngineError::Other {
                        rank,
                        message: "optimizer on nvme without a swap store".into(),
                    });
                };
                let mut scratch = pool.lease();
                for (state, data) in [
                    (State::Master, &master),
                    (State::ExpAvg, &exp_avg),
                    (State::ExpAvgSq, &exp_avg_sq),
                ] {
                    let key = TensorKey {
                        unit: u as u32,
                        rank: rank as u32,
                        state,
                    };
                    scratch = store
                        .write_tensor(key, f32_bytes(data), scratch)
                        .map_err(|source| EngineError::Io { rank, source })?;
                }
                None
            } else {
                Some(OptimizerState {
                    master,
                    exp_avg,
                    exp_avg_sq,
                })
            };
            if param_nvme {
                let Some(store) = param_store else {
                    return Err(EngineError::Other {
                        rank,
                        message: "parameters on nvme without a swap store".into(),
                    });
                };
                let key = TensorKey {
                    unit: u as u32,
                    rank: rank as u32,
                    state: State::Param,
                };
                let scratch =
                    IoBuf::new(store.chunk_bytes(params.elem_bytes())).map_err(|e| EngineError::Other {
                        rank,
                        message: e.to_string(),
                    })?;
                store
                    .write_tensor(key, params.as_bytes(), scratch)
                    .map_err(|source| EngineError::Io { rank, source })?;
            }
            let params = if param_nvme {
                Params::Nvme
            } else {
                Params::Memory(Arc::new(params))
            };
            // what of this unit sits on the device for the whole run
            if !param_nvme && plan.zero.offload_param.tier == Tier::Device {
                let bytes =
                    (if stage == 3 { part.shard } else { part.padded } * plan.precision.bytes()) as u64;
                held.push(device.reserve(bytes, &format!("parameters of unit {u}"))?);
            }
            if plan.zero.offload_optimizer.tier == Tier::Device {
                held.push(device.reserve(grad.bytes() as u64, &format!("gradients of unit {u}"))?);
                held.push(device.reserve(12 * opt_len as u64, &format!("optimizer state of unit {u}"))?);
            }
            units.push(UnitState {
                part,
                params,
                persistent: None,
                opt_start,
                opt_len,
                grad,
                optimizer,
                spare_grad: Grads::default(),
                spare_params: None,
            });
        }
        let mut scaler = LossScaler::new(match &plan.precision {
            Precision::Fp16(s) => Some(s),
            _ => None,
        });
        let mut adam_steps = 0;
        if let Some(checkpoint) = start.checkpoint() {
            scaler.restore(&checkpoint.manifest.loss_scaler);
            adam_steps = checkpoint.manifest.adam_steps;
        }
        Ok(RankEngine {
            comm,
            gather_comm,
            reduce_comm,
            reducer: None,
            chunk_buffers: ChunkBuffers::default(),
            plan,
            model,
            dataset,
            store,
            param_store,
            pool,
            units,
            scaler,
            adam_steps,
            rank,
            device,
            _held: held,
            updates: None,
            next_update: 0,
            tracks: Tracks::new(timeline, rank),
            overlap,
            lanes,
            gather_buffers: Some(GatherBuffers::new(lanes.mode)),
            param_staging: Default::default(),
            compute: plan.train.compute_device(rank),
        })
    }

    /// The full parameters of unit `u` as a tensor of the compute kind, with the device
    /// memory its gathered form holds (stage 3) until dropped. At stage 3 the gather
    /// comes from the prefetcher's lanes when they run, else it happens here.
    fn fetch(
        &mut self,
        prefetch: Option<&mut Prefetcher<'a, C>>,
        u: usize,
    ) -> Result<(Tensor, Option<Reservation>), EngineError> {
        self.install_through(u)?;
        if let Some((t, _)) = &self.units[u].persistent {
            return Ok((t.shallow_clone(), None));
        }
        let (tensor, gathered) = match (self.stage(), prefetch) {
            (3, Some(prefetch)) => {
                // a unit is requested only once its pending update is installed
                let (tensor, hold) = prefetch.next(u, &mut |v| {
                    self.install_through(v)?;
                    Ok(self.shard_source(v))
                })?;
                (tensor, Some(hold))
            }
            (3, None) => {
                let bytes = (self.units[u].part.padded * self.plan.precision.bytes()) as u64;
                let hold = self.device.reserve(bytes, &format!("gathered unit {u}"))?;
                let shard = self.local_params(u)?;
                let full = self.all_gather(&shard, self.units[u].part.padded)?;
                (self.tensor_of(&full, u)?, Some(hold))
            }
            // the replica is already whole: in memory it becomes a tensor without a clone
            _ => match &self.units[u].params {
                Params::Memory(params) => return Ok((self.tensor_of(params, u)?, None)),
                Params::Nvme => {
                    let params = self.local_params(u)?;
                    (self.tensor_of(&params, u)?, None)
                }
            },
        };
        let numel = self.units[u].part.numel;
        match gathered {
            // small units stay gathered (stage3_param_persistence_threshold)
            Some(hold) if numel <= self.plan.zero.param_persistence_threshold => {
                self.units[u].persistent = Some((tensor.shallow_clone(), hold));
                Ok((tensor, None))
            }
            gathered => Ok((tensor, gathered)),
        }
    }

    /// Unit `u`'s parameters (a padded full buffer) as a tensor of the compute kind.
    fn tensor_of(&self, full: &LowParams, u: usize) -> Result<Tensor, EngineError> {
        let numel = self.units[u].part.numel;
        let bytes = (numel * full.elem_bytes()) as u64;
        self.tracks
            .compute
            .span(Phase::H2d, Some(u), bytes, || match full {
                LowParams::F32(v) => torch::tensor_f32(&v[..numel], self.compute),
                LowParams::U16(v) => torch::tensor_u16(&v[..numel], self.model.kind, self.compute),
            })
            .map_err(self.torch_err())
    }

    /// Where the lanes find a unit's shard: shared from memory, or on NVMe.
    fn shard_source(&self, u: usize) -> Source {
        self.units[u].params.clone()
    }

    /// Every rank's `shard` of a unit, concatenated into its padded length.
    pub(super) fn all_gather(&self, shard: &LowParams, padded: usize) -> Result<LowParams, EngineError> {
        let mut full = LowParams::zeros(padded, &self.plan.precision);
        self.all_gather_into(shard, &mut full)?;
        Ok(full)
    }

    /// Every rank's `shard` of a unit into `full` (its padded length, same precision).
    pub(super) fn all_gather_into(&self, shard: &LowParams, full: &mut LowParams) -> Result<(), EngineError> {
        let start = Instant::now();
        let bytes = full.as_bytes().len() as u64;
        match (shard, &mut *full) {
            (LowParams::F32(s), LowParams::F32(out)) => self.comm.all_gather(s, out)?,
            (LowParams::U16(s), LowParams::U16(out)) => self.comm.all_gather(s, out)?,
            _ => {
                return Err(EngineError::Other {
                    rank: self.rank,
                    message: "all-gather between two precisions".into(),
                })
            }
        }
        self.tracks.compute.record(Phase::AllGather, None, start, bytes);
        Ok(())
    }

    /// This rank's stored parameters of unit `u` (from NVMe when offloaded there).
    pub(super) fn local_params(&self, u: usize) -> Result<LowParams, EngineError> {
        let unit = &self.units[u];
        if let Params::Memory(params) = &unit.params {
            return Ok(LowParams::clone(params));
        }
        let len = if self.stage() == 3 {
            unit.part.shard
        } else {
            unit.part.padded
        };
        let bytes = (len * self.plan.precision.bytes()) as u64;
        self.tracks.compute.span(Phase::NvmeRead, Some(u), bytes, || {
            prefetch::read_param_shard(self.param_store, self.rank, u, len, &self.plan.precision)
        })
    }

    /// Adds a unit's flat gradient (numel elements, the compute kind) into this rank's
    /// accumulator: reduce-scattered at stages 2–3 (on the reduce lane when it runs), else
    /// added to the replica's accumulator.
    fn accumulate(&mut self, u: usize, grad: &Tensor) -> Result<(), EngineError> {
        let part = self.units[u].part;
        if self.stage() >= 2 {
            if let Some(reducer) = self.reducer.as_mut() {
                // a unit reduced twice in a micro-batch (the tied embedding): its
                // accumulator comes back from the lane first
                while reducer.holds(u) {
                    if let Some((v, acc)) = reducer.take(true)? {
                        self.units[v].grad = acc;
                    }
                }
                let acc = std::mem::take(&mut self.units[u].grad);
                if let Some((v, acc)) = reducer.send(u, grad.shallow_clone(), part, acc)? {
                    self.units[v].grad = acc;
                }
                return self.absorb(false);
            }
        }
        let target = if self.stage() >= 2 {
            Target::Shard
        } else {
            Target::Replica
        };
        reduce_into(
            &self.comm,
            target,
            u,
            grad,
            part,
            &mut self.units[u].grad,
            &mut self.chunk_buffers,
            &self.tracks.compute,
            CHUNK_LIMIT,
        )
    }

    /// Puts the accumulators the reduce lane finished back in their units, in the order
    /// they were sent; with `wait`, every outstanding one.
    fn absorb(&mut self, wait: bool) -> Result<(), EngineError> {
        while let Some((u, acc)) = match self.reducer.as_mut() {
            Some(r) => r.take(wait)?,
            None => None,
        } {
            self.units[u].grad = acc;
        }
        Ok(())
    }

    /// Every micro-batch of the step, with the reduce lane when gradients are
    /// reduce-scattered per unit and `overlap_comm` asks for it. Returns the loss.
    fn micro_batches(&mut self, step: u64, loss_scale: f64) -> Result<f64, EngineError> {
        let plan = self.plan;
        let world = self.comm.world();
        let run = |engine: &mut Self| -> Result<f64, EngineError> {
            let mut loss = 0.0;
            for micro in 0..plan.batch.gradient_accumulation_steps {
                let global_micro = (micro * world + engine.rank) as u64;
                loss += engine.with_prefetch(|engine, prefetch| {
                    engine.micro_batch(prefetch, step, global_micro, loss_scale)
                })?;
            }
            engine.absorb(true)?;
            Ok(loss)
        };
        if self.stage() < 2 || !self.overlap || !plan.zero.overlap_comm {
            return run(self);
        }
        let abort = self.reduce_comm.clone();
        let (rank, mode) = (self.rank, self.lanes.mode);
        std::thread::scope(|scope| {
            let lane = Lane::start(scope, rank, "reduce", mode);
            let buffers = std::mem::take(&mut self.chunk_buffers);
            self.reducer = Some(Reducer::new(
                lane,
                self.reduce_comm.clone(),
                self.tracks.reduce.clone(),
                buffers,
            ));
            let result = run(self);
            if let Err(e) = &result {
                abort.abort(&e.to_string());
            }
            if let Some(r) = self.reducer.take() {
                self.chunk_buffers = r.finish();
            }
            result
        })
    }

    /// One optimizer step: every micro-batch of this rank, then the update, which runs on
    /// a thread of `scope` when one is given (see [`Self::optimize`]).
    pub fn step<'s, 'e>(
        &mut self,
        step: u64,
        scope: Option<&'s std::thread::Scope<'s, 'e>>,
    ) -> Result<StepReport, EngineError>
    where
        'a: 'e,
    {
        let plan = self.plan;
        for unit in &mut self.units {
            // (a gradient lent to the optimizer phase comes back zeroed)
            unit.grad.fill_zero();
        }
        let loss_scale = self.scaler.scale;
        let loss = self.micro_batches(step, loss_scale)?;
        // stages 0 and 1 all-reduce whole gradients once per step
        let reduce_start = Instant::now();
        if self.stage() <= 1 {
            for u in 0..self.units.len() {
                let mut grads = std::mem::take(&mut self.units[u].grad);
                let g = grads.as_f32_mut().ok_or_else(|| EngineError::Other {
                    rank: self.rank,
                    message: "stages 0-1 keep fp32 gradients".into(),
                })?;
                self.comm.all_reduce(g, ReduceOp::Avg)?;
                self.units[u].grad = grads;
            }
        }
        let mut losses = [loss];
        self.comm.all_reduce(&mut losses, ReduceOp::Avg)?;
        // the global gradient norm (of the unscaled gradients)
        let mut sum_sq = [self
            .units
            .iter()
            .map(|u| u.grad.sum_squares(self.opt_range(u)))
            .sum::<f64>()];
        if self.stage() >= 1 {
            self.comm.all_reduce(&mut sum_sq, ReduceOp::Sum)?;
        }
        self.tracks.compute.record(Phase::Reduce, None, reduce_start, 0);
        let grad_norm = sum_sq[0].sqrt() / loss_scale;
        // DeepSpeed steps its scheduler only when the update is applied: the rate is that
        // of the number of applied steps, so overflow-skipped steps do not advance it.
        let lr = learning_rate(&plan.scheduler, f64::from(plan.optimizer.lr), self.adam_steps);
        let mut report = StepReport {
            loss: losses[0],
            grad_norm,
            lr,
            loss_scale,
            skipped: false,
        };
        if !grad_norm.is_finite() {
            // fp16 overflow (or a non-finite gradient in any precision): skip the update
            self.scaler.update(true);
            report.skipped = true;
            return Ok(report);
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
        let coefficients = plan
            .optimizer
            .hyper(lr as f32)
            .coefficients(self.adam_steps, grad_scale as f32);
        self.install_all()?;
        self.optimize(coefficients, scope)?;
        Ok(report)
    }

    /// Runs `body` with the prefetcher's lanes at stage 3 (none below). On any error the
    /// gather communicator is aborted, so no rank's gather lane waits forever.
    fn with_prefetch<T>(
        &mut self,
        body: impl FnOnce(&mut Self, Option<&mut Prefetcher<'a, C>>) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if self.stage() != 3 || !self.overlap {
            return body(self, None);
        }
        let tied = self.model.config.tie_word_embeddings;
        let threshold = self.plan.zero.param_persistence_threshold;
        let parts: Vec<Partition> = self.units.iter().map(|u| u.part).collect();
        let mut order = prefetch::schedule(parts.len(), tied, |u| parts[u].numel <= threshold);
        // a pending update invalidates every cached unit before its use, so while one is
        // pending every unit is fetched
        let pending = self.updates.is_some();
        order.retain(|&(u, _)| pending || self.units[u].persistent.is_none());
        let fetcher = Fetcher {
            comm: self.gather_comm.clone(),
            rank: self.rank,
            store: self.param_store,
            precision: self.plan.precision,
            kind: self.model.kind,
            compute: self.compute,
            parts,
            gather_track: self.tracks.prefetch.clone(),
            h2d_track: self.tracks.h2d.clone(),
            dropped: self.lanes.dropped,
        };
        let limits = prefetch::Limits {
            bucket: self.plan.zero.prefetch_bucket_size,
            max_live: self.plan.zero.max_live_parameters,
            persistence_threshold: threshold,
        };
        let buffers = self
            .gather_buffers
            .take()
            .unwrap_or_else(|| GatherBuffers::new(self.lanes.mode));
        let (gather_comm, mode, rank) = (self.gather_comm.clone(), self.lanes.mode, self.rank);
        std::thread::scope(|scope| {
            let lanes = FetchLanes {
                h2d: Lane::start(scope, rank, "h2d", mode),
                gather: Lane::start(scope, rank, "gather", mode),
            };
            let mut prefetcher = Prefetcher::new(
                order,
                self.plan.precision.bytes(),
                limits,
                self.device.clone(),
                self.tracks.compute.clone(),
                buffers,
                lanes,
                fetcher,
            );
            let result = body(self, Some(&mut prefetcher));
            if let Err(e) = &result {
                gather_comm.abort(&e.to_string());
            }
            self.gather_buffers = Some(prefetcher.finish());
            result
        })
    }

    /// One micro-batch: forward, the final unit's loss and backward, backward by
    /// recompute. Returns this micro-batch's share of the step loss.
    fn micro_batch(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        step: u64,
        global_micro: u64,
        loss_scale: f64,
    ) -> Result<f64, EngineError> {
        let plan = self.plan;
        let gas = plan.batch.gradient_accumulation_steps;
        let last = self.units.len() - 1;
        let (rows, seq) = (plan.batch.micro_batch_per_gpu, plan.data.seq_len);
        let data_start = Instant::now();
        let batch = self
            .dataset
            .batch(plan.train.seed, 0, step, global_micro, rows, seq);
        let shape = [rows as i64, seq as i64];
        let tokens = torch::tensor_tokens(&batch.inputs, &shape, self.compute).map_err(self.torch_err())?;
        let targets = torch::tensor_tokens(&batch.targets, &shape, self.compute).map_err(self.torch_err())?;
        self.tracks.compute.record(Phase::Forward, None, data_start, 0);
        // forward, keeping each unit's input (activation checkpoints on the device)
        let mut kept = vec![self.device.reserve(8 * (rows * seq) as u64, "token ids")?];
        let mut inputs = vec![tokens];
        for u in 0..last {
            let (params, _gathered) = self.fetch(prefetch.as_deref_mut(), u)?;
            let y = self
                .tracks
                .compute
                .span(Phase::Forward, Some(u), 0, || {
                    let y = self.model.forward_unit(u, &params, &inputs[u])?;
                    self.settle().map(|()| y)
                })
                .map_err(self.torch_err())?;
            let bytes = (y.numel() * self.plan.precision.bytes()) as u64;
            kept.push(
                self.device
                    .reserve(bytes, &format!("activation checkpoint of unit {}", u + 1))?,
            );
            inputs.push(y);
        }
        // loss and the final unit's backward
        let (params, gathered) = self.fetch(prefetch.as_deref_mut(), last)?;
        let tied = if self.model.config.tie_word_embeddings {
            Some(self.fetch(prefetch.as_deref_mut(), 0)?)
        } else {
            None
        };
        let final_start = Instant::now();
        let fin = self
            .model
            .backward_final(
                &params,
                tied.as_ref().map(|t| &t.0),
                &inputs[last],
                &targets,
                loss_scale / gas as f64,
            )
            .map_err(self.torch_err())?;
        self.settle().map_err(self.torch_err())?;
        self.tracks
            .compute
            .record(Phase::Backward, Some(last), final_start, 0);
        drop((params, gathered, tied));
        let loss = fin.loss_sum / fin.count.max(1) as f64 / gas as f64;
        self.accumulate(last, &fin.params)?;
        if let Some(t) = &fin.tied {
            self.accumulate(0, &t.reshape([-1]))?;
        }
        // backward in reverse by recompute
        let mut grad_out = fin.input;
        for u in (0..last).rev() {
            let (params, _gathered) = self.fetch(prefetch.as_deref_mut(), u)?;
            let (g, grad_in) = self
                .tracks
                .compute
                .span(Phase::Backward, Some(u), 0, || {
                    let grads = self.model.backward_unit(u, &params, &inputs[u], &grad_out)?;
                    self.settle().map(|()| grads)
                })
                .map_err(self.torch_err())?;
            self.accumulate(u, &g)?;
            if let Some(d) = grad_in {
                grad_out = d;
            }
        }
        drop(kept);
        Ok(loss)
    }

    /// fp32 master weights of this rank's optimizer partition of unit `u`.
    pub fn master(&mut self, u: usize) -> Result<(usize, Vec<f32>), EngineError> {
        self.install_all()?;
        let unit = &self.units[u];
        if let Some(state) = &unit.optimizer {
            return Ok((unit.opt_start, state.master.clone()));
        }
        let Some(store) = self.store else {
            return Err(EngineError::Other {
                rank: self.rank,
                message: "optimizer state has no tier".into(),
            });
        };
        let mut master = vec![0f32; unit.opt_len];
        let key = TensorKey {
            unit: u as u32,
            rank: self.rank as u32,
            state: State::Master,
        };
        let scratch = IoBuf::new(store.chunk_bytes(4)).map_err(|e| EngineError::Other {
            rank: self.rank,
            message: e.to_string(),
        })?;
        store
            .read_tensor(key, f32_bytes_mut(&mut master), scratch)
            .map_err(self.io_err())?;
        Ok((unit.opt_start, master))
    }

    pub fn unit_count(&self) -> usize {
        self.units.len()
    }

    pub fn is_embedding(&self, u: usize) -> bool {
        self.model.units[u].kind == UnitKind::Embedding
    }

    /// Peak device bytes this rank has held.
    pub fn device_peak(&self) -> u64 {
        self.device.peak()
    }

    /// Bytes on each tier now (device: the peak since the last call; NVMe: the swap
    /// stores' files, every rank's).
    pub fn tier_bytes(&self) -> TierBytes {
        let optimizer_tier = self.plan.zero.offload_optimizer.tier;
        let host: usize = self
            .units
            .iter()
            .map(|u| {
                // the optimizer thread may hold the state: count it by size
                let optimizer = if optimizer_tier == Tier::Cpu {
                    12 * u.opt_len
                } else {
                    0
                };
                // the optimizer phase may hold the gradient: count it by size
                let grads = if optimizer_tier == Tier::Device {
                    0
                } else {
                    let len = if self.stage() >= 2 {
                        u.opt_len
                    } else {
                        u.part.padded
                    };
                    len * if bf16_gradients(self.plan) { 2 } else { 4 }
                };
                let params = match (&u.params, self.plan.zero.offload_param.tier) {
                    (Params::Memory(p), Tier::Cpu) => p.as_bytes().len(),
                    _ => 0,
                };
                params + optimizer + grads
            })
            .sum::<usize>()
            + self.pool.as_ref().map_or(0, |p| p.count() * p.buffer_bytes());
        TierBytes {
            device: self.device.take_window_peak(),
            host: host as u64,
            nvme: [self.store, self.param_store]
                .iter()
                .flatten()
                .map(|s| s.disk_bytes())
                .sum(),
        }
    }

    pub fn loss_scale(&self) -> f64 {
        self.scaler.scale
    }

    /// Mean loss on `batches` evaluation micro-batches of this rank (no update).
    pub fn eval(&mut self, batches: usize) -> Result<f64, EngineError> {
        let plan = self.plan;
        let world = self.comm.world();
        let last = self.units.len() - 1;
        let (rows, seq) = (plan.batch.micro_batch_per_gpu, plan.data.seq_len);
        let (mut sum, mut count) = (0.0, 0.0);
        for b in 0..batches {
            let batch = self
                .dataset
                .batch(plan.train.seed, 1, 0, (b * world + self.rank) as u64, rows, seq);
            let shape = [rows as i64, seq as i64];
            let mut x =
                torch::tensor_tokens(&batch.inputs, &shape, self.compute).map_err(self.torch_err())?;
            let targets =
                torch::tensor_tokens(&batch.targets, &shape, self.compute).map_err(self.torch_err())?;
            for u in 0..last {
                let (params, _gathered) = self.fetch(None, u)?;
                x = self
                    .model
                    .forward_unit(u, &params, &x)
                    .map_err(self.torch_err())?;
            }
            let (params, _gathered) = self.fetch(None, last)?;
            let tied = if self.model.config.tie_word_embeddings {
                Some(self.fetch(None, 0)?)
            } else {
                None
            };
            let (s, c) = self
                .model
                .loss(&params, tied.as_ref().map(|t| &t.0), &x, &targets)
                .map_err(self.torch_err())?;
            sum += s;
            count += c as f64;
        }
        let mut totals = [sum, count];
        self.comm.all_reduce(&mut totals, ReduceOp::Sum)?;
        Ok(totals[0] / totals[1].max(1.0))
    }
}

/// Whether gradient accumulators are kept in bf16: a bf16 run whose optimizer state is on
/// NVMe, at stages 2–3, without gradient accumulation (see `grads.rs`). With several
/// micro-batches per step a bf16 sum of nearly cancelling micro-batch gradients can
/// flip a sign that Adam then follows at full step size, so those runs keep fp32.
pub(super) fn bf16_gradients(plan: &Plan) -> bool {
    plan.zero.stage >= 2
        && plan.zero.offload_optimizer.tier == Tier::Nvme
        && plan.precision == Precision::Bf16
        && plan.batch.gradient_accumulation_steps == 1
}

/// Rounds fp32 values into the stored precision.
fn round_into(values: &[f32], out: &mut LowParams, precision: &Precision) {
    match out {
        LowParams::F32(o) => o.copy_from_slice(values),
        LowParams::U16(o) => {
            for (d, &x) in o.iter_mut().zip(values) {
                *d = match precision {
                    Precision::Fp16(_) => tierzero_offload::convert::f32_to_f16(x),
                    _ => tierzero_offload::convert::f32_to_bf16(x),
                };
            }
        }
    }
}

pub(super) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 4) }
}

fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: any byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 4) }
}

/// The element kind tch uses for a precision (re-exported for the trainer).
pub fn kind_for(precision: &Precision) -> Kind {
    torch::compute_kind(precision)
}
