//! A run's per-step history in memory, bounded: what `train` keeps of every step for the
//! plots and the summary (`TrainResult::steps` and `breakdowns`). Up to [`KEPT_STEPS`]
//! entries every step is kept; past that the history halves its resolution (every
//! second step, then every fourth, …), always keeping the first and the latest step, so
//! a run of a million steps holds a few thousand evenly spaced steps and its plots stay
//! readable. `metrics.jsonl` on disk still has every step.

/// The most steps a history keeps (between half of this and all of it once thinned).
pub const KEPT_STEPS: usize = 4096;

/// Evenly spaced steps of a run: two parallel lists (a step's metrics and its
/// breakdown) thinned together.
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

    /// Appends step `index` (`a` and `b` are its entries); `index_of` reads an entry's
    /// step index back. The entry that was latest until now stays only if it falls on
    /// the stride.
    pub fn push<A, B>(
        &mut self,
        (list_a, list_b): (&mut Vec<A>, &mut Vec<B>),
        (a, b): (A, B),
        index_of: impl Fn(&A) -> u64,
    ) {
        debug_assert_eq!(list_a.len(), list_b.len());
        if list_a.len() > 1
            && list_a
                .last()
                .is_some_and(|last| !index_of(last).is_multiple_of(self.stride))
        {
            list_a.pop();
            list_b.pop();
        }
        list_a.push(a);
        list_b.push(b);
        if list_a.len() > self.cap {
            self.stride *= 2;
            let last = list_a.len() - 1;
            let keep: Vec<bool> = list_a
                .iter()
                .enumerate()
                .map(|(i, x)| i == 0 || i == last || index_of(x).is_multiple_of(self.stride))
                .collect();
            let mut flags = keep.iter();
            list_a.retain(|_| *flags.next().unwrap_or(&true));
            let mut flags = keep.iter();
            list_b.retain(|_| *flags.next().unwrap_or(&true));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_history_stays_bounded_evenly_spaced_and_ends_at_the_latest_step() {
        let mut thinning = Thinning::new(16);
        let (mut steps, mut twins) = (Vec::new(), Vec::new());
        for step in 0..1000u64 {
            thinning.push((&mut steps, &mut twins), (step, step * 10), |s| *s);
            assert!(steps.len() <= 16, "{} entries at step {step}", steps.len());
            assert_eq!(steps.last(), Some(&step));
            assert_eq!(steps[0], 0);
        }
        assert_eq!(twins, steps.iter().map(|s| s * 10).collect::<Vec<_>>());
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
        let (mut steps, mut twins) = (Vec::new(), Vec::new());
        for step in 0..16u64 {
            thinning.push((&mut steps, &mut twins), (step, ()), |s| *s);
        }
        assert_eq!(steps, (0..16).collect::<Vec<_>>());
    }
}
