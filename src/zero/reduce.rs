//! Gradient reduction off the compute thread (`overlap_comm`, stages 2 and 3).
//!
//! After a unit's backward the compute thread copies its flat gradient to the host and
//! hands it to the reducer, which reduce-scatters it on its own communicator while the
//! compute thread goes on with the next unit's backward. Reduced shards come back in the
//! order they were sent and are added to the accumulators in that order, so the result
//! is the blocking path's bit for bit. At most `DEPTH` full gradients wait at once (the
//! role of DeepSpeed's reduce bucket). On any error the engine aborts the reducer's
//! communicator, so no rank's reducer waits forever.

use super::rank::EngineError;
use crate::comm::{Collective, ReduceOp};
use crate::metrics::timeline::{Phase, Track};
use crossbeam_channel::{Receiver, Sender};
use std::time::Instant;

/// Full gradients queued for reduction at most.
pub const DEPTH: usize = 2;

/// A unit's full flat gradient (padded length), to be reduce-scattered.
pub struct Job {
    pub unit: usize,
    pub full: Vec<f32>,
}

/// A unit's reduced shard.
pub type Reduced = Result<(usize, Vec<f32>), EngineError>;

/// The compute thread's end of the reducer.
pub struct Reducer {
    jobs: Option<Sender<Job>>,
    done: Receiver<Reduced>,
    pending: usize,
}

impl Reducer {
    /// The channels to the worker; run [`serve`] with the other ends on a thread.
    pub fn channels() -> (Reducer, Receiver<Job>, Sender<Reduced>) {
        let (job_tx, job_rx) = crossbeam_channel::bounded(DEPTH);
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let reducer = Reducer {
            jobs: Some(job_tx),
            done: done_rx,
            pending: 0,
        };
        (reducer, job_rx, done_tx)
    }

    /// Queues a gradient (waits while `DEPTH` are queued).
    pub fn send(&mut self, job: Job) -> Result<(), EngineError> {
        let jobs = self.jobs.as_ref().ok_or_else(|| self.stopped())?;
        jobs.send(job).map_err(|_| self.stopped())?;
        self.pending += 1;
        Ok(())
    }

    /// The next reduced shard: waiting for it when `wait`, else only if it is ready.
    pub fn take(&mut self, wait: bool) -> Result<Option<(usize, Vec<f32>)>, EngineError> {
        if self.pending == 0 {
            return Ok(None);
        }
        let next = if wait {
            self.done.recv().map_err(|_| self.stopped())?
        } else {
            match self.done.try_recv() {
                Ok(r) => r,
                Err(crossbeam_channel::TryRecvError::Empty) => return Ok(None),
                Err(_) => return Err(self.stopped()),
            }
        };
        self.pending -= 1;
        next.map(Some)
    }

    /// Hangs up; the worker finishes what it holds and exits.
    pub fn close(&mut self) {
        self.jobs = None;
    }

    /// The worker's own error if it queued one, else that it is gone.
    fn stopped(&self) -> EngineError {
        while let Ok(r) = self.done.try_recv() {
            if let Err(e) = r {
                return e;
            }
        }
        EngineError::Other {
            rank: 0,
            message: "the gradient reducer stopped".into(),
        }
    }
}

/// The worker: reduce-scatters (mean) each job on `comm` and sends back this rank's
/// shard, until the jobs channel closes or a collective fails.
pub fn serve<C: Collective>(comm: C, jobs: Receiver<Job>, done: Sender<Reduced>, track: Track) {
    let world = comm.world();
    for job in jobs {
        let start = Instant::now();
        let mut mine = vec![0f32; job.full.len() / world];
        let result = comm
            .reduce_scatter(&job.full, &mut mine, ReduceOp::Avg)
            .map(|()| (job.unit, mine))
            .map_err(EngineError::from);
        track.record(Phase::Reduce, Some(job.unit), start, 4 * job.full.len() as u64);
        let failed = result.is_err();
        if done.send(result).is_err() || failed {
            return;
        }
    }
}
