//! The last leg of a reduction out of a GPU, two stretches deep: each stretch (a reduced
//! stretch, a gradient's, a device sum's) is copied in the kind it has there into one of
//! two pinned staging buffers by a DMA copy queued on the calling thread's stream (the
//! collectives lane's, or compute's at stages 0–1), with a mark recorded after it; it is
//! added into the host accumulator once the next stretch's copy is queued and its own
//! mark has passed. So one stretch's copy runs while the host adds the one before, and
//! the thread polls a mark instead of sleeping in a blocking copy (on an H200 virtual
//! machine a blocking 8 MB copy cost its thread 0.62 ms against 0.15 ms of DMA). The adds
//! come in the stretches' order, each with the values it would add unstaged: the same
//! bits. A simulated GPU is charged the same schedule ([`Staging::charge`]): each copy
//! on the stream's copy engine from when it is queued, each add once its copy is in.
//!
//! Every add of a reduction goes through here ([`Staging::add_now`] where the values are
//! in host memory already), so that a step's last contribution to an accumulator can
//! give Σ g² of its final values as it adds them ([`Squares`]): the gradient norm then
//! needs no pass of its own over the accumulators (on an H200 that pass took 0.10 s of a
//! 0.75 s llama-1b step).

use super::error::EngineError;
use super::grad_store::Accumulate;
use super::grads::Values;
use crate::device::cuda::Cuda;
use crate::device::lanes::{Mark, Stream};
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::rules::NORM_BLOCK;
use crate::plan::simulate::costs::Work;
use crate::torch;
use std::time::Instant;
use tch::{Kind, Tensor};

/// A stretch whose copy is queued and whose add is not done.
struct InFlight {
    unit: usize,
    /// The accumulator's element its first value goes to.
    start: usize,
    /// Elements in the buffer (those past the copied ones zeros).
    len: usize,
    /// The staging buffer that holds it.
    buffer: usize,
    /// Recorded after its copy on the GPU.
    mark: Mark,
}

/// On a simulated GPU, a stretch charged as copied whose add is not charged yet.
struct Charged {
    elements: u64,
    /// Virtual time its copy is in.
    landed: f64,
}

/// Σ g² of an accumulator's values as a step's last contribution leaves them, gathered
/// as the reduction adds stretch after stretch from element 0; each stretch must start on
/// a block of the sum ([`NORM_BLOCK`]) so that the sum is the one a pass over the
/// accumulator folds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Squares {
    sum: f64,
    /// The element the next stretch must start at.
    next: usize,
}

impl Squares {
    /// The sum over an accumulator of `len` elements, if every stretch up to its end was
    /// squared in order.
    pub fn over(&self, len: usize) -> Option<f64> {
        (self.next == len).then_some(self.sum)
    }
}

/// Adds `x` into `acc` at `start`, continuing `squares` where they are gathered; they are
/// lost (None) where the stretch does not follow on from the last on a block boundary,
/// or the accumulator does not square as it adds.
fn add<A: Accumulate + ?Sized>(
    squares: &mut Option<Squares>,
    acc: &mut A,
    (start, x): (usize, Values),
    track: &Track,
) -> Result<(), EngineError> {
    let Some(s) = squares.take() else {
        return acc.add(start, x, track);
    };
    if start != s.next || !start.is_multiple_of(NORM_BLOCK) {
        return acc.add(start, x, track);
    }
    *squares = acc.add_squared(start, x, s.sum, track)?.map(|sum| Squares {
        sum,
        next: start + x.len(),
    });
    Ok(())
}

/// The two pinned buffers and the stretch in flight, reused across units and steps.
#[derive(Default)]
pub struct Staging {
    buffers: [Option<Tensor>; 2],
    /// The buffer the next copy goes into.
    next: usize,
    in_flight: Option<InFlight>,
    charged: Option<Charged>,
    /// Virtual time the simulated copy engine is free from.
    engine_free: f64,
    /// What the charged stretches' adds charged (their gradients' NVMe I/O), charged
    /// after the last add.
    later: Vec<Work>,
    /// fp32 values of a kind the add does not widen itself.
    host: Vec<f32>,
    /// Σ g² of the reduction's adds, when asked for ([`Self::gather_squares`]).
    squares: Option<Squares>,
}

impl Staging {
    /// The adds of the next reduction are its accumulator's last of the step: gather
    /// Σ g² of the values they leave.
    pub fn gather_squares(&mut self) {
        self.squares = Some(Squares::default());
    }

    /// What [`Self::gather_squares`] gathered (None when not asked, or lost).
    pub fn take_squares(&mut self) -> Option<Squares> {
        self.squares.take()
    }

    /// Adds values already in host memory (a CPU device's, or a simulated one's) into
    /// `acc` at `start`, continuing the squares; on a simulated GPU what the add charges
    /// is charged later ([`Self::charged_add`]).
    pub fn add_now<A: Accumulate + ?Sized>(
        &mut self,
        acc: &mut A,
        start: usize,
        x: Values,
        track: &Track,
    ) -> Result<(), EngineError> {
        let mut squares = self.squares.take();
        let result = self.charged_add(|| add(&mut squares, acc, (start, x), track));
        self.squares = squares;
        result
    }

    /// Queues the copy of `src` (a contiguous GPU tensor: the first elements of a stretch
    /// of `len` for `acc` at `start`, zeros past them; its queueing recorded on `track` as
    /// a copy out of `bytes`), then adds the stretch queued before it into `acc`.
    #[allow(clippy::too_many_arguments)]
    pub fn send<A: Accumulate + ?Sized>(
        &mut self,
        unit: usize,
        src: &Tensor,
        (start, len): (usize, usize),
        bytes: u64,
        acc: &mut A,
        track: &Track,
        rank: usize,
    ) -> Result<(), EngineError> {
        let torch_err = |source| EngineError::Torch { rank, source };
        let issued = Instant::now();
        let (copied, kind) = (src.numel(), src.kind());
        let buffer = self.next;
        // the buffer's last stretch was added before this one was queued
        let pinned = pinned_view(&mut self.buffers[buffer], len, kind).map_err(torch_err)?;
        if len > copied {
            // zeros past the copied elements (+0.0 in every kind), written by the host
            // beside the copy into the elements before them
            let tail = pinned
                .f_narrow(0, copied as i64, (len - copied) as i64)
                .map_err(torch_err)?;
            let bytes = (len - copied) * kind.elt_size_in_bytes();
            // SAFETY: the tail of this staging's own buffer, which no copy writes
            unsafe { torch::host_bytes_mut(&tail, bytes) }
                .map_err(torch_err)?
                .fill(0);
        }
        let head = pinned.f_narrow(0, 0, copied as i64).map_err(torch_err)?;
        let mark = dma(&head, src, false, "a staged copy's mark", rank)
            .map_err(|(DmaFailed::NotQueued(e) | DmaFailed::InFlight(e))| e)?;
        self.next = 1 - buffer;
        track.record(Phase::D2h, Some(unit), issued, bytes);
        let before = self.in_flight.replace(InFlight {
            unit,
            start,
            len,
            buffer,
            mark,
        });
        match before {
            Some(before) => self.land(before, acc, track, rank),
            None => Ok(()),
        }
    }

    /// Adds the stretch in flight, if any, into `acc`.
    pub fn drain<A: Accumulate + ?Sized>(
        &mut self,
        acc: &mut A,
        track: &Track,
        rank: usize,
    ) -> Result<(), EngineError> {
        if let Some(stretch) = self.in_flight.take() {
            self.land(stretch, acc, track, rank)?;
        }
        Ok(())
    }

    /// Forgets the stretch in flight (its reduction failed): its buffer is used again only
    /// after its copy is done.
    pub fn abandon(&mut self) {
        if let Some(stretch) = self.in_flight.take() {
            if stretch.mark.synchronize().is_err() {
                // unknown when the copy is done: torch's host allocator knows
                self.buffers[stretch.buffer] = None;
            }
        }
        self.charged = None;
        self.later.clear();
        self.squares = None;
    }

    fn land<A: Accumulate + ?Sized>(
        &mut self,
        stretch: InFlight,
        acc: &mut A,
        track: &Track,
        rank: usize,
    ) -> Result<(), EngineError> {
        let torch_err = |source| EngineError::Torch { rank, source };
        let waited = Instant::now();
        stretch.mark.synchronize().map_err(|e| EngineError::Torch {
            rank,
            source: tch::TchError::Torch(format!("a staged copy: {e}")),
        })?;
        track.waited(Phase::D2h, Some(stretch.unit), waited);
        let Some(pinned) = self.buffers[stretch.buffer].as_ref() else {
            return Err(EngineError::Invariant {
                rank,
                what: "a staged stretch without its buffer",
            });
        };
        // SAFETY: the buffer is this staging's; the copy into it is done (its mark) and
        // nothing writes it until the next copy, queued after this add
        let values = match unsafe { in_place(pinned, stretch.len) }.map_err(torch_err)? {
            Some(values) => values,
            None => {
                self.host.resize(stretch.len, 0.0);
                let view = pinned.f_narrow(0, 0, stretch.len as i64).map_err(torch_err)?;
                torch::copy_to_f32(&view, &mut self.host).map_err(torch_err)?;
                Values::F32(&self.host)
            }
        };
        add(&mut self.squares, acc, (stretch.start, values), track)
    }

    /// On a simulated GPU, charges a stretch of `elements` leaving in a kind of `elt`
    /// bytes as [`Self::send`] runs it: its copy on the copy engine from the later of now
    /// and the engine's last copy, then the add of the stretch before it once that one's
    /// copy is in. False elsewhere (nothing charged).
    pub fn charge(&mut self, elements: u64, elt: usize) -> bool {
        let Some(stream) = sim::entered().filter(|_| sim::gpu()) else {
            return false;
        };
        let landed = charge_copy(&stream, &mut self.engine_free, Work::D2h(elt as u64 * elements));
        if let Some(before) = self.charged.replace(Charged { elements, landed }) {
            land_charged(&stream, before);
        }
        true
    }

    /// Runs the add of a stretch just [`Self::charge`]d: on a simulated GPU the work it
    /// charges (a gradient's NVMe I/O) is charged after the reduction's last add, since
    /// the payload adds each stretch at once where a GPU adds it a stretch later (the
    /// I/O's place among the adds is left out; its time is counted).
    fn charged_add<R>(&mut self, add: impl FnOnce() -> R) -> R {
        if self.charged.is_none() {
            return add();
        }
        let (result, work) = sim::deferring(add);
        self.later.extend(work);
        result
    }

    /// On a simulated GPU, charges the add of the stretch charged last, then what the
    /// adds charged. The copy engine is then idle by the thread's time, whichever thread
    /// uses these buffers next.
    pub fn drain_charged(&mut self) {
        if let (Some(stream), Some(last)) = (sim::entered(), self.charged.take()) {
            land_charged(&stream, last);
        }
        for work in self.later.drain(..) {
            sim::charge(work);
        }
        self.engine_free = 0.0;
    }
}

/// A CPU tensor of `len` elements of `kind` over the host memory at `ptr`, for a copy
/// between it and a GPU.
///
/// # Safety
/// The memory must hold `len` elements and outlive the view, and any copy queued with
/// it (until that copy's mark has passed).
pub(super) unsafe fn host_view(ptr: *const u8, len: usize, kind: Kind) -> Result<Tensor, tch::TchError> {
    // SAFETY: as the caller promises
    unsafe { Tensor::f_from_blob(ptr, &[len as i64], &[1], kind, tch::Device::Cpu) }
}

/// How a [`dma`] copy failed.
pub(super) enum DmaFailed {
    /// It was not queued.
    NotQueued(EngineError),
    /// It was queued, and nothing says when it is done: its host memory must never be
    /// freed nor used again.
    InFlight(EngineError),
}

/// Queues a copy between `host` (a view of pinned host memory, [`host_view`]) and the GPU
/// tensor `device`, into `device` or out of it, on the calling thread's current stream
/// without waiting; returns the mark recorded after it (`what` names it in an error).
pub(super) fn dma(
    host: &Tensor,
    device: &Tensor,
    into_device: bool,
    what: &str,
    rank: usize,
) -> Result<Mark, DmaFailed> {
    let queued = if into_device {
        torch::shim::copy_(&mut device.shallow_clone(), host, true)
    } else {
        torch::shim::copy_(&mut host.shallow_clone(), device, true)
    };
    queued.map_err(|source| DmaFailed::NotQueued(EngineError::Torch { rank, source }))?;
    copied_mark(device, what, rank).map_err(DmaFailed::InFlight)
}

/// A mark on the calling thread's current stream of `src`'s GPU, recorded after a copy
/// out of `src` queued there (`what` names it in an error).
pub(super) fn copied_mark(src: &Tensor, what: &str, rank: usize) -> Result<Mark, EngineError> {
    let ordinal = match src.device() {
        tch::Device::Cuda(ordinal) => ordinal,
        _ => 0,
    };
    Cuda::shared(ordinal)
        .and_then(|cuda| cuda.current_stream())
        .map_err(|e| e.to_string())
        .and_then(|stream| stream.mark().map_err(|e| e.to_string()))
        .map_err(|message| EngineError::Torch {
            rank,
            source: tch::TchError::Torch(format!("{what}: {message}")),
        })
}

/// Charges `work`, a copy a thread queued on a simulated GPU, to its stream's copy engine,
/// free from `engine_free`: from the later of the stream's time and that, beside the
/// thread. Returns when the copy is in (the engine's time from then).
pub(super) fn charge_copy(stream: &sim::SimStream, engine_free: &mut f64, work: Work) -> f64 {
    let start = stream.now().max(*engine_free);
    *engine_free = start + stream.seconds(work);
    stream.beside(work, start, *engine_free);
    *engine_free
}

/// The host's wait for a charged stretch's copy (with the thread's wake-up after it),
/// then its add.
fn land_charged(stream: &sim::SimStream, stretch: Charged) {
    stream.wait_for_copy(stretch.landed);
    stream.run(Work::HostAdd(stretch.elements));
}

/// The first `len` elements of `kind` of the pinned buffer in `slot` ([`slot_view`]).
fn pinned_view(slot: &mut Option<Tensor>, len: usize, kind: Kind) -> Result<Tensor, tch::TchError> {
    slot_view(slot, (len, kind, tch::Device::Cpu), || {
        torch::shim::pinned_bytes(len * kind.elt_size_in_bytes())?.f_view_dtype(kind)
    })
}

/// The first `len` elements of the buffer in `slot`, which `make` makes (or remakes
/// larger) when it does not hold `len` elements of `kind` on `device`: buffers grow to
/// the largest stretch in the first step, then stay.
pub(super) fn slot_view(
    slot: &mut Option<Tensor>,
    (len, kind, device): (usize, Kind, tch::Device),
    make: impl FnOnce() -> Result<Tensor, tch::TchError>,
) -> Result<Tensor, tch::TchError> {
    let fits = |t: &Tensor| t.numel() >= len && t.kind() == kind && t.device() == device;
    let buffer = match slot.take() {
        Some(t) if fits(&t) => t,
        _ => make()?,
    };
    let view = buffer.f_narrow(0, 0, len as i64);
    *slot = Some(buffer);
    view
}

/// The values of `t`, a contiguous CPU tensor, read in place as a reduction adds them
/// (None for a kind it does not add).
///
/// # Safety
/// Nothing may write `t`'s elements while the values are read (a chunk buffer of the
/// reduction, the gradient, which nothing writes once backward produced it, or a staging
/// buffer whose copy is done).
pub(super) unsafe fn in_place(t: &Tensor, n: usize) -> Result<Option<Values<'_>>, tch::TchError> {
    Ok(Some(match t.kind() {
        // SAFETY: the element type is the kind's (16-bit floats read as their bits, in
        // all three arms); the caller's contract
        Kind::Float => Values::F32(unsafe { torch::host_slice::<f32>(t, n) }?),
        // SAFETY: as above
        Kind::BFloat16 => Values::Bf16(unsafe { torch::host_slice::<u16>(t, n) }?),
        // SAFETY: as above
        Kind::Half => Values::F16(unsafe { torch::host_slice::<u16>(t, n) }?),
        _ => return Ok(None),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::grads::Grads;

    /// Σ g² gathered through the adds of a reduction is the pass's over the accumulator
    /// when the stretches follow on from element 0 on block boundaries (the last one
    /// short); a stretch that starts elsewhere loses it, and the adds are made all the
    /// same.
    #[test]
    fn squares_follow_stretches_on_block_boundaries_and_are_lost_off_them() {
        let n = 5 * NORM_BLOCK + 300;
        let x: Vec<f32> = (0..n).map(|i| ((i * 31) % 97) as f32 / 9.0 - 3.3).collect();
        let track = Track::disabled();
        for (stretch, kept) in [
            (NORM_BLOCK, true),
            (2 * NORM_BLOCK, true),
            (NORM_BLOCK + 1, false),
        ] {
            let mut staging = Staging::default();
            staging.gather_squares();
            let mut acc = Grads::zeros(n, false).unwrap();
            for a in (0..n).step_by(stretch) {
                let b = (a + stretch).min(n);
                staging
                    .add_now(&mut acc, a, Values::F32(&x[a..b]), &track)
                    .unwrap();
            }
            let squares = staging.take_squares();
            let Grads::F32(g) = &acc else { unreachable!() };
            assert_eq!(&g[..], &x[..], "stretches of {stretch}: the adds");
            let pass = acc.sum_squares(0..n);
            assert_eq!(
                squares.and_then(|s| s.over(n)).map(f64::to_bits),
                kept.then_some(pass.to_bits()),
                "stretches of {stretch}"
            );
            assert_eq!(
                squares.and_then(|s| s.over(n - 1)),
                None,
                "a sum short of the accumulator's end"
            );
        }
        // not asked: nothing gathered
        let mut staging = Staging::default();
        let mut acc = Grads::zeros(4, false).unwrap();
        staging
            .add_now(&mut acc, 0, Values::F32(&x[..4]), &track)
            .unwrap();
        assert!(staging.take_squares().is_none());
    }
}
