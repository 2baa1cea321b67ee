//! The host's cores on a CPU device: the lanes' host work takes cores from compute.
//!
//! On a GPU the lanes' host work (copies into staging, host adds, the CPU AdamW, the
//! NVMe checksums) runs beside kernels that need no host core. On a CPU device compute
//! is torch's threads on the same cores: a profile measures its rates with every rank's
//! compute threads running at once and nothing else, so where a lane's thread works
//! while compute runs, compute is slower than its rate says. [`costs`] prices that in
//! two passes: the schedule is replayed at the profile's rates; at each moment of the
//! reported step that compute runs, the cores the ranks' lanes ask for (one for a copy,
//! an add or a collective's memcpy; a share of every core for the CPU AdamW; an NVMe
//! transfer's crc32c, not the disk's time) beyond those compute leaves free are taken
//! from it; that time, spread over the cores compute runs on, is what compute loses, and
//! every piece of compute is stretched by it in the pass that is reported (and on the
//! simulated device, which prices with the same [`Costs`]).

use super::clock::{Span, Track};
use super::costs::Costs;
use super::profile::Profile;
use super::step::Replay;
use super::STEPS;
use crate::plan::Plan;

/// The profile's prices for `plan`, with compute stretched by the lanes' host work on a
/// CPU device (unchanged on a GPU).
pub fn costs(plan: &Plan, profile: &Profile) -> Costs {
    let base = Costs::new(plan, profile);
    if base.cuda() {
        return base;
    }
    let stretch = compute_stretch(plan, &base);
    base.with_compute_stretch(stretch)
}

/// 1 + the time compute loses to the lanes' host work ÷ compute's busy time, from a
/// replay at the profile's rates.
fn compute_stretch(plan: &Plan, costs: &Costs) -> f64 {
    let mut replay = Replay::new(plan, costs.clone());
    let (mut start, mut step) = (0.0, 0.0);
    for _ in 0..STEPS {
        start = replay.clocks.now(Track::Compute);
        step = replay.step();
    }
    let end = start + step;
    let within = |s: &Span| (s.start.max(start), s.end.min(end));
    let busy: Vec<(f64, f64)> = replay
        .clocks
        .spans()
        .iter()
        .filter(|s| s.track == Track::Compute && s.waited_for.is_none())
        .map(within)
        .filter(|(a, b)| b > a)
        .collect();
    let compute: f64 = busy.iter().map(|(a, b)| b - a).sum();
    if compute <= 0.0 {
        return 1.0;
    }
    // each lane span's host work, as cores over its stretch of the window
    let lanes: Vec<(f64, f64, f64)> = replay
        .clocks
        .spans()
        .iter()
        .filter(|s| s.track != Track::Compute && s.waited_for.is_none() && s.end > s.start)
        .filter_map(|s| {
            let (a, b) = within(s);
            (b > a).then(|| (a, b, host_core_seconds(s, costs) / (s.end - s.start)))
        })
        .collect();
    let profile = costs.profile();
    let ranks = costs.ranks();
    let cores = profile.host_cores.max(1) as f64;
    let compute_threads = ranks * profile.compute.threads.max(1) as f64;
    let spare = (cores - compute_threads).max(0.0);
    // while compute runs, whatever the ranks' lanes ask beyond the spare cores is taken
    // from compute, moment by moment
    let mut taken = 0.0;
    for &(c, d) in &busy {
        let beside: Vec<&(f64, f64, f64)> = lanes.iter().filter(|l| l.1 > c && l.0 < d).collect();
        let mut cuts = vec![c, d];
        cuts.extend(beside.iter().flat_map(|l| [l.0.max(c), l.1.min(d)]));
        cuts.sort_by(f64::total_cmp);
        cuts.dedup();
        for w in cuts.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            let demand: f64 = beside
                .iter()
                .filter(|l| l.0 <= mid && mid < l.1)
                .map(|l| l.2)
                .sum();
            taken += (ranks * demand - spare).max(0.0) * (w[1] - w[0]);
        }
    }
    1.0 + taken / cores.min(compute_threads) / compute
}

/// Core-seconds of host work in a lane's span: an NVMe transfer's checksum (the disk's
/// own time needs no core), the CPU AdamW's share of every core (its rate is every
/// core's, shared by the ranks), one core for anything else.
fn host_core_seconds(s: &Span, costs: &Costs) -> f64 {
    let seconds = s.end - s.start;
    let profile = costs.profile();
    match s.what {
        // a transfer's span on the disk: its crc32c (a bounce buffer's copy is a span of
        // its own, with no bytes, one core like any copy)
        "nvme_read" | "nvme_write" if s.bytes > 0 => {
            let copies = &profile.copies;
            let checksum = copies
                .checksum
                .as_ref()
                .map_or(copies.host_memcpy.value, |f| f.value);
            Costs::seconds_at(s.bytes, checksum).min(seconds)
        }
        "optimizer" => seconds * profile.host_cores.max(1) as f64 / costs.ranks(),
        _ => seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::simulate::profile::Profile;

    fn plan(profile: &Profile) -> Plan {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json");
        crate::plan::load(&path, &[], profile.facts()).unwrap().plan
    }

    /// A CPU twin of `h100-pcie5` with `cores` host cores and one torch thread per rank.
    fn cpu(cores: usize) -> Profile {
        let mut p = Profile::load("h100-pcie5").unwrap();
        p.device = "cpu".into();
        p.host_cores = cores;
        p.compute.threads = 1;
        p
    }

    #[test]
    fn lanes_working_beside_compute_stretch_it_less_the_more_cores_are_spare() {
        let gpu = Profile::load("h100-pcie5").unwrap();
        let plan = plan(&gpu);
        // two ranks' compute fills two cores: the lanes' work beside it takes from it
        let busy = compute_stretch(&plan, &Costs::new(&plan, &cpu(2)));
        assert!(busy > 1.0, "{busy}");
        // with many cores to spare the lanes take less (the CPU AdamW, on every core,
        // still takes some where it runs beside the next forward)
        let spare = compute_stretch(&plan, &Costs::new(&plan, &cpu(64)));
        assert!((1.0..busy).contains(&spare), "{spare} against {busy}");
        // on a GPU compute needs no host core
        let on_gpu = costs(&plan, &gpu);
        assert_eq!(
            on_gpu.seconds(crate::plan::simulate::costs::Work::Forward(1)),
            Costs::new(&plan, &gpu).seconds(crate::plan::simulate::costs::Work::Forward(1))
        );
        let stretched = costs(&plan, &cpu(2));
        let base = Costs::new(&plan, &cpu(2));
        let forward = crate::plan::simulate::costs::Work::Forward(1);
        assert!((stretched.seconds(forward) / base.seconds(forward) - busy).abs() < 1e-12);
    }
}
