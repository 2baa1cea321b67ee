//! Gradient reduction on the reduce lane (`overlap_comm`, stages 2 and 3).
//!
//! After a unit's backward the compute thread copies its flat gradient into a pooled
//! host buffer and hands it to the reduce lane, which reduce-scatters it (mean) on its
//! own communicator while the compute thread goes on with the next unit's backward. The
//! buffers move into the lane's job and come back with its event (the buffer is never
//! reachable from two places). Reduced shards are taken back in the order they were
//! sent and added to the accumulators in that order, so the result is the blocking
//! path's bit for bit. At most [`DEPTH`] gradients are in flight (the role of
//! DeepSpeed's reduce bucket). On any error the engine aborts the reduce communicator,
//! so no rank's lane waits forever.

use super::rank::EngineError;
use crate::comm::{Collective, ReduceOp};
use crate::device::lanes::{Event, Lane};
use crate::device::pool::best_fit;
use crate::metrics::timeline::{Phase, Track};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Full gradients in flight at most.
pub const DEPTH: usize = 2;

/// Host buffers of full gradients and reduced shards, reused across units and steps.
#[derive(Default)]
pub struct ReduceBuffers {
    free: Vec<Vec<f32>>,
}

impl ReduceBuffers {
    /// A buffer of exactly `len` elements (contents unspecified), from a free one with
    /// room when there is one.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        let mut buffer = match best_fit(&self.free, len, Vec::capacity) {
            Some(i) => self.free.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        buffer.resize(len, 0.0);
        buffer
    }

    pub fn give(&mut self, buffer: Vec<f32>) {
        self.free.push(buffer);
    }
}

type Outcome = Result<(Vec<f32>, Vec<f32>), EngineError>;

/// A gradient on the lane: its unit, the event of its reduce-scatter, and where the
/// job leaves the buffers.
struct InFlight {
    unit: usize,
    done: Event,
    slot: Arc<Mutex<Option<Outcome>>>,
}

/// The compute thread's end of the reduce lane.
pub struct Reducer<'env, C: Collective> {
    lane: Lane<'env>,
    comm: C,
    track: Track,
    in_flight: VecDeque<InFlight>,
    pub buffers: ReduceBuffers,
}

impl<'env, C: Collective + Clone + 'env> Reducer<'env, C> {
    pub fn new(lane: Lane<'env>, comm: C, track: Track, buffers: ReduceBuffers) -> Self {
        Reducer {
            lane,
            comm,
            track,
            in_flight: VecDeque::new(),
            buffers,
        }
    }

    /// Queues unit `unit`'s full gradient (padded length) for reduce-scatter. With
    /// `DEPTH` in flight, first takes back the oldest: returned for the caller to add.
    pub fn send(&mut self, unit: usize, full: Vec<f32>) -> Result<Option<(usize, Vec<f32>)>, EngineError> {
        let oldest = if self.in_flight.len() >= DEPTH {
            self.take(true)?
        } else {
            None
        };
        let mine = self.buffers.take(full.len() / self.comm.world().max(1));
        let slot = Arc::new(Mutex::new(None));
        let (comm, track, out) = (self.comm.clone(), self.track.clone(), slot.clone());
        let done = self.lane.submit(move || {
            let start = Instant::now();
            let mut mine = mine;
            let result = comm.reduce_scatter(&full, &mut mine, ReduceOp::Avg);
            track.record(Phase::Reduce, Some(unit), start, 4 * full.len() as u64);
            let message = result.as_ref().err().map(|e| e.to_string());
            let outcome = result.map(|()| (full, mine)).map_err(EngineError::from);
            *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
            message.map_or(Ok(()), Err)
        });
        self.in_flight.push_back(InFlight { unit, done, slot });
        Ok(oldest)
    }

    /// The oldest reduced shard: waiting for it when `wait`, else only if it is done.
    /// The full gradient's buffer goes back to the pool; the shard is the caller's to
    /// add and give back.
    pub fn take(&mut self, wait: bool) -> Result<Option<(usize, Vec<f32>)>, EngineError> {
        let Some(oldest) = self.in_flight.front() else {
            return Ok(None);
        };
        if !wait && !oldest.done.query() {
            return Ok(None);
        }
        let InFlight { unit, done, slot } = self.in_flight.pop_front().ok_or_else(|| self.lane_gone())?;
        let waited = done.synchronize();
        let outcome = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        match (outcome, waited) {
            // the job's own error names the collective's cause
            (Some(Err(e)), _) => Err(e),
            (_, Err(e)) => Err(e.into()),
            (Some(Ok((full, mine))), Ok(())) => {
                self.buffers.give(full);
                Ok(Some((unit, mine)))
            }
            (None, Ok(())) => Err(self.lane_gone()),
        }
    }

    fn lane_gone(&self) -> EngineError {
        EngineError::Other {
            rank: self.comm.rank(),
            message: "the reduce lane lost a gradient".into(),
        }
    }

    /// Hands the pools back once nothing is in flight.
    pub fn finish(self) -> ReduceBuffers {
        for job in &self.in_flight {
            let _ = job.done.synchronize();
        }
        self.buffers
    }
}
