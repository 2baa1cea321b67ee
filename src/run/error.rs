//! What stops a run: a rank's engine error, the data, a checkpoint, the swap store, an
//! output file, or an invalid request.

use crate::checkpoint::CheckpointError;
use crate::data::DataError;
use crate::engine::error::EngineError;
use std::path::PathBuf;
use tierzero_offload::nvme::IoError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("swap store under {path}: {source}")]
    Swap { path: PathBuf, source: IoError },
    #[error("cannot write {path}: {source}")]
    Output { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
}
