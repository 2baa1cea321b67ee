//! The simulated step: what a config's step would take on a machine described by a
//! [`profile::Profile`], without running it (`tierzero plan --simulate PROFILE`).
//!
//! [`step`] replays one rank's schedule on the virtual clocks of [`clock`] (every
//! stream and lane a track); this module turns the replay into the figures a person
//! reads: step time, tokens/s, MFU against the profile's peak, each track's busy time
//! and the time compute waited for it, bytes across PCIe per parameter beside the
//! layout's minimum, the plan's device and host peaks, and what bounds the step: the
//! slowest resource at its profiled rate with the layout's minimal traffic, beside the
//! critical path of the replay (the track compute waited for most).

pub mod clock;
mod contention;
pub mod costs;
pub mod disk;
pub mod flops;
pub mod profile;
mod step;

use crate::plan::partition::Partition;
use crate::plan::report::nvme_bytes;
use crate::plan::rules;
use crate::plan::{Plan, Tier};
use clock::{Clocks, Track};
use profile::Profile;
use serde::Serialize;
use std::collections::BTreeMap;

/// Steps replayed; the last is reported (the optimizer of the one before overlaps it).
const STEPS: usize = 3;

pub use contention::costs;

/// One track's share of the simulated step.
#[derive(Clone, Debug, Serialize)]
pub struct TrackFigures {
    pub track: Track,
    pub busy_s: f64,
    /// Seconds compute waited for this track.
    pub compute_waited_s: f64,
    pub bytes: u64,
}

/// What a step costs on a profiled machine.
#[derive(Clone, Debug, Serialize)]
pub struct Simulation {
    pub profile: String,
    pub step_s: f64,
    pub tokens_per_step: usize,
    pub tokens_per_s: f64,
    /// Model FLOP/s ÷ (ranks × the profile's dense peak in the training precision).
    pub mfu: f64,
    pub tracks: Vec<TrackFigures>,
    /// Busy seconds per phase, named as the trainer's breakdown names them.
    pub phases: BTreeMap<&'static str, f64>,
    /// Bytes moved per phase in the step, named as the breakdown's `bytes` name them.
    pub phase_bytes: BTreeMap<&'static str, u64>,
    /// Bytes across one GPU's PCIe link per model parameter per step (all ranks' links
    /// together ÷ parameters): host → device, device → host, and the layout's minimum.
    pub pcie_bytes_per_param: [f64; 2],
    pub pcie_minimum_per_param: f64,
    pub device_peak_bytes: u64,
    pub host_peak_bytes: u64,
    /// The slowest resource at its profiled rate with the layout's minimal traffic.
    pub bound: String,
    pub bound_s: f64,
    /// The step's floor where no update starts before the step's last backward has
    /// ended (what it is made of, and its seconds; see `floor`), where optimizer state is
    /// off the device.
    pub floor: Option<(String, f64)>,
    /// The track compute waited for most, or compute itself.
    pub critical: String,
    #[serde(skip)]
    pub clocks: Clocks,
    #[serde(skip)]
    pub step_start: f64,
}

/// Replays `STEPS` steps of `plan` on `profile`'s machine and reports the last.
pub fn simulate(plan: &Plan, profile: &Profile) -> Simulation {
    simulate_on(plan, profile, Clocks::default())
}

/// [`simulate`] with a disk per track, as the simulated device times the engine
/// ([`Clocks::disk_per_track`]): what a run on it reports, to the nanosecond.
pub fn simulate_as_the_device(plan: &Plan, profile: &Profile) -> Simulation {
    simulate_on(plan, profile, Clocks::disk_per_track())
}

fn simulate_on(plan: &Plan, profile: &Profile, clocks: Clocks) -> Simulation {
    let mut replay = step::Replay::new(plan, contention::costs(plan, profile));
    replay.clocks = clocks;
    let mut step_s = 0.0;
    let mut step_start = 0.0;
    for _ in 0..STEPS {
        step_start = replay.clocks.now(Track::Compute);
        step_s = replay.step();
    }
    let clocks = replay.clocks.clone();
    let config = &plan.model.config;
    let tokens_per_step = plan.batch.train_batch_size * plan.data.seq_len;
    let tokens_per_s = tokens_per_step as f64 / step_s;
    let peak = profile.peak_flops(plan.precision.name()) * plan.world_size as f64;
    let mfu = config.flops_per_token(plan.data.seq_len) * tokens_per_s / peak;
    let window = |s: &clock::Span| (s.end.min(step_start + step_s) - s.start.max(step_start)).max(0.0);
    let mut phases: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut phase_bytes: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut busy: BTreeMap<Track, (f64, u64)> = BTreeMap::new();
    for s in clocks.spans().iter().filter(|s| s.waited_for.is_none()) {
        let t = window(s);
        *phases.entry(s.what).or_default() += t;
        let entry = busy.entry(s.track).or_default();
        entry.0 += t;
        if s.end > step_start && s.end <= step_start + step_s && s.bytes > 0 {
            entry.1 += s.bytes;
            *phase_bytes.entry(s.what).or_default() += s.bytes;
        }
    }
    let waited = |on: Track| -> f64 {
        clocks
            .spans()
            .iter()
            .filter(|s| s.track == Track::Compute && s.waited_for == Some(on))
            .map(window)
            .sum()
    };
    let tracks: Vec<TrackFigures> = Track::ALL
        .iter()
        .filter_map(|&t| {
            let (busy_s, bytes) = busy.get(&t).copied().unwrap_or_default();
            let compute_waited_s = if t == Track::Compute { 0.0 } else { waited(t) };
            (busy_s > 0.0 || compute_waited_s > 0.0).then_some(TrackFigures {
                track: t,
                busy_s,
                compute_waited_s,
                bytes,
            })
        })
        .collect();
    let params = config.num_parameters() as f64;
    let per_param = |bytes: u64| bytes as f64 * plan.world_size as f64 / params;
    let pcie_bytes_per_param = [per_param(replay.pcie[0]), per_param(replay.pcie[1])];
    let p = plan.precision.bytes() as f64;
    let offloaded =
        plan.zero.offload_param.tier != Tier::Device || plan.zero.offload_optimizer.tier != Tier::Device;
    // the parameters' training precision each way, except that the step's gradient of
    // several micro-batches reaches an fp32 optimizer as their fp32 sum: 4 bytes once, or
    // each micro-batch's gradient in the training precision, whichever is less
    let micro_batches = plan.batch.gradient_accumulation_steps as f64;
    // a unit whose optimizer state and parameters both stay on the device crosses no
    // PCIe at all (`offload_optimizer.ratio`, `train.shards_on_device`); one whose state
    // is there and parameters are not sends its new values out instead of its gradient
    let (optimizer_tiers, param_tiers) = (rules::optimizer_tiers(plan), rules::param_tiers(plan));
    let gradient = (micro_batches * p).min(4.0_f64.max(p));
    let pcie_minimum = if profile.is_cpu() || !offloaded {
        [0.0, 0.0]
    } else {
        config
            .unit_numels()
            .iter()
            .enumerate()
            .map(|(u, &n)| {
                let n = n as f64 / params;
                match (optimizer_tiers[u], param_tiers[u]) {
                    (Tier::Device, Tier::Device) => [0.0, 0.0],
                    (Tier::Device, _) => [n * p, n * p],
                    _ => [n * p, n * gradient],
                }
            })
            .fold([0.0, 0.0], |[i, o], [a, b]| [i + a, o + b])
    };
    let pcie_minimum_per_param = pcie_minimum[0] + pcie_minimum[1];
    let compute_s = busy.get(&Track::Compute).map_or(0.0, |b| b.0);
    let (bound, bound_s) = bound(plan, profile, compute_s, pcie_minimum);
    let floor = floor(
        plan,
        profile,
        compute_s,
        (replay.first_forward, replay.ahead_bytes),
    );
    let critical = tracks
        .iter()
        .filter(|t| t.track != Track::Compute)
        .max_by(|a, b| a.compute_waited_s.total_cmp(&b.compute_waited_s))
        .filter(|t| t.compute_waited_s > 0.15 * step_s)
        .map(|t| {
            format!(
                "compute waits for {} ({:.0}% of the step)",
                t.track.name(),
                100.0 * t.compute_waited_s / step_s
            )
        })
        .unwrap_or_else(|| format!("compute ({:.0}% of the step busy)", 100.0 * compute_s / step_s));
    Simulation {
        profile: profile.name.clone(),
        step_s,
        tokens_per_step,
        tokens_per_s,
        mfu,
        tracks,
        phases,
        phase_bytes,
        pcie_bytes_per_param,
        pcie_minimum_per_param,
        device_peak_bytes: crate::plan::memory::predict(plan).in_tensors(),
        host_peak_bytes: crate::plan::host_memory::predict_host(plan).total,
        bound,
        bound_s,
        floor,
        critical,
        clocks,
        step_start,
    }
}

/// Bytes one rank reads and writes per step for its parameters on NVMe (stage 3): each
/// fetched use of such a unit in a micro-batch's fetch order (`fetch::Fetches`) reads its shard,
/// a unit that stays gathered once per step; each update writes it once.
fn nvme_param_bytes(plan: &Plan) -> (f64, f64) {
    let tiers = crate::plan::rules::param_tiers(plan);
    if plan.zero.stage != 3 || !tiers.contains(&Tier::Nvme) {
        return (0.0, 0.0);
    }
    let numels = plan.model.config.unit_numels();
    let threshold = plan.zero.param_persistence_threshold;
    let persistent = |u: usize| numels[u] <= threshold;
    let uses = crate::plan::rules::unit_schedule(plan);
    // a use served by the gather of the unit's previous one reads nothing
    let order =
        crate::plan::fetch::Fetches::new(uses, &numels, persistent, plan.zero.max_reuse_distance).order();
    // a layered step's fetch serves every micro-batch
    let micro_batches = crate::plan::rules::passes(plan) as f64;
    let elem = plan.precision.bytes() as f64;
    let (mut read, mut written) = (0.0, 0.0);
    for (u, _) in tiers.iter().enumerate().filter(|(_, t)| **t == Tier::Nvme) {
        let shard = Partition::new(numels[u], plan.world_size).shard as f64 * elem;
        let uses = order.iter().filter(|(v, _)| *v == u).count() as f64;
        read += shard * if persistent(u) { 1.0 } else { uses * micro_batches };
        written += shard;
    }
    (read, written)
}

/// The step's lower bound: the slowest of compute, PCIe each way with the layout's
/// minimal traffic, the NVMe optimizer's minimal traffic (with the parameter writes the
/// same thread makes), the parameter reads of the h2d lane, and the CPU optimizer.
fn bound(plan: &Plan, profile: &Profile, compute_s: f64, [h2d, d2h]: [f64; 2]) -> (String, f64) {
    let params = plan.model.config.num_parameters() as f64;
    let per_rank = params / plan.world_size as f64;
    let gb = 1e9;
    let mut candidates = vec![("compute".to_string(), compute_s)];
    if h2d + d2h > 0.0 {
        candidates.push((
            "PCIe h2d".into(),
            h2d * per_rank / (profile.copies.h2d_pinned.value * gb),
        ));
        candidates.push((
            "PCIe d2h".into(),
            d2h * per_rank / (profile.copies.d2h_pinned.value * gb),
        ));
    }
    if let Some((link_s, _)) = link(plan, profile) {
        candidates.push(("the link".into(), link_s));
    }
    let [cpu, nvme] = optimizer_resources(plan, profile);
    candidates.extend(cpu.map(|s| ("CPU optimizer".to_string(), s)));
    candidates.extend(nvme.map(|s| ("NVMe".to_string(), s)));
    let (param_reads, _) = nvme_param_bytes(plan);
    let ranks_per_host = plan.train.devices as f64;
    let (read_gb_s, _) = profile.nvme.rates_for(nvme_bytes(plan));
    if param_reads > 0.0 {
        // the h2d lane: each use of a unit on NVMe reads its shard
        candidates.push((
            "NVMe parameter reads".into(),
            param_reads * ranks_per_host / (read_gb_s * gb),
        ));
    }
    candidates
        .into_iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or(("compute".into(), compute_s))
}

/// The link's seconds a step with minimal traffic, and those of its one gather of the
/// model (stage 3), where there are several ranks: a ring moves (W-1)/W of each buffer;
/// at stages 2–3 every micro-batch reduce-scatters each gradient (a rank keeps only its
/// shard's sum; a layered step, each unit's sum once) and stage 3 gathers each unit at
/// least once a step; stages 0–1
/// all-reduce the step's fp32 gradients once (twice a buffer's traffic).
fn link(plan: &Plan, profile: &Profile) -> Option<(f64, f64)> {
    if plan.world_size < 2 {
        return None;
    }
    let w = plan.world_size as f64;
    let ring = (w - 1.0) / w * plan.model.config.num_parameters() as f64;
    // a layered step reduces each unit's sum once (`train.layered_accumulation`)
    let micro_batches = crate::plan::rules::passes(plan) as f64;
    let wire = plan.communication.kind().elt_size_in_bytes() as f64;
    let gather = if plan.zero.stage == 3 {
        plan.precision.bytes() as f64 * ring
    } else {
        0.0
    };
    let bytes = match plan.zero.stage {
        0 | 1 => 2.0 * 4.0 * ring,
        _ => micro_batches * wire * ring + gather,
    };
    let rate = profile.link.bus_gb_s.value * 1e9;
    Some((bytes / rate, gather / rate))
}

/// The optimizer's own resources at their profiled rates, for the state off the device:
/// the CPU AdamW (a machine's ranks share its cores), and the NVMe traffic of the
/// optimizer thread (master and both moments read and written once, the new parameters
/// of units on NVMe written; a machine's ranks share its disk). None where it has none.
fn optimizer_resources(plan: &Plan, profile: &Profile) -> [Option<f64>; 2] {
    let per_rank = plan.model.config.num_parameters() as f64 / plan.world_size as f64;
    let ranks_per_host = plan.train.devices as f64;
    let gb = 1e9;
    // the share of the parameters whose optimizer state is off the device, and on NVMe
    let tiers = crate::plan::rules::optimizer_tiers(plan);
    let numels = plan.model.config.unit_numels();
    let share = |tier: &dyn Fn(Tier) -> bool| {
        let of: usize = numels
            .iter()
            .zip(&tiers)
            .filter(|(_, &t)| tier(t))
            .map(|(n, _)| n)
            .sum();
        of as f64 / numels.iter().sum::<usize>().max(1) as f64
    };
    let off_device = share(&|t| t != Tier::Device);
    let cpu = (off_device > 0.0)
        .then(|| off_device * per_rank * ranks_per_host / profile.cpu_adam.params_per_s.value);
    let on_nvme = share(&|t| t == Tier::Nvme);
    let (_, param_writes) = nvme_param_bytes(plan);
    let (read_gb_s, write_gb_s) = profile.nvme.rates_for(nvme_bytes(plan));
    let nvme = (on_nvme > 0.0 || param_writes > 0.0).then(|| {
        let state = 12.0 * on_nvme * per_rank * ranks_per_host;
        let written = state + param_writes * ranks_per_host;
        state / (read_gb_s * gb) + written / (write_gb_s * gb)
    });
    [cpu, nvme]
}

/// The step's floor where no update starts before the step's last backward has ended
/// (the gradient norm, which clipping needs; the engine waits for it, as DeepSpeed
/// does): the micro-batches at the slowest of compute and the link, then the optimizer
/// at the slowest of its own resources. Only the next step's first micro-batch can run
/// beside the optimizer, unit by unit as each is updated, so the micro-batches' part
/// leaves out the compute of its forward (`one_forward`: every piece the compute track
/// runs there, installs and replicas' gathers with the units' forward) and one gather of
/// the model of the link; the optimizer's part leaves out the state read ahead during
/// the backward (`ahead_bytes`). None where no optimizer state is off the device.
/// Returns what it is made of, and its seconds.
fn floor(
    plan: &Plan,
    profile: &Profile,
    compute_s: f64,
    (one_forward, ahead_bytes): (f64, u64),
) -> Option<(String, f64)> {
    let [cpu, nvme] = optimizer_resources(plan, profile);
    // none without optimizer state off the device
    cpu?;
    // the read-ahead of every rank of a machine, on its one disk
    let (read_gb_s, _) = profile.nvme.rates_for(nvme_bytes(plan));
    let ahead_s = ahead_bytes as f64 * plan.train.devices as f64 / (read_gb_s * 1e9);
    let nvme = nvme.map(|s| s - ahead_s);
    let (what, optimizer_s) = [("the CPU optimizer", cpu), ("the NVMe optimizer", nvme)]
        .into_iter()
        .filter_map(|(what, s)| Some((what, s?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    let compute = (
        format!(
            "compute {compute_s:.3} s less {} {one_forward:.3} s",
            if plan.train.layered_accumulation {
                "the layered forward"
            } else {
                "one micro-batch's forward"
            }
        ),
        compute_s - one_forward,
    );
    let link = link(plan, profile).map(|(link_s, gather_s)| {
        (
            format!("the link {link_s:.3} s less one gather of the model {gather_s:.3} s"),
            link_s - gather_s,
        )
    });
    let (before, before_s) = match link {
        Some(link) if link.1 > compute.1 => link,
        _ => compute,
    };
    Some((
        format!("{before}, then {what} {optimizer_s:.3} s"),
        before_s + optimizer_s,
    ))
}

impl Simulation {
    /// The table `plan --simulate` prints.
    pub fn human(&self, plan: &Plan) -> String {
        let mut out = String::new();
        let line = |out: &mut String, k: &str, v: String| out.push_str(&format!("  {k:<28} {v}\n"));
        let ranks = if plan.world_size == 1 {
            "1 rank".to_string()
        } else {
            format!("{} ranks", plan.world_size)
        };
        out.push_str(&format!(
            "simulated step on {} (dry run, {ranks}, {}, micro-batch {} × {} tokens × accumulation {})\n",
            self.profile,
            plan.precision.name(),
            plan.batch.micro_batch_per_gpu,
            plan.data.seq_len,
            plan.batch.gradient_accumulation_steps
        ));
        for choice in &plan.auto {
            line(&mut out, choice.key, format!("{} ({})", choice.value, choice.why));
        }
        line(&mut out, "step time", format!("{:.3} s", self.step_s));
        line(
            &mut out,
            "tokens/s",
            format!(
                "{:.0} ({} tokens per step)",
                self.tokens_per_s, self.tokens_per_step
            ),
        );
        line(&mut out, "MFU", format!("{:.1}%", 100.0 * self.mfu));
        line(
            &mut out,
            "bound",
            format!(
                "{} at {:.3} s: step ÷ bound {:.2}",
                self.bound,
                self.bound_s,
                self.step_s / self.bound_s.max(1e-12)
            ),
        );
        if let Some((what, floor_s)) = &self.floor {
            line(
                &mut out,
                "floor, no update before norm",
                format!(
                    "{floor_s:.3} s ({what}): step ÷ floor {:.2}",
                    self.step_s / floor_s.max(1e-12)
                ),
            );
        }
        line(&mut out, "critical path", self.critical.clone());
        line(
            &mut out,
            "PCIe bytes per parameter",
            format!(
                "{:.1} h2d + {:.1} d2h = {:.1} per step (layout minimum {:.1})",
                self.pcie_bytes_per_param[0],
                self.pcie_bytes_per_param[1],
                self.pcie_bytes_per_param[0] + self.pcie_bytes_per_param[1],
                self.pcie_minimum_per_param
            ),
        );
        line(
            &mut out,
            "device peak per rank",
            format!("{:.2} GiB", self.device_peak_bytes as f64 / (1u64 << 30) as f64),
        );
        line(
            &mut out,
            "host peak per process",
            format!("{:.2} GiB", self.host_peak_bytes as f64 / (1u64 << 30) as f64),
        );
        out.push_str("  track          busy s   busy %  compute waited s      GB\n");
        for t in &self.tracks {
            out.push_str(&format!(
                "  {:<12} {:>8.3} {:>7.0}% {:>17.3} {:>7.2}\n",
                t.track.name(),
                t.busy_s,
                100.0 * t.busy_s / self.step_s,
                t.compute_waited_s.max(0.0),
                t.bytes as f64 / 1e9
            ));
        }
        out
    }

    /// The step's spans as a Chrome trace (chrome://tracing, Perfetto), one track per lane,
    /// in virtual microseconds from the reported step's start.
    pub fn chrome_trace(&self) -> serde_json::Value {
        let events: Vec<serde_json::Value> = self
            .clocks
            .spans()
            .iter()
            .filter(|s| s.end > self.step_start && s.start < self.step_start + self.step_s)
            .map(|s| {
                let name = match (s.waited_for, s.unit) {
                    (Some(on), _) => format!("wait {}", on.name()),
                    (None, Some(u)) => format!("{} {u}", s.what),
                    (None, None) => s.what.to_string(),
                };
                serde_json::json!({
                    "name": name, "ph": "X", "pid": 0, "tid": s.track.name(),
                    "ts": (s.start - self.step_start) * 1e6, "dur": (s.end - s.start) * 1e6,
                    "args": {"bytes": s.bytes},
                })
            })
            .collect();
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}
