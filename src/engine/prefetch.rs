//! Stage-3 prefetch on lanes: a shard on the device is all-gathered from where it lives;
//! a shard in host memory or on NVMe first goes to device staging on the h2d lane, and
//! the gather lane waits for that copy. The gather lane all-gathers into a pooled unit
//! buffer on the device, and the compute thread waits for the gather's event before it
//! computes, while later units are fetched. A unit whose next use comes within
//! `stage3_max_reuse_distance` elements stays gathered for it (`plan::fetch::Fetches`).
//!
//! Per micro-batch, the order in which units are fetched is fixed and the same on every
//! rank (`plan::fetch::schedule`). The compute thread asks for units ahead of time, as many as fit
//! in `stage3_prefetch_bucket_size` elements and `stage3_max_live_parameters` (at least
//! the one it needs now), at most `plan::fetch::MAX_IN_FLIGHT` ahead, and takes them in order. The
//! gather lane is the step's collectives lane, which also runs the reductions: every
//! rank issues the same collectives in the same order from one thread (on a GPU, on
//! one stream), so they cannot deadlock each other. DeepSpeed's PartitionedParameterCoordinator
//! plays this role with a CUDA stream per direction; FSDP2 with its all-gather stream.
//!
//! Buffers come from pools that stop allocating after the first step: unit buffers are
//! released when the compute thread is done with the unit, staging buffers with the
//! event of the gather that read them (`keep_until`).

use super::error::{EngineError, On};
use super::params::{LowParams, Params};
use crate::comm::{collective_start, record_collective, Collective};
use crate::device::cpu::{CpuDevice, Reservation};
use crate::device::lanes::{Event, Lane, LaneError, Mark, Mode, Streams};
use crate::device::pool::{tensor_buffer, Pool};
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::fetch::{may_request, Fetches, Limits, Purpose};
use crate::plan::partition::Partition;
use crate::plan::simulate::costs::Work;
use crate::plan::Precision;
use crate::torch;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::Tensor;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pool::IoBuf;

/// Waits a test may leave out on purpose, to show that checked lanes catch it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DroppedWait {
    #[default]
    None,
    /// Compute does not wait for the gather's event before using the unit.
    ComputeOnGather,
    /// The staging shard is released without waiting for the gather that reads it.
    StagingUntilGather,
    /// Compute does not wait for a device update's mark where it installs the update
    /// (on a GPU, the next gather and forward may read the old values).
    ComputeOnUpdate,
}

/// The buffers stage-3 fetches reuse across micro-batches and steps (device memory).
pub struct GatherBuffers {
    units: Pool<Tensor>,
    staging: Pool<Tensor>,
    /// The h2d lane's bounce buffers (it runs one job at a time).
    scratch: Arc<Mutex<Scratch>>,
}

/// The h2d lane's host buffers: the NVMe read's aligned bounce buffer, and on a GPU two
/// pinned buffers a shard read from NVMe goes through on its way to the device.
#[derive(Default)]
struct Scratch {
    /// The NVMe reads' two bounce buffers (two chunks in flight).
    io: Option<[IoBuf; 2]>,
    pinned: [Pinned; 2],
    next: usize,
    /// Registered shards a copy reads in place, held until its mark (`keep_until`).
    read_in_place: Vec<(Arc<LowParams>, Mark)>,
}

/// A pinned host buffer (torch's pinned allocator) and the mark of the asynchronous copy
/// that last read it: it is written again only after that mark (`keep_until`).
#[derive(Default)]
struct Pinned {
    buffer: Option<Tensor>,
    read_until: Option<Mark>,
}

impl Pinned {
    /// At least `bytes` pinned bytes, free of the copy that read them last.
    fn ready(&mut self, bytes: usize, rank: usize) -> Result<&Tensor, EngineError> {
        if let Some(mark) = self.read_until.take() {
            if let Err(message) = mark.synchronize() {
                // the copy may still read it: left to torch's pinned allocator, which
                // reuses the block only after the copy
                self.buffer = None;
                return Err(h2d_failed(rank, message.to_string()));
            }
        }
        if self.buffer.as_ref().is_none_or(|b| b.numel() < bytes) {
            let fresh =
                torch::shim::pinned_bytes(bytes).map_err(|source| EngineError::Torch { rank, source })?;
            self.buffer = Some(fresh);
        }
        self.buffer.as_ref().ok_or(EngineError::Invariant {
            rank,
            what: "a pinned buffer just made",
        })
    }
}

/// A failure of the h2d lane's device side.
fn h2d_failed(rank: usize, message: String) -> EngineError {
    LaneError::Failed {
        rank,
        lane: "h2d",
        message,
    }
    .into()
}

impl GatherBuffers {
    pub fn new(mode: Mode) -> GatherBuffers {
        GatherBuffers {
            units: Pool::new(mode),
            staging: Pool::new(mode),
            scratch: Arc::new(Mutex::new(Scratch::default())),
        }
    }

    /// Buffers made so far and their elements (units, staging).
    pub fn allocated(&self) -> [(usize, usize); 2] {
        [self.units.allocated(), self.staging.allocated()]
    }
}

/// Where a unit's shard comes from: the rank's own residency, shared (a memory shard is
/// never copied on the issuing thread).
pub type Source<'a> = Params<'a>;

/// What the prefetcher asks of the engine before it fetches a unit (the optimizer phase's
/// `Installer`): install the unit's pending update, and say where its shard is.
pub(super) trait Sources<'a> {
    fn source(&mut self, u: usize) -> Result<Source<'a>, EngineError>;
}

/// What the lanes need, owned or shared for the run (never the engine itself).
pub struct Fetcher<C: Collective> {
    pub comm: C,
    pub rank: usize,
    pub precision: Precision,
    pub kind: tch::Kind,
    pub compute: tch::Device,
    pub parts: Vec<Partition>,
    /// The lanes' tracks: all-gathers; copies and NVMe reads.
    pub gather_track: Track,
    pub h2d_track: Track,
    pub dropped: DroppedWait,
    /// The GPU's streams (None on CPU devices).
    pub streams: Option<Arc<dyn Streams>>,
    /// Each unit's parameters in host memory are pinned (`rules::pinned_params`): on a
    /// GPU their copy reads them in place, no fill of a pinned buffer first.
    pub pinned: Vec<bool>,
}

/// The two lanes a fetch runs on: the gather lane is the step's collectives lane,
/// shared with the gradient reduction (`step_lanes.rs`).
pub struct FetchLanes<'env> {
    pub h2d: Arc<Lane<'env>>,
    pub gather: Arc<Lane<'env>>,
}

/// A fetch issued to the lanes and not yet taken by the compute thread.
struct InFlight {
    unit: usize,
    buffer: Tensor,
    gathered: Event,
    hold: Reservation,
}

/// The compute thread's side: issues fetches ahead, takes them in order, and holds the
/// device memory of each gathered unit from request to release.
pub struct Prefetcher<'env, C: Collective> {
    /// The micro-batch's uses, and which are fetched.
    fetches: Fetches,
    /// The fetched uses, in order.
    schedule: Vec<(usize, Purpose)>,
    /// Uses the compute thread took so far.
    taken: usize,
    numels: Vec<usize>,
    padded_bytes: Vec<u64>,
    /// Units that stay gathered once fetched (not counted as in use, never pooled).
    persistent: Vec<bool>,
    limits: Limits,
    /// Elements of the units the compute thread holds (the one it computes with, and
    /// the final unit while the tied embedding joins it).
    in_use: usize,
    /// Their buffers, returned to the pool when the compute thread moves on.
    using: Vec<Tensor>,
    /// Units that stay gathered for their next use (`stage3_max_reuse_distance`), with
    /// their device memory; their elements count as live.
    kept: Vec<(usize, Tensor, Reservation)>,
    kept_numel: usize,
    in_flight: VecDeque<InFlight>,
    requested: usize,
    received: usize,
    device: Arc<CpuDevice>,
    /// The compute thread's track: time waiting for the lanes.
    track: Track,
    buffers: GatherBuffers,
    lanes: FetchLanes<'env>,
    fetcher: Arc<Fetcher<C>>,
}

impl<'env, C: Collective + Clone + 'env> Prefetcher<'env, C> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        fetches: Fetches,
        elem_bytes: usize,
        limits: Limits,
        device: Arc<CpuDevice>,
        track: Track,
        buffers: GatherBuffers,
        lanes: FetchLanes<'env>,
        fetcher: Fetcher<C>,
    ) -> Self {
        let parts = &fetcher.parts;
        Prefetcher {
            schedule: fetches.order(),
            fetches,
            taken: 0,
            numels: parts.iter().map(|p| p.numel).collect(),
            padded_bytes: parts.iter().map(|p| (p.padded * elem_bytes) as u64).collect(),
            persistent: parts
                .iter()
                .map(|p| p.numel <= limits.persistence_threshold)
                .collect(),
            limits,
            in_use: 0,
            using: Vec::new(),
            kept: Vec::new(),
            kept_numel: 0,
            in_flight: VecDeque::new(),
            requested: 0,
            received: 0,
            device,
            track,
            buffers,
            lanes,
            fetcher: Arc::new(fetcher),
        }
    }

    /// Issues every fetch the limits allow; `sources` installs a unit's pending update
    /// and gives where its shard is.
    fn fill(&mut self, needed: bool, sources: &mut dyn Sources<'env>) -> Result<(), EngineError> {
        loop {
            let outstanding = self.requested - self.received;
            let Some(&(unit, _)) = self.schedule.get(self.requested) else {
                return Ok(());
            };
            let outstanding_numel: usize = self.schedule[self.received..self.requested]
                .iter()
                .map(|&(u, _)| self.numels[u])
                .sum();
            if !may_request(
                needed,
                outstanding,
                outstanding_numel,
                self.numels[unit],
                self.in_use + self.kept_numel,
                self.limits,
            ) {
                return Ok(());
            }
            // installing a pending update first drops the unit's old gathered copy
            let shard = sources.source(unit)?;
            let hold = self
                .device
                .reserve(self.padded_bytes[unit], &format!("gathered unit {unit}"))?;
            self.issue(unit, shard, hold)?;
            self.requested += 1;
        }
    }

    /// Queues unit `unit`'s fetch: a shard on the device straight to the gather lane;
    /// else shard → staging on the h2d lane (with one rank, straight into the unit
    /// buffer), then the all-gather into a unit buffer on the gather lane.
    fn issue(&mut self, unit: usize, shard: Source<'env>, hold: Reservation) -> Result<(), EngineError> {
        let f = self.fetcher.clone();
        let part = f.parts[unit];
        let torch_err = |source| EngineError::Torch { rank: f.rank, source };
        let make = |n| tensor_buffer(n, f.kind, f.compute);
        let buffer = self.buffers.units.take(part.padded, make).map_err(torch_err)?;
        let gathered = match shard {
            Source::Device(stored) => {
                let (f, out) = (f.clone(), buffer.shallow_clone());
                // the job holds its own handle on the stored shard
                self.lanes
                    .gather
                    .submit(move || Ok(f.gather(unit, &stored.tensor(), &out)?))
            }
            shard if part.world == 1 => {
                // one rank: the shard is the whole unit, copied straight into the unit
                // buffer; the gather has nothing to do and compute waits for the copy
                let (f, out, scratch) = (f.clone(), buffer.shallow_clone(), self.buffers.scratch.clone());
                self.lanes
                    .h2d
                    .submit(move || Ok(f.to_staging(unit, shard, &out, &scratch)?))
            }
            shard => {
                let staging = self.buffers.staging.take(part.shard, make).map_err(torch_err)?;
                let copied = {
                    let (f, staging, scratch) =
                        (f.clone(), staging.shallow_clone(), self.buffers.scratch.clone());
                    self.lanes
                        .h2d
                        .submit(move || Ok(f.to_staging(unit, shard, &staging, &scratch)?))
                };
                self.lanes.gather.wait(&copied);
                let gathered = {
                    let (f, staging, out) = (f.clone(), staging.shallow_clone(), buffer.shallow_clone());
                    self.lanes
                        .gather
                        .submit(move || Ok(f.gather(unit, &staging, &out)?))
                };
                let staging_until = match f.dropped {
                    DroppedWait::StagingUntilGather => Event::done(),
                    _ => gathered.clone(),
                };
                self.buffers.staging.release(staging, staging_until);
                gathered
            }
        };
        self.in_flight.push_back(InFlight {
            unit,
            buffer,
            gathered,
            hold,
        });
        Ok(())
    }

    /// The next scheduled unit, gathered (its first `numel` elements as a tensor), with
    /// its device memory (None while the prefetcher keeps it for the unit's next use);
    /// `sources` installs pending updates before units are fetched.
    pub(super) fn next(
        &mut self,
        expected: usize,
        sources: &mut dyn Sources<'env>,
    ) -> Result<(Tensor, Option<Reservation>), EngineError> {
        let Some(&(unit, purpose)) = self.fetches.uses.get(self.taken) else {
            return Err(self.order_error(expected, None));
        };
        // the compute thread is done with the previous unit, except the final one while
        // the tied embedding joins it (on CPU compute is synchronous: its work is done; on
        // a GPU its kernels may still read it, but the next lane job to write the buffer
        // first waits for the compute queued before it was submitted, and compute's own
        // later use is in stream order); a final unit used in place is not among the uses
        let after_final = self.taken > 0 && self.fetches.uses[self.taken - 1].1 == Purpose::Final;
        if purpose != Purpose::Tied || !after_final {
            self.in_use = 0;
            for buffer in self.using.drain(..) {
                self.buffers.units.release(buffer, Event::done());
            }
        }
        if unit != expected {
            return Err(self.order_error(expected, Some(unit)));
        }
        let fetched = self.fetches.fetched[self.taken];
        self.fill(fetched, sources)?;
        let (buffer, hold) = if fetched {
            let Some(fetch) = self.in_flight.pop_front() else {
                return Err(self.order_error(expected, None));
            };
            if fetch.unit != expected || self.schedule.get(self.received).map(|s| s.0) != Some(expected) {
                return Err(self.order_error(expected, Some(fetch.unit)));
            }
            if self.fetcher.dropped != DroppedWait::ComputeOnGather {
                let start = Instant::now();
                // on a GPU compute's stream waits for the gather; the thread goes on
                fetch.gathered.order_compute()?;
                self.track.waited(Phase::AllGather, Some(expected), start);
            }
            self.received += 1;
            (fetch.buffer, fetch.hold)
        } else {
            // gathered at the unit's previous use, and kept for this one
            let Some(at) = self.kept.iter().position(|k| k.0 == expected) else {
                return Err(self.order_error(expected, None));
            };
            let (_, buffer, hold) = self.kept.swap_remove(at);
            self.kept_numel -= self.numels[expected];
            (buffer, hold)
        };
        let keep = self.fetches.keep[self.taken];
        self.taken += 1;
        let numel = self.numels[expected];
        let torch_err = |source| EngineError::Torch {
            rank: self.fetcher.rank,
            source,
        };
        let view = buffer.f_narrow(0, 0, numel as i64).map_err(torch_err)?;
        let hold = if self.persistent[expected] {
            Some(hold)
        } else if keep {
            self.kept_numel += numel;
            self.kept.push((expected, buffer, hold));
            None
        } else {
            self.in_use += numel;
            self.using.push(buffer);
            Some(hold)
        };
        // keep the lanes busy while this unit computes
        self.fill(false, sources)?;
        Ok((view, hold))
    }

    /// Whether unit `u` is held gathered for its next use (`stage3_max_reuse_distance`).
    pub(super) fn holds(&self, u: usize) -> bool {
        self.kept.iter().any(|k| k.0 == u)
    }

    fn order_error(&self, expected: usize, got: Option<usize>) -> EngineError {
        EngineError::Order {
            rank: self.fetcher.rank,
            expected,
            got,
        }
    }

    /// Waits for the lanes' outstanding work and returns the pools (after an error the
    /// caller aborts the gather communicator first, so no lane waits forever).
    pub fn finish(mut self) -> GatherBuffers {
        for fetch in self.in_flight.drain(..) {
            self.buffers.units.release(fetch.buffer, fetch.gathered);
        }
        for buffer in self.using.drain(..) {
            self.buffers.units.release(buffer, Event::done());
        }
        for (_, buffer, _) in self.kept.drain(..) {
            self.buffers.units.release(buffer, Event::done());
        }
        let h2d = self.lanes.h2d.record().synchronize();
        let gather = self.lanes.gather.record().synchronize();
        if h2d.is_ok() && gather.is_ok() {
            // every copy is done: the shards read in place are free for their update,
            // which overwrites them only when no one else holds them (`Units::overwritten`)
            let mut scratch = self.buffers.scratch.lock().unwrap_or_else(|e| e.into_inner());
            scratch.read_in_place.clear();
        }
        self.buffers
    }
}

impl<C: Collective> Fetcher<C> {
    /// The h2d lane's job: a shard in host memory or on NVMe into device staging (on
    /// CPU devices a memcpy, or the NVMe read straight into it; on a GPU through one of
    /// two alternating pinned buffers, filled on every core and copied asynchronously on
    /// the lane's stream, so the next shard's fill overlaps this copy).
    fn to_staging(
        &self,
        unit: usize,
        shard: Source<'_>,
        staging: &Tensor,
        scratch: &Mutex<Scratch>,
    ) -> Result<(), EngineError> {
        let bytes = self.parts[unit].shard * self.precision.bytes();
        let torch_err = |source| EngineError::Torch {
            rank: self.rank,
            source,
        };
        if let Source::Device(_) = shard {
            return Err(EngineError::Invariant {
                rank: self.rank,
                what: "a device shard sent through host staging",
            });
        }
        let on_host = staging.device() == tch::Device::Cpu;
        charge_staging(bytes as u64, matches!(shard, Source::Nvme(_)), self.pinned[unit]);
        let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Source::Host(params) = &shard {
            if !on_host && params.is_registered() {
                return self.copy_in_place(unit, params, staging, &mut scratch.read_in_place);
            }
        }
        let Scratch { io, pinned, next, .. } = &mut *scratch;
        // where the shard's bytes land: the staging buffer itself on CPU devices (the
        // pool gives it to this fetch alone until the gather's event), else a pinned buffer
        let mut slot = (!on_host).then(|| {
            let slot = &mut pinned[*next];
            *next = 1 - *next;
            slot
        });
        let landing = match &mut slot {
            Some(slot) => slot.ready(bytes, self.rank)?.shallow_clone(),
            None => staging.shallow_clone(),
        };
        // SAFETY: `landing` is this job's alone (above; a pinned buffer's last copy is
        // done, `ready`) until its event or the copy queued below; its element size is
        // the precision's
        let out = unsafe { torch::host_bytes_mut(&landing, bytes) }.map_err(torch_err)?;
        match shard {
            Source::Nvme(store) => {
                let buf = self
                    .h2d_track
                    .span(Phase::NvmeRead, Some(unit), bytes as u64, || {
                        read_param_bytes(store, (self.rank, unit, self.precision.bytes()), out, io.take())
                    })?;
                *io = Some(buf);
            }
            // on CPU devices this memcpy is the host-to-device transfer
            Source::Host(params) if on_host => {
                self.h2d_track.span(Phase::H2d, Some(unit), bytes as u64, || {
                    out.copy_from_slice(&params.as_bytes()[..bytes])
                })
            }
            // into a pinned buffer for the GPU's DMA copy: on every core
            Source::Host(params) => tierzero_offload::host::copy_parallel(out, &params.as_bytes()[..bytes]),
            Source::Device(_) => {}
        }
        let Some(slot) = slot else {
            return Ok(());
        };
        let streams = self.streams.as_ref();
        self.h2d_track
            .span(Phase::H2d, Some(unit), bytes as u64, || {
                let src = landing.f_narrow(0, 0, bytes as i64)?.f_view_dtype(self.kind)?;
                let mut dst = staging.f_narrow(0, 0, (bytes / self.precision.bytes()) as i64)?;
                torch::shim::copy_(&mut dst, &src, streams.is_some())
            })
            .map_err(torch_err)?;
        if let Some(streams) = streams {
            // the buffer is written again only after the copy has read it
            match streams.current().and_then(|s| s.mark()) {
                Ok(mark) => slot.read_until = Some(mark),
                Err(message) => {
                    // unknown when the copy is done: torch's allocator knows
                    slot.buffer = None;
                    return Err(h2d_failed(self.rank, message.to_string()));
                }
            }
        }
        Ok(())
    }

    /// A shard in registered host memory (`offload_param.pin_memory`) copied to device
    /// staging by DMA straight from where it lives, asynchronously on the lane's stream;
    /// the buffer is held (`held`) until the copy's mark, whatever happens to the unit's
    /// parameters meanwhile.
    fn copy_in_place(
        &self,
        unit: usize,
        params: &Arc<LowParams>,
        staging: &Tensor,
        held: &mut Vec<(Arc<LowParams>, Mark)>,
    ) -> Result<(), EngineError> {
        let torch_err = |source| EngineError::Torch {
            rank: self.rank,
            source,
        };
        let streams = self.streams.as_ref().ok_or(EngineError::Invariant {
            rank: self.rank,
            what: "a copy to a GPU without its streams",
        })?;
        let elements = self.parts[unit].shard;
        let bytes = elements * self.precision.bytes();
        let source = &params.as_bytes()[..bytes];
        self.h2d_track
            .span(Phase::H2d, Some(unit), bytes as u64, || {
                // SAFETY: the view lives only within this closure; the bytes stay alive
                // and unwritten until the copy's mark: `held` keeps them, and the unit's
                // update overwrites its buffer only after the lanes are drained
                let src = unsafe {
                    Tensor::f_from_blob(
                        source.as_ptr(),
                        &[elements as i64],
                        &[1],
                        self.kind,
                        tch::Device::Cpu,
                    )
                }?;
                let mut dst = staging.f_narrow(0, 0, elements as i64)?;
                torch::shim::copy_(&mut dst, &src, true)
            })
            .map_err(torch_err)?;
        held.retain(|(_, mark)| !mark.query());
        match streams.current().and_then(|s| s.mark()) {
            Ok(mark) => {
                held.push((params.clone(), mark));
                Ok(())
            }
            Err(message) => {
                // unknown when the copy is done: the buffer is kept to the end of the run
                std::mem::forget(params.clone());
                Err(h2d_failed(self.rank, message.to_string()))
            }
        }
    }

    /// The gather lane's job: every rank's shard into the unit buffer, on the device.
    fn gather(&self, unit: usize, shard: &Tensor, out: &Tensor) -> Result<(), EngineError> {
        let part = self.parts[unit];
        let torch_err = |source| EngineError::Torch {
            rank: self.rank,
            source,
        };
        let start = collective_start();
        // the pool's buffers may be larger than this unit
        let shard = shard.f_narrow(0, 0, part.shard as i64).map_err(torch_err)?;
        let full = out.f_narrow(0, 0, part.padded as i64).map_err(torch_err)?;
        // the shard is read only by this job until its event (a staging shard was written
        // by the h2d lane before: the gather lane waited for it; a stored shard is written
        // only by its update, installed before the fetch was requested); the unit buffer
        // is written only here and read by compute after this job's event
        self.comm.all_gather_tensor(&shard, &full)?;
        let bytes = (part.padded * self.precision.bytes()) as u64;
        sim::charge(Work::Gather(bytes));
        record_collective(&self.gather_track, (Phase::AllGather, Some(unit)), start, bytes);
        Ok(())
    }
}

/// Charges a shard's way to device staging on a simulated device as its device makes
/// it: from NVMe a read through a bounce buffer; on a GPU then a fill of pinned staging
/// (on every core from host memory; none from `pinned` host memory, read in place) and
/// the DMA copy; on a CPU device a host shard's memcpy.
fn charge_staging(bytes: u64, from_nvme: bool, pinned: bool) {
    if from_nvme {
        sim::charge(Work::NvmeRead(bytes));
        sim::charge(Work::Fill {
            bytes,
            parallel: false,
        });
    }
    if sim::gpu() && pinned && !from_nvme {
        sim::charge(Work::H2d(bytes));
    } else if sim::gpu() {
        sim::charge(Work::Fill {
            bytes,
            parallel: !from_nvme,
        });
        sim::charge(Work::H2d(bytes));
    } else if !from_nvme {
        sim::charge(Work::H2d(bytes));
    }
}

/// Reads rank `rank`'s stored parameters of `unit` (`elem`-byte elements) into `out`
/// through `scratch` (the two bounce buffers, made when None), which come back for the
/// next.
fn read_param_bytes(
    store: &SwapStore,
    (rank, unit, elem): (usize, usize, usize),
    out: &mut [u8],
    scratch: Option<[IoBuf; 2]>,
) -> Result<[IoBuf; 2], EngineError> {
    let key = TensorKey {
        unit: unit as u32,
        rank: rank as u32,
        state: State::Param,
    };
    let scratch = match scratch {
        Some(bufs) => bufs,
        None => store
            .scratch_pair(store.chunk_bytes(elem))
            .map_err(On(rank).alloc())?,
    };
    store.read_tensor_ahead(key, out, scratch).map_err(On(rank).io())
}

/// Reads rank `rank`'s stored parameters of `unit` (`len` elements) from the NVMe
/// parameter store.
pub fn read_param_shard(
    store: &SwapStore,
    rank: usize,
    unit: usize,
    len: usize,
    precision: &Precision,
) -> Result<LowParams, EngineError> {
    let mut params = LowParams::zeros(len, precision);
    let elem = params.elem_bytes();
    read_param_bytes(store, (rank, unit, elem), params.bytes_mut(), None)?;
    Ok(params)
}
