//! Where a run's state starts: the seeded init, a Hugging Face directory, or a
//! checkpoint. Every source answers per unit and element range, so each rank reads only
//! the slices it keeps (its shard at stage 3, the replica below), never the whole model.

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::model::hf::{HfError, HfWeights};
use crate::model::layout::UnitLayout;
use crate::plan::Precision;
use std::ops::Range;
use tierzero_offload::nvme::swap::State;

/// Why a source could not give a unit's starting state.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

pub enum Start {
    /// The seeded initialisation (a pure function of seed, tensor and index).
    Init { seed: u64 },
    /// Pretrained weights (`model.hf_dir`), memory-mapped.
    Hf(HfWeights),
    /// Every state of a saved run (`train --resume`).
    Checkpoint(Box<Checkpoint>),
}

impl Start {
    /// fp32 weights of elements `range` (within the unit's real length) into `out`.
    pub fn master(
        &self,
        u: usize,
        layout: &UnitLayout,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), StartError> {
        match self {
            Start::Init { seed } => layout.init_range(*seed, range, out),
            Start::Hf(weights) => weights.read(u, range, out)?,
            Start::Checkpoint(c) => c.read_f32(State::Master, u, range, out)?,
        }
        Ok(())
    }

    /// Adam moments of elements `range`; zeros unless resuming.
    pub fn moments(
        &self,
        u: usize,
        range: Range<usize>,
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
    ) -> Result<(), StartError> {
        if let Start::Checkpoint(c) = self {
            c.read_f32(State::ExpAvg, u, range.clone(), exp_avg)?;
            c.read_f32(State::ExpAvgSq, u, range, exp_avg_sq)?;
        }
        Ok(())
    }

    /// The stored low-precision parameters of elements `range` as raw little-endian
    /// bytes, when the source has them in `precision` (else they are rounded from the
    /// master weights).
    pub fn params(
        &self,
        u: usize,
        range: Range<usize>,
        precision: &Precision,
    ) -> Result<Option<Vec<u8>>, StartError> {
        match self {
            Start::Checkpoint(c) if c.params_match(precision) => {
                c.read(State::Param, u, range).map(Some).map_err(StartError::from)
            }
            _ => Ok(None),
        }
    }

    /// The step a run starting here begins at.
    pub fn first_step(&self) -> u64 {
        self.checkpoint().map_or(0, |c| c.manifest.step)
    }

    /// Lets go of the resident pages of a memory-mapped source once every rank holds
    /// its state (checkpoints are read with `pread`, the seeded init has none).
    pub fn release_pages(&self) {
        if let Start::Hf(weights) = self {
            weights.release_pages();
        }
    }

    pub fn checkpoint(&self) -> Option<&Checkpoint> {
        match self {
            Start::Checkpoint(c) => Some(c),
            _ => None,
        }
    }
}
