//! Parameters on the device updated by the host's optimizer (state in host memory or on
//! NVMe; `train.shards_on_device`): the optimizer thread writes each unit's new values
//! into one of two buffers of the largest such partition and copies them into the
//! device partition on its own stream, so the host holds two partitions' values however
//! many units it updates, and one copy runs while the next unit is updated. A GPU's
//! copies are DMA from pinned memory, each with a mark recorded after it, and a buffer is
//! written again only once its copy's mark has passed; the optimizer's mark after the
//! update covers the copy for compute, which waits for it before the unit's next use. A
//! CPU device's copy is a memcpy; a simulated GPU is charged it on the thread's stream.

use super::error::EngineError;
use super::staging::{dma, host_view, DmaFailed};
use crate::device::lanes::Mark;
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::simulate::costs::Work;
use crate::plan::Precision;
use crate::torch;
use std::time::Instant;
use tch::Tensor;
use tierzero_offload::arena::Pinning;

use super::params::LowParams;

pub(super) struct UpdateCopies {
    /// The two buffers, each with the mark recorded after its last copy out of it (a
    /// GPU's, until waited for).
    buffers: Vec<(LowParams, Option<Mark>)>,
    /// The buffer the next update writes.
    next: usize,
    rank: usize,
}

impl UpdateCopies {
    /// Two buffers of `elements` each in `precision`, held as `pinning` says (none for 0:
    /// no unit's parameters are on the device with its optimizer state off it).
    pub(super) fn new(
        rank: usize,
        elements: usize,
        precision: &Precision,
        pinning: &Pinning,
    ) -> Result<UpdateCopies, EngineError> {
        let mut buffers = Vec::new();
        if elements > 0 {
            for _ in 0..2 {
                let buffer = LowParams::zeros(elements, precision)
                    .pinned(pinning)
                    .map_err(|source| EngineError::Arena {
                        rank,
                        what: "the buffers of host updates to device parameters",
                        source,
                    })?;
                buffers.push((buffer, None));
            }
        }
        Ok(UpdateCopies {
            buffers,
            next: 0,
            rank,
        })
    }

    /// Bytes of the buffers.
    pub(super) fn bytes(&self) -> usize {
        self.buffers
            .iter()
            .map(|(b, _)| b.capacity() * b.elem_bytes())
            .sum()
    }

    /// `error`, once the buffers are forgotten: a copy out of them may still be in
    /// flight, so they are never freed, nor used again.
    fn copy_failed(&mut self, error: EngineError) -> EngineError {
        std::mem::take(&mut self.buffers)
            .into_iter()
            .for_each(std::mem::forget);
        error
    }

    /// Unit `u`'s update off the device into its device partition `target`: `update`
    /// writes the new values into the next buffer (once its last copy is in), which are
    /// then copied into `target` on the calling thread's stream, recorded on `track`.
    pub(super) fn through<R>(
        &mut self,
        u: usize,
        target: &Tensor,
        track: &Track,
        update: impl FnOnce(&mut LowParams) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let len = target.numel();
        let index = self.next;
        let Some((buffer, copied)) = self.buffers.get_mut(index).filter(|(b, _)| b.capacity() >= len) else {
            return Err(EngineError::Invariant {
                rank: self.rank,
                what: "a host update of device parameters larger than its copy buffers",
            });
        };
        if let Some(mark) = copied.take() {
            let waited = Instant::now();
            if let Err(e) = mark.synchronize() {
                let error = EngineError::Torch {
                    rank: self.rank,
                    source: tch::TchError::Torch(format!("a host update's copy to the device: {e}")),
                };
                return Err(self.copy_failed(error));
            }
            track.waited(Phase::H2d, Some(u), waited);
        }
        buffer.resize(len);
        let result = update(buffer)?;
        let bytes = buffer.as_bytes();
        let moved = bytes.len() as u64;
        let issued = Instant::now();
        let torch_error = |source| EngineError::Torch {
            rank: self.rank,
            source,
        };
        if target.device().is_cuda() {
            // SAFETY: the view lives while the copy is in flight: the buffer is not
            // written again before its mark has passed (above), and is freed only after
            // it has (`Drop`)
            let view = unsafe { host_view(bytes.as_ptr(), len, target.kind()) }.map_err(torch_error)?;
            match dma(&view, target, true, "a host update's copy mark", self.rank) {
                Ok(mark) => self.buffers[index].1 = Some(mark),
                Err(DmaFailed::NotQueued(e)) => return Err(e),
                Err(DmaFailed::InFlight(e)) => return Err(self.copy_failed(e)),
            }
        } else {
            sim::charge(Work::H2d(moved));
            torch::copy_from_host(target, bytes).map_err(torch_error)?;
        }
        track.record(Phase::H2d, Some(u), issued, moved);
        self.next = 1 - index;
        Ok(result)
    }
}

impl Drop for UpdateCopies {
    /// A copy still in flight (the run stopped) is waited for before its buffer goes.
    fn drop(&mut self) {
        for (_, copied) in &mut self.buffers {
            if let Some(mark) = copied.take() {
                let _ = mark.synchronize();
            }
        }
    }
}

/// [`UpdateCopies`] kept by the optimizer between steps and lent to its thread.
pub(super) type SharedUpdateCopies = std::sync::Arc<std::sync::Mutex<UpdateCopies>>;
