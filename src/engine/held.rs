//! Gradient sums held on the device until the optimizer reaches their unit
//! (`rules::held_gradients`), taken to the host for an update there, two deep: the
//! optimizer thread queues the copy of the next unit's sum before it waits for this
//! unit's, so one copy runs while the host updates the unit before (as the reduction's
//! staging does, `staging.rs`). A GPU's sums are copied by DMA on the thread's stream
//! into two pinned buffers of the largest held partition, each with a mark recorded
//! after its copy; a CPU device's are read where they are, and a simulated GPU is charged
//! the same schedule: each copy on the stream's copy engine from when it is queued, each
//! update once its copy is in.

use super::error::EngineError;
use super::staging::{dma, host_view, DmaFailed};
use crate::device::lanes::Mark;
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::simulate::costs::Work;
use crate::torch;
use std::time::Instant;
use tch::{Kind, Tensor};
use tierzero_offload::adam::GradSlice;
use tierzero_offload::arena::{self, Pinning, Slab};

/// A sum whose copy is queued.
struct Queued {
    unit: usize,
    /// The buffer it goes into (a GPU's), and the mark recorded after its copy.
    copy: Option<(usize, Mark)>,
    /// On a simulated GPU, the virtual time its copy is in.
    landed: Option<f64>,
    len: usize,
}

/// The optimizer thread's copies of held sums: the pinned buffers (none on a CPU device),
/// and the sum being used and the one queued after it.
pub(super) struct HeldCopies {
    buffers: Vec<Slab<f32>>,
    queued: Vec<Queued>,
    /// The buffer the next copy goes into.
    next: usize,
    /// Virtual time a simulated GPU's copy engine is free from.
    engine_free: f64,
    rank: usize,
}

impl HeldCopies {
    /// Two pinned buffers of `elements` each (none for 0: a CPU device's sums are read in
    /// place), carved once for the run.
    pub(super) fn new(rank: usize, elements: usize, pinning: &Pinning) -> Result<HeldCopies, EngineError> {
        let buffers = if elements == 0 {
            Vec::new()
        } else {
            arena::carve::<f32>(&[elements, elements], pinning).map_err(|source| EngineError::Arena {
                rank,
                what: "held gradient copies",
                source,
            })?
        };
        Ok(HeldCopies {
            buffers,
            queued: Vec::with_capacity(2),
            next: 0,
            engine_free: 0.0,
            rank,
        })
    }

    /// Bytes of the pinned buffers.
    pub(super) fn bytes(&self) -> usize {
        self.buffers.iter().map(|b| 4 * b.len()).sum()
    }

    fn torch_error(&self, what: &str, message: String) -> EngineError {
        EngineError::Torch {
            rank: self.rank,
            source: tch::TchError::Torch(format!("{what}: {message}")),
        }
    }

    /// Forgets what is queued from an earlier step, each copy waited for first (a step
    /// whose optimizer stopped early leaves its next unit's copy queued).
    pub(super) fn start_step(&mut self) -> Result<(), EngineError> {
        for queued in std::mem::take(&mut self.queued) {
            if let Some((_, mark)) = queued.copy {
                if let Err(e) = mark.synchronize() {
                    self.poison();
                    return Err(self.torch_error("a held sum's copy", e.to_string()));
                }
            }
        }
        Ok(())
    }

    /// After a GPU error, when a copy into the buffers may still be in flight: they are
    /// never freed (nor used again: a later copy finds none).
    fn poison(&mut self) {
        std::mem::take(&mut self.buffers)
            .into_iter()
            .for_each(std::mem::forget);
        self.queued.clear();
    }

    /// Queues the copy of unit `u`'s held `sum` unless it is queued already (at most the
    /// one in use and one after it); a GPU's copy is recorded on `track`.
    pub(super) fn queue(&mut self, u: usize, sum: &Tensor, track: &Track) -> Result<(), EngineError> {
        if self.queued.iter().any(|q| q.unit == u) || self.queued.len() >= 2 {
            return Ok(());
        }
        let len = sum.numel();
        let bytes = 4 * len as u64;
        let mut queued = Queued {
            unit: u,
            copy: None,
            landed: None,
            len,
        };
        if sum.device() == tch::Device::Cpu {
            if let Some(stream) = sim::entered().filter(|_| sim::gpu()) {
                let landed = super::staging::charge_copy(&stream, &mut self.engine_free, Work::D2h(bytes));
                queued.landed = Some(landed);
            }
            self.queued.push(queued);
            return Ok(());
        }
        let (buffer, issued) = (self.next, Instant::now());
        let Some(slab) = self.buffers.get_mut(buffer).filter(|b| b.len() >= len) else {
            return Err(EngineError::Invariant {
                rank: self.rank,
                what: "a held gradient sum larger than its copy buffers",
            });
        };
        let out = torch::pod_bytes_mut(&mut slab[..len]);
        // SAFETY: the view lives while the copy is in flight: the buffer is not written
        // or read again before its mark has passed (`with`), and is freed only after
        // every queued copy's mark has (`Drop`)
        let view =
            unsafe { host_view(out.as_ptr(), len, Kind::Float) }.map_err(|source| EngineError::Torch {
                rank: self.rank,
                source,
            })?;
        let mark = match dma(&view, sum, false, "a held sum's copy mark", self.rank) {
            Ok(mark) => mark,
            Err(DmaFailed::NotQueued(e)) => return Err(e),
            Err(DmaFailed::InFlight(e)) => {
                self.poison();
                return Err(e);
            }
        };
        track.record(Phase::D2h, Some(u), issued, bytes);
        queued.copy = Some((buffer, mark));
        self.next = 1 - buffer;
        self.queued.push(queued);
        Ok(())
    }

    /// Unit `u`'s held `sum` as host values, given to `f` once its copy is in (queued
    /// now where it was not), then done with.
    pub(super) fn with<R>(
        &mut self,
        u: usize,
        sum: &Tensor,
        track: &Track,
        f: impl FnOnce(GradSlice<'_>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        self.queue(u, sum, track)?;
        let Some(i) = self.queued.iter().position(|q| q.unit == u) else {
            return Err(EngineError::Invariant {
                rank: self.rank,
                what: "a held gradient sum not queued for its copy",
            });
        };
        let queued = self.queued.remove(i);
        if let (Some(at), Some(stream)) = (queued.landed, sim::entered()) {
            stream.wait_for_copy(at);
        }
        match queued.copy {
            None => {
                // SAFETY: the step's reductions into the sum are done (the reduce lane
                // is stopped before the update is issued), and the next step writes it
                // only after this update is installed
                let values = unsafe { torch::host_slice::<f32>(sum, queued.len) }.map_err(|source| {
                    EngineError::Torch {
                        rank: self.rank,
                        source,
                    }
                })?;
                f(GradSlice::F32(values))
            }
            Some((buffer, mark)) => {
                let waited = Instant::now();
                if let Err(e) = mark.synchronize() {
                    self.poison();
                    return Err(self.torch_error("a held sum's copy", e.to_string()));
                }
                track.waited(Phase::D2h, Some(u), waited);
                f(GradSlice::F32(&self.buffers[buffer][..queued.len]))
            }
        }
    }
}

impl Drop for HeldCopies {
    /// A copy still in flight (the run stopped) is waited for before its buffer goes.
    fn drop(&mut self) {
        for queued in self.queued.drain(..) {
            if let Some((_, mark)) = queued.copy {
                let _ = mark.synchronize();
            }
        }
    }
}

/// [`HeldCopies`] kept by the optimizer between steps and lent to its thread.
pub(super) type SharedHeld = std::sync::Arc<std::sync::Mutex<HeldCopies>>;
