//! The owner of a rank's low-precision parameters: each unit's residency (memory or
//! NVMe), the gathered form of persistent units, and the buffers reused between
//! updates. Residency changes only here: at start-up ([`Units::push`]) and when an
//! update is installed ([`Units::install`]).

use super::error::{EngineError, On};
use super::params::{LowParams, Params};
use super::partition::Partition;
use super::prefetch::{self, GatherBuffers, Source};
use crate::comm::Collective;
use crate::config::plan::Precision;
use crate::device::cpu::Reservation;
use crate::device::lanes::Mode;
use crate::metrics::timeline::{Phase, Track};
use crate::torch;
use std::sync::Arc;
use std::time::Instant;
use tch::Tensor;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pool::IoBuf;

/// One unit's parameters on this rank.
struct Unit<'a> {
    part: Partition,
    /// Stage 3: this rank's shard; else the padded replica.
    params: Params<'a>,
    /// Stage-3 units at or below the persistence threshold keep their gathered form
    /// (with the device memory it holds) until their next update.
    persistent: Option<(Tensor, Reservation)>,
    /// A buffer the unit no longer needs, for the next update's new partition.
    spare: Option<LowParams>,
}

/// Where the optimizer writes a unit's new low-precision partition.
pub(super) enum Destination<'a> {
    /// Into this buffer, installed by [`Units::install`] when the update arrives.
    Memory(LowParams),
    /// Into the NVMe parameter store, from the optimizer lane's staging buffer.
    Nvme(&'a SwapStore),
}

/// A unit's new low-precision partition: in a buffer to install, or already written to
/// the NVMe parameter store by the optimizer lane.
pub(super) enum NewParams {
    Memory(LowParams),
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
}

impl<'a> Units<'a> {
    pub(super) fn new(
        rank: usize,
        stage: u8,
        precision: Precision,
        (kind, compute): (tch::Kind, tch::Device),
        persistence_threshold: usize,
        mode: Mode,
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
        }
    }

    /// Adds the next unit with its initial stored parameters, written to the NVMe
    /// parameter store when `nvme` is given.
    pub(super) fn push(
        &mut self,
        part: Partition,
        initial: LowParams,
        nvme: Option<&'a SwapStore>,
    ) -> Result<(), EngineError> {
        let u = self.units.len();
        let params = match nvme {
            Some(store) => {
                let scratch = IoBuf::new(store.chunk_bytes(initial.elem_bytes())).map_err(self.on.alloc())?;
                store
                    .write_tensor(self.key(u), initial.as_bytes(), scratch)
                    .map_err(self.on.io())?;
                Params::Nvme(store)
            }
            None => Params::Memory(Arc::new(initial)),
        };
        self.units.push(Unit {
            part,
            params,
            persistent: None,
            spare: None,
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

    /// This rank's stored parameters of unit `u`, read from NVMe when they live there.
    pub(super) fn stored(&self, u: usize, track: &Track) -> Result<LowParams, EngineError> {
        match &self.units[u].params {
            Params::Memory(params) => Ok(LowParams::clone(params)),
            Params::Nvme(store) => {
                let len = self.stored_len(u);
                let bytes = (len * self.precision.bytes()) as u64;
                track.span(Phase::NvmeRead, Some(u), bytes, || {
                    prefetch::read_param_shard(store, self.on.0, u, len, &self.precision)
                })
            }
        }
    }

    /// Calls `f` with this rank's stored parameters of unit `u` (no copy in memory).
    pub(super) fn with_stored<T>(
        &self,
        u: usize,
        track: &Track,
        f: impl FnOnce(&LowParams) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        match &self.units[u].params {
            Params::Memory(params) => f(params),
            Params::Nvme(_) => f(&self.stored(u, track)?),
        }
    }

    /// Unit `u`'s whole parameters (a padded buffer) as a tensor of the compute kind.
    pub(super) fn tensor_of(&self, full: &LowParams, u: usize, track: &Track) -> Result<Tensor, EngineError> {
        let numel = self.units[u].part.numel;
        let bytes = (numel * full.elem_bytes()) as u64;
        track
            .span(Phase::H2d, Some(u), bytes, || match full {
                LowParams::F32(v) => torch::tensor_f32(&v[..numel], self.compute),
                LowParams::U16(v) => torch::tensor_u16(&v[..numel], self.kind, self.compute),
            })
            .map_err(self.on.torch())
    }

    /// The replica of unit `u` (stages 0–2) as a tensor; in memory without a clone.
    pub(super) fn replica(&self, u: usize, track: &Track) -> Result<Tensor, EngineError> {
        self.with_stored(u, track, |params| self.tensor_of(params, u, track))
    }

    /// Stage 3 without the prefetch lanes: every rank's shard of unit `u` gathered here.
    pub(super) fn gather_now<C: Collective>(
        &self,
        u: usize,
        comm: &C,
        track: &Track,
    ) -> Result<Tensor, EngineError> {
        let shard = self.stored(u, track)?;
        let mut full = LowParams::zeros(self.units[u].part.padded, &self.precision);
        all_gather_into(comm, &shard, &mut full, track)?;
        self.tensor_of(&full, u, track)
    }

    /// Where the optimizer writes unit `u`'s new partition of `len` elements: a spare
    /// buffer when one of that length is left, or straight to NVMe.
    pub(super) fn destination(&mut self, u: usize, len: usize) -> Destination<'a> {
        let unit = &mut self.units[u];
        match (&unit.params, unit.spare.take()) {
            (Params::Nvme(store), _) => Destination::Nvme(store),
            (Params::Memory(_), Some(p)) if p.len() == len => Destination::Memory(p),
            (Params::Memory(_), _) => Destination::Memory(LowParams::zeros(len, &self.precision)),
        }
    }

    /// The new parameters of unit `u` to where they live: all-gathered into the replica
    /// (stages 1–2) or kept in memory; parameters on NVMe were written by the optimizer
    /// lane already. The persistent gathered copy is dropped either way. Buffers the unit
    /// no longer needs become its spares for the next update.
    pub(super) fn install<C: Collective>(
        &mut self,
        u: usize,
        fresh: NewParams,
        comm: &C,
        track: &Track,
    ) -> Result<(), EngineError> {
        self.units[u].persistent = None;
        let fresh = match fresh {
            NewParams::Written => return Ok(()),
            NewParams::Memory(fresh) => fresh,
        };
        let params = match self.stage {
            3 | 0 => fresh,
            _ => {
                let padded = self.units[u].part.padded;
                // the old replica (stages 1-2 keep it in memory) is the gather's output
                let previous = match &mut self.units[u].params {
                    Params::Memory(old) => Some(std::mem::take(old)),
                    Params::Nvme(_) => None,
                };
                let mut full = match previous.map(Arc::try_unwrap) {
                    Some(Ok(old)) if old.len() == padded => old,
                    _ => LowParams::zeros(padded, &self.precision),
                };
                if let Err(e) = all_gather_into(comm, &fresh, &mut full, track) {
                    // the buffer goes back so the unit is never left empty (the run stops)
                    self.units[u].params = Params::Memory(Arc::new(full));
                    return Err(e);
                }
                self.units[u].spare = Some(fresh);
                full
            }
        };
        let previous = std::mem::replace(&mut self.units[u].params, Params::Memory(Arc::new(params)));
        if let (Params::Memory(old), 3 | 0) = (previous, self.stage) {
            // a lane may still hold the old shard: then it is dropped, not reused
            self.units[u].spare = Arc::try_unwrap(old).ok();
        }
        Ok(())
    }

    /// Host bytes of parameters kept in memory.
    pub(super) fn memory_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|u| match &u.params {
                Params::Memory(p) => p.as_bytes().len(),
                Params::Nvme(_) => 0,
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
    let start = Instant::now();
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
    track.record(Phase::AllGather, None, start, bytes);
    Ok(())
}
