//! The host's cores on a CPU device: the lanes' host work takes cores from compute.
//!
//! On a GPU the lanes' host work (copies into staging, host adds, the CPU AdamW, the
//! NVMe checksums) runs beside kernels that need no host core. On a CPU device compute
//! is torch's threads on the same cores: a profile measures its rates with every rank's
//! compute threads running at once and nothing else, so where a lane's thread works
//! while compute runs, compute is slower than its rate says. [`costs`] prices that in
//! two passes: the schedule is replayed at the profile's rates; the host work of the
//! lanes that overlapped compute in the reported step (core-seconds: one core for a
//! copy, an add or a collective's memcpy; a share of every core for the CPU AdamW; the
//! bounce copy and crc32c of an NVMe transfer, not the disk's time) less what the cores
//! compute leaves free can absorb, spread over the cores compute runs on, is the time
//! compute loses; every piece of compute is stretched by it in the pass that is
//! reported (and on the simulated device, which prices with the same [`Costs`]).

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
    let lanes: f64 = replay
        .clocks
        .spans()
        .iter()
        .filter(|s| s.track != Track::Compute && s.waited_for.is_none() && s.end > s.start)
        .map(|s| {
            let (a, b) = within(s);
            let overlap: f64 = busy.iter().map(|&(c, d)| (b.min(d) - a.max(c)).max(0.0)).sum();
            host_core_seconds(s, costs) * overlap / (s.end - s.start)
        })
        .sum();
    let profile = costs.profile();
    let ranks = plan.train.devices.max(1) as f64;
    let cores = profile.host_cores.max(1) as f64;
    let compute_threads = ranks * profile.compute.threads.max(1) as f64;
    let spare = (cores - compute_threads).max(0.0);
    let taken = (ranks * lanes - spare * compute).max(0.0);
    1.0 + taken / cores.min(compute_threads) / compute
}

/// Core-seconds of host work in a lane's span: an NVMe transfer's bounce copy and
/// checksum (the disk's own time needs no core), the CPU AdamW's share of every core
/// (its rate is every core's, shared by the ranks), one core for anything else.
fn host_core_seconds(s: &Span, costs: &Costs) -> f64 {
    let seconds = s.end - s.start;
    let profile = costs.profile();
    match s.what {
        "nvme_read" | "nvme_write" => {
            let copies = &profile.copies;
            let checksum = copies
                .checksum
                .as_ref()
                .map_or(copies.host_memcpy.value, |f| f.value);
            let cpu =
                Costs::seconds_at(s.bytes, copies.host_memcpy.value) + Costs::seconds_at(s.bytes, checksum);
            cpu.min(seconds)
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
    fn lanes_working_beside_compute_on_busy_cores_stretch_it_and_spare_cores_do_not() {
        let gpu = Profile::load("h100-pcie5").unwrap();
        let plan = plan(&gpu);
        // two ranks' compute fills two cores: the lanes' work beside it takes from it
        let busy = compute_stretch(&plan, &Costs::new(&plan, &cpu(2)));
        assert!(busy > 1.0, "{busy}");
        // with many cores to spare the lanes take none
        let spare = compute_stretch(&plan, &Costs::new(&plan, &cpu(64)));
        assert_eq!(spare, 1.0);
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
