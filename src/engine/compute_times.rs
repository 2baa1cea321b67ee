//! Compute's spans on a GPU, timed by the device. Each unit's forward and backward, and
//! the head, is bracketed by two timed marks on compute's stream; the spans go to the
//! compute track once the step's micro-batches are done, placed by the device's clock
//! from an origin the host synchronised with at the step's start. So the thread that
//! issues compute never waits for a unit's kernels (no host sync per unit: it queues the
//! next unit, its fetches and its reductions while the GPU computes), and the phase times
//! are still the kernels' own. On CPU devices compute is done when the call returns and
//! its spans are the host's; a simulated device times itself on its virtual clocks.

use crate::device::lanes::{Mark, Stream};
use crate::device::DeviceError;
use crate::metrics::timeline::{Phase, Track};
use std::time::{Duration, Instant};
use tch::TchError;

/// A device failure as a torch error, as compute reports its own.
fn device_err(e: DeviceError) -> TchError {
    TchError::Torch(e.to_string())
}

/// A span whose marks are queued and whose times are not read yet.
struct Pending {
    phase: Phase,
    unit: Option<usize>,
    start: Mark,
    end: Mark,
}

/// The spans of one step's compute on a GPU.
#[derive(Default)]
pub(super) struct ComputeTimes {
    /// A mark the host waited for, and when it saw it pass.
    origin: Option<(Mark, Instant)>,
    pending: Vec<Pending>,
}

impl ComputeTimes {
    /// The step starts on `stream` (compute's): its origin, synchronised here (compute
    /// has nothing queued at a step's start, so this costs no wait).
    pub(super) fn begin(&mut self, stream: &dyn Stream) -> Result<(), TchError> {
        self.pending.clear();
        let origin = stream.timed_mark().map_err(device_err)?;
        origin.synchronize().map_err(device_err)?;
        self.origin = Some((origin, Instant::now()));
        Ok(())
    }

    /// Runs `f`, which queues one span's work on `stream`, between two timed marks.
    pub(super) fn span<T>(
        &mut self,
        stream: &dyn Stream,
        (phase, unit): (Phase, Option<usize>),
        f: impl FnOnce() -> Result<T, TchError>,
    ) -> Result<T, TchError> {
        let start = stream.timed_mark().map_err(device_err)?;
        let out = f()?;
        let end = stream.timed_mark().map_err(device_err)?;
        self.pending.push(Pending {
            phase,
            unit,
            start,
            end,
        });
        Ok(out)
    }

    /// Records the step's spans on `track` (waiting for the last of them); spans whose
    /// times the device cannot give are left out.
    pub(super) fn flush(&mut self, track: &Track) {
        let Some((origin, at)) = &self.origin else {
            self.pending.clear();
            return;
        };
        let since = |mark: &Mark| {
            mark.seconds_since(origin)
                .map(|s| *at + Duration::from_secs_f64(s.max(0.0)))
        };
        for span in self.pending.drain(..) {
            if let (Some(start), Some(end)) = (since(&span.start), since(&span.end)) {
                track.record_between(span.phase, false, span.unit, start, end, 0);
            }
        }
    }
}
