//! The optimizer phase of a rank: AdamW on every unit's partition in forward order, on
//! a thread of its own (the next step's forward waits only for its unit's update) or
//! inline, with optimizer state in memory or streamed through the NVMe pipeline; and
//! installing each update with the owners it came from (parameters, gradients,
//! optimizer state).

use super::context::Tracks;
use super::error::{EngineError, On};
use super::gradients::{FinalGrad, Gradients};
use super::optimizer::{
    AdamStep, Ahead, AheadClock, DeviceState, Moments, NvmeTier, Optimizer, OptimizerState, ParamStaging,
    SharedStaging, Update,
};
use super::params::LowParams;
use super::prefetch::DroppedWait;
use super::prefetch::{Source, Sources};
use super::rank::RankEngine;
use super::units::{Destination, NewParams, Units};
use crate::comm::Collective;
use crate::device::lanes::{LaneError, Mark, Mode, Stream, Streams};
use crate::device::sim::{self, SimStream};
use crate::device::DeviceError;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::simulate::costs::Work;
use crate::plan::simulate::disk;
use crate::plan::Precision;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};
use tierzero_offload::adam::{self, GradSlice, Sweep};
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pipeline::{self, GradIn, PipelineConfig};

/// What installing an update touches: the three owners it was lent from, and the compute
/// thread's communicator (stages 1–2 gather an installed update) and track. The
/// prefetcher gets this handle, so a unit's pending update is installed before the unit
/// is fetched.
pub(super) struct Installer<'e, 'a, C: Collective + Clone> {
    units: &'e mut Units<'a>,
    grads: &'e mut Gradients<'a, C>,
    optimizer: &'e mut Optimizer<'a>,
    comm: &'e C,
    track: &'e Track,
    /// The rank's device streams (None on CPU devices), and a wait a test leaves out.
    device: (Option<&'e Arc<dyn Streams>>, DroppedWait),
}

impl<'a, C: Collective + Clone> Installer<'_, 'a, C> {
    /// An update back with the owners it was lent from.
    fn install(&mut self, update: Update<'a>) -> Result<(), EngineError> {
        let (u, fresh, moments, grad) = update;
        self.optimizer.restore(u, moments);
        self.grads.take_back(u, grad);
        self.units.install(u, fresh, self.comm, self.track)
    }

    /// Installs the optimizer lane's updates for units up to and including `through`
    /// (waiting for them; on a device compute's stream then waits for each update's
    /// mark, so whatever compute queues after it, and every lane job it submits after
    /// it, reads the new values: on a simulated device compute's clock waits).
    pub(super) fn through(&mut self, through: usize) -> Result<(), EngineError> {
        while self.optimizer.pending_through(through) {
            let (start, next) = (Instant::now(), self.optimizer.next_unit());
            let (update, mark) = self.optimizer.receive()?;
            if let (Some(mark), (Some(streams), dropped)) = (mark, self.device) {
                if dropped != DroppedWait::ComputeOnUpdate {
                    let rank = self.optimizer.rank();
                    streams
                        .current()
                        .and_then(|compute| compute.wait(&mark))
                        .map_err(stream_failed(rank))?;
                }
            }
            self.track.waited(Phase::Optimizer, Some(next), start);
            self.install(update)?;
        }
        Ok(())
    }
}

impl<'a, C: Collective + Clone> Sources<'a> for Installer<'_, 'a, C> {
    /// Where unit `u`'s shard is, once its pending update is installed.
    fn source(&mut self, u: usize) -> Result<Source<'a>, EngineError> {
        self.through(u)?;
        Ok(self.units.source(u))
    }
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    pub(super) fn installer(&mut self) -> Installer<'_, 'a, C> {
        Installer {
            units: &mut self.units,
            grads: &mut self.grads,
            optimizer: &mut self.optimizer,
            comm: &self.comms.main,
            track: &self.tracks.compute,
            device: (self.site.streams.as_ref(), self.lanes.dropped),
        }
    }

    /// Installs the optimizer lane's updates for units up to and including `through`.
    pub(super) fn install_through(&mut self, through: usize) -> Result<(), EngineError> {
        self.installer().through(through)
    }

    /// Waits for every pending update.
    pub fn install_all(&mut self) -> Result<(), EngineError> {
        self.install_through(self.units.len() - 1)
    }

    /// The optimizer phase: AdamW on every unit's partition in forward order. With a
    /// scope it runs on a thread of its own while the next step's forward proceeds, each
    /// fetch waiting only for its unit's update (the updates arrive in forward order);
    /// without one it runs here. Both compute exactly the same values.
    pub(super) fn optimize<'s, 'e>(
        &mut self,
        step: AdamStep,
        scope: Option<&'s std::thread::Scope<'s, 'e>>,
    ) -> Result<(), EngineError>
    where
        'a: 'e,
    {
        // each unit's gradient, state and destination are lent to the job and come back
        // with its update (all or nothing: nothing is lent unless every gradient is here)
        self.grads.all_here()?;
        self.grads.store_missing(&self.tracks.compute)?;
        self.grads.zero_idle_sums()?;
        self.optimizer
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .start_step()?;
        // on a device the optimizer's stream follows what compute has queued by now (taken
        // before anything is lent, so a failure leaves every owner whole)
        let device = match (&self.site.streams, scope) {
            (Some(streams), Some(_)) => Some(UpdateStream::new(
                streams,
                self.lanes.mode,
                self.site.rank,
                step.step,
            )?),
            _ => None,
        };
        let mut jobs = Vec::with_capacity(self.units.len());
        for u in 0..self.units.len() {
            let len = self.optimizer.partition(u).len();
            let on_device = self.optimizer.on_device(u);
            jobs.push(OptimizerJob {
                unit: u,
                grad: self.grads.lend_to_optimizer(u)?,
                destination: self.units.destination(u, len, on_device)?,
                moments: self.optimizer.lend(u),
            });
        }
        let context = OptimizerContext {
            on: On(self.site.rank),
            precision: self.plan.precision,
            staging: self.optimizer.staging.clone(),
            pipeline: {
                // every phase blocking: the legs in turn on the calling thread
                let how = crate::plan::rules::pipeline(self.plan);
                PipelineConfig {
                    pipeline_read: self.overlap && how.pipeline_read,
                    pipeline_write: self.overlap && how.pipeline_write,
                    ..how
                }
            },
            step,
            tracks: self.tracks.clone(),
            ahead: std::sync::Mutex::new(std::mem::take(&mut self.optimizer.ahead)),
            next_nvme: std::sync::Mutex::new(None),
            disk: std::sync::Mutex::new(disk::Disk::default()),
            held: self.optimizer.held.clone(),
            update_copies: self.optimizer.update_copies.clone(),
        };
        match scope {
            Some(scope) => {
                let (tx, rx) = crossbeam_channel::unbounded();
                let rank = self.site.rank;
                scope.spawn(move || {
                    let stream = device.as_ref().map(UpdateStream::enter).transpose();
                    let mut jobs = jobs.into_iter().peekable();
                    while let Some(job) = jobs.next() {
                        let result = stream.clone().map_err(stream_failed(rank)).and_then(|stream| {
                            let unit = job.unit;
                            let delay = device.as_ref().and_then(|d| d.delay(unit));
                            if let (Some(stream), Some(micros)) = (&stream, delay) {
                                stream.delay(micros).map_err(stream_failed(rank))?;
                            }
                            let update = context.run_before(job, jobs.peek())?;
                            let mark = stream.map(|s| s.mark()).transpose();
                            Ok((update, mark.map_err(stream_failed(rank))?))
                        });
                        let failed = result.is_err();
                        if tx.send(result).is_err() || failed {
                            return;
                        }
                    }
                });
                self.optimizer.running(rx);
            }
            None => {
                let mut jobs = jobs.into_iter().peekable();
                while let Some(job) = jobs.next() {
                    let update = context.run_before(job, jobs.peek())?;
                    self.installer().install(update)?;
                }
            }
        }
        Ok(())
    }
}

/// The optimizer thread's device stream, on a GPU or a simulated device: a stream of
/// its own, which first waits for what compute had queued when the step's update was
/// issued (the gradients, the last reads of the old values). Each update carries a mark
/// of it, which compute's stream waits for where it installs the update
/// ([`Installer::through`]), so the order of an update and the next use of its unit is
/// the device's, whatever streams the threads queue on. In checked mode each update
/// starts late on the device, so a missing wait shows.
struct UpdateStream {
    streams: Arc<dyn Streams>,
    after: Mark,
    mode: Mode,
    salt: u64,
}

impl UpdateStream {
    /// Taken on the compute thread, when the update of optimizer step `step` is issued.
    fn new(
        streams: &Arc<dyn Streams>,
        mode: Mode,
        rank: usize,
        step: u64,
    ) -> Result<UpdateStream, EngineError> {
        let after = streams
            .current()
            .and_then(|compute| compute.mark())
            .map_err(stream_failed(rank))?;
        Ok(UpdateStream {
            streams: streams.clone(),
            after,
            mode,
            salt: Mode::round_salt("optimizer", rank, step),
        })
    }

    /// Makes the stream the calling thread's (the optimizer's), after compute's mark.
    fn enter(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        let stream = self.streams.lane("optimizer")?;
        stream.enter()?;
        stream.wait(&self.after)?;
        Ok(stream)
    }

    /// Checked mode's delay before unit `u`'s update, in microseconds.
    fn delay(&self, u: usize) -> Option<u64> {
        self.mode.device_delay(self.salt, u as u64)
    }
}

fn stream_failed(rank: usize) -> impl Fn(DeviceError) -> EngineError {
    move |e| {
        EngineError::Lane(LaneError::Failed {
            rank,
            lane: "optimizer",
            message: format!("its device stream: {e}"),
        })
    }
}

/// One unit's optimizer work: its state, final gradient, and where the new
/// low-precision partition goes.
struct OptimizerJob<'a> {
    unit: usize,
    moments: Moments<'a>,
    grad: FinalGrad,
    destination: Destination<'a>,
}

/// What the optimizer phase needs, without borrowing the engine.
struct OptimizerContext {
    on: On,
    precision: Precision,
    staging: SharedStaging,
    pipeline: PipelineConfig,
    step: AdamStep,
    tracks: Tracks,
    /// The next NVMe sub-groups' state reads: the first ones, submitted during the
    /// backward, then each next unit's first, submitted by the update before it.
    ahead: std::sync::Mutex<Vec<super::optimizer::Ahead>>,
    /// The unit whose update comes next, where its state streams through the pipeline
    /// too (set by [`Self::run_before`]): the update before it reads its first state.
    next_nvme: std::sync::Mutex<Option<usize>>,
    /// The optimizer thread's disk in virtual time, on a simulated device: the
    /// pipeline's legs, the read-aheads and the new parameters written to NVMe take their
    /// turns on it as in the replay (`plan/simulate/step/optimizer.rs`).
    disk: std::sync::Mutex<disk::Disk>,
    /// The copies of held gradient sums out of the device.
    held: super::held::SharedHeld,
    /// The copies of host updates into device parameters.
    update_copies: super::update_copies::SharedUpdateCopies,
}

/// The NVMe pipeline's legs: spans on the optimizer's tracks, and on a simulated device
/// each sub-group's read, update and write priced on the optimizer thread's stream as
/// the pipeline orders them (the legs run on its own threads; see [`LegClock`]).
struct Legs<'t> {
    tracks: &'t Tracks,
    simulated: Option<std::sync::Mutex<LegClock>>,
}

impl pipeline::Observer for Legs<'_> {
    fn leg(&self, leg: pipeline::Leg, unit: u32, start: Instant, end: Instant, bytes: u64) {
        if let Some(clock) = &self.simulated {
            clock.lock().unwrap_or_else(|e| e.into_inner()).leg(leg, bytes);
        }
        self.tracks.leg(leg, unit, start, end, bytes);
    }
}

/// One NVMe pipeline run in virtual time (`offload/src/pipeline.rs`): each sub-group's
/// read, update and write priced as the pipeline reports them (each kind of leg in
/// sub-group order, so the i-th of a kind is sub-group i's), and timed when the run is
/// done by `disk::schedule`, which the replay uses too: a read waits for a free buffer
/// set and, without `pipeline_read`, for the update before it; an update for its read;
/// a write for its update; the reads and writes one at a time on the optimizer thread's
/// disk. The read-aheads submitted during the backward take the disk from then, in order,
/// when the first run that is given them is timed ([`place_aheads`]); one the run before
/// placed is done when it says; the next run's, which this run submits, takes the disk
/// after this run's legs.
pub(super) struct LegClock {
    stream: SimStream,
    start: f64,
    config: PipelineConfig,
    /// Whether a read-ahead's leg came before the next read reported.
    ahead: bool,
    /// Each sub-group's read, and whether a read-ahead read its state.
    reads: Vec<(Work, bool)>,
    updates: Vec<Work>,
    writes: Vec<Work>,
}

impl LegClock {
    fn new(stream: SimStream, config: PipelineConfig) -> LegClock {
        LegClock {
            start: stream.now(),
            stream,
            config,
            ahead: false,
            reads: Vec::new(),
            updates: Vec::new(),
            writes: Vec::new(),
        }
    }

    fn leg(&mut self, leg: pipeline::Leg, bytes: u64) {
        match leg {
            pipeline::Leg::ReadAhead => self.ahead = true,
            pipeline::Leg::Read => self
                .reads
                .push((Work::NvmeRead(bytes), std::mem::take(&mut self.ahead))),
            pipeline::Leg::Update => self.updates.push(Work::AdamSummed(bytes / 16)),
            pipeline::Leg::Write => self.writes.push(Work::NvmeWrite(bytes)),
            pipeline::Leg::ReadWait | pipeline::Leg::WriteWait => {}
        }
    }

    /// Times the run's legs on the stream and `disk`, once the pipeline has reported
    /// them all (a sub-group read ahead waits for the next of `ahead`, when those reads
    /// are in), then the next run's read-ahead of `next` bytes where it submitted one;
    /// returns when that is done.
    fn finish(self, disk: &mut disk::Disk, ahead: &[f64], next: Option<u64>) -> Option<f64> {
        let legs: Vec<_> = (self.reads.iter().zip(&self.updates).zip(&self.writes))
            .map(|((&(read, _), &update), &write)| disk::Legs {
                read: self.stream.transfer(read),
                update: self.stream.seconds(update),
                write: self.stream.transfer(write),
            })
            .collect();
        // the pipeline uses the read-aheads of its first sub-groups, in order
        let used = self.reads.iter().take_while(|r| r.1).count();
        let start = self.start + self.stream.pipeline_overhead();
        let timed = disk::schedule(
            start,
            &legs,
            self.config,
            (&mut *disk, 0),
            &ahead[..used.min(ahead.len())],
        );
        for (i, t) in timed.iter().enumerate() {
            self.stream.overlapped(self.reads[i].0, t.read.0, t.read.1);
            self.stream.overlapped(self.updates[i], t.update.0, t.update.1);
            self.stream.overlapped(self.writes[i], t.write.0, t.write.1);
        }
        let all = timed.iter().map(|t| t.read_all.max(t.write_all));
        self.stream.after_peers(all.fold(start, f64::max));
        let bytes = next?;
        let work = Work::NvmeRead(bytes);
        let ready = disk::next_read_ready(start, &timed, self.config);
        let (start, end) = disk.take(ready, self.stream.read_ahead(bytes), 0).own;
        self.stream.beside(work, start, end);
        Some(end)
    }
}

/// The read-aheads a run is given, each with when its reads are in: those submitted
/// during the backward take `disk` from then, in order (on a simulated device the first
/// run given them places them all, those kept for the runs after it too), and count on
/// `stream` beside its own order without moving its clock (the thread does not wait for
/// them; its update of each does); one placed already is done when it says.
fn place_aheads(
    stream: &SimStream,
    disk: &mut disk::Disk,
    aheads: Vec<((pipeline::Group, u64), Option<AheadClock>)>,
) -> Vec<(pipeline::Group, f64)> {
    aheads
        .into_iter()
        .filter_map(|((group, bytes), at)| match at? {
            AheadClock::Submitted(at) => {
                let work = Work::NvmeRead(bytes);
                let (start, end) = disk.take(at, stream.read_ahead(bytes), 0).own;
                stream.beside(work, start, end);
                Some((group, end))
            }
            AheadClock::Done(end) => Some((group, end)),
        })
        .collect()
}

impl pipeline::Observer for Tracks {
    fn leg(&self, leg: pipeline::Leg, unit: u32, start: Instant, end: Instant, bytes: u64) {
        let unit = Some(unit as usize);
        match leg {
            pipeline::Leg::Read | pipeline::Leg::ReadAhead => {
                self.nvme_read
                    .record_between(Phase::NvmeRead, false, unit, start, end, bytes)
            }
            pipeline::Leg::Write => {
                self.nvme_write
                    .record_between(Phase::NvmeWrite, false, unit, start, end, bytes)
            }
            pipeline::Leg::Update => {
                self.optimizer
                    .record_between(Phase::Optimizer, false, unit, start, end, bytes)
            }
            pipeline::Leg::ReadWait => {
                self.optimizer
                    .record_between(Phase::NvmeRead, true, unit, start, end, 0)
            }
            pipeline::Leg::WriteWait => {
                self.optimizer
                    .record_between(Phase::NvmeWrite, true, unit, start, end, 0)
            }
        }
    }
}

impl OptimizerContext {
    fn run<'a>(&self, job: OptimizerJob<'a>) -> Result<Update<'a>, EngineError> {
        let OptimizerJob {
            unit,
            moments,
            grad,
            destination,
        } = job;
        match destination {
            Destination::Host(mut fresh) => {
                let moments = self.update(unit, moments, &grad, Fresh::Host(&mut fresh))?;
                Ok((unit, NewParams::Host(fresh), moments, grad))
            }
            Destination::Device(fresh) => {
                let moments = self.update(unit, moments, &grad, Fresh::Device(&fresh))?;
                Ok((unit, NewParams::Device(fresh), moments, grad))
            }
            Destination::ToDevice(target) => {
                let moments = self
                    .update_copies
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .through(unit, &target, &self.tracks.optimizer, |fresh| {
                        self.update(unit, moments, &grad, Fresh::Host(fresh))
                    })?;
                Ok((unit, NewParams::Device(target), moments, grad))
            }
            Destination::Nvme(store) => {
                let moments = self.update_to_nvme(unit, moments, &grad, store)?;
                Ok((unit, NewParams::Written, moments, grad))
            }
        }
    }

    /// AdamW on one partition whose parameters live on NVMe: the new values go into the
    /// staging buffer and from there to the parameter store, before the update is
    /// reported (so the unit's next fetch reads them).
    fn update_to_nvme<'a>(
        &self,
        unit: usize,
        moments: Moments<'a>,
        grad: &FinalGrad,
        store: &SwapStore,
    ) -> Result<Moments<'a>, EngineError> {
        let mut slot = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut staging = match slot.take() {
            Some(staging) => staging,
            None => ParamStaging {
                values: LowParams::zeros(0, &self.precision),
                scratch: store
                    .scratch_pair(store.chunk_bytes(self.precision.bytes()))
                    .map_err(self.on.alloc())?,
            },
        };
        staging.values.resize(grad.len());
        let moments = self.update(unit, moments, grad, Fresh::Host(&mut staging.values))?;
        let key = TensorKey {
            unit: unit as u32,
            rank: self.on.0 as u32,
            state: State::Param,
        };
        let bytes = staging.values.as_bytes();
        let start = Instant::now();
        staging.scratch = store
            .write_tensor_ahead(key, bytes, staging.scratch)
            .map_err(self.on.io())?;
        if let Some(stream) = sim::entered() {
            // its turn on the optimizer thread's disk, after the read-ahead the update
            // submitted
            let work = Work::NvmeWrite(bytes.len() as u64);
            let mut disk = self.disk.lock().unwrap_or_else(|e| e.into_inner());
            let turn = disk.take(stream.now(), stream.transfer(work), 0);
            stream.overlapped(work, turn.own.0, turn.own.1);
            stream.after_peers(turn.all);
        }
        self.tracks.nvme_write.record_between(
            Phase::NvmeWrite,
            false,
            Some(unit),
            start,
            Instant::now(),
            bytes.len() as u64,
        );
        *slot = Some(staging);
        Ok(moments)
    }

    /// AdamW on one partition: in memory, on the device, or streamed through the NVMe
    /// pipeline; the new low-precision values into `fresh`.
    fn update<'a>(
        &self,
        unit: usize,
        mut moments: Moments<'a>,
        grad: &FinalGrad,
        fresh: Fresh<'_>,
    ) -> Result<Moments<'a>, EngineError> {
        let opt_len = fresh.len();
        let invariant = |what| EngineError::Invariant {
            rank: self.on.0,
            what,
        };
        let device_params = "parameters on the device updated from optimizer state off it";
        let stored_in_memory = "a gradient on NVMe with optimizer state in memory";
        match (&mut moments, grad) {
            (Moments::Memory(state), FinalGrad::Here(grad)) => {
                let Fresh::Host(fresh) = fresh else {
                    return Err(invariant(device_params));
                };
                self.memory_update(unit, state, grad.slice(0..grad.len()), fresh)?;
            }
            (Moments::Memory(state), FinalGrad::Device(sum)) => {
                let Fresh::Host(fresh) = fresh else {
                    return Err(invariant(device_params));
                };
                self.held_on_host(unit, sum, |grad| self.memory_update(unit, state, grad, fresh))?;
            }
            (Moments::Device(state), grad) => {
                // the step's sum where it stayed on the device, else the host
                // accumulator's (`rules::gradients_on_device`)
                let grad = match grad {
                    FinalGrad::Device(sum) => DeviceGrad::Sum(sum.shallow_clone()),
                    FinalGrad::Here(g) => DeviceGrad::Host(g.slice(0..g.len())),
                    FinalGrad::Stored { .. } => return Err(invariant(stored_in_memory)),
                };
                let bytes = 16 * opt_len as u64;
                let on_device = match &fresh {
                    Fresh::Device(out) => Some(*out),
                    Fresh::Host(_) => None,
                };
                self.tracks
                    .optimizer
                    .span(Phase::Optimizer, Some(unit), bytes, || {
                        sim::charge(match grad {
                            DeviceGrad::Sum(_) => Work::DeviceAdamOnly(opt_len as u64),
                            DeviceGrad::Host(_) => Work::DeviceAdam(opt_len as u64),
                        });
                        device_update(state, grad, &self.step, on_device, &self.precision)
                    })
                    .map_err(self.on.torch())?;
                if let Fresh::Host(out) = fresh {
                    // the new values out to the parameters' host buffer: a PCIe crossing
                    // of its own, timed and counted as one (at the pinned rate into a
                    // pinned unit's own buffer)
                    let bytes = out.as_bytes().len() as u64;
                    let pinned = out.is_pinned();
                    self.tracks
                        .optimizer
                        .span(Phase::D2h, Some(unit), bytes, || {
                            sim::charge(if pinned {
                                Work::D2h(bytes)
                            } else {
                                Work::D2hPageable(bytes)
                            });
                            copy_out(&state.master, out, &self.precision)
                        })
                        .map_err(self.on.torch())?;
                }
            }
            (Moments::Memory(_), FinalGrad::Stored { .. }) => return Err(invariant(stored_in_memory)),
            (Moments::Nvme(tier), grad) => {
                let Fresh::Host(fresh) = fresh else {
                    return Err(invariant(device_params));
                };
                match grad {
                    FinalGrad::Here(g) => {
                        self.nvme_update(unit, tier, GradIn::Host(g.slice(0..g.len())), fresh)?
                    }
                    &FinalGrad::Stored { len, bf16 } => {
                        self.nvme_update(unit, tier, GradIn::Stored { len, bf16 }, fresh)?
                    }
                    FinalGrad::Device(sum) => self.held_on_host(unit, sum, |grad| {
                        self.nvme_update(unit, tier, GradIn::Host(grad), fresh)
                    })?,
                }
            }
            (Moments::Lent, _) => return Err(invariant("an optimizer job was given state already lent")),
        }
        Ok(moments)
    }

    /// AdamW on in-memory state, the new low-precision values into `fresh`.
    fn memory_update(
        &self,
        unit: usize,
        state: &mut OptimizerState,
        grad: GradSlice<'_>,
        fresh: &mut LowParams,
    ) -> Result<(), EngineError> {
        let OptimizerState {
            master,
            exp_avg,
            exp_avg_sq,
        } = state;
        let opt_len = fresh.len();
        let sweep = Sweep {
            master: &mut master[..],
            exp_avg: &mut exp_avg[..],
            exp_avg_sq: &mut exp_avg_sq[..],
            grad,
            low: fresh.out_as(&self.precision),
        };
        let bytes = 16 * opt_len as u64;
        self.tracks
            .optimizer
            .span(Phase::Optimizer, Some(unit), bytes, || {
                sim::charge(Work::Adam(opt_len as u64));
                adam::step(&self.step.coefficients, sweep)
            })
            .map_err(|source| EngineError::Adam {
                rank: self.on.0,
                unit,
                source,
            })?;
        Ok(())
    }

    /// AdamW on NVMe state through the pipeline (its legs timed on a simulated device by
    /// a [`LegClock`]), the new low-precision values into `fresh`.
    fn nvme_update(
        &self,
        unit: usize,
        tier: &NvmeTier<'_>,
        grad: GradIn<'_>,
        fresh: &mut LowParams,
    ) -> Result<(), EngineError> {
        let groups = pipeline::sub_groups(
            unit as u32,
            self.on.0 as u32,
            tier.store.chunk_elems(),
            grad,
            fresh.out_as(&self.precision),
        );
        let ahead = std::mem::take(&mut *self.ahead.lock().unwrap_or_else(|e| e.into_inner()));
        let (ahead, at): (Vec<_>, Vec<_>) = ahead.into_iter().map(|a| (a.reads, a.at)).unzip();
        let placed: Vec<_> = ahead.iter().map(|r| (r.group(), r.bytes())).zip(at).collect();
        let next = self.next_nvme.lock().unwrap_or_else(|e| e.into_inner()).take();
        let legs = Legs {
            tracks: &self.tracks,
            simulated: sim::entered().map(|s| std::sync::Mutex::new(LegClock::new(s, self.pipeline))),
        };
        let (_, next) = pipeline::nvme_adam_step_then(
            tier.store,
            &tier.pool,
            (groups, ahead, next.map(|u| (u as u32, self.on.0 as u32, 0))),
            &self.step.coefficients,
            self.pipeline,
            &legs,
        )
        .map_err(self.on.io())?;
        let (placed, done) = match legs.simulated {
            Some(clock) => {
                let clock = clock.into_inner().unwrap_or_else(|e| e.into_inner());
                let mut disk = self.disk.lock().unwrap_or_else(|e| e.into_inner());
                let placed = place_aheads(&clock.stream, &mut disk, placed);
                let ends: Vec<f64> = placed.iter().map(|p| p.1).collect();
                // a run given read-aheads submits none
                let submitted = next.iter().find(|n| !placed.iter().any(|p| p.0 == n.group()));
                let done = clock.finish(&mut disk, &ends, submitted.map(|n| n.bytes()));
                (placed, done)
            }
            None => (Vec::new(), None),
        };
        // a read-ahead kept for a later run keeps its time; the one this run submitted
        // is done when the disk had it
        let at = |group| {
            let kept = placed.iter().find(|p| p.0 == group).map(|p| p.1);
            kept.or(done).map(AheadClock::Done)
        };
        *self.ahead.lock().unwrap_or_else(|e| e.into_inner()) = next
            .into_iter()
            .map(|reads| Ahead {
                at: at(reads.group()),
                reads,
            })
            .collect();
        Ok(())
    }

    /// A gradient sum held on the device (`rules::held_gradients`) as host values for an
    /// update off it, given to `f` once its copy is in (`held.rs`).
    fn held_on_host<R>(
        &self,
        unit: usize,
        sum: &Tensor,
        f: impl FnOnce(GradSlice<'_>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .with(unit, sum, &self.tracks.optimizer, f)
    }

    /// Queues the copy of `job`'s gradient sum where it is held on the device for an
    /// update off it: a unit's own before its update, the next unit's beside it.
    fn queue_held(&self, job: &OptimizerJob<'_>) -> Result<(), EngineError> {
        match (&job.grad, &job.moments) {
            (FinalGrad::Device(sum), Moments::Memory(_) | Moments::Nvme(_)) => self
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .queue(job.unit, sum, &self.tracks.optimizer),
            _ => Ok(()),
        }
    }

    /// One unit's update, the next unit's held sum queued for its copy beside it where
    /// the update is the host's (a device-tier update would queue behind the copy on the
    /// thread's stream).
    fn run_before<'a>(
        &self,
        job: OptimizerJob<'a>,
        next: Option<&OptimizerJob<'a>>,
    ) -> Result<Update<'a>, EngineError> {
        self.queue_held(&job)?;
        if let Some(next) = next.filter(|_| !matches!(job.moments, Moments::Device(_))) {
            self.queue_held(next)?;
        }
        // an NVMe update reads the next one's first state ahead
        *self.next_nvme.lock().unwrap_or_else(|e| e.into_inner()) = next
            .filter(|n| matches!(n.moments, Moments::Nvme(_)) && n.grad.len() > 0)
            .map(|n| n.unit);
        self.run(job)
    }
}

/// Where one update writes the new low-precision partition.
enum Fresh<'f> {
    Host(&'f mut LowParams),
    /// A tensor of the compute kind on the device.
    Device(&'f Tensor),
}

impl Fresh<'_> {
    fn len(&self) -> usize {
        match self {
            Fresh::Host(p) => p.len(),
            Fresh::Device(t) => t.numel(),
        }
    }
}

/// Where a device-tier update reads its gradient: the step's sum on the device, or the
/// host accumulator.
enum DeviceGrad<'g> {
    Sum(Tensor),
    Host(GradSlice<'g>),
}

/// AdamW on device-tier state: the gradient (scaled as the CPU kernel scales it) to the
/// state's device, torch's fused kernel there, and the new master in the training
/// precision into `fresh` where the parameters live on the device (else [`copy_out`]).
fn device_update(
    state: &mut DeviceState,
    grad: DeviceGrad<'_>,
    step: &AdamStep,
    fresh: Option<&Tensor>,
    precision: &Precision,
) -> Result<(), tch::TchError> {
    let device = state.master.device();
    let mut grad = match grad {
        // scaled in place: the next step's first contribution overwrites it
        DeviceGrad::Sum(sum) => sum,
        DeviceGrad::Host(g) => match g {
            GradSlice::F32(g) => Tensor::f_from_slice(g)?,
            GradSlice::Bf16(g) => {
                crate::torch::tensor_u16(g, Kind::BFloat16, tch::Device::Cpu)?.f_to_kind(Kind::Float)?
            }
        }
        .f_to(device)?,
    };
    let _ = grad.f_mul_scalar_(f64::from(step.coefficients.grad_scale))?;
    let DeviceState {
        master,
        exp_avg,
        exp_avg_sq,
    } = state;
    crate::torch::shim::fused_adam(master, &grad, exp_avg, exp_avg_sq, step.step, &step.hyper)?;
    match fresh {
        Some(out) => {
            let kind = crate::torch::compute_kind(precision);
            out.shallow_clone().f_copy_(&master.f_to_kind(kind)?)
        }
        None => Ok(()),
    }
}

/// Device-tier state's new master in the training precision into the parameters' host
/// buffer: rounded on the device, then copied straight into `out`
/// ([`crate::torch::copy_to_host`]).
fn copy_out(master: &Tensor, out: &mut LowParams, precision: &Precision) -> Result<(), tch::TchError> {
    let kind = crate::torch::compute_kind(precision);
    let n = out.len();
    let bytes = out.bytes_mut();
    if bytes.len() != n * kind.elt_size_in_bytes() {
        return Err(tch::TchError::Shape(format!(
            "{n} new parameters of {kind:?} into a host buffer of {} bytes",
            bytes.len()
        )));
    }
    crate::torch::copy_to_host(&master.f_narrow(0, 0, n as i64)?.f_to_kind(kind)?, bytes)
}
