//! What can stop a rank, each with the rank it happened on and its cause.

use crate::checkpoint::export::ExportError;
use crate::checkpoint::CheckpointError;
use crate::comm::CommError;
use crate::device::lanes::LaneError;
use crate::device::OutOfMemory;
use tch::TchError;
use tierzero_offload::adam::AdamError;
use tierzero_offload::arena::CarveError;
use tierzero_offload::host::AllocError;
use tierzero_offload::nvme::IoError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("rank {rank}: torch: {source}")]
    Torch { rank: usize, source: TchError },
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("rank {rank}: nvme: {source}")]
    Io { rank: usize, source: IoError },
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    #[error(transparent)]
    Lane(#[from] LaneError),
    #[error("rank {rank}: {source}")]
    Alloc { rank: usize, source: AllocError },
    #[error("rank {rank}: {source}")]
    Cuda {
        rank: usize,
        source: crate::device::cuda::CudaError,
    },
    #[error("rank {rank}: the {what} arena: {source}")]
    Arena {
        rank: usize,
        what: &'static str,
        source: CarveError,
    },
    #[error("rank {rank}: AdamW on unit {unit}: {source}")]
    Adam {
        rank: usize,
        unit: usize,
        source: AdamError,
    },
    /// Where the initial state comes from (a checkpoint or Hugging Face weights) failed.
    #[error("rank {rank}: initial state of unit {unit}: {source}")]
    Start {
        rank: usize,
        unit: usize,
        source: super::start::StartError,
    },
    #[error("rank {rank}: saving checkpoint: {source}")]
    Checkpoint { rank: usize, source: CheckpointError },
    #[error("rank {rank}: saving the 16-bit model: {source}")]
    Export { rank: usize, source: ExportError },
    /// Another rank reported a failure in an agreement; its own error names the cause.
    #[error("rank {rank} starts at step {mine}, but the ranks' mean start is {mean}: every process must resume from the same checkpoint (with `--resume auto` each reads `latest` under output_dir, which must be one shared directory)")]
    StartDiffers { rank: usize, mine: u64, mean: f64 },
    #[error("rank {rank}: another rank failed while {what}")]
    Peer { rank: usize, what: &'static str },
    /// A lane's thread ended before handing back what it was lent (it failed first).
    #[error("rank {rank}: the {lane} lane stopped before returning unit {unit}")]
    LaneStopped {
        rank: usize,
        lane: &'static str,
        unit: usize,
    },
    /// A unit's gradient accumulator was wanted while a lane still holds it (an engine bug).
    #[error("rank {rank}: the gradient of unit {unit} is still lent to the {lane} lane")]
    Lent {
        rank: usize,
        unit: usize,
        lane: &'static str,
    },
    /// A state the engine's own rules exclude (an engine bug, named).
    #[error("rank {rank}: engine invariant broken: {what}")]
    Invariant { rank: usize, what: &'static str },
    /// The compute thread and the prefetch schedule disagree (an engine bug).
    #[error("rank {rank}: prefetch order: got unit {got:?}, expected {expected}")]
    Order {
        rank: usize,
        expected: usize,
        got: Option<usize>,
    },
}

/// Maps a cause to an [`EngineError`] of a given rank (`map_err(on(rank).torch)`).
#[derive(Clone, Copy)]
pub struct On(pub usize);

impl On {
    pub fn torch(self) -> impl Fn(TchError) -> EngineError {
        move |source| EngineError::Torch { rank: self.0, source }
    }

    pub fn io(self) -> impl Fn(IoError) -> EngineError {
        move |source| EngineError::Io { rank: self.0, source }
    }

    pub fn alloc(self) -> impl Fn(AllocError) -> EngineError {
        move |source| EngineError::Alloc { rank: self.0, source }
    }
}
