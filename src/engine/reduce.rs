//! Gradient reduction, chunk by chunk, on the compute thread or the reduce lane
//! (`overlap_comm`, stages 2 and 3).
//!
//! A unit's flat gradient (a tensor of the compute kind on the rank's device) is reduced
//! on the device in chunks of `reduce_bucket_size` elements, at most [`CHUNK_LIMIT`]. Each chunk gathers the
//! same stretch of every rank's shard into a device bucket in the communication type
//! (`communication_data_type`: the training precision unless the config says otherwise),
//! so the reduce-scatter of the bucket leaves this rank its own stretch; only that
//! reduced stretch leaves the device (to fp32 in host memory) and is added into the
//! unit's accumulator at the stretch's offset. Every element is reduced exactly as a
//! whole-gradient reduce-scatter reduces it (sums in rank order on `Local`), so results
//! are bit-identical to it, while the device holds one bucket instead of a second full
//! gradient, and the host one reduced stretch.
//!
//! On the reduce lane the gradient tensor and the unit's accumulator move into the job
//! and the accumulator comes back with its event (never reachable from two places);
//! accumulators are taken back in the order they were sent. At most [`REDUCE_DEPTH`] gradients
//! are in flight (the role of DeepSpeed's reduce bucket). On any error the engine aborts
//! the reduce communicator, so no rank's lane waits forever.

use super::error::EngineError;
use super::grad_store::{Acc, Accumulate};
use super::grads::Values;
use super::staging::{in_place, slot_view, Squares, Staging};
use crate::comm::{collective_start, record_collective, Collective, ReduceOp};
use crate::device::lanes::{Event, Lane};
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::partition::Partition;
use crate::plan::rules::REDUCE_DEPTH;
use crate::plan::simulate::costs::Work;
use crate::torch;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::{Kind, Tensor};

/// The buffers of a chunked reduction, reused across units and steps: on the device the
/// bucket (every rank's stretches) and this rank's reduced stretch, in host memory the
/// fp32 copy added into the accumulator where a CPU tensor cannot be read in place, and
/// a GPU's pinned staging.
pub struct ChunkBuffers {
    /// What gradients travel as between ranks.
    wire: Kind,
    /// Elements of a chunk ([`chunk_elements`]).
    chunk: usize,
    bucket: Option<Tensor>,
    reduced: Option<Tensor>,
    host: Vec<f32>,
    /// Where a GPU's stretches (a reduced stretch or a gradient's in its own kind, a
    /// device sum in fp32) leave it: two pinned buffers, one copy at the link's DMA speed
    /// running while the host adds the stretch before (a pageable copy of the fp32 form
    /// ran at a tenth of that speed on an H200).
    staging: Staging,
}

impl ChunkBuffers {
    pub fn new(wire: Kind, chunk: usize) -> ChunkBuffers {
        ChunkBuffers {
            wire,
            chunk,
            bucket: None,
            reduced: None,
            host: Vec::new(),
            staging: Staging::default(),
        }
    }

    /// New buffers of the same communication type and chunk (none allocated yet).
    pub fn fresh(&self) -> ChunkBuffers {
        ChunkBuffers::new(self.wire, self.chunk)
    }

    /// Elements of a chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Where a GPU's stretches leave it, and every reduction's adds go through.
    pub fn staging(&mut self) -> &mut Staging {
        &mut self.staging
    }
}

/// The first `len` elements of a device buffer of `kind` in `slot` (`staging::slot_view`).
fn device_view(
    slot: &mut Option<Tensor>,
    len: usize,
    kind: Kind,
    device: tch::Device,
) -> Result<Tensor, tch::TchError> {
    slot_view(slot, (len, kind, device), || {
        Tensor::f_empty([len as i64], (kind, device))
    })
}

/// `t`'s values in host memory, as a reduction adds them into an accumulator (`t` a CPU
/// tensor: device memory on CPU devices; a GPU's stretches leave through [`Staging`]):
/// in place when it is contiguous, fp32 or the bits of a 16-bit kind (widened as they
/// are added), else copied into `host` as fp32. The same values either way: widening is
/// exact.
fn host_values<'b>(t: &'b Tensor, host: &'b mut Vec<f32>) -> Result<Values<'b>, tch::TchError> {
    let n = t.numel();
    if t.is_contiguous() {
        // SAFETY: a chunk buffer of this reduction, or the gradient (see `in_place`)
        if let Some(values) = unsafe { in_place(t, n) }? {
            return Ok(values);
        }
    }
    host.resize(n, 0.0);
    torch::widen_to_f32(t, host)?;
    Ok(Values::F32(host))
}

/// Where a gradient goes: reduce-scattered into this rank's shard (stages 2–3), or added
/// whole into the replica's accumulator (stages 0–1 all-reduce once per step).
#[derive(Clone, Copy)]
pub enum Target {
    Shard,
    Replica,
}

/// A unit's gradient summed on the device over a step's micro-batches
/// (`plan::rules::device_sums`): an fp32 tensor of its accumulator (the partition at
/// stages 2–3, the padded replica at 0–1), which the step's first contribution overwrites
/// and the others add into; the `flush`ing one (the last micro-batch's, unless the
/// gradient stays on the device) then hands the sum to the host accumulator. fp32
/// additions in the same order as the host accumulator's, so the sum is the bits it would
/// hold.
pub struct OnDevice {
    pub acc: Tensor,
    pub first: bool,
    pub flush: bool,
}

/// Adds (or, first, copies) `src` into the first elements of `dst`, zeroing the rest
/// on a first contribution.
fn device_add(dst: &Tensor, src: &Tensor, first: bool) -> Result<(), tch::TchError> {
    let n = src.numel() as i64;
    let mut head = dst.f_narrow(0, 0, n)?;
    if first {
        head.f_copy_(src)?;
        let rest = dst.numel() as i64 - n;
        if rest > 0 {
            let _ = dst.f_narrow(0, n, rest)?.f_fill_(0.0)?;
        }
    } else {
        let _ = head.f_add_(src)?;
    }
    Ok(())
}

/// Reduces unit `unit`'s flat gradient `grad` (its first elements; the rest of the
/// padded unit counts as zeros) into `acc`, in chunks of at most `chunk` elements (all
/// ranks' stretches together), on the calling thread. Gradients travel in the buffers'
/// communication type between ranks; with one rank, or into a replica, nothing travels
/// and they stay fp32. With `device`, each reduced stretch is added into the device
/// accumulator instead, and reaches `acc` (which may then be None) only when flushing.
/// From a GPU the stretches leave through the buffers' [`Staging`], the last one added
/// before this returns.
#[allow(clippy::too_many_arguments)]
pub fn reduce_into<C: Collective, A: Accumulate + ?Sized>(
    comm: &C,
    target: Target,
    unit: usize,
    grad: &Tensor,
    part: Partition,
    mut acc: Option<&mut A>,
    on_device: Option<&OnDevice>,
    buffers: &mut ChunkBuffers,
    track: &Track,
    chunk: usize,
) -> Result<(), EngineError> {
    let rank = comm.rank();
    let chunks = Chunks {
        comm,
        target,
        unit,
        grad,
        part,
        on_device,
        track,
        chunk,
    };
    let result = chunks.run(acc.as_deref_mut(), buffers);
    buffers.staging.drain_charged();
    match (result, acc) {
        (Ok(()), Some(acc)) => buffers.staging.drain(acc, track, rank),
        (Ok(()), None) => Ok(()),
        (Err(e), _) => {
            buffers.staging.abandon();
            Err(e)
        }
    }
}

/// One gradient's reduction ([`reduce_into`]).
struct Chunks<'r, C> {
    comm: &'r C,
    target: Target,
    unit: usize,
    grad: &'r Tensor,
    part: Partition,
    on_device: Option<&'r OnDevice>,
    track: &'r Track,
    chunk: usize,
}

impl<C: Collective> Chunks<'_, C> {
    fn run<A: Accumulate + ?Sized>(
        &self,
        mut acc: Option<&mut A>,
        buffers: &mut ChunkBuffers,
    ) -> Result<(), EngineError> {
        let Chunks {
            comm,
            target,
            unit,
            grad,
            part,
            on_device,
            track,
            chunk,
        } = *self;
        let rank = comm.rank();
        let torch_err = |source| EngineError::Torch { rank, source };
        let (pieces, length) = match target {
            Target::Shard => (part.world, part.shard),
            Target::Replica => (1, part.padded),
        };
        let device = grad.device();
        let step = (chunk / pieces).max(1);
        // the gradient covers the unit's first `numel` elements (a tied head's gradient only
        // the embedding's); the rest, and the padding, reduce as zeros
        let numel = grad.numel().min(part.padded);
        let mut start = 0;
        while start < length {
            let k = step.min(length - start);
            if pieces == 1 {
                // nothing travels (a replica, or one rank): the stretch straight from the
                // gradient, zeros past its end
                let real = start.min(numel)..(start + k).min(numel);
                let copy_start = Instant::now();
                let view = grad
                    .f_narrow(0, real.start as i64, real.len() as i64)
                    .map_err(torch_err)?;
                if let Some(device) = on_device {
                    let recorded = Some((copy_start, 4 * k as u64));
                    let acc = acc.as_deref_mut();
                    self.add_to_device_sum(device, &view, (start, k), acc, buffers, recorded)?;
                    start += k;
                    continue;
                }
                let Some(acc) = acc.as_deref_mut() else {
                    return Err(no_accumulator(rank));
                };
                let elt = view.kind().elt_size_in_bytes();
                if view.device().is_cuda() {
                    // what crosses: the gradient's own kind
                    let bytes = (elt * k) as u64;
                    buffers
                        .staging
                        .send(unit, &view, (start, k), bytes, acc, track, rank)?;
                    start += k;
                    continue;
                }
                let values = if real.len() == k {
                    host_values(&view, &mut buffers.host).map_err(torch_err)?
                } else {
                    let host = &mut buffers.host;
                    host.resize(k, 0.0);
                    if !real.is_empty() {
                        torch::widen_to_f32(&view, &mut host[..real.len()]).map_err(torch_err)?;
                    }
                    host[real.len()..].fill(0.0);
                    Values::F32(&host[..])
                };
                track.record(Phase::D2h, Some(unit), copy_start, 4 * k as u64);
                charge_to_host(&mut buffers.staging, k, elt);
                buffers.staging.add_now(acc, start, values, track)?;
                start += k;
                continue;
            }
            let wire = buffers.wire;
            let bucket = device_view(&mut buffers.bucket, pieces * k, wire, device).map_err(torch_err)?;
            let copy_start = Instant::now();
            for p in 0..pieces {
                // this chunk's stretch of piece p, within the real elements
                let from = p * length + start;
                let real = from.min(numel)..(from + k).min(numel);
                let stretch = bucket.f_narrow(0, (p * k) as i64, k as i64).map_err(torch_err)?;
                let copy = || -> Result<(), tch::TchError> {
                    if !real.is_empty() {
                        let source = grad.f_narrow(0, real.start as i64, real.len() as i64)?;
                        stretch.f_narrow(0, 0, real.len() as i64)?.f_copy_(&source)?;
                    }
                    if real.len() < k {
                        let _ = stretch
                            .f_narrow(0, real.len() as i64, (k - real.len()) as i64)?
                            .f_fill_(0.0)?;
                    }
                    Ok(())
                };
                copy().map_err(torch_err)?;
            }
            let bytes = (wire.elt_size_in_bytes() * pieces * k) as u64;
            track.record(Phase::D2h, Some(unit), copy_start, bytes);
            let reduced = device_view(&mut buffers.reduced, k, wire, device).map_err(torch_err)?;
            let reduce_start = collective_start();
            comm.reduce_scatter_tensor(&bucket, &reduced, ReduceOp::Avg)?;
            record_collective(track, (Phase::Reduce, Some(unit)), reduce_start, bytes);
            sim::charge(Work::OnDevice(bytes));
            sim::charge(Work::Collective(bytes));
            if let Some(device) = on_device {
                let acc = acc.as_deref_mut();
                self.add_to_device_sum(device, &reduced, (start, k), acc, buffers, None)?;
                start += k;
                continue;
            }
            let Some(acc) = acc.as_deref_mut() else {
                return Err(no_accumulator(rank));
            };
            charge_to_host(&mut buffers.staging, k, wire.elt_size_in_bytes());
            if reduced.device().is_cuda() {
                buffers
                    .staging
                    .send(unit, &reduced, (start, k), 0, acc, track, rank)?;
            } else {
                let values = host_values(&reduced, &mut buffers.host).map_err(torch_err)?;
                buffers.staging.add_now(acc, start, values, track)?;
            }
            start += k;
        }
        Ok(())
    }

    /// A stretch `src` of `k` elements added into the device sum at `start`; the flushing
    /// contribution sends the sum's stretch on to the host accumulator (`recorded` as in
    /// [`Self::flush`]).
    fn add_to_device_sum<A: Accumulate + ?Sized>(
        &self,
        device: &OnDevice,
        src: &Tensor,
        (start, k): (usize, usize),
        acc: Option<&mut A>,
        buffers: &mut ChunkBuffers,
        recorded: Option<(Instant, u64)>,
    ) -> Result<(), EngineError> {
        let rank = self.comm.rank();
        let torch_err = |source| EngineError::Torch { rank, source };
        let dst = device
            .acc
            .f_narrow(0, start as i64, k as i64)
            .map_err(torch_err)?;
        device_add(&dst, src, device.first).map_err(torch_err)?;
        sim::charge(Work::OnDevice(4 * k as u64));
        if device.flush {
            charge_to_host(&mut buffers.staging, k, 4);
            self.flush(&dst, start, acc, buffers, recorded)?;
        }
        Ok(())
    }

    /// A stretch of a device accumulator's sum into the host accumulator at `start`
    /// (recorded as a copy out from the given time, of the given bytes, where asked).
    fn flush<A: Accumulate + ?Sized>(
        &self,
        dst: &Tensor,
        start: usize,
        acc: Option<&mut A>,
        buffers: &mut ChunkBuffers,
        recorded: Option<(Instant, u64)>,
    ) -> Result<(), EngineError> {
        let (rank, unit, track) = (self.comm.rank(), self.unit, self.track);
        let Some(acc) = acc else {
            return Err(no_accumulator(rank));
        };
        if dst.device().is_cuda() {
            let bytes = recorded.map_or(0, |(_, bytes)| bytes);
            let k = dst.numel();
            return buffers
                .staging
                .send(unit, dst, (start, k), bytes, acc, track, rank);
        }
        let values =
            host_values(dst, &mut buffers.host).map_err(|source| EngineError::Torch { rank, source })?;
        buffers.staging.add_now(acc, start, values, track)?;
        if let Some((from, bytes)) = recorded {
            track.record(Phase::D2h, Some(unit), from, bytes);
        }
        Ok(())
    }
}

/// Charges `k` elements reaching the host accumulator on a simulated device: from a GPU
/// one copy in their kind (`elt` bytes each) through the staging, the add once it is in;
/// on a CPU device the add alone, which reads the values where they are (`in_place`).
fn charge_to_host(staging: &mut Staging, k: usize, elt: usize) {
    if staging.charge(k as u64, elt) {
        return;
    }
    sim::charge(Work::HostAdd(k as u64));
}

fn no_accumulator(rank: usize) -> EngineError {
    EngineError::Invariant {
        rank,
        what: "a reduction into the host accumulator without one",
    }
}

/// What a job hands back: the accumulator it was lent (none when the reduction only
/// added into the device accumulator), and Σ g² of its values when asked.
type Outcome<'s> = Result<(Option<Acc<'s>>, Option<Squares>), EngineError>;

/// A gradient on the lane: its unit, the event of its reduction, and where the job
/// leaves the accumulator.
struct InFlight<'s> {
    unit: usize,
    done: Event,
    slot: Arc<Mutex<Option<Outcome<'s>>>>,
    /// The gradient the job reads, held until its event (`keep_until`): on a GPU the job
    /// only queues the reads (a device sum's add, the bucket's copies) on the lane's
    /// stream, and compute's allocator would hand the freed block to the next unit
    /// before they ran.
    grad: Tensor,
}

/// The compute thread's end of the reduce lane.
pub struct Reducer<'env, C: Collective> {
    /// The step's collectives lane (shared with the stage-3 gathers).
    lane: Arc<Lane<'env>>,
    comm: C,
    track: Track,
    in_flight: VecDeque<InFlight<'env>>,
    /// Used by one job at a time (the lane runs them in order).
    buffers: Arc<Mutex<ChunkBuffers>>,
}

impl<'env, C: Collective + Clone + 'env> Reducer<'env, C> {
    pub fn new(lane: Arc<Lane<'env>>, comm: C, track: Track, buffers: ChunkBuffers) -> Self {
        Reducer {
            lane,
            comm,
            track,
            in_flight: VecDeque::new(),
            buffers: Arc::new(Mutex::new(buffers)),
        }
    }

    /// Accumulators on the lane.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether unit `unit`'s accumulator is on the lane.
    pub fn holds(&self, unit: usize) -> bool {
        self.in_flight.iter().any(|job| job.unit == unit)
    }

    /// Queues unit `unit`'s gradient for reduction into `acc` (its accumulator, lent to
    /// the job; with `squares`, this is its step's last contribution, whose Σ g² comes
    /// back with it) or `device` (see [`reduce_into`]). The caller takes accumulators back
    /// first while [`Self::in_flight`] is `REDUCE_DEPTH` (so that it leases a chunk buffer
    /// only when the lane has room); more is an error.
    pub fn send(
        &mut self,
        unit: usize,
        grad: Tensor,
        part: Partition,
        (acc, squares): (Option<Acc<'env>>, bool),
        device: Option<OnDevice>,
    ) -> Result<(), EngineError> {
        if self.in_flight.len() >= REDUCE_DEPTH {
            return Err(EngineError::Invariant {
                rank: self.comm.rank(),
                what: "more gradients sent to the reduce lane than its depth",
            });
        }
        let slot = Arc::new(Mutex::new(None));
        let (comm, track, out, buffers) = (
            self.comm.clone(),
            self.track.clone(),
            slot.clone(),
            self.buffers.clone(),
        );
        let held = grad.shallow_clone();
        let done = self.lane.submit(move || {
            let mut acc = acc;
            let mut buffers = buffers.lock().unwrap_or_else(|e| e.into_inner());
            let chunk = buffers.chunk();
            if squares {
                buffers.staging.gather_squares();
            }
            let result = reduce_into(
                &comm,
                Target::Shard,
                unit,
                &grad,
                part,
                acc.as_mut(),
                device.as_ref(),
                &mut buffers,
                &track,
                chunk,
            )
            .and_then(|()| acc.as_mut().map_or(Ok(()), |a| a.finish(&track)));
            let squares = buffers.staging.take_squares();
            let message = result.as_ref().err().map(|e| e.to_string());
            *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(result.map(|()| (acc, squares)));
            message.map_or(Ok(()), |m| Err(m.into()))
        });
        self.in_flight.push_back(InFlight {
            unit,
            done,
            slot,
            grad: held,
        });
        Ok(())
    }

    /// The oldest accumulator back: waiting for it when `wait`, else only if its job is
    /// done.
    #[allow(clippy::type_complexity)]
    pub fn take(
        &mut self,
        wait: bool,
    ) -> Result<Option<(usize, Option<Acc<'env>>, Option<Squares>)>, EngineError> {
        let Some(oldest) = self.in_flight.front() else {
            return Ok(None);
        };
        if !wait && !oldest.done.query() {
            return Ok(None);
        }
        let Some(InFlight {
            unit,
            done,
            slot,
            grad,
        }) = self.in_flight.pop_front()
        else {
            return Ok(None);
        };
        // the gradient goes once the job's device work is done
        let waited = done.synchronize();
        drop(grad);
        let outcome = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        match (outcome, waited) {
            // the job's own error names the collective's cause
            (Some(Err(e)), _) => Err(e),
            (_, Err(e)) => Err(e.into()),
            (Some(Ok((acc, squares))), Ok(())) => Ok(Some((unit, acc, squares))),
            (None, Ok(())) => Err(EngineError::LaneStopped {
                rank: self.comm.rank(),
                lane: "reduce",
                unit,
            }),
        }
    }

    /// Hands the chunk buffers back once nothing is in flight.
    pub fn finish(self) -> ChunkBuffers {
        for job in &self.in_flight {
            let _ = job.done.synchronize();
        }
        match Arc::try_unwrap(self.buffers) {
            Ok(buffers) => buffers.into_inner().unwrap_or_else(|e| e.into_inner()),
            // a job still holds them: new ones of the same shape
            Err(shared) => shared.lock().unwrap_or_else(|e| e.into_inner()).fresh(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::Local;
    use crate::engine::grads::Grads;
    use crate::plan::rules::CHUNK_LIMIT;

    /// `body` on each rank of a `Local` group of `world`, each on a thread of its own;
    /// the results in rank order.
    fn on_ranks<R: Send>(world: usize, body: impl Fn(Local) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let handles: Vec<_> = Local::group(world)
                .into_iter()
                .map(|comm| {
                    let body = &body;
                    s.spawn(move || body(comm))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every chunking (stretches of 1, 7, 64 elements, and the whole) leaves each rank
    /// the bits one reduce-scatter of the whole padded gradient gives it, added to what
    /// its accumulator held; replicas get the whole gradient added.
    #[test]
    fn chunked_reduction_equals_one_reduce_scatter_bit_for_bit() {
        for world in 1..=3 {
            let part = Partition::new(1000, world);
            let results = on_ranks(world, |comm| {
                let rank = comm.rank();
                let values: Vec<f32> = (0..part.numel)
                    .map(|i| ((i * 31 + rank * 7) % 97) as f32 / 9.0 - 3.3)
                    .collect();
                let grad = Tensor::from_slice(&values);
                let start: Vec<f32> = (0..part.shard).map(|i| i as f32 * 0.01).collect();
                // the reference: the whole padded gradient at once
                let mut full = values.clone();
                full.resize(part.padded, 0.0);
                let mut mine = vec![0f32; part.shard];
                comm.reduce_scatter(&full, &mut mine, ReduceOp::Avg).unwrap();
                let expected: Vec<f32> = start.iter().zip(&mine).map(|(a, b)| a + b).collect();
                let mut outcomes = Vec::new();
                for chunk in [world, 7 * world, 64 * world, usize::MAX] {
                    let mut acc = Grads::from_f32(&start).unwrap();
                    let mut buffers = ChunkBuffers::new(Kind::Float, CHUNK_LIMIT);
                    let track = Track::disabled();
                    reduce_into(
                        &comm,
                        Target::Shard,
                        0,
                        &grad,
                        part,
                        Some(&mut acc),
                        None,
                        &mut buffers,
                        &track,
                        chunk,
                    )
                    .unwrap();
                    let mut replica = Grads::from_f32(&vec![1.0; part.padded]).unwrap();
                    reduce_into(
                        &comm,
                        Target::Replica,
                        0,
                        &grad,
                        part,
                        Some(&mut replica),
                        None,
                        &mut buffers,
                        &track,
                        chunk,
                    )
                    .unwrap();
                    outcomes.push((acc, replica));
                }
                (expected, full, outcomes)
            });
            for (expected, full, outcomes) in results {
                for (acc, replica) in outcomes {
                    let Grads::F32(acc) = acc else { unreachable!() };
                    let Grads::F32(replica) = replica else {
                        unreachable!()
                    };
                    assert_eq!(&acc[..], &expected[..], "world {world}");
                    let whole: Vec<f32> = full.iter().map(|x| 1.0 + x).collect();
                    assert_eq!(&replica[..], &whole[..], "world {world}");
                }
            }
        }
    }

    /// Gradient accumulation on the device: three micro-batches' gradients added into
    /// the device sum (the first overwriting it), flushed by the last, leave the host
    /// accumulator the bits three reductions straight into it give, for every world size
    /// and chunking, gradients shorter than the unit included.
    #[test]
    fn device_sums_flush_the_bits_of_host_accumulation() {
        for world in 1..=3 {
            let part = Partition::new(1000, world);
            let results = on_ranks(world, |comm| {
                let rank = comm.rank();
                let grads: Vec<Tensor> = (0..3)
                    .map(|m| {
                        let len = if m == 1 { 600 } else { part.numel };
                        let values: Vec<f32> = (0..len)
                            .map(|i| ((i * 37 + rank * 11 + m * 5) % 89) as f32 / 7.0 - 5.1)
                            .collect();
                        Tensor::from_slice(&values)
                    })
                    .collect();
                let track = Track::disabled();
                let mut pairs = Vec::new();
                for chunk in [world, 7 * world, usize::MAX] {
                    let mut buffers = ChunkBuffers::new(Kind::Float, CHUNK_LIMIT);
                    let mut host = Grads::zeros(part.shard, false).unwrap();
                    for g in &grads {
                        let acc = Some(&mut host);
                        reduce_into(
                            &comm,
                            Target::Shard,
                            0,
                            g,
                            part,
                            acc,
                            None,
                            &mut buffers,
                            &track,
                            chunk,
                        )
                        .unwrap();
                    }
                    let mut flushed = Grads::zeros(part.shard, false).unwrap();
                    let sum = Tensor::full([part.shard as i64], 7.0, (Kind::Float, tch::Device::Cpu));
                    for (m, g) in grads.iter().enumerate() {
                        let on = OnDevice {
                            acc: sum.shallow_clone(),
                            first: m == 0,
                            flush: m == 2,
                        };
                        let acc = (m == 2).then_some(&mut flushed);
                        reduce_into(
                            &comm,
                            Target::Shard,
                            0,
                            g,
                            part,
                            acc,
                            Some(&on),
                            &mut buffers,
                            &track,
                            chunk,
                        )
                        .unwrap();
                    }
                    pairs.push((host, flushed));
                }
                pairs
            });
            for (host, flushed) in results.into_iter().flatten() {
                let (Grads::F32(host), Grads::F32(flushed)) = (host, flushed) else {
                    unreachable!()
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&flushed), bits(&host), "world {world}");
            }
        }
    }

    /// A tied head's gradient covers only the embedding: the unit's other elements
    /// (GPT-2's position embedding) reduce as zeros.
    #[test]
    fn a_gradient_shorter_than_its_unit_reduces_the_rest_as_zeros() {
        let part = Partition::new(1000, 2);
        let results = on_ranks(2, |comm| {
            let values: Vec<f32> = (0..600).map(|i| (i + comm.rank()) as f32 * 0.5).collect();
            let mut full = values.clone();
            full.resize(part.padded, 0.0);
            let mut expected = vec![0f32; part.shard];
            comm.reduce_scatter(&full, &mut expected, ReduceOp::Avg).unwrap();
            let mut acc = Grads::zeros(part.shard, false).unwrap();
            let (mut buffers, track) = (ChunkBuffers::new(Kind::Float, CHUNK_LIMIT), Track::disabled());
            let grad = Tensor::from_slice(&values);
            reduce_into(
                &comm,
                Target::Shard,
                0,
                &grad,
                part,
                Some(&mut acc),
                None,
                &mut buffers,
                &track,
                64,
            )
            .unwrap();
            (acc, expected)
        });
        for (acc, expected) in results {
            let Grads::F32(acc) = acc else { unreachable!() };
            assert_eq!(&acc[..], &expected[..]);
        }
    }
}
