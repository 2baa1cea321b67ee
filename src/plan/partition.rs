//! How a unit's flat buffer is split across ranks.
//!
//! The buffer is padded to a multiple of `world × 64` elements (64 keeps every shard
//! aligned for SIMD and for O_DIRECT-sized chunks of 16-bit data) and rank r owns the
//! contiguous slice r (ZeRO paper, §5.1; DeepSpeed's flat partitions).

use std::ops::Range;

/// Elements every shard is a multiple of.
pub const SHARD_ALIGN: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Real elements in the unit.
    pub numel: usize,
    /// Padded length: world × shard.
    pub padded: usize,
    /// Elements per rank.
    pub shard: usize,
    pub world: usize,
}

impl Partition {
    pub fn new(numel: usize, world: usize) -> Partition {
        let world = world.max(1);
        let align = world * SHARD_ALIGN;
        let padded = numel.div_ceil(align).max(1) * align;
        Partition {
            numel,
            padded,
            shard: padded / world,
            world,
        }
    }

    /// Rank r's slice of the padded buffer.
    pub fn range(&self, rank: usize) -> Range<usize> {
        rank * self.shard..(rank + 1) * self.shard
    }

    /// Elements of a rank's optimizer partition at ZeRO `stage`: the padded replica at
    /// stage 0, its shard above.
    pub fn optimizer_len(&self, stage: u8) -> usize {
        if stage == 0 {
            self.padded
        } else {
            self.shard
        }
    }

    /// Elements of a rank's gradient accumulator at ZeRO `stage`: its optimizer partition
    /// at stages 2–3 (gradients are reduce-scattered into it), the padded replica below.
    pub fn accumulator_len(&self, stage: u8) -> usize {
        if stage >= 2 {
            self.optimizer_len(stage)
        } else {
            self.padded
        }
    }

    /// The part of rank r's slice that holds real elements (the rest is padding).
    pub fn real(&self, rank: usize) -> Range<usize> {
        let r = self.range(rank);
        r.start.min(self.numel)..r.end.min(self.numel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_buffer_once() {
        for world in 1..=5 {
            for numel in [1usize, 63, 64, 1000, 46_208] {
                let p = Partition::new(numel, world);
                assert_eq!(p.padded % (world * SHARD_ALIGN), 0);
                assert!(p.padded >= numel && p.padded - numel < world * SHARD_ALIGN);
                let covered: usize = (0..world).map(|r| p.real(r).len()).sum();
                assert_eq!(covered, numel);
            }
        }
    }
}
