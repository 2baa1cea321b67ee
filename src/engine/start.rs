//! Where a run's state starts: the seeded init, a Hugging Face directory, or a
//! checkpoint. Every source answers per unit and element range, so each rank reads only
//! the slices it keeps (its shard at stage 3, the replica below), never the whole model.

use crate::checkpoint::Checkpoint;
use crate::model::hf::HfWeights;
use crate::model::layout::UnitLayout;
use crate::plan::Precision;
use std::ops::Range;
use tierzero_offload::nvme::swap::State;

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
    ) -> Result<(), String> {
        match self {
            Start::Init { seed } => {
                layout.init_range(*seed, range, out);
                Ok(())
            }
            Start::Hf(weights) => weights.read(u, range, out).map_err(|e| e.to_string()),
            Start::Checkpoint(c) => c
                .read_f32(State::Master, u, range, out)
                .map_err(|e| e.to_string()),
        }
    }

    /// Adam moments of elements `range`; zeros unless resuming.
    pub fn moments(
        &self,
        u: usize,
        range: Range<usize>,
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
    ) -> Result<(), String> {
        if let Start::Checkpoint(c) = self {
            c.read_f32(State::ExpAvg, u, range.clone(), exp_avg)
                .and_then(|_| c.read_f32(State::ExpAvgSq, u, range, exp_avg_sq))
                .map_err(|e| e.to_string())?;
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
    ) -> Result<Option<Vec<u8>>, String> {
        match self {
            Start::Checkpoint(c) if c.params_match(precision) => c
                .read(State::Param, u, range)
                .map(Some)
                .map_err(|e| e.to_string()),
            _ => Ok(None),
        }
    }

    /// The step a run starting here begins at.
    pub fn first_step(&self) -> u64 {
        self.checkpoint().map_or(0, |c| c.manifest.step)
    }

    pub fn checkpoint(&self) -> Option<&Checkpoint> {
        match self {
            Start::Checkpoint(c) => Some(c),
            _ => None,
        }
    }
}
