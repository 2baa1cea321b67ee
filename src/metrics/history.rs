//! A run's per-step history in memory, bounded: what `train` keeps of every step for the
//! plots and the summary (`TrainResult::steps`, each with its breakdown). Up to [`KEPT_STEPS`]
//! entries every step is kept; past that the history halves its resolution (every
//! second step, then every fourth, …), always keeping the first and the latest step, so
//! a run of a million steps holds a few thousand evenly spaced steps and its plots stay
//! readable. `metrics.jsonl` on disk still has every step.

/// The most steps a history keeps (between half of this and all of it once thinned).
pub const KEPT_STEPS: usize = 2048;

/// Evenly spaced steps of a run.
#[derive(Debug)]
pub struct Thinning {
    /// Keep steps whose index is a multiple of this (a power of two).
    stride: u64,
    cap: usize,
}

impl Default for Thinning {
    fn default() -> Self {
        Thinning::new(KEPT_STEPS)
    }
}

impl Thinning {
    pub fn new(cap: usize) -> Thinning {
        Thinning {
            stride: 1,
            cap: cap.max(2),
        }
    }

    /// Appends `item` to `list`; `index_of` reads an entry's step index. The entry that
    /// was latest until now stays only if it falls on the stride.
    pub fn push<T>(&mut self, list: &mut Vec<T>, item: T, index_of: impl Fn(&T) -> u64) {
        if list.len() > 1
            && list
                .last()
                .is_some_and(|last| !index_of(last).is_multiple_of(self.stride))
        {
            list.pop();
        }
        list.push(item);
        if list.len() > self.cap {
            self.stride *= 2;
            let last = list.len() - 1;
            let mut i = 0;
            list.retain(|x| {
                let keep = i == 0 || i == last || index_of(x).is_multiple_of(self.stride);
                i += 1;
                keep
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_history_stays_bounded_evenly_spaced_and_ends_at_the_latest_step() {
        let mut thinning = Thinning::new(16);
        let mut steps = Vec::new();
        for step in 0..1000u64 {
            thinning.push(&mut steps, step, |s| *s);
            assert!(steps.len() <= 16, "{} entries at step {step}", steps.len());
            assert_eq!(steps.last(), Some(&step));
            assert_eq!(steps[0], 0);
        }
        // all but the latest on one stride
        let stride = steps[1] - steps[0];
        assert!(stride.is_power_of_two() && stride >= 64, "{steps:?}");
        assert!(
            steps[..steps.len() - 1].windows(2).all(|w| w[1] - w[0] == stride),
            "{steps:?}"
        );
        assert!(steps.len() >= 8, "{steps:?}");
        // short runs keep every step
        let mut thinning = Thinning::new(16);
        let mut steps = Vec::new();
        for step in 0..16u64 {
            thinning.push(&mut steps, step, |s| *s);
        }
        assert_eq!(steps, (0..16).collect::<Vec<_>>());
    }
}
