//! Samples into rows: each epoch shuffles the samples (a pure function of seed and
//! epoch) and fills rows of `seq_len` positions with them in that order, a sample that
//! does not fit the rest of a row starting the next one; row r of the run is the r-th
//! row of the epochs laid end to end. The global row index of a micro-batch's row is
//! `step × train_batch_size + micro × rows + row`, whatever the world size, so any
//! decomposition of the global batch sees the same rows and a resumed run continues
//! them.
//!
//! A sample of L tokens takes L − 1 positions (inputs and shifted targets); one longer
//! than `seq_len + 1` tokens is truncated (counted in the start-up report). Without
//! packing each row holds one sample, padded. Padding is input 0, an uncounted target,
//! and a segment of its own.

use super::samples::Samples;
use super::{mix, Batch, DataError};
use std::sync::{Arc, Mutex};

/// A sample set read once for rows of `seq_len`: every id checked against the model's
/// vocabulary, and each sample's counted targets within the positions it takes.
pub struct Scanned {
    samples: Samples,
    seq_len: usize,
    /// Counted targets of each sample within its positions.
    counted: Vec<u32>,
    /// Samples longer than a row (truncated).
    pub truncated: usize,
    /// Tokens of the samples with a target, as rows take them.
    pub tokens: u64,
}

impl Scanned {
    pub fn new(samples: Samples, seq_len: usize, vocab: usize) -> Result<Scanned, DataError> {
        let (mut counted, mut truncated, mut tokens) = (Vec::with_capacity(samples.len()), 0, 0u64);
        for i in 0..samples.len() {
            let n = samples.tokens(i).min(seq_len + 1);
            let mut c = 0;
            for j in 0..n {
                let (id, counts) = samples.token(i, j);
                if id as usize >= vocab {
                    return Err(DataError::Invalid {
                        path: samples.path().to_path_buf(),
                        message: format!(
                            "sample {i} has token id {id}, outside the model's vocabulary ({vocab}); use the model's own tokenizer"
                        ),
                    });
                }
                c += u32::from(counts && j > 0);
            }
            counted.push(c);
            if n >= 2 {
                truncated += usize::from(samples.tokens(i) > seq_len + 1);
                tokens += n as u64;
            }
        }
        Ok(Scanned {
            samples,
            seq_len,
            counted,
            truncated,
            tokens,
        })
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The samples with a target (two tokens or more), in order.
    pub fn usable(&self) -> Vec<u32> {
        (0..self.samples.len() as u32)
            .filter(|&i| self.samples.tokens(i as usize) >= 2)
            .collect()
    }

    /// Counted targets of the samples in `members`.
    pub fn trained(&self, members: &[u32]) -> u64 {
        members.iter().map(|&i| u64::from(self.counted[i as usize])).sum()
    }

    /// Positions sample `i` takes in a row.
    fn positions(&self, i: u32) -> usize {
        (self.samples.tokens(i as usize) - 1).min(self.seq_len)
    }
}

/// One epoch's rows: sample indices in order, and where each row's start.
struct Epoch {
    number: usize,
    first_row: u64,
    order: Vec<u32>,
    starts: Vec<usize>,
    /// Counted targets of each row.
    counted: Vec<u64>,
}

impl Epoch {
    fn rows(&self) -> u64 {
        self.starts.len() as u64
    }

    fn row(&self, r: usize) -> &[u32] {
        let end = self.starts.get(r + 1).copied().unwrap_or(self.order.len());
        &self.order[self.starts[r]..end]
    }
}

/// The rows of one split of a sample set.
pub struct Packer {
    set: Arc<Scanned>,
    /// The split's samples (those with a target).
    members: Vec<u32>,
    packing: bool,
    /// Shuffle each epoch (training); evaluation reads the split in order.
    shuffle: bool,
    seed: u64,
    epochs: Mutex<Vec<Arc<Epoch>>>,
}

impl Packer {
    pub fn new(set: Arc<Scanned>, members: Vec<u32>, packing: bool, shuffle: bool, seed: u64) -> Packer {
        Packer {
            set,
            members,
            packing,
            shuffle,
            seed,
            epochs: Mutex::new(Vec::new()),
        }
    }

    fn epoch(&self, number: usize, first_row: u64) -> Epoch {
        let mut order = self.members.clone();
        if self.shuffle {
            let mut state = mix(mix(self.seed) ^ number as u64);
            for k in (1..order.len()).rev() {
                state = mix(state);
                order.swap(k, (state % (k as u64 + 1)) as usize);
            }
        }
        let seq = self.set.seq_len;
        let mut starts = Vec::new();
        let mut counted = Vec::new();
        let mut fill = seq;
        for (k, &i) in order.iter().enumerate() {
            let p = self.set.positions(i);
            if !self.packing || fill + p > seq {
                starts.push(k);
                counted.push(0);
                fill = 0;
            }
            fill += p;
            if let Some(c) = counted.last_mut() {
                *c += u64::from(self.set.counted[i as usize]);
            }
        }
        Epoch {
            number,
            first_row,
            order,
            starts,
            counted,
        }
    }

    /// The epoch holding global row `row`, and the row's index in it.
    fn locate(&self, row: u64) -> (Arc<Epoch>, usize) {
        let mut epochs = self.epochs.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(e) = epochs
                .iter()
                .find(|e| row >= e.first_row && row < e.first_row + e.rows())
            {
                return (e.clone(), (row - e.first_row) as usize);
            }
            let (number, first_row) = match epochs.last() {
                Some(last) if row >= last.first_row => (last.number + 1, last.first_row + last.rows()),
                _ => {
                    epochs.clear();
                    (0, 0)
                }
            };
            // a step's rows span at most two epochs: older ones are rebuilt if asked
            if epochs.len() >= 2 {
                epochs.remove(0);
            }
            epochs.push(Arc::new(self.epoch(number, first_row)));
        }
    }

    /// Counted targets of global rows `rows`.
    pub fn counted_in(&self, rows: std::ops::Range<u64>) -> u64 {
        rows.map(|r| {
            let (epoch, k) = self.locate(r);
            epoch.counted[k]
        })
        .sum()
    }

    /// `count` rows from global row `first`.
    pub fn batch(&self, first: u64, count: usize) -> Batch {
        let (seq, samples) = (self.set.seq_len, &self.set.samples);
        let mut inputs = Vec::with_capacity(count * seq);
        let mut targets = Vec::with_capacity(count * seq);
        let mut segments = Vec::with_capacity(count * seq);
        for r in 0..count as u64 {
            let (epoch, k) = self.locate(first + r);
            let mut segment = 0;
            for &i in epoch.row(k) {
                for j in 0..self.set.positions(i) {
                    inputs.push(samples.token(i as usize, j).0);
                    let (target, counted) = samples.token(i as usize, j + 1);
                    targets.push(if counted { target } else { -1 });
                    segments.push(segment);
                }
                segment += 1;
            }
            let pad = (r as usize + 1) * seq - inputs.len();
            inputs.extend(std::iter::repeat_n(0, pad));
            targets.extend(std::iter::repeat_n(-1, pad));
            segments.extend(std::iter::repeat_n(segment, pad));
        }
        Batch {
            rows: count,
            seq_len: seq,
            inputs,
            targets,
            // one sample per row, at its start: causal attention is already right
            segments: self.packing.then_some(segments),
        }
    }
}
