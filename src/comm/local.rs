//! `Local`: N ranks as threads of one process.
//!
//! Every collective is one rendezvous: each rank deposits a copy of its contribution,
//! the last to arrive publishes the set, and each rank computes its own result from it
//! in rank order (deterministic). The next rendezvous waits until every rank has
//! collected the previous one. A rank that fails calls `abort` (the engine does so for
//! errors and panics alike), and every rank waiting or arriving later gets an error
//! naming the reason instead of hanging.

use super::exchange::{Contribution, Exchange};
use super::CommError;
use std::sync::{Arc, Condvar, Mutex};

#[derive(Default)]
struct Round {
    slots: Vec<Option<Contribution>>,
    arrived: usize,
    published: Option<Arc<Vec<Contribution>>>,
    collected: usize,
    aborted: Option<String>,
}

struct Hub {
    world: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

/// One rank of a local communicator.
#[derive(Clone)]
pub struct Local {
    hub: Arc<Hub>,
    rank: usize,
}

impl Local {
    /// Handles for ranks 0..world.
    pub fn group(world: usize) -> Vec<Local> {
        let hub = Arc::new(Hub {
            world,
            round: Mutex::new(Round {
                slots: vec![None; world],
                ..Round::default()
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| Local {
                hub: hub.clone(),
                rank,
            })
            .collect()
    }

    fn aborted(&self, reason: &str) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            reason: reason.to_string(),
        }
    }

    /// Deposits `data` and returns every rank's contribution, in rank order.
    fn deposit(&self, data: Vec<u8>) -> Result<Arc<Vec<Contribution>>, CommError> {
        let hub = &self.hub;
        let mut round = hub.round.lock().unwrap_or_else(|e| e.into_inner());
        // wait for the previous round to be collected by everyone
        while round.published.is_some() && round.aborted.is_none() {
            round = hub.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(reason) = &round.aborted {
            return Err(self.aborted(reason));
        }
        round.slots[self.rank] = Some(Arc::new(data));
        round.arrived += 1;
        if round.arrived == hub.world {
            let all: Vec<Contribution> = round
                .slots
                .iter_mut()
                .map(|s| s.take().unwrap_or_default())
                .collect();
            round.published = Some(Arc::new(all));
            round.arrived = 0;
            hub.changed.notify_all();
        }
        loop {
            if let Some(reason) = &round.aborted {
                return Err(self.aborted(reason));
            }
            if let Some(all) = &round.published {
                let all = all.clone();
                round.collected += 1;
                if round.collected == hub.world {
                    round.published = None;
                    round.collected = 0;
                    hub.changed.notify_all();
                }
                return Ok(all);
            }
            round = hub.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Exchange for Local {
    fn index(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.hub.world
    }

    fn exchange(&self, data: Vec<u8>) -> Result<Arc<Vec<Contribution>>, CommError> {
        self.deposit(data)
    }

    fn cancel(&self, reason: &str) {
        let mut round = self.hub.round.lock().unwrap_or_else(|e| e.into_inner());
        round.aborted.get_or_insert_with(|| reason.to_string());
        self.hub.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Collective, ReduceOp};

    fn run<R: Send>(world: usize, body: impl Fn(Local) -> R + Sync) -> Vec<R> {
        let ranks = Local::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(|| body(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn gather_scatter_reduce_broadcast() {
        for world in 1..=4 {
            let results = run(world, |c| {
                let r = c.rank() as f32;
                let mut gathered = vec![0f32; 2 * world];
                c.all_gather(&[r, r + 0.5], &mut gathered).unwrap();
                let full: Vec<f32> = (0..2 * world).map(|i| i as f32 + r).collect();
                let mut mine = vec![0f32; 2];
                c.reduce_scatter(&full, &mut mine, ReduceOp::Sum).unwrap();
                let mut sum = [r as f64];
                c.all_reduce(&mut sum, ReduceOp::Avg).unwrap();
                let mut b = [r * 10.0];
                c.broadcast(&mut b, world - 1).unwrap();
                for _ in 0..50 {
                    c.barrier().unwrap();
                }
                (gathered, mine, sum[0], b[0])
            });
            let w = world as f32;
            let rank_sum: f32 = (0..world).map(|r| r as f32).sum();
            for (rank, (gathered, mine, avg, b)) in results.into_iter().enumerate() {
                let expected: Vec<f32> = (0..world).flat_map(|r| [r as f32, r as f32 + 0.5]).collect();
                assert_eq!(gathered, expected);
                let i0 = (2 * rank) as f32;
                assert_eq!(mine, vec![i0 * w + rank_sum, (i0 + 1.0) * w + rank_sum]);
                assert_eq!(avg, rank_sum as f64 / world as f64);
                assert_eq!(b, (world - 1) as f32 * 10.0);
            }
        }
    }

    #[test]
    fn a_failing_rank_makes_every_rank_fail_instead_of_hanging() {
        let results = run(3, |c| {
            if c.rank() == 1 {
                c.abort("rank 1 failed: out of memory");
                return Err(c.rank());
            }
            let mut x = [1.0f32];
            c.all_reduce(&mut x, ReduceOp::Sum).map_err(|e| {
                assert!(e.to_string().contains("rank 1 failed"), "{e}");
                c.rank()
            })
        });
        assert!(results.iter().all(Result::is_err));
    }
}
