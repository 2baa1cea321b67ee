//! Collectives between ranks: all_gather, reduce_scatter, all_reduce, broadcast, barrier.
//!
//! [`Collective`] is the seam; [`local::Local`] runs N ranks as threads of one process
//! (every test uses it); NCCL plugs in behind the same trait on GPUs. Reductions sum in
//! rank order, so results do not depend on thread timing.

pub mod exchange;
pub mod launch;
pub mod local;
pub mod nccl;
pub mod rendezvous;
pub mod tcp;

use tierzero_offload::host::Pod;

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

/// One rank's handle on a communicator.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// `out` (world × shard.len()) receives every rank's `shard`, in rank order.
    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError>;
    /// Reduces `full` (world × out.len()) across ranks; this rank keeps its slice.
    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError>;
    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError>;
    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError>;
    fn barrier(&self) -> Result<(), CommError>;
    /// Makes every rank's pending and future collectives fail with `reason`.
    fn abort(&self, reason: &str);
}

/// The communicator of a `train` rank: ranks as threads of this process, or ranks in
/// several processes through the TCP hub. Both compute the same bits.
#[derive(Clone)]
pub enum Group {
    Local(local::Local),
    Tcp(std::sync::Arc<tcp::Tcp>),
}

impl exchange::Exchange for Group {
    fn index(&self) -> usize {
        match self {
            Group::Local(c) => c.index(),
            Group::Tcp(c) => c.index(),
        }
    }

    fn size(&self) -> usize {
        match self {
            Group::Local(c) => c.size(),
            Group::Tcp(c) => c.size(),
        }
    }

    fn exchange(&self, data: Vec<u8>) -> Result<std::sync::Arc<Vec<exchange::Contribution>>, CommError> {
        match self {
            Group::Local(c) => c.exchange(data),
            Group::Tcp(c) => c.exchange(data),
        }
    }

    fn cancel(&self, reason: &str) {
        match self {
            Group::Local(c) => c.cancel(reason),
            Group::Tcp(c) => c.cancel(reason),
        }
    }
}
