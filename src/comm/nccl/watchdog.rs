//! NCCL's watchdog: NCCL neither times out nor tells a rank that a peer died, so one
//! thread per process watches its communicators: a failure published in the store aborts
//! them all with it; a collective of its own that makes no progress for the timeout (on
//! the host, or on the device: the event recorded after each collective) is published
//! for the others, then every communicator is aborted.

use super::super::gloo::{Store, ABORT_KEY};
use super::Nccl;
use cudarc::driver::CudaEvent;
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

impl Watched for Nccl {
    /// The oldest collective not done: one the host is still enqueueing, or the first
    /// queued one whose event has not fired on the device.
    fn busy_since(&self) -> Option<(Instant, &'static str)> {
        let host = *self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.cuda.context().bind_to_thread();
        prune(&mut queued);
        let device = queued.front().map(|(since, op, _)| (*since, *op));
        host.into_iter().chain(device).min_by_key(|(since, _)| *since)
    }

    fn stop(&self, reason: &str) {
        self.abort_with(reason.to_string());
    }
}

/// Drops the queued collectives the device has finished, oldest first (an event that
/// cannot be queried counts as done: the host's wait reports the error).
pub(super) fn prune(queued: &mut VecDeque<(Instant, &'static str, CudaEvent)>) {
    while queued
        .front()
        .is_some_and(|(_, _, done)| done.try_is_complete().unwrap_or(true))
    {
        queued.pop_front();
    }
}

/// What the [`watchdog`] needs of a communicator.
pub trait Watched: Send + Sync {
    /// The host-visible collective in flight and when it started.
    fn busy_since(&self) -> Option<(Instant, &'static str)>;
    /// Aborts it with `reason`.
    fn stop(&self, reason: &str);
}

/// Watches this process's communicators until they are all dropped: when the store
/// holds a published failure, every one is aborted with it; when one of them has a
/// collective in flight for longer than `timeout`, the failure is published (naming
/// the rank and the collective) and every one is aborted.
pub fn watchdog(
    store: Arc<Store>,
    comms: Vec<(usize, Weak<dyn Watched>)>,
    timeout: Duration,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(100));
        let live: Vec<(usize, Arc<dyn Watched>)> = comms
            .iter()
            .filter_map(|(r, w)| Some((*r, w.upgrade()?)))
            .collect();
        if live.is_empty() {
            return;
        }
        let published = store.try_get(ABORT_KEY).ok().flatten();
        let reason = published.map(|r| String::from_utf8_lossy(&r).into_owned()).or_else(|| {
            live.iter().find_map(|(rank, c)| {
                let (since, op) = c.busy_since()?;
                (since.elapsed() > timeout).then(|| {
                    let reason = format!(
                        "rank {rank}: NCCL {op} made no progress for {timeout:?} (train.rendezvous_timeout): a peer exited or stopped answering"
                    );
                    let _ = store.set(ABORT_KEY, reason.as_bytes());
                    reason
                })
            })
        });
        if let Some(reason) = reason {
            // each on a thread of its own: one abort stuck behind a blocked call does not
            // hold back the others
            std::thread::scope(|s| {
                for (_, c) in &live {
                    s.spawn(|| c.stop(&reason));
                }
            });
            return;
        }
    })
}
