//! The fetch order of stage 3 and how far ahead it runs: the rules the engine's
//! prefetcher (`engine/prefetch.rs`) follows and the device-memory prediction
//! (`memory.rs`) replays, so a plan's peak is the engine's.

use super::rules::MAX_IN_FLIGHT;

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
