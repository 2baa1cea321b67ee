//! Token data: where each sample of each step comes from.
//!
//! A sample is `seq_len + 1` tokens (inputs and shifted targets) chosen by a pure
//! function of (seed, step, global micro-batch index, row): the same global batch is
//! drawn whatever the world size, so an N-rank run and a single-rank run with N× the
//! accumulation steps see the same samples, and a resumed run continues the stream
//! exactly (the position is just the step number).
//!
//! - `synthetic.rs`: built-in corpora with a known loss floor, for the default run
//! - `tokens.rs`: nanoGPT-style `.bin` token files (u16/u32), memory-mapped
//! - `text.rs`: `.txt`/`.jsonl` tokenized with a `tokenizer.json`, cached as a token file

pub mod synthetic;
pub mod text;
pub mod tokens;

use crate::plan::{DataSource, Plan, TokenDtype};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read token file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("token file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// One micro-batch: inputs and targets, each [rows × seq_len], row-major. Targets < 0
/// are not counted in the loss.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub rows: usize,
    pub seq_len: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
}

/// A source of samples.
pub enum Dataset {
    Synthetic(synthetic::Corpus),
    Tokens(tokens::TokenFile),
}

impl Dataset {
    pub fn open(plan: &Plan) -> Result<Dataset, DataError> {
        match &plan.data.source {
            DataSource::Synthetic { name } => Ok(Dataset::Synthetic(synthetic::Corpus::new(name))),
            DataSource::Tokens { path, dtype } => Ok(Dataset::Tokens(tokens::TokenFile::open(
                path,
                *dtype,
                plan.data.seq_len,
                plan.model.config.vocab_size,
            )?)),
            DataSource::Text { path, tokenizer } => {
                let cache = text::tokenize_cached(path, tokenizer)?;
                let file = tokens::TokenFile::open(
                    &cache,
                    TokenDtype::U32,
                    plan.data.seq_len,
                    plan.model.config.vocab_size,
                )?;
                Ok(Dataset::Tokens(file))
            }
        }
    }

    /// Tokens the source uses (the model's vocabulary must cover them).
    pub fn vocab_needed(&self) -> usize {
        match self {
            Dataset::Synthetic(c) => c.vocab_size(),
            Dataset::Tokens(_) => 0,
        }
    }

    /// The loss a perfect model would reach, when the source knows it.
    pub fn loss_floor(&self, seq_len: usize) -> Option<f64> {
        match self {
            Dataset::Synthetic(c) => Some(c.loss_floor(seq_len)),
            Dataset::Tokens(_) => None,
        }
    }

    /// The micro-batch `micro` (global index across ranks and accumulation steps) of
    /// optimizer step `step`, `rows` samples. `split` distinguishes train (0) from eval
    /// (1) streams. Each sample is keyed by (seed, split, step, global sample index
    /// `micro × rows + row`), as a `DistributedSampler` split is: any micro-batch ×
    /// accumulation × world decomposition of one global batch draws the same samples.
    pub fn batch(&self, seed: u64, split: u64, step: u64, micro: u64, rows: usize, seq_len: usize) -> Batch {
        let mut inputs = Vec::with_capacity(rows * seq_len);
        let mut targets = Vec::with_capacity(rows * seq_len);
        for row in 0..rows {
            let key = sample_key(seed, split, step, micro * rows as u64 + row as u64);
            let (i, t) = match self {
                Dataset::Synthetic(c) => c.sample(key, seq_len),
                Dataset::Tokens(f) => f.sample(key, seq_len),
            };
            inputs.extend(i);
            targets.extend(t);
        }
        Batch {
            rows,
            seq_len,
            inputs,
            targets,
        }
    }
}

/// SplitMix64 finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn sample_key(seed: u64, split: u64, step: u64, sample: u64) -> u64 {
    mix(mix(mix(mix(seed) ^ split) ^ step) ^ sample)
}
