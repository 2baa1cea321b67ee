//! The host's cores on a CPU device: every thread that works shares them.
//!
//! On a GPU the lanes' host work (copies into staging, host adds, the CPU AdamW, the
//! NVMe checksums) runs beside kernels that need no host core. On a CPU device compute
//! is torch's threads on the same cores as the lanes' threads, and a profile measures
//! each rate alone: compute with every rank's compute threads running at once and
//! nothing else, a copy or an add on one idle thread, the AdamW on every core. Where
//! more threads work than there are cores, the kernel shares the cores out evenly, and
//! each of them runs that much slower than its rate says. [`costs`] prices that in two
//! passes: the schedule is replayed at the profile's rates; at each moment of the
//! reported step, the threads working are counted (the ranks' compute threads; one for
//! a copy, an add or a collective's memcpy; every core for the CPU AdamW; one for an
//! NVMe transfer's crc32c, as the store computes it before a write and after a read,
//! not for the disk's time), and each phase's work is stretched by the mean, over the
//! moments it runs, of threads ÷ cores where above one. The pass that is reported (and
//! the simulated device, which prices with the same [`Costs`]) runs at those stretches;
//! an NVMe transfer's stretch is of its latency, its way back through the store's ring
//! threads, not of the disk's time.

use super::clock::{Span, Track};
use super::costs::{Costs, Stretch};
use super::profile::Profile;
use super::step::Replay;
use super::STEPS;
use crate::plan::Plan;

/// The profile's prices for `plan`, each phase stretched by the threads working beside
/// it on a CPU device (unchanged on a GPU).
pub fn costs(plan: &Plan, profile: &Profile) -> Costs {
    let base = Costs::new(plan, profile);
    if base.cuda() {
        return base;
    }
    let stretch = stretches(plan, &base);
    base.with_stretch(stretch)
}

/// Each phase's mean of threads ÷ cores (at least one) over the moments it runs, from
/// a replay at the profile's rates.
fn stretches(plan: &Plan, costs: &Costs) -> Stretch {
    let mut replay = Replay::new(plan, costs.clone());
    let (mut start, mut step) = (0.0, 0.0);
    for _ in 0..STEPS {
        start = replay.clocks.now(Track::Compute);
        step = replay.step();
    }
    let end = start + step;
    let cores = costs.profile().host_cores.max(1) as f64;
    let ranks = costs.ranks();
    // the moments each span works (its phase's share of the mean) and the threads it
    // keeps busy meanwhile, each rank running the same schedule
    let mut events: Vec<(f64, Event)> = Vec::new();
    for s in replay.clocks.spans().iter().filter(|s| s.waited_for.is_none()) {
        let (a, b) = (s.start.max(start), s.end.min(end));
        if b <= a {
            continue;
        }
        events.push((a, Event::Runs(phase(s.what), 1)));
        events.push((b, Event::Runs(phase(s.what), -1)));
        let (from, to, threads) = threads(s, costs);
        let (from, to) = (from.max(start), to.min(end));
        if to > from {
            events.push((from, Event::Threads(ranks * threads)));
            events.push((to, Event::Threads(-ranks * threads)));
        }
    }
    events.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut running: Vec<(&'static str, i64, f64, f64)> = Vec::new(); // phase, spans, Σ stretch·dt, Σ dt
    let mut working = 0.0f64;
    let mut last = start;
    for (t, event) in events {
        let dt = t - last;
        if dt > 0.0 {
            let stretch = (working / cores).max(1.0);
            for r in running.iter_mut().filter(|r| r.1 > 0) {
                r.2 += r.1 as f64 * stretch * dt;
                r.3 += r.1 as f64 * dt;
            }
            last = t;
        }
        match event {
            Event::Threads(n) => working = (working + n).max(0.0),
            Event::Runs(phase, n) => match running.iter_mut().find(|r| r.0 == phase) {
                Some(r) => r.1 += n,
                None => running.push((phase, n, 0.0, 0.0)),
            },
        }
    }
    Stretch(
        running
            .into_iter()
            .filter(|r| r.3 > 0.0)
            .map(|(phase, _, weighted, time)| (phase, weighted / time))
            .collect(),
    )
}

/// The phase a span's work is priced in (`Work::phase`): the copies and adds of a
/// gradient on its way to the host are the d2h phase's, whatever the span is called.
fn phase(what: &'static str) -> &'static str {
    match what {
        "host_add" | "device_add" | "copy_out" => "d2h",
        other => other,
    }
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Threads start (or, negative, stop) working.
    Threads(f64),
    /// A span of a phase starts (or, negative, ends).
    Runs(&'static str, i64),
}

/// When a span keeps host threads busy and how many, per rank: the compute threads for
/// compute; every core, shared by the ranks, for the CPU AdamW; one for an NVMe
/// transfer's crc32c, before a write's bytes go and after a read's arrive (the disk's
/// own time needs no core); one for anything else.
fn threads(s: &Span, costs: &Costs) -> (f64, f64, f64) {
    let profile = costs.profile();
    match s.what {
        _ if s.track == Track::Compute => (s.start, s.end, profile.compute.threads.max(1) as f64),
        "nvme_read" | "nvme_write" => {
            let copies = &profile.copies;
            let checksum = copies
                .checksum
                .as_ref()
                .map_or(copies.host_memcpy.value, |f| f.value);
            let crc = Costs::seconds_at(s.bytes, checksum).min(s.end - s.start);
            if s.what == "nvme_write" {
                (s.start, s.start + crc, 1.0)
            } else {
                (s.end - crc, s.end, 1.0)
            }
        }
        "optimizer" => (s.start, s.end, profile.host_cores.max(1) as f64 / costs.ranks()),
        _ => (s.start, s.end, 1.0),
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
    fn threads_beyond_the_cores_stretch_each_phase_less_the_more_cores_there_are() {
        use crate::plan::simulate::costs::Work;
        let gpu = Profile::load("h100-pcie5").unwrap();
        let plan = plan(&gpu);
        // two ranks' compute fills two cores: the lanes' work beside it slows both
        let busy = stretches(&plan, &Costs::new(&plan, &cpu(2)));
        let phases = ["forward", "backward", "all_gather", "d2h"];
        for phase in phases {
            assert!(busy.of(phase) > 1.0, "{phase}: {busy:?}");
        }
        // with many cores to spare less (the CPU AdamW, on every core, still slows what
        // runs beside it)
        let spare = stretches(&plan, &Costs::new(&plan, &cpu(64)));
        for phase in phases {
            assert!(
                (1.0..busy.of(phase)).contains(&spare.of(phase)),
                "{phase}: {spare:?} against {busy:?}"
            );
        }
        // on a GPU compute needs no host core
        let forward = Work::Forward(1);
        assert_eq!(
            costs(&plan, &gpu).seconds(forward),
            Costs::new(&plan, &gpu).seconds(forward)
        );
        let stretched = costs(&plan, &cpu(2));
        let base = Costs::new(&plan, &cpu(2));
        assert!((stretched.seconds(forward) / base.seconds(forward) - busy.of("forward")).abs() < 1e-12);
    }
}
