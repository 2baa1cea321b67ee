//! Collectives between ranks: all_gather, reduce_scatter, all_reduce, broadcast, barrier.
//!
//! [`Collective`] is the seam; [`local::Local`] runs N ranks as threads of one process
//! (every test uses it); [`gloo::Gloo`] runs ranks in several processes over torch's
//! c10d (TCPStore, ProcessGroupGloo); NCCL plugs in behind the same trait on GPUs.
//! `Local` sums in rank order, so results do not depend on thread timing.

pub mod gloo;
pub mod launch;
pub mod local;
pub mod nccl;
pub mod rendezvous;
pub mod tensors;

use crate::metrics::timeline::{Phase, Track};
use std::cell::Cell;
use std::time::{Duration, Instant};
use tch::Tensor;
use tierzero_offload::host::Pod;

thread_local! {
    /// Time this thread's collectives waited for their peers since the last
    /// [`take_peer_wait`]: `Local`'s rendezvous measures it (a rank early at a round waits
    /// there for the last to arrive, and after reading for every peer to finish); other
    /// communicators, whose waits are the library's, leave it zero.
    static PEER_WAIT: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// The time this thread's collectives waited for their peers since the last call.
pub fn take_peer_wait() -> Duration {
    PEER_WAIT.replace(Duration::ZERO)
}

/// The start of a collective whose span [`record_collective`] records (the peer waits
/// of the thread's collectives before it are let go).
pub fn collective_start() -> Instant {
    let _ = take_peer_wait();
    Instant::now()
}

/// Records the collective that ran on `track` from `start` (a [`collective_start`]) until
/// now: the time it waited for its peers ([`take_peer_wait`]: a rank early at the
/// rendezvous) as a wait for `phase`, the rest as `phase`'s work. A late peer is the
/// peer's time, not the collective's.
pub fn record_collective(track: &Track, (phase, unit): (Phase, Option<usize>), start: Instant, bytes: u64) {
    let waited = take_peer_wait();
    let now = Instant::now();
    let split = (start + waited).min(now);
    track.record_between(phase, true, unit, start, split, 0);
    track.record_between(phase, false, unit, split, now, bytes);
}

fn add_peer_wait(waited: Duration) {
    PEER_WAIT.set(PEER_WAIT.get() + waited);
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CommError {
    #[error("rank {rank}: collective aborted because {reason}")]
    Aborted { rank: usize, reason: String },
    #[error("rank {rank}: {op}: {message}")]
    Shape {
        rank: usize,
        op: &'static str,
        message: String,
    },
}

/// A call into torch's c10d that failed (the `TCPStore`, joining a Gloo group), with
/// what was asked and c10d's own message.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum C10dError {
    /// c10d raised: the first line of its exception.
    #[error("{0}")]
    Torch(String),
    /// A key or host name with a NUL byte, which c10d cannot take.
    #[error("{0:?} contains a NUL byte")]
    Nul(String),
    /// The store could not be served or reached.
    #[error("cannot {role} the c10d store at {host}:{port}: {cause}")]
    Connect {
        role: &'static str,
        host: String,
        port: u16,
        cause: Box<C10dError>,
    },
    /// A rank could not join a communicator.
    #[error("rank {rank}: joining the {name} communicator of {world} ranks: {cause}")]
    Join {
        rank: usize,
        name: String,
        world: usize,
        cause: Box<C10dError>,
    },
    /// A failing process left its reason under the stop key while this one waited.
    #[error("{0}")]
    Stopped(String),
}

impl From<C10dError> for String {
    fn from(e: C10dError) -> String {
        e.to_string()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
}

/// Element types the collectives move (fp32, f64, and 16-bit floats as raw bits).
pub trait Element: Pod + Default {
    /// The tensor kind that carries it (16-bit values travel as bf16 bits).
    const KIND: tch::Kind;
    fn add(self, other: Self) -> Self;
    fn scale(self, by: f64) -> Self;
}

impl Element for f32 {
    const KIND: tch::Kind = tch::Kind::Float;
    fn add(self, other: f32) -> f32 {
        self + other
    }
    fn scale(self, by: f64) -> f32 {
        (f64::from(self) * by) as f32
    }
}

impl Element for f64 {
    const KIND: tch::Kind = tch::Kind::Double;
    fn add(self, other: f64) -> f64 {
        self + other
    }
    fn scale(self, by: f64) -> f64 {
        self * by
    }
}

impl Element for u16 {
    const KIND: tch::Kind = tch::Kind::BFloat16;
    /// 16-bit values are only gathered and broadcast, never reduced.
    fn add(self, _: u16) -> u16 {
        self
    }
    fn scale(self, _: f64) -> u16 {
        self
    }
}

/// One rank's handle on a communicator (owned: lanes hold clones of it).
pub trait Collective: Send + Sync + 'static {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// `out` (world × shard.len()) receives every rank's `shard`, in rank order.
    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError>;
    /// The same on tensors on the rank's device (`out` contiguous, world × shard's
    /// elements): through host memory unless the communicator reads device memory.
    fn all_gather_tensor(&self, shard: &Tensor, out: &Tensor) -> Result<(), CommError> {
        tensors::all_gather(self, shard, out)
    }
    /// Reduces `full` (world × out.len()) across ranks; this rank keeps its slice.
    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError>;
    /// The same on tensors on the rank's device (`full` and `out` contiguous, of one
    /// kind): through host memory unless the communicator reads device memory.
    fn reduce_scatter_tensor(&self, full: &Tensor, out: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        tensors::reduce_scatter(self, full, out, op)
    }
    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError>;
    /// The same in place on an fp32 tensor on the rank's device (contiguous): through
    /// host memory unless the communicator reads device memory.
    fn all_reduce_tensor(&self, data: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        tensors::all_reduce(self, data, op)
    }
    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError>;
    fn barrier(&self) -> Result<(), CommError>;
    /// Makes every rank's pending and future collectives fail with `reason`.
    fn abort(&self, reason: &str);
}

/// The communicator of a `train` rank: ranks as threads of this process, ranks in
/// several processes over c10d's Gloo, or CUDA ranks in several processes over NCCL.
/// Local and Gloo compute the same bits for two ranks (Gloo sums three or more in ring
/// order).
#[derive(Clone)]
pub enum Group {
    Local(local::Local),
    Gloo(std::sync::Arc<gloo::Gloo>),
    Nccl(std::sync::Arc<nccl::Nccl>),
}

/// Calls the same method on whichever communicator a [`Group`] holds.
macro_rules! dispatch {
    ($self:ident, $c:ident => $call:expr) => {
        match $self {
            Group::Local($c) => $call,
            Group::Gloo($c) => $call,
            Group::Nccl($c) => $call,
        }
    };
}

impl Collective for Group {
    fn rank(&self) -> usize {
        dispatch!(self, c => c.rank())
    }

    fn world(&self) -> usize {
        dispatch!(self, c => c.world())
    }

    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError> {
        dispatch!(self, c => c.all_gather(shard, out))
    }

    fn all_gather_tensor(&self, shard: &Tensor, out: &Tensor) -> Result<(), CommError> {
        dispatch!(self, c => c.all_gather_tensor(shard, out))
    }

    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        dispatch!(self, c => c.reduce_scatter(full, out, op))
    }

    fn reduce_scatter_tensor(&self, full: &Tensor, out: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        dispatch!(self, c => c.reduce_scatter_tensor(full, out, op))
    }

    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        dispatch!(self, c => c.all_reduce(data, op))
    }

    fn all_reduce_tensor(&self, data: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        dispatch!(self, c => c.all_reduce_tensor(data, op))
    }

    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError> {
        dispatch!(self, c => c.broadcast(data, root))
    }

    fn barrier(&self) -> Result<(), CommError> {
        dispatch!(self, c => c.barrier())
    }

    fn abort(&self, reason: &str) {
        dispatch!(self, c => c.abort(reason))
    }
}
