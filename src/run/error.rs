//! What stops a run: a rank's engine error, the data, a Hugging Face model directory, a
//! checkpoint, the swap store, the c10d store, an output file, a rank that panicked, or
//! a request the run cannot serve; each names its cause.

use crate::checkpoint::CheckpointError;
use crate::data::DataError;
use crate::engine::error::EngineError;
use crate::model::hf::HfError;
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
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error("the synthetic corpus uses {needed} token ids but model.vocab_size is {vocab}; raise model.vocab_size")]
    VocabTooSmall { needed: usize, vocab: usize },
    /// A request that needs every rank in this process.
    #[error("{0}")]
    OneProcess(&'static str),
    /// The c10d store the ranks meet through.
    #[error("{what}: {message}")]
    Store { what: &'static str, message: String },
    #[error("rank {rank} panicked: {message}")]
    RankPanicked { rank: usize, message: String },
    #[error("a rank thread panicked")]
    ThreadPanicked,
    #[error("cannot start a rank thread: {0}")]
    Spawn(std::io::Error),
    #[error("--stages: {0} is not a ZeRO stage")]
    Stage(u8),
}
