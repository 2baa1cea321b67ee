//! The owner of a rank's low-precision parameters: each unit's residency (a tensor on
//! the rank's device, host memory or NVMe), the gathered form of persistent units, and
//! the buffers reused between updates. Residency changes only here: at start-up ([`Units::push`]) and when an
//! update is installed ([`Units::install`]).

use super::error::{EngineError, On};
use super::params::{LowParams, Params};
use super::prefetch::{self, GatherBuffers, Source};
use crate::comm::{collective_start, record_collective, Collective};
use crate::device::cpu::Reservation;
use crate::device::lanes::Mode;
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::partition::Partition;
use crate::plan::rules::gathers_updates;
use crate::plan::simulate::costs::Work;
use crate::plan::Precision;
use crate::torch::{self, Shared};
use std::sync::Arc;
use tch::Tensor;
use tierzero_offload::arena::Pinning;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pool::IoBuf;

/// Where a unit's stored parameters live (`offload_param`, `rules::param_tiers`).
#[derive(Clone, Copy)]
pub(super) enum Home<'a> {
    Device,
    Host,
    Nvme(&'a SwapStore),
}

/// One unit's parameters on this rank.
struct Unit<'a> {
    part: Partition,
    /// Stage 3: this rank's shard; else the padded replica.
    params: Params<'a>,
    /// Stage-3 units at or below the persistence threshold keep their gathered form
    /// (with the device memory it holds) until their next update.
    persistent: Option<(Tensor, Reservation)>,
    /// A host buffer the unit no longer needs, for the next update's new partition.
    spare: Option<LowParams>,
    /// Bytes of the host buffer lent to the optimizer for the new partition, until the
    /// update is installed (counted as the unit's, as its old buffer may be that one).
    lent: usize,
    /// Stages 1–2 with several ranks and the replica on the device: the new partition,
    /// all-gathered from here into the replica in place (made at the first update).
    partition: Option<Tensor>,
}

/// Where the optimizer writes a unit's new low-precision partition.
pub(super) enum Destination<'a> {
    /// Into this host buffer, installed by [`Units::install`] when the update arrives.
    Host(LowParams),
    /// Into this tensor on the device (parameters and optimizer state both there).
    Device(Tensor),
    /// Into this tensor on the device from the host's optimizer, through the optimizer
    /// thread's two buffers (`update_copies.rs`).
    ToDevice(Tensor),
    /// Into the NVMe parameter store, from the optimizer lane's staging buffer.
    Nvme(&'a SwapStore),
}

/// A unit's new low-precision partition: in a buffer to install, or already written to
/// the NVMe parameter store by the optimizer lane.
pub(super) enum NewParams {
    Host(LowParams),
    Device(Tensor),
    Written,
}

pub(super) struct Units<'a> {
    units: Vec<Unit<'a>>,
    on: On,
    stage: u8,
    precision: Precision,
    kind: tch::Kind,
    compute: tch::Device,
    persistence_threshold: usize,
    /// Stage-3 gather buffers, reused across micro-batches (lent to the prefetcher).
    gather_buffers: Option<GatherBuffers>,
    /// How parameters in host memory are held (`offload_param.pin_memory`): each unit's
    /// in a locked arena of its own, registered with a CUDA rank's GPU; None: `Vec`s.
    pinning: Option<Pinning>,
}

impl<'a> Units<'a> {
    pub(super) fn new(
        rank: usize,
        stage: u8,
        precision: Precision,
        (kind, compute): (tch::Kind, tch::Device),
        persistence_threshold: usize,
        (mode, pinning): (Mode, Option<Pinning>),
    ) -> Units<'a> {
        Units {
            units: Vec::new(),
            on: On(rank),
            stage,
            precision,
            kind,
            compute,
            persistence_threshold,
            gather_buffers: Some(GatherBuffers::new(mode)),
            pinning,
        }
    }

    /// `values` as parameters in host memory are held: in a locked (and registered)
    /// arena of their own with `offload_param.pin_memory`, copied there unless they are
    /// in one already. Where the arena cannot be made, the values come back with the
    /// error.
    fn held(&self, values: LowParams) -> Result<LowParams, (LowParams, EngineError)> {
        match &self.pinning {
            Some(pinning) if !values.is_pinned() => match values.pinned(pinning) {
                Ok(pinned) => Ok(pinned),
                Err(source) => {
                    let rank = self.on.0;
                    let what = "parameters";
                    Err((values, EngineError::Arena { rank, what, source }))
                }
            },
            _ => Ok(values),
        }
    }

    /// Adds the next unit with its initial stored parameters, put on its home tier.
    pub(super) fn push(
        &mut self,
        part: Partition,
        initial: LowParams,
        home: Home<'a>,
    ) -> Result<(), EngineError> {
        let u = self.units.len();
        let params = match home {
            Home::Nvme(store) => {
                let buffer = || IoBuf::new(store.chunk_bytes(initial.elem_bytes())).map_err(self.on.alloc());
                store
                    .write_tensor_ahead(self.key(u), initial.as_bytes(), [buffer()?, buffer()?])
                    .map_err(self.on.io())?;
                Params::Nvme(store)
            }
            Home::Host => Params::Host(Arc::new(self.held(initial).map_err(|(_, e)| e)?)),
            Home::Device => {
                let tensor = self.upload(&initial, initial.len()).map_err(self.on.torch())?;
                Params::Device(Shared::new(tensor))
            }
        };
        self.units.push(Unit {
            part,
            params,
            persistent: None,
            spare: None,
            lent: 0,
            partition: None,
        });
        Ok(())
    }

    fn key(&self, u: usize) -> TensorKey {
        TensorKey {
            unit: u as u32,
            rank: self.on.0 as u32,
            state: State::Param,
        }
    }

    pub(super) fn part(&self, u: usize) -> Partition {
        self.units[u].part
    }

    pub(super) fn parts(&self) -> Vec<Partition> {
        self.units.iter().map(|u| u.part).collect()
    }

    pub(super) fn len(&self) -> usize {
        self.units.len()
    }

    /// The gathered form of a persistent unit, while it is valid.
    pub(super) fn persistent(&self, u: usize) -> Option<Tensor> {
        self.units[u].persistent.as_ref().map(|(t, _)| t.shallow_clone())
    }

    /// Where the lanes find unit `u`'s stored parameters (shared, never copied here).
    pub(super) fn source(&self, u: usize) -> Source<'a> {
        self.units[u].params.clone()
    }

    /// A gathered unit becomes persistent when small enough (the tensor stays, the
    /// caller gets no reservation to drop); otherwise it is handed back as it came.
    pub(super) fn keep_if_small(
        &mut self,
        u: usize,
        tensor: Tensor,
        hold: Option<Reservation>,
    ) -> (Tensor, Option<Reservation>) {
        match hold {
            Some(hold) if self.units[u].part.numel <= self.persistence_threshold => {
                self.units[u].persistent = Some((tensor.shallow_clone(), hold));
                (tensor, None)
            }
            hold => (tensor, hold),
        }
    }

    /// Elements this rank stores of unit `u`: its shard at stage 3, else the replica.
    fn stored_len(&self, u: usize) -> usize {
        let part = self.units[u].part;
        if self.stage == 3 {
            part.shard
        } else {
            part.padded
        }
    }

    /// The swap store holding unit `u`'s parameters, when they are on NVMe.
    pub(super) fn nvme_store(&self, u: usize) -> Option<&'a SwapStore> {
        match &self.units[u].params {
            Params::Nvme(store) => Some(*store),
            _ => None,
        }
    }

    /// This rank's stored parameters of unit `u` in host memory: copied from the device
    /// or read from NVMe when they live there.
    pub(super) fn stored(&self, u: usize, track: &Track) -> Result<LowParams, EngineError> {
        match &self.units[u].params {
            Params::Host(params) => Ok(LowParams::clone(params)),
            Params::Device(tensor) => {
                let mut params = LowParams::zeros(self.stored_len(u), &self.precision);
                torch::copy_to_host(&tensor.tensor(), params.bytes_mut()).map_err(self.on.torch())?;
                Ok(params)
            }
            Params::Nvme(store) => {
                let len = self.stored_len(u);
                let bytes = (len * self.precision.bytes()) as u64;
                sim::charge(Work::NvmeRead(bytes));
                track.span(Phase::NvmeRead, Some(u), bytes, || {
                    prefetch::read_param_shard(store, self.on.0, u, len, &self.precision)
                })
            }
        }
    }

    /// Calls `f` with this rank's stored parameters of unit `u` in host memory (no copy
    /// when they live there).
    pub(super) fn with_stored<T>(
        &self,
        u: usize,
        track: &Track,
        f: impl FnOnce(&LowParams) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        match &self.units[u].params {
            Params::Host(params) => f(params),
            Params::Device(_) | Params::Nvme(_) => f(&self.stored(u, track)?),
        }
    }

    /// The first `len` elements of host `params` as a tensor of the compute kind on the
    /// device.
    fn upload(&self, params: &LowParams, len: usize) -> Result<Tensor, tch::TchError> {
        match params {
            LowParams::F32(v) => torch::tensor_f32(&v[..len], self.compute),
            LowParams::U16(v) => torch::tensor_u16(&v[..len], self.kind, self.compute),
        }
    }

    /// The replica of unit `u` (stages 0–2) as a tensor: a view of it on the device, else
    /// copied there.
    pub(super) fn replica(&self, u: usize, track: &Track) -> Result<Tensor, EngineError> {
        let numel = self.units[u].part.numel;
        if let Params::Device(tensor) = &self.units[u].params {
            return tensor
                .tensor()
                .f_narrow(0, 0, numel as i64)
                .map_err(self.on.torch());
        }
        self.with_stored(u, track, |params| {
            let bytes = (numel * params.elem_bytes()) as u64;
            sim::charge(Work::H2dPageable(bytes));
            track
                .span(Phase::H2d, Some(u), bytes, || self.upload(params, numel))
                .map_err(self.on.torch())
        })
    }

    /// Stage 3 without the prefetch lanes: every rank's shard of unit `u` gathered here,
    /// on the device.
    pub(super) fn gather_now<C: Collective>(
        &self,
        u: usize,
        comm: &C,
        track: &Track,
    ) -> Result<Tensor, EngineError> {
        let part = self.units[u].part;
        let shard = match &self.units[u].params {
            Params::Device(tensor) => tensor.tensor(),
            _ => {
                let stored = self.stored(u, track)?;
                let bytes = stored.as_bytes().len() as u64;
                sim::charge(Work::H2dPageable(bytes));
                track
                    .span(Phase::H2d, Some(u), bytes, || self.upload(&stored, part.shard))
                    .map_err(self.on.torch())?
            }
        };
        let full = self.device_tensor(part.padded).map_err(self.on.torch())?;
        gather_tensor(comm, &shard, &full, track)?;
        full.f_narrow(0, 0, part.numel as i64).map_err(self.on.torch())
    }

    fn device_tensor(&self, len: usize) -> Result<Tensor, tch::TchError> {
        Tensor::f_empty([len as i64], (self.kind, self.compute))
    }

    fn gathers_updates(&self, u: usize) -> bool {
        gathers_updates(self.stage, self.units[u].part.world)
    }

    /// Where the new partition of `len` elements of a unit stored on the device is
    /// written: the stored tensor itself, updated in place (its shard at stage 3, the
    /// whole replica at stage 0 or with one rank), or the partition the stage 1–2 gather
    /// reads from.
    ///
    /// In place is safe because every reader of a unit's stored parameters — compute's
    /// views and the gather lane — starts only after the unit's update is installed
    /// (`install_through` precedes each fetch and each prefetch request), and the
    /// readers of the previous step are done before the optimizer is handed its
    /// destinations (the prefetch lanes are drained at the end of the micro-batches;
    /// on a GPU compute's stream orders the rest: the optimizer's stream starts after
    /// compute's mark). On a GPU the update's kernels run on the optimizer's own stream;
    /// each update carries a mark of it that compute's stream waits for where it
    /// installs the update (`Installer::through`), so the mark a gather's job waits for,
    /// recorded on compute's stream at its submission, covers the update.
    fn update_target(&mut self, u: usize, len: usize) -> Result<Tensor, EngineError> {
        let target = match (&self.units[u].partition, &self.units[u].params) {
            (Some(partition), _) => partition.shallow_clone(),
            (None, _) if self.gathers_updates(u) => {
                // made at the first update, kept for the run
                let partition = self.device_tensor(len).map_err(self.on.torch())?;
                self.units[u].partition = Some(partition.shallow_clone());
                partition
            }
            (None, Params::Device(stored)) => stored.tensor(),
            (None, Params::Host(_) | Params::Nvme(_)) => {
                return Err(EngineError::Invariant {
                    rank: self.on.0,
                    what: "a device update target for parameters off the device",
                })
            }
        };
        target.f_narrow(0, 0, len as i64).map_err(self.on.torch())
    }

    /// Where the optimizer writes unit `u`'s new partition of `len` elements: straight to
    /// NVMe; into a device tensor where the parameters are on the device (with the
    /// optimizer state there, `device_optimizer`, or from the host's optimizer through its
    /// copy buffers); else into a host buffer. Spare buffers of that length are reused.
    pub(super) fn destination(
        &mut self,
        u: usize,
        len: usize,
        device_optimizer: bool,
    ) -> Result<Destination<'a>, EngineError> {
        let destination = match &self.units[u].params {
            Params::Nvme(store) => Destination::Nvme(store),
            Params::Device(_) if device_optimizer => Destination::Device(self.update_target(u, len)?),
            Params::Device(_) => Destination::ToDevice(self.update_target(u, len)?),
            Params::Host(_) if matches!(self.stage, 0 | 3) => self.overwritten(u, len),
            Params::Host(_) => match self.units[u].spare.take() {
                Some(p) if p.len() == len => Destination::Host(p),
                _ => Destination::Host(LowParams::zeros(len, &self.precision)),
            },
        };
        if let Destination::Host(buffer) = &destination {
            self.units[u].lent = buffer.as_bytes().len();
        }
        Ok(destination)
    }

    /// Stages 0 and 3, parameters in host memory: the update overwrites the unit's own
    /// buffer (one copy of the parameters, not two). The old values are dead once the
    /// step's backward is done: nothing reads a unit before its update is installed
    /// (`install_through`, the prefetcher's sources, a checkpoint's `install_all`). A
    /// buffer a lane still holds is left to it, and the update gets a new one.
    fn overwritten(&mut self, u: usize, len: usize) -> Destination<'a> {
        let old = match &mut self.units[u].params {
            Params::Host(old) => std::mem::take(old),
            Params::Device(_) | Params::Nvme(_) => {
                return Destination::Host(LowParams::zeros(len, &self.precision))
            }
        };
        match Arc::try_unwrap(old) {
            Ok(own) if own.len() == len => Destination::Host(own),
            kept => {
                self.units[u].params = Params::Host(kept.map_or_else(|shared| shared, Arc::new));
                Destination::Host(LowParams::zeros(len, &self.precision))
            }
        }
    }

    /// The new parameters of unit `u` to where they live: on the device written in place
    /// (by the optimizer thread) and all-gathered into the replica (stages 1–2), in host
    /// memory all-gathered into the replica (stages 1–2) or kept as the unit's stored
    /// parameters; parameters on NVMe were written by the optimizer lane already. The
    /// persistent gathered copy is dropped either way. Host buffers the unit no longer needs become its spares for the
    /// next update.
    pub(super) fn install<C: Collective>(
        &mut self,
        u: usize,
        fresh: NewParams,
        comm: &C,
        track: &Track,
    ) -> Result<(), EngineError> {
        self.units[u].persistent = None;
        self.units[u].lent = 0;
        let written = match (fresh, &self.units[u].params) {
            (NewParams::Written, _) => return Ok(()),
            (NewParams::Device(written), Params::Device(_)) => written,
            (NewParams::Host(_), Params::Device(_)) => {
                return Err(EngineError::Invariant {
                    rank: self.on.0,
                    what: "a host update for parameters on the device",
                })
            }
            (NewParams::Host(fresh), _) => return self.install_in_host(u, fresh, comm, track),
            (NewParams::Device(_), _) => {
                return Err(EngineError::Invariant {
                    rank: self.on.0,
                    what: "a device update for parameters off the device",
                })
            }
        };
        if let (true, Params::Device(stored)) = (self.gathers_updates(u), &self.units[u].params) {
            gather_tensor(comm, &written, &stored.tensor(), track)?;
        }
        Ok(())
    }

    /// The new partition in host memory becomes the unit's shard (stages 0 and 3) or is
    /// all-gathered into its replica (stages 1–2).
    fn install_in_host<C: Collective>(
        &mut self,
        u: usize,
        fresh: LowParams,
        comm: &C,
        track: &Track,
    ) -> Result<(), EngineError> {
        let params = match self.stage {
            3 | 0 => fresh,
            _ => {
                let padded = self.units[u].part.padded;
                // the old replica (stages 1-2 keep it in memory) is the gather's output
                let previous = match &mut self.units[u].params {
                    Params::Host(old) => Some(std::mem::take(old)),
                    Params::Device(_) | Params::Nvme(_) => None,
                };
                let mut full = match previous.map(Arc::try_unwrap) {
                    Some(Ok(old)) if old.len() == padded => old,
                    _ => LowParams::zeros(padded, &self.precision),
                };
                if let Err(e) = all_gather_into(comm, &fresh, &mut full, track) {
                    // the buffer goes back so the unit is never left empty (the run stops)
                    self.units[u].params = Params::Host(Arc::new(full));
                    return Err(e);
                }
                self.units[u].spare = Some(fresh);
                full
            }
        };
        // stages 0 and 3: the update was written over the old buffer, or into a new one
        // while a lane held the old (`overwritten`), which is dropped; a new buffer is
        // held as the old one was (else it stays, so the unit is never left empty)
        let (params, failed) = match self.held(params) {
            Ok(params) => (params, None),
            Err((params, e)) => (params, Some(e)),
        };
        self.units[u].params = Params::Host(Arc::new(params));
        failed.map_or(Ok(()), Err)
    }

    /// Host bytes of parameters: those kept in host memory, and the host buffers the
    /// CPU optimizer writes their new partitions into (spare, or lent until installed;
    /// the buffers of parameters on the device are the optimizer's, `update_copies.rs`).
    pub(super) fn memory_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|u| {
                let spare = u.spare.as_ref().map_or(0, |p| p.as_bytes().len());
                spare
                    + u.lent
                    + match &u.params {
                        Params::Host(p) => p.as_bytes().len(),
                        Params::Device(_) | Params::Nvme(_) => 0,
                    }
            })
            .sum()
    }

    /// The gather buffers, lent to a prefetcher for one micro-batch.
    pub(super) fn lend_gather_buffers(&mut self, mode: Mode) -> GatherBuffers {
        self.gather_buffers
            .take()
            .unwrap_or_else(|| GatherBuffers::new(mode))
    }

    pub(super) fn return_gather_buffers(&mut self, buffers: GatherBuffers) {
        self.gather_buffers = Some(buffers);
    }
}

/// Every rank's `shard` of a unit into `full` (its padded length, same precision).
fn all_gather_into<C: Collective>(
    comm: &C,
    shard: &LowParams,
    full: &mut LowParams,
    track: &Track,
) -> Result<(), EngineError> {
    let start = collective_start();
    let bytes = full.as_bytes().len() as u64;
    match (shard, &mut *full) {
        (LowParams::F32(s), LowParams::F32(out)) => comm.all_gather(s, out)?,
        (LowParams::U16(s), LowParams::U16(out)) => comm.all_gather(s, out)?,
        // one engine stores one precision: a shard and its unit always match
        _ => {
            return Err(EngineError::Invariant {
                rank: comm.rank(),
                what: "all-gather between two precisions",
            })
        }
    }
    record_collective(track, (Phase::AllGather, None), start, bytes);
    sim::charge(Work::Gather(bytes));
    Ok(())
}

/// Every rank's `shard` tensor into `full` (its padded length, same kind) on the device.
fn gather_tensor<C: Collective>(
    comm: &C,
    shard: &Tensor,
    full: &Tensor,
    track: &Track,
) -> Result<(), EngineError> {
    let start = collective_start();
    comm.all_gather_tensor(shard, full)?;
    let bytes = (full.numel() * full.kind().elt_size_in_bytes()) as u64;
    record_collective(track, (Phase::AllGather, None), start, bytes);
    sim::charge(Work::Gather(bytes));
    Ok(())
}
