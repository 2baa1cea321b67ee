//! The host's cores: the lanes' host work takes cores from compute on a CPU device, and
//! from the CPU AdamW.
//!
//! On a GPU the lanes' host work (copies into staging, host adds, the CPU AdamW, the
//! NVMe checksums) runs beside kernels that need no host core. On a CPU device compute
//! is torch's threads on the same cores: a profile measures its rates with every rank's
//! compute threads running at once and nothing else, so where a lane's thread works
//! while compute runs, compute is slower than its rate says. [`costs`] prices that from
//! replays of the schedule, the first at the profile's rates, the next at the prices the
//! first gave ([`PASSES`]: a stretched forward meets lanes' work it ended before at the
//! profile's rates). At each moment of the reported step that compute runs, the cores
//! the ranks' lanes ask for beyond those compute leaves free slow it: one for a copy, an
//! add or a collective's memcpy; a share of every core for the CPU AdamW; for an NVMe
//! transfer, its crc32c and the cores the disk's own work takes while it moves the
//! transfer's bytes (`nvme.cores`, which `bench profile` measures: the kernel's
//! submissions and completions, and a virtual machine's hypervisor's, which its guest
//! sees as steal), spread over the stretch every rank's turn at the disk for it takes
//! (`Span::all`: the ranks' transfers go one after another, each rank's demand where
//! its own turn falls, on average over the stretch).
//! Torch's threads work in step, so one core taken holds them all back: compute runs at
//! 1 − `compute.lost_beside_a_thread` of its rate while the lanes take a core or more
//! (`bench profile` measures it: a block's forward beside a busy thread), in proportion
//! while they take part of one. Each unit's forward and backward is stretched by what
//! ran beside it in the pass that is reported (and on the simulated device, which
//! prices with the same [`Costs`]). The CPU AdamW runs a thread on every core: what is
//! runnable beside its sweeps (the lanes' host work, compute's threads on a CPU device)
//! shares the cores with it, and its sweeps are stretched by that, on a GPU too where
//! the profile measured the disk's cost. The other way round, an NVMe transfer handed to
//! the store's threads while compute holds every core waits for one until that stretch
//! of compute ends, at most what `bench profile` measured
//! (`nvme.latency.*_beside_compute_s`: the transfers beside threads busy on compute's
//! cores, a scheduler's slice here): every read and write pays the step's average wait
//! on top of its latency, except a read submitted ahead of its update, which no thread
//! waits for as it completes (`Costs::read_ahead`; left out of the average too).

use super::clock::{Span, Track};
use super::costs::Costs;
use super::profile::Profile;
use super::step::Replay;
use super::STEPS;
use crate::plan::Plan;

/// The profile's prices for `plan`, with compute stretched by the lanes' host work on a
/// CPU device, NVMe transfers beside compute paying their latency there, and the CPU
/// AdamW stretched by the work beside it where the profile measured the disk's cost
/// (unchanged on a GPU otherwise).
pub fn costs(plan: &Plan, profile: &Profile) -> Costs {
    let base = Costs::new(plan, profile);
    if base.cuda() && profile.nvme.cores.is_none() {
        return base;
    }
    // a replay at the profile's rates, then one at the prices it gave: stretched compute
    // meets lanes' work that it ended before at the profile's rates (a forward beside
    // the optimizer's first sweep of the next unit)
    let mut costs = base.clone();
    for _ in 0..PASSES {
        let pass = Pass::new(plan, &costs);
        let optimizer = pass.optimizer_stretch(&costs);
        costs = if base.cuda() {
            base.clone().with_optimizer_stretch(optimizer)
        } else {
            let waits = pass.waits_beside_compute(base.nvme_latency_beside_compute());
            base.clone()
                .with_compute_stretch(pass.compute_stretch(&costs))
                .with_nvme_waits(waits)
                .with_optimizer_stretch(optimizer)
        };
    }
    costs
}

/// Replays that price the step: the first at the profile's rates, each next at the
/// prices the one before gave.
const PASSES: usize = 2;

/// A replay at some prices: its work's spans, and the window of its reported step (the
/// last of [`STEPS`]).
struct Pass {
    spans: Vec<Span>,
    window: (f64, f64),
    /// Per unit, whether its AdamW is the CPU's (its state off the device), whose
    /// sweeps the prices stretch.
    host_adam: Vec<bool>,
}

impl Pass {
    fn new(plan: &Plan, costs: &Costs) -> Pass {
        let mut replay = Replay::new(plan, costs.clone());
        let (mut start, mut step) = (0.0, 0.0);
        for _ in 0..STEPS {
            start = replay.clocks.now(Track::Compute);
            step = replay.step();
        }
        let spans = replay
            .clocks
            .spans()
            .iter()
            .filter(|s| s.waited_for.is_none() && s.end > s.start)
            .cloned()
            .collect();
        Pass {
            spans,
            window: (start, start + step),
            host_adam: crate::plan::rules::optimizer_tiers(plan)
                .into_iter()
                .map(|t| t != crate::plan::Tier::Device)
                .collect(),
        }
    }

    /// Whether `s` is a sweep of the CPU AdamW.
    fn host_sweep(&self, s: &Span) -> bool {
        s.what == "optimizer"
            && s.unit
                .is_some_and(|u| self.host_adam.get(u).copied().unwrap_or(true))
    }

    /// [`host_core_seconds`] of `s` in this pass: a CPU AdamW's sweep at the stretch
    /// `costs` priced it at, a device's at its own time.
    fn host_core_seconds(&self, s: &Span, costs: &Costs) -> f64 {
        let stretch = if self.host_sweep(s) {
            costs.optimizer_stretch()
        } else {
            1.0
        };
        host_core_seconds(s, costs, stretch)
    }

    /// The spans `keep` keeps, cut to the reported step: those left of them.
    fn within<'a>(&'a self, keep: impl Fn(&Span) -> bool + 'a) -> impl Iterator<Item = Span> + 'a {
        let (start, end) = self.window;
        self.spans
            .iter()
            .filter(move |s| keep(s))
            .map(move |s| Span {
                start: s.start.max(start),
                end: s.end.min(end),
                all: s.all.min(end),
                ..s.clone()
            })
            .filter(|s| s.end > s.start)
    }

    /// Per unit, how much longer its forward and its backward (the final unit's: the
    /// head) take for the lanes' host work beside them.
    fn compute_stretch(&self, costs: &Costs) -> Vec<[f64; 2]> {
        // the pieces of compute a stretch applies to: (unit, slot, start, end)
        let pieces: Vec<(usize, usize, f64, f64)> = self
            .within(|s| s.track == Track::Compute)
            .filter_map(|s| {
                let slot = match s.what {
                    "forward" => 0,
                    "backward" => 1,
                    _ => return None,
                };
                Some((s.unit?, slot, s.start, s.end))
            })
            .collect();
        let profile = costs.profile();
        let ranks = costs.ranks();
        let cores = profile.host_cores.max(1) as f64;
        let compute_threads = ranks * profile.compute.threads.max(1) as f64;
        let spare = (cores - compute_threads).max(0.0);
        // measured: lost while a core or more is taken; else the assumption that came
        // before, a core's share of compute's cores for each core taken
        let (lost, most) = profile
            .compute
            .lost_beside_a_thread
            .as_ref()
            .map_or((1.0 / cores.min(compute_threads), f64::INFINITY), |f| {
                (f.value.clamp(0.0, 0.95), 1.0)
            });
        // compute's rate over the window, piece by piece of time: the lanes' host work
        // of every rank, beyond the cores compute leaves free, holds it back
        let rates = Rates::new(
            self.spans.iter().filter(|s| s.track != Track::Compute).map(|s| {
                (
                    s.start,
                    s.all,
                    self.host_core_seconds(s, costs) / (s.all - s.start),
                )
            }),
            |demand| (1.0 - lost * (ranks * demand - spare).clamp(0.0, most)).max(0.05),
        );
        let units = pieces.iter().map(|p| p.0 + 1).max().unwrap_or(0);
        // (time taken, time at the profile's rate) per unit and slot
        let mut sums = vec![[(0.0, 0.0); 2]; units];
        for &(u, slot, c, d) in &pieces {
            // the piece's work at the profile's rate: its span less the stretch this
            // pass priced it at
            let work = (d - c) / costs.compute_stretch_of(u, slot);
            let sum = &mut sums[u][slot];
            *sum = (sum.0 + rates.finish(c, work) - c, sum.1 + work);
        }
        sums.iter()
            .map(|s| s.map(|(taken, alone)| if alone > 0.0 { taken / alone } else { 1.0 }))
            .collect()
    }

    /// How much longer the CPU AdamW's sweeps take for the work beside them. The sweep
    /// runs a thread on every core; whatever else is runnable beside it (the disk's own
    /// work, the transfers' checksums, copies and adds, compute's torch threads on a CPU
    /// device, of every rank; on a GPU only the NVMe transfers and the host's adds)
    /// shares the cores with its threads, which keep cores ÷ (cores + the others'
    /// demand) of them. A device-tier unit's AdamW is not the CPU's: not stretched.
    fn optimizer_stretch(&self, costs: &Costs) -> f64 {
        let profile = costs.profile();
        let cores = profile.host_cores.max(1) as f64;
        let ranks = costs.ranks();
        let threads = profile.compute.threads.max(1) as f64;
        // on a GPU the kernels, the collectives and the copies' DMA take no host core:
        // only the host's own work beside the sweeps counts there
        let asked = |s: &Span| match (costs.cuda(), s.track, s.what) {
            (true, _, "nvme_read" | "nvme_write" | "host_add") => self.host_core_seconds(s, costs),
            (true, _, _) => 0.0,
            (false, Track::Compute, _) => threads * (s.end - s.start),
            (false, _, _) => self.host_core_seconds(s, costs),
        };
        let rates = Rates::new(
            self.spans
                .iter()
                .filter(|s| !self.host_sweep(s))
                .map(|s| (s.start, s.all, asked(s) / (s.all - s.start))),
            |demand| cores / (cores + ranks * demand),
        );
        let (taken, alone) = self
            .within(|s| self.host_sweep(s))
            .fold((0.0, 0.0), |(taken, alone), s| {
                let work = (s.end - s.start) / costs.optimizer_stretch();
                (taken + rates.finish(s.start, work) - s.start, alone + work)
            });
        if alone > 0.0 {
            taken / alone
        } else {
            1.0
        }
    }

    /// What the step's NVMe reads and its writes wait for a core, on average (read,
    /// write): a transfer handed to the store's threads while compute holds the cores
    /// waits until that stretch of compute ends, at most `extra` (what the profile
    /// measured beside compute beyond the latency on idle cores).
    fn waits_beside_compute(&self, extra: (f64, f64)) -> (f64, f64) {
        let mut busy: Vec<(f64, f64)> = self
            .within(|s| s.track == Track::Compute)
            .map(|s| (s.start, s.end))
            .collect();
        busy.sort_by(|x, y| x.0.total_cmp(&y.0));
        let merged = busy.into_iter().fold(Vec::<(f64, f64)>::new(), |mut m, (a, b)| {
            match m.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => m.push((a, b)),
            }
            m
        });
        // what is left of the stretch of compute a transfer starts in
        let left = |t: f64| {
            let i = merged.partition_point(|&(a, _)| a <= t);
            i.checked_sub(1).map_or(0.0, |i| (merged[i].1 - t).max(0.0))
        };
        let share = |what: &str, extra: f64| {
            let (sum, n) = self
                .within(|s| s.what == what && s.bytes > 0 && !s.ahead)
                .fold((0.0, 0usize), |(sum, n), s| {
                    (sum + left(s.start).min(extra), n + 1)
                });
            if n == 0 {
                0.0
            } else {
                sum / n as f64
            }
        };
        (share("nvme_read", extra.0), share("nvme_write", extra.1))
    }
}

/// Compute's rate through time (1: the profile's), piecewise constant between the lanes'
/// spans' ends.
struct Rates {
    /// (from, rate) in time order; the rate holds until the next `from`, and 1 before
    /// the first and after the last.
    steps: Vec<(f64, f64)>,
}

impl Rates {
    /// From the lanes' spans (start, end, cores asked) and what compute's rate is while
    /// they ask for so many cores.
    fn new(lanes: impl Iterator<Item = (f64, f64, f64)>, rate: impl Fn(f64) -> f64) -> Rates {
        let mut events: Vec<(f64, f64)> = lanes
            .flat_map(|(a, b, cores)| [(a, cores), (b, -cores)])
            .collect();
        events.sort_by(|x, y| x.0.total_cmp(&y.0));
        let mut steps: Vec<(f64, f64)> = Vec::with_capacity(events.len() + 1);
        let mut demand = 0.0;
        for (i, &(t, change)) in events.iter().enumerate() {
            demand += change;
            if events.get(i + 1).is_some_and(|next| next.0 == t) {
                continue;
            }
            // sums of many changes leave dust where nothing is asked
            let r = if demand > 1e-9 { rate(demand) } else { 1.0 };
            steps.push((t, r));
        }
        Rates { steps }
    }

    /// When `work` seconds of compute at the profile's rate, started at `from`, end.
    fn finish(&self, from: f64, work: f64) -> f64 {
        let first = self.steps.partition_point(|s| s.0 <= from);
        let (mut t, mut left) = (from, work);
        let mut rate = if first == 0 { 1.0 } else { self.steps[first - 1].1 };
        for &(next, next_rate) in &self.steps[first..] {
            if rate * (next - t) >= left {
                break;
            }
            left -= rate * (next - t);
            (t, rate) = (next, next_rate);
        }
        t + left / rate
    }
}

/// Core-seconds of host work in a lane's span: an NVMe transfer's checksum (the NVMe
/// optimizer's are in its sweep) and what the disk's own work takes from the host's
/// cores while it moves the transfer's bytes (`nvme.cores`: the kernel's, and a virtual
/// machine's hypervisor's); the CPU AdamW's share of every core (its rate is every
/// core's, shared by the ranks; its work at the profile's rate, its span priced
/// `adam_stretch` times that); one core for anything else.
fn host_core_seconds(s: &Span, costs: &Costs, adam_stretch: f64) -> f64 {
    let seconds = s.end - s.start;
    let profile = costs.profile();
    match s.what {
        "nvme_read" | "nvme_write" if s.bytes > 0 || s.track == Track::Optimizer => {
            let write = s.what == "nvme_write";
            // the cores the disk takes while it moves these bytes, at the machine's rate
            let disk = profile.nvme.cores.as_ref().map_or(0.0, |c| {
                let (read, written) = costs.disk_rates();
                let (cores, rate) = if write {
                    (&c.while_writing, written)
                } else {
                    (&c.while_reading, read)
                };
                cores.value * Costs::seconds_at(s.bytes, rate)
            });
            // the optimizer's transfers of its state are summed in its sweep (the
            // parameter shard's write after a unit's update, summed apart, is left
            // uncounted); any other transfer's crc32c takes a core while it runs (a bounce
            // buffer's copy is a span of its own, with no bytes, one core like any copy)
            let checksum = if s.track == Track::Optimizer {
                0.0
            } else {
                let copies = &profile.copies;
                let rate = copies
                    .checksum
                    .as_ref()
                    .map_or(copies.host_memcpy.value, |f| f.value);
                Costs::seconds_at(s.bytes, rate).min(seconds)
            };
            disk + checksum
        }
        // its work at the profile's rate, wherever a pass stretched its span
        "optimizer" => seconds / adam_stretch * profile.host_cores.max(1) as f64 / costs.ranks(),
        _ => seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::simulate::costs::Transfer;
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

    /// Unit 0's work of `bytes` named `what` on `track` over [start, end), not waited
    /// for, not submitted ahead.
    fn span(track: Track, what: &'static str, start: f64, end: f64, bytes: u64) -> Span {
        Span {
            track,
            what,
            unit: Some(0),
            start,
            end,
            all: end,
            bytes,
            waited_for: None,
            ahead: false,
        }
    }

    #[test]
    fn compute_runs_at_the_rate_of_each_stretch_of_time_it_meets() {
        // one lane asks a core over [1, 2), another half a core over [1.5, 3)
        let rates = Rates::new([(1.0, 2.0, 1.0), (1.5, 3.0, 0.5)].into_iter(), |cores| {
            1.0 - 0.5 * cores.min(1.0)
        });
        // 2 s of work from 0: 1 s done by 1 at full rate, 0.5 s more over [1, 2) at half
        // (one core asked, then one and a half), the last 0.5 s at 0.75 from 2
        let end = rates.finish(0.0, 2.0);
        assert!((end - (2.0 + 0.5 / 0.75)).abs() < 1e-12, "{end}");
        // the same, stepped in small pieces of time: the reference
        let rate_at = |t: f64| match t {
            t if (1.0..1.5).contains(&t) => 0.5,
            t if (1.5..2.0).contains(&t) => 0.5,
            t if (2.0..3.0).contains(&t) => 0.75,
            _ => 1.0,
        };
        let (mut t, mut done, dt) = (0.0, 0.0, 1e-6);
        while done < 2.0 {
            done += rate_at(t) * dt;
            t += dt;
        }
        assert!((end - t).abs() < 1e-5, "{end} against {t}");
        // work that ends before any lane, and work that starts after every lane
        assert_eq!(rates.finish(0.0, 0.5), 0.5);
        assert_eq!(rates.finish(4.0, 1.0), 5.0);
    }

    #[test]
    fn lanes_working_beside_compute_stretch_it_less_the_more_cores_are_spare() {
        let gpu = Profile::load("h100-pcie5").unwrap();
        let plan = plan(&gpu);
        // two ranks' compute fills two cores: the lanes' work beside it takes from it
        let stretch = |cores| {
            let c = Costs::new(&plan, &cpu(cores));
            let s = Pass::new(&plan, &c).compute_stretch(&c);
            s.iter().flatten().copied().fold(0.0, f64::max)
        };
        let busy = stretch(2);
        assert!(busy > 1.0, "{busy}");
        // with many cores to spare the lanes take less (the CPU AdamW, on every core,
        // still takes some where it runs beside the next forward)
        let spare = stretch(64);
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
        let unit_1 = stretched.compute_stretch_of(1, 0);
        assert!(unit_1 >= 1.0, "{unit_1}");
        assert!((stretched.seconds(forward) / base.seconds(forward) - unit_1).abs() < 1e-12);
    }

    #[test]
    fn a_transfer_beside_compute_waits_until_that_stretch_of_compute_ends() {
        let span = |track, what, start, end| {
            let bytes = if track == Track::Compute { 0 } else { 1 << 20 };
            span(track, what, start, end, bytes)
        };
        let pass = Pass {
            spans: vec![
                // compute over [0, 3) in two pieces, and [5, 6); its window ends at 8
                span(Track::Compute, "forward", 0.0, 1.0),
                span(Track::Compute, "forward", 1.0, 3.0),
                span(Track::Compute, "backward", 5.0, 6.0),
                // reads: 2.5 s of compute left (more than the extra, 1 s), none, 0.1 s
                span(Track::Nvme, "nvme_read", 0.5, 0.7),
                span(Track::Nvme, "nvme_read", 4.0, 4.5),
                span(Track::Nvme, "nvme_read", 5.9, 6.5),
                // a read submitted ahead, which no thread waits for: not counted
                Span {
                    ahead: true,
                    ..span(Track::Optimizer, "nvme_read", 0.2, 0.3)
                },
                // a write 0.5 s before compute ends; one after the window, not counted
                span(Track::Nvme, "nvme_write", 2.5, 2.6),
                span(Track::Nvme, "nvme_write", 9.0, 9.5),
            ],
            window: (0.0, 8.0),
            host_adam: vec![true],
        };
        let (read, write) = pass.waits_beside_compute((1.0, 1.0));
        assert!((read - (1.0 + 0.0 + 0.1) / 3.0).abs() < 1e-12, "{read}");
        assert!((write - 0.5).abs() < 1e-12, "{write}");
        // nothing measured beside compute: no wait
        assert_eq!(pass.waits_beside_compute((0.0, 0.0)), (0.0, 0.0));
        // the prices: every transfer pays the wait but a read submitted ahead
        let profile = cpu(2);
        let costs = Costs::new(&plan(&profile), &profile);
        let waited = costs.clone().with_nvme_waits((read, write));
        let mib = 1 << 20;
        let read_of = |c: &Costs| c.transfer(crate::plan::simulate::costs::Work::NvmeRead(mib));
        assert!((read_of(&waited).latency - read_of(&costs).latency - read).abs() < 1e-12);
        assert_eq!(waited.read_ahead(mib), read_of(&costs));
        assert_eq!(waited.read_ahead(0), Transfer::default());
    }

    #[test]
    fn the_nvme_optimizer_sums_its_state_in_its_sweep_not_on_its_transfers() {
        use crate::plan::simulate::costs::Work;
        use crate::plan::simulate::profile::Figure;
        let mut profile = cpu(2);
        let costs = |p: &Profile| Costs::new(&plan(p), p);
        let elements = 1 << 20;
        let plain = costs(&profile).seconds(Work::Adam(elements));
        // no summed rate in the profile: the plain one
        assert_eq!(costs(&profile).seconds(Work::AdamSummed(elements)), plain);
        let rate = profile.cpu_adam.params_per_s.value / 2.0;
        profile.cpu_adam.summed_params_per_s = Some(Figure::new(rate, "test"));
        let summed = costs(&profile).seconds(Work::AdamSummed(elements));
        assert!((summed / plain - 2.0).abs() < 1e-12, "{summed} against {plain}");
        // a span of the optimizer's state transfers asks no core for its checksum; the
        // other tracks' transfers sum theirs apart
        let c = costs(&profile);
        let span = |track| span(track, "nvme_read", 0.0, 1.0, 1 << 30);
        assert_eq!(host_core_seconds(&span(Track::Optimizer), &c, 1.0), 0.0);
        assert!(host_core_seconds(&span(Track::H2d), &c, 1.0) > 0.0);
    }

    #[test]
    fn the_disk_asks_the_cores_its_bytes_cost_beside_their_checksums() {
        use crate::plan::simulate::profile::{Figure, NvmeCores};
        let span = |track, what| span(track, what, 0.0, 1.0, 500_000_000);
        let mut profile = cpu(2);
        let asked =
            |p: &Profile, track, what| host_core_seconds(&span(track, what), &Costs::new(&plan(p), p), 1.0);
        let (read, write) = (
            asked(&profile, Track::H2d, "nvme_read"),
            asked(&profile, Track::H2d, "nvme_write"),
        );
        // not measured: the checksums alone, none for the optimizer's state
        assert!(read > 0.0 && write > 0.0);
        assert_eq!(asked(&profile, Track::Optimizer, "nvme_read"), 0.0);
        profile.nvme.cores = Some(NvmeCores {
            while_reading: Figure::new(0.8, "test"),
            while_writing: Figure::new(0.4, "test"),
        });
        // half a GB: 0.8 and 0.4 cores for its time on the machine's disk, on every track
        let (r, w) = Costs::new(&plan(&profile), &profile).disk_rates();
        let close = |x: f64, y: f64| (x - y).abs() < 1e-12;
        assert!(close(
            asked(&profile, Track::H2d, "nvme_read"),
            read + 0.8 * 0.5 / r
        ));
        assert!(close(
            asked(&profile, Track::H2d, "nvme_write"),
            write + 0.4 * 0.5 / w
        ));
        assert!(close(
            asked(&profile, Track::Optimizer, "nvme_read"),
            0.8 * 0.5 / r
        ));
        assert!(close(
            asked(&profile, Track::Optimizer, "nvme_write"),
            0.4 * 0.5 / w
        ));
    }

    #[test]
    fn the_cpu_adamw_shares_the_cores_with_what_runs_beside_it() {
        let span = |track, what, start, end| span(track, what, start, end, 0);
        // two ranks of one torch thread on two cores: while compute runs, the AdamW's
        // threads keep 2 ÷ (2 + 2) of the cores
        let profile = cpu(2);
        let base = Costs::new(&plan(&profile), &profile);
        let pass = |sweep: (f64, f64)| Pass {
            spans: vec![
                span(Track::Compute, "forward", 0.0, 0.5),
                span(Track::Optimizer, "optimizer", sweep.0, sweep.1),
            ],
            window: (0.0, 10.0),
            host_adam: vec![true],
        };
        // 1 s of sweep from 0: 0.25 s of it done beside compute's 0.5 s, the rest after
        let stretch = pass((0.0, 1.0)).optimizer_stretch(&base);
        assert!((stretch - 1.25).abs() < 1e-12, "{stretch}");
        // a pass at prices that stretched the sweep 2×: the same work, the same stretch
        let priced = base.clone().with_optimizer_stretch(2.0);
        let again = pass((0.0, 2.0)).optimizer_stretch(&priced);
        assert!((again - 1.25).abs() < 1e-12, "{again}");
        // nothing beside it: none
        assert_eq!(pass((1.0, 2.0)).optimizer_stretch(&base), 1.0);
        // a device-tier unit's AdamW is not the CPU's: nothing to stretch
        let device = Pass {
            host_adam: vec![false],
            ..pass((0.0, 1.0))
        };
        assert_eq!(device.optimizer_stretch(&base), 1.0);
        // on a GPU compute's kernels take no host core from it
        let gpu = Profile::load("h100-pcie5").unwrap();
        let on_gpu = Costs::new(&plan(&gpu), &gpu);
        assert_eq!(pass((0.0, 1.0)).optimizer_stretch(&on_gpu), 1.0);
        // the prices take it: the CPU AdamW's sweeps, plain and summed
        use crate::plan::simulate::costs::Work;
        for work in [Work::Adam(1 << 20), Work::AdamSummed(1 << 20)] {
            assert!((priced.seconds(work) / base.seconds(work) - 2.0).abs() < 1e-12);
        }
    }
}
