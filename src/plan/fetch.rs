//! The fetch order of stage 3 and how far ahead it runs: the rules the engine's
//! prefetcher (`engine/prefetch.rs`) follows and the device-memory prediction
//! (`memory.rs`) replays, so a plan's peak is the engine's.

/// Gathers issued ahead of the one the compute thread waits for, at most (DeepSpeed
/// bounds its in-flight all-gathers the same way).
pub const MAX_IN_FLIGHT: usize = 2;

/// Why a unit is fetched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    Forward,
    /// The final unit, for the loss and its backward.
    Final,
    /// The embedding again, for the tied LM head (alive together with the final unit).
    Tied,
    Backward,
}

/// The fetch order of one micro-batch: forward 0..last, the final unit (and the tied
/// embedding), then backward last-1..0. Units that stay gathered (`persistent`) appear
/// only at their first use.
pub fn schedule(units: usize, tied: bool, persistent: impl Fn(usize) -> bool) -> Vec<(usize, Purpose)> {
    let last = units - 1;
    let mut order: Vec<(usize, Purpose)> = (0..last).map(|u| (u, Purpose::Forward)).collect();
    order.push((last, Purpose::Final));
    if tied {
        order.push((0, Purpose::Tied));
    }
    order.extend((0..last).rev().map(|u| (u, Purpose::Backward)));
    let mut seen = vec![false; units];
    order.retain(|&(u, _)| {
        let keep = !(persistent(u) && seen[u]);
        seen[u] = true;
        keep
    });
    order
}

/// A micro-batch's uses of gathered units (the compute thread's order, after `schedule`)
/// and which of them are fetched. After a use, a unit stays gathered for its next use in
/// the micro-batch when the elements of the uses between are fewer than
/// `stage3_max_reuse_distance` (DeepSpeed's `PartitionedParameterCoordinator` walks its
/// trace the same way): the units just before the final one keep their forward gather
/// for their backward, and that second use is not fetched.
#[derive(Clone, Debug)]
pub struct Fetches {
    pub uses: Vec<(usize, Purpose)>,
    /// Per use: the gathered unit stays until the unit's next use.
    pub keep: Vec<bool>,
    /// Per use: it is fetched (false: the previous use's gathered copy serves it).
    pub fetched: Vec<bool>,
}

impl Fetches {
    /// `persistent` units stay gathered anyway and are never kept here.
    pub fn new(
        uses: Vec<(usize, Purpose)>,
        numels: &[usize],
        persistent: impl Fn(usize) -> bool,
        distance: usize,
    ) -> Fetches {
        let n = uses.len();
        let mut keep = vec![false; n];
        let mut fetched = vec![true; n];
        for k in 0..n {
            if persistent(uses[k].0) {
                continue;
            }
            if let Some(next) = kept_until(&uses, k, numels, distance) {
                keep[k] = true;
                fetched[next] = false;
            }
        }
        Fetches { uses, keep, fetched }
    }

    /// The fetch order: the uses that are fetched.
    pub fn order(&self) -> Vec<(usize, Purpose)> {
        self.uses
            .iter()
            .zip(&self.fetched)
            .filter(|(_, &f)| f)
            .map(|(&use_, _)| use_)
            .collect()
    }
}

/// The unit of use `k` stays gathered for its next use in `uses` (returned) when the
/// uses between hold fewer than `distance` elements.
pub fn kept_until(uses: &[(usize, Purpose)], k: usize, numels: &[usize], distance: usize) -> Option<usize> {
    let u = uses[k].0;
    let mut between = 0usize;
    for (j, &(v, _)) in uses.iter().enumerate().skip(k + 1) {
        if between >= distance {
            return None;
        }
        if v == u {
            return Some(j);
        }
        between += numels[v];
    }
    None
}

/// How far ahead to gather: `stage3_prefetch_bucket_size` elements outstanding, and
/// `stage3_max_live_parameters` elements gathered at once (in use plus outstanding);
/// units of at most `persistence_threshold` elements stay gathered and do not count.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub bucket: usize,
    pub max_live: usize,
    pub persistence_threshold: usize,
}

/// Whether to ask for one more unit now: always for the unit compute needs now (`needed`
/// and nothing outstanding), otherwise while fewer than [`MAX_IN_FLIGHT`] are
/// outstanding, the outstanding elements stay within the bucket and the live ones
/// (`in_use` + outstanding) within `max_live`. A bucket of 0 is DeepSpeed's "no
/// prefetch": only needed units are fetched.
pub fn may_request(
    needed: bool,
    outstanding: usize,
    outstanding_numel: usize,
    next_numel: usize,
    in_use: usize,
    limits: Limits,
) -> bool {
    let ahead = outstanding_numel + next_numel;
    (needed && outstanding == 0)
        || (outstanding < MAX_IN_FLIGHT && ahead <= limits.bucket && in_use + ahead <= limits.max_live)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_keeps_the_units_before_the_final_one_within_the_distance() {
        // units 0..4, the final unit 4; each 10 elements, the final 30
        let numels = [10, 10, 10, 10, 30];
        let uses = schedule(5, false, |_| false);
        let kept_units = |distance| {
            let f = Fetches::new(uses.clone(), &numels, |_| false, distance);
            let kept: Vec<usize> = (0..uses.len())
                .filter(|&k| f.keep[k])
                .map(|k| uses[k].0)
                .collect();
            let refetched: Vec<usize> = f
                .order()
                .iter()
                .filter(|u| u.1 == Purpose::Backward)
                .map(|u| u.0)
                .collect();
            (kept, refetched)
        };
        // unit 3: the final unit between (30); unit 2: 10 + 30 + 10 = 50; unit 1: 70
        assert_eq!(kept_units(0), (vec![], vec![3, 2, 1, 0]));
        assert_eq!(kept_units(30), (vec![], vec![3, 2, 1, 0]));
        assert_eq!(kept_units(31), (vec![3], vec![2, 1, 0]));
        assert_eq!(kept_units(51), (vec![2, 3], vec![1, 0]));
        assert_eq!(kept_units(1_000_000_000), (vec![0, 1, 2, 3], vec![]));
        // persistent units stay anyway: never kept here, never refetched
        let f = Fetches::new(uses.clone(), &numels, |u| u == 3, 1_000);
        assert!(!f.keep[3]);
    }

    #[test]
    fn a_tied_embedding_stays_through_the_final_unit() {
        let numels = [10, 10, 10, 30];
        let uses = schedule(4, true, |_| false);
        // forward 0 1 2, final 3, tied 0, backward 2 1 0
        let f = Fetches::new(uses.clone(), &numels, |_| false, 51);
        // unit 0: its forward → its tied use, 10 + 10 + 30 = 50 elements between, the
        // tied use → its backward 20; unit 1: 60; unit 2: 40
        let forward = [
            (0, Purpose::Forward),
            (1, Purpose::Forward),
            (2, Purpose::Forward),
            (3, Purpose::Final),
        ];
        let order = |tail: &[(usize, Purpose)]| [&forward[..], tail].concat();
        assert_eq!(f.order(), order(&[(1, Purpose::Backward)]));
        let f = Fetches::new(uses, &numels, |_| false, 50);
        assert_eq!(f.order(), order(&[(0, Purpose::Tied), (1, Purpose::Backward)]));
    }
}
