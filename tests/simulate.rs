//! The simulated step (`plan --simulate`): the replay's counts follow the engine's
//! schedule (PCIe bytes per parameter, gathers hidden by prefetch), its bytes per phase
//! are the real engine's, and a dry run of the largest shipped config takes a moment.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use tierzero::plan::simulate::clock::Track;
use tierzero::plan::simulate::profile::Profile;
use tierzero::plan::simulate::{simulate, simulate_as_the_device, Simulation};
use tierzero::plan::Plan;
use tierzero::run::{train, TrainOptions};

/// Optimizer state on the device, parameters in host memory: the update's new values
/// leave the device (a layout both simulation tests run).
const STATE_ON_DEVICE_PARAMS_IN_HOST: &[&str] = &[
    "train.accumulate_on_device=true",
    "zero_optimization.offload_optimizer.device=none",
    "zero_optimization.offload_param.device=cpu",
];

/// The same with the parameters in pinned host memory.
const STATE_ON_DEVICE_PARAMS_PINNED: &[&str] = &[
    "train.accumulate_on_device=true",
    "zero_optimization.offload_optimizer.device=none",
    "zero_optimization.offload_param.device=cpu",
    "zero_optimization.offload_param.pin_memory=true",
];

fn plan_on(config: &str, sets: &[&str], profile: &Profile) -> Plan {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(config);
    tierzero::plan::load(&path, &sets, profile.facts()).unwrap().plan
}

fn waited_for(sim: &Simulation, track: Track) -> f64 {
    sim.tracks
        .iter()
        .find(|t| t.track == track)
        .map_or(0.0, |t| t.compute_waited_s)
}

/// llama-1b on one GPU with parameters and optimizer in host memory (bf16, 8
/// micro-batches), with `train.keep_gathered` off: every unit but the final one crosses
/// h2d twice per micro-batch (forward and backward: nothing is kept), the final unit once and the tied embedding a third time
/// (for the LM head), in bf16: 2·2·8 = 32 bytes in per parameter, ± those shares. The
/// gradients accumulate on the device over the micro-batches and leave it once per step,
/// in fp32: 4 bytes out. The layout's minimum is 2 bytes in and 4 out: an fp32 sum of
/// several micro-batches' gradients cannot cross in bf16 without being rounded.
#[test]
fn pcie_bytes_per_parameter_follow_the_engines_schedule() {
    let profile = Profile::load("h100-pcie5").unwrap();
    let plan = plan_on(
        "llama-1b-1gpu-cpu.json",
        &[
            "train.keep_gathered=false",
            "train.shards_on_device=false",
            "zero_optimization.stage3_max_reuse_distance=0",
        ],
        &profile,
    );
    assert_eq!(plan.precision.name(), "bf16");
    let sim = simulate(&plan, &profile);
    let config = &plan.model.config;
    let units = config.unit_numels();
    let share = |u: usize| units[u] as f64 / config.num_parameters() as f64;
    assert!(config.tie_word_embeddings);
    let expected_in = 32.0 * (1.0 - share(units.len() - 1) / 2.0 + share(0) / 2.0);
    let [h2d, d2h] = sim.pcie_bytes_per_param;
    assert!(
        (h2d - expected_in).abs() < 0.5,
        "h2d {h2d} per parameter, expected {expected_in}"
    );
    let expected_out = 4.0;
    assert!(
        (d2h - expected_out).abs() < 0.5,
        "d2h {d2h} per parameter, expected {expected_out}"
    );
    // bf16 parameters in, and the fp32 sum of 8 micro-batches' gradients out
    assert!(
        (sim.pcie_minimum_per_param - 6.0).abs() < 1e-9,
        "{}",
        sim.pcie_minimum_per_param
    );
    // DeepSpeed's default reuse distance (1e9 elements): the embedding and the blocks
    // within the distance of the head keep their forward gather for the backward
    let reused = plan_on(
        "llama-1b-1gpu-cpu.json",
        &["train.keep_gathered=false", "train.shards_on_device=false"],
        &profile,
    );
    let [reused_h2d, _] = simulate(&reused, &profile).pcie_bytes_per_param;
    assert!(
        reused_h2d < h2d - 8.0 && reused_h2d >= 16.0,
        "{reused_h2d} with reuse, {h2d} without"
    );
    assert!(sim.mfu > 0.0 && sim.mfu < 1.0, "{}", sim.mfu);
    // as shipped, the GPU's memory keeps every unit gathered for the step: each crosses
    // once, after its update
    let kept = plan_on("llama-1b-1gpu-cpu.json", &[], &profile);
    assert!(kept.zero.param_persistence_threshold >= config.unit_numels().into_iter().max().unwrap());
    let [h2d, d2h] = simulate(&kept, &profile).pcie_bytes_per_param;
    assert!(
        (h2d - 2.0).abs() < 0.01 && (d2h - 4.0).abs() < 0.01,
        "{h2d} + {d2h}"
    );
}

/// A prefetch bucket that holds the next units lets gathers run ahead of compute; a
/// bucket of 0 (DeepSpeed's "no prefetch") makes compute wait for every gather.
#[test]
fn prefetch_hides_gathers_that_no_prefetch_exposes() {
    let profile = Profile::load("h100-pcie5").unwrap();
    let run = |bucket: &str| {
        let set = format!("zero_optimization.stage3_prefetch_bucket_size={bucket}");
        // every unit fetched for each use (kept gathered, none would be fetched again)
        let sets = [set.as_str(), "train.keep_gathered=false"];
        simulate(&plan_on("llama-13b-2gpu-cpu.json", &sets, &profile), &profile)
    };
    let (ahead, none) = (run("auto"), run("0"));
    assert!(
        waited_for(&ahead, Track::Collectives) < waited_for(&none, Track::Collectives),
        "prefetch: compute waited {} s for the collectives lane, without: {} s",
        waited_for(&ahead, Track::Collectives),
        waited_for(&none, Track::Collectives)
    );
    assert!(ahead.step_s < none.step_s);
}

/// A profile measured over several ranks times each piece at the pace they keep meeting
/// after every run (the slowest of them each time) and at a rank's own rate
/// (`own_flops_per_s`). A run's ranks meet at collectives only, not after each piece:
/// compute is priced at the own rate, so a profile whose own rates are higher prices
/// less compute and a shorter step. One rank's pace is its own.
#[test]
fn compute_over_several_ranks_is_priced_at_a_ranks_own_rate() {
    let gpu = Profile::load("h100-pcie5").unwrap();
    let mut own = gpu.clone();
    for rate in &mut own.compute.rates {
        rate.own_flops_per_s = Some(1.25 * rate.flops_per_s);
    }
    let phase = |s: &Simulation, name: &str| s.phases.get(name).copied().unwrap_or(0.0);
    let two = plan_on("llama-13b-2gpu-cpu.json", &[], &gpu);
    let (paced, fast) = (simulate(&two, &gpu), simulate(&two, &own));
    for compute in ["forward", "backward"] {
        assert!(phase(&fast, compute) < phase(&paced, compute), "{compute}");
    }
    assert!(fast.step_s < paced.step_s);
    let one = plan_on("llama-1b-1gpu-cpu.json", &[], &gpu);
    assert_eq!(simulate(&one, &own).step_s, simulate(&one, &gpu).step_s);
}

/// `plan --simulate` on the 70B config over 8 GPUs: a whole step replayed without a GPU,
/// its figures finite, its trace a track per lane.
#[test]
fn a_dry_run_of_llama_70b_on_eight_gpus() {
    let profile = Profile::load("h100-pcie5").unwrap();
    let plan = plan_on("llama-70b-8gpu-nvme.json", &[], &profile);
    assert_eq!(plan.world_size, 8);
    let sim = simulate(&plan, &profile);
    assert!(sim.step_s.is_finite() && sim.step_s > 0.0);
    assert!(sim.mfu > 0.0 && sim.mfu < 1.0);
    assert!(
        sim.bound_s > 0.0 && sim.bound_s <= sim.step_s * 1.0001,
        "{} > {}",
        sim.bound_s,
        sim.step_s
    );
    let trace = sim.chrome_trace();
    let tracks: std::collections::BTreeSet<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["tid"].as_str())
        .collect();
    for t in ["compute", "collectives", "optimizer"] {
        assert!(tracks.contains(t), "{t} missing from {tracks:?}");
    }
    // the config's layered step holds every micro-batch's checkpoints, which take the
    // room of some units' shards (`train.shards_on_device` "auto"); micro-batch by
    // micro-batch every unit's shard fits the GPUs beside the rest, and only the update
    // crosses to the device, once a step, in bf16, but each unit is gathered for every
    // micro-batch both ways: a slower step
    assert!(plan.train.layered_accumulation);
    let units = plan.model.config.unit_numels().len();
    assert!(plan.zero.offload_param.device_units < units);
    let major = plan_on(
        "llama-70b-8gpu-nvme.json",
        &["train.layered_accumulation=false"],
        &profile,
    );
    assert_eq!(major.zero.offload_param.device_units, units);
    let major_sim = simulate(&major, &profile);
    assert!(
        (major_sim.pcie_bytes_per_param[0] - 2.0).abs() < 0.01,
        "{:?}",
        major_sim.pcie_bytes_per_param
    );
    assert!(
        sim.step_s < major_sim.step_s,
        "{} against {}",
        sim.step_s,
        major_sim.step_s
    );
    let json: Value = serde_json::to_value(&sim).unwrap();
    assert!(json["phases"]["forward"].as_f64().unwrap() > 0.0);
}

/// The floor `plan --simulate` prints where optimizer state is off the device (no update
/// before the step's last backward has ended: the micro-batches, then the optimizer,
/// beside at most the next step's first micro-batch) is one no replayed step goes
/// under, on the shipped configs; with every unit's state on the GPU there is none.
#[test]
fn no_step_goes_under_its_floor() {
    let profile = Profile::load("h100-pcie5").unwrap();
    // and at stages 1-2 with the parameters on the GPU, where the first forward's
    // compute track installs each update and (over 2 ranks) gathers the replica
    let replicas: &[&str] = &[
        "zero_optimization.stage=1",
        "zero_optimization.offload_param.device=none",
    ];
    let halves: &[&str] = &[
        "zero_optimization.stage=2",
        "zero_optimization.offload_param.device=none",
    ];
    for (config, sets) in [
        ("llama-1b-1gpu-cpu.json", &[][..]),
        ("llama-8b-1gpu-nvme.json", &[]),
        ("llama-13b-2gpu-cpu.json", &[]),
        ("llama-70b-8gpu-nvme.json", &[]),
        ("llama-1b-1gpu-cpu.json", replicas),
        ("llama-13b-2gpu-cpu.json", replicas),
        ("llama-13b-2gpu-cpu.json", halves),
    ] {
        let sim = simulate(&plan_on(config, sets, &profile), &profile);
        let (what, floor_s) = sim.floor.clone().unwrap();
        assert!(
            floor_s > 0.0 && floor_s <= sim.step_s * 1.0001,
            "{config} {sets:?}: floor {floor_s} ({what}), step {}",
            sim.step_s
        );
    }
    let sets = ["zero_optimization.offload_optimizer.device=none"];
    let plan = plan_on("llama-1b-1gpu-cpu.json", &sets, &profile);
    assert_eq!(simulate(&plan, &profile).floor, None);
}

/// The replay moves the bytes the engine moves: per phase of the breakdown (gathers,
/// reductions, copies each way, NVMe reads and writes), the simulated step's bytes equal
/// the real run's in a steady step, for the default config and variants that change the
/// schedule (stage, tiers, precision, persistent and kept units, reduction chunks,
/// micro-batches, sums on the device, ranks, parameters split between host memory and
/// NVMe). Bytes do not depend on the profile's rates, so a shipped profile run as a CPU serves; the times are checked
/// against real runs by `scripts/sim_check.sh` (README), not here.
#[test]
fn the_replay_moves_the_bytes_the_engine_moves() {
    const PARAM_NVME: &str = "(the parameters' NVMe directory)";
    let mut profile = Profile::load("h100-pcie5").unwrap();
    profile.device = "cpu".into();
    let variants: [&[&str]; 19] = [
        &["bf16.enabled=true"],
        &["zero_optimization.stage3_param_persistence_threshold=100000"],
        &["zero_optimization.overlap_comm=false", "train.devices=1"],
        &[],
        &["zero_optimization.stage=2"],
        &["zero_optimization.stage=1"],
        &[
            "zero_optimization.stage=0",
            "zero_optimization.offload_optimizer.device=none",
        ],
        &["zero_optimization.offload_param.device=cpu"],
        &[
            "zero_optimization.offload_param.device=nvme",
            "zero_optimization.offload_param.max_in_cpu=0",
            PARAM_NVME,
        ],
        // the embedding and the first block in host memory, the rest on NVMe
        &[
            "zero_optimization.offload_param.device=nvme",
            "zero_optimization.offload_param.max_in_cpu=62592",
            PARAM_NVME,
        ],
        &["zero_optimization.offload_optimizer.device=none"],
        &["zero_optimization.reduce_bucket_size=20000"],
        &["gradient_accumulation_steps=2", "train.devices=4"],
        &["gradient_accumulation_steps=3", "train.accumulate_on_device=true"],
        &[
            "gradient_accumulation_steps=2",
            "train.keep_gathered=true",
            "train.accumulate_on_device=true",
        ],
        &[
            "gradient_accumulation_steps=2",
            "train.accumulate_on_device=true",
            "train.devices=1",
        ],
        // gradients that stay on the device: none of them crosses
        &[
            "train.accumulate_on_device=true",
            "zero_optimization.offload_optimizer.device=none",
        ],
        // and with the parameters in host memory, their new values do (into pinned
        // memory as well)
        STATE_ON_DEVICE_PARAMS_IN_HOST,
        STATE_ON_DEVICE_PARAMS_PINNED,
    ];
    let params = tempfile::tempdir().unwrap();
    let param_nvme = format!(
        "zero_optimization.offload_param.nvme_path={}",
        params.path().display()
    );
    for (i, sets) in variants.iter().enumerate() {
        let mut all = vec!["train.steps=3"];
        all.extend(
            sets.iter()
                .map(|&s| if s == PARAM_NVME { param_nvme.as_str() } else { s }),
        );
        let (_dir, plan) = crate::default_run::default_config(&format!("simulate-bytes-{i}"), &all);
        let sim = simulate(&plan, &profile);
        // the optimizer inside its step (beside the next step, its last sub-groups may
        // end in either step's window); a steady step moves the same bytes either way
        let options = TrainOptions {
            blocking_optimizer: true,
            ..TrainOptions::default()
        };
        let result = train(&plan, options).unwrap();
        let real: BTreeMap<&str, u64> = result.steps[2]
            .breakdown
            .bytes
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(p, b)| (p.name(), *b))
            .collect();
        let simulated: BTreeMap<&str, u64> = sim.phase_bytes.iter().map(|(p, b)| (*p, *b)).collect();
        assert_eq!(
            simulated, real,
            "{sets:?}: simulated bytes per phase, then the real run's"
        );
    }
}

/// The simulated device (`device/sim.rs`) runs the engine itself on CPU tensors with its
/// real math, its streams keeping virtual clocks priced by a profile: the losses are the
/// CPU run's bit for bit (checked lanes on), and its steady step is the dry-run replay's
/// prediction for the same plan and profile, since both price the same pieces of work
/// with the same rates (`plan/simulate/costs.rs`) and follow the same schedule: the
/// replay by its own account of it, the simulated device by running it. (The replay is
/// taken with a disk per track, as the device's streams keep them; the dry run shares
/// one between the tracks.)
#[test]
fn the_simulated_device_trains_the_cpu_runs_bits_on_the_replays_clock() {
    use tierzero::device::lanes::Mode;
    use tierzero::engine::context::LaneOptions;
    use tierzero::engine::prefetch::DroppedWait;
    let checked = LaneOptions {
        mode: Mode::Checked {
            seed: 3,
            max_delay_us: 200,
        },
        dropped: DroppedWait::None,
    };
    // each rank's own compute a fifth faster than the ranks' pace, which prices compute
    // on the device's streams as in the replay
    let mut gpu = Profile::load("h100-pcie5").unwrap();
    for rate in &mut gpu.compute.rates {
        rate.own_flops_per_s = Some(1.25 * rate.flops_per_s);
    }
    let mut cpu = gpu.clone();
    cpu.device = "cpu".into();
    let variants: [&[&str]; 32] = [
        &[],
        &[
            "zero_optimization.stage=0",
            "zero_optimization.offload_optimizer.device=none",
        ],
        &["zero_optimization.stage=1"],
        &[
            "zero_optimization.offload_param.device=nvme",
            "zero_optimization.offload_param.max_in_cpu=62592",
            "(the parameters' NVMe directory)",
        ],
        // in chunks of 8192 elements: each rank's parameter read takes its turn at the
        // disk whole, the optimizer's sub-groups one by one
        &[
            "zero_optimization.offload_param.device=nvme",
            "zero_optimization.offload_param.max_in_cpu=62592",
            "(the parameters' NVMe directory)",
            "zero_optimization.sub_group_size=8192",
        ],
        &["bf16.enabled=true"],
        // the NVMe optimizer's pipeline: reads ahead and writes behind, or writes only
        &[
            "zero_optimization.offload_optimizer.pipeline_read=true",
            "zero_optimization.offload_optimizer.pipeline_write=true",
        ],
        // ten buffer sets, the gradients' sums held on the device (none in the swap
        // store): the backward reads the first ten sub-groups ahead, across units, kept
        // through the runs before theirs (`rules::read_ahead_sets`)
        &[
            "zero_optimization.offload_optimizer.pipeline_read=true",
            "zero_optimization.offload_optimizer.pipeline_write=true",
            "zero_optimization.offload_optimizer.buffer_count=30",
            "gradient_accumulation_steps=2",
            "train.accumulate_on_device=true",
        ],
        &[
            "zero_optimization.offload_optimizer.pipeline_write=true",
            "bf16.enabled=true",
        ],
        &["zero_optimization.stage=2"],
        &["zero_optimization.offload_param.device=cpu"],
        &[
            "zero_optimization.offload_param.device=cpu",
            "train.shards_on_device=true",
        ],
        &["zero_optimization.offload_optimizer.device=none"],
        &["gradient_accumulation_steps=3", "train.accumulate_on_device=true"],
        &[
            "gradient_accumulation_steps=2",
            "train.accumulate_on_device=true",
            "zero_optimization.offload_optimizer.device=none",
        ],
        // one micro-batch: the gradients of device-tier state stay on the device
        &[
            "train.accumulate_on_device=true",
            "zero_optimization.offload_optimizer.device=none",
        ],
        // stages 0-1: the replica's sum all-reduced on the device
        &[
            "train.accumulate_on_device=true",
            "zero_optimization.stage=0",
            "zero_optimization.offload_optimizer.device=none",
        ],
        &[
            "gradient_accumulation_steps=2",
            "train.accumulate_on_device=true",
            "zero_optimization.stage=1",
            "zero_optimization.offload_optimizer.device=none",
        ],
        // units kept gathered with their state and shard on the device, the rest off it
        &[
            "zero_optimization.offload_param.device=cpu",
            "zero_optimization.offload_optimizer.ratio=0.5",
            "train.keep_gathered=true",
            "train.shards_on_device=true",
        ],
        // device-tier state, parameters in host memory: the new values go out (into
        // pinned memory as well, from which the shards are copied in place)
        STATE_ON_DEVICE_PARAMS_IN_HOST,
        STATE_ON_DEVICE_PARAMS_PINNED,
        &[
            "zero_optimization.offload_param.device=cpu",
            "zero_optimization.offload_param.pin_memory=true",
        ],
        &[
            "gradient_accumulation_steps=2",
            "train.keep_gathered=true",
            "train.accumulate_on_device=true",
        ],
        &["gradient_accumulation_steps=2", "train.devices=4"],
        &["zero_optimization.stage=1", "train.devices=1"],
        // sums held on the device for the host optimizer, the next unit's copy beside
        // each update
        &[
            "gradient_accumulation_steps=3",
            "train.accumulate_on_device=true",
            "zero_optimization.offload_optimizer.device=cpu",
        ],
        // one rank, shards on the device: each the whole unit, used where it is stored
        &["train.devices=1"],
        // units kept gathered whose shard would be on NVMe keep it on the device: the
        // NVMe optimizer's new values copied there through the thread's two buffers
        &[
            "zero_optimization.offload_param.device=nvme",
            "zero_optimization.offload_param.max_in_cpu=0",
            "(the parameters' NVMe directory)",
            "train.keep_gathered=true",
            "train.shards_on_device=true",
        ],
        // half the units' state on the device: no copy queued beside their updates
        &[
            "gradient_accumulation_steps=2",
            "train.accumulate_on_device=true",
            "zero_optimization.offload_optimizer.device=cpu",
            "zero_optimization.offload_optimizer.ratio=0.5",
        ],
        // the micro-batches unit by unit: each unit fetched once each way a step, its
        // gradient summed on the device and reduced once
        &["gradient_accumulation_steps=3", "train.layered_accumulation=true"],
        &[
            "gradient_accumulation_steps=2",
            "train.layered_accumulation=true",
            "train.accumulate_on_device=true",
            "zero_optimization.offload_optimizer.device=cpu",
        ],
        // one rank in bf16: the fp32 sum leaves the device as it is, 4 bytes an element
        &[
            "bf16.enabled=true",
            "train.devices=1",
            "gradient_accumulation_steps=2",
            "train.layered_accumulation=true",
            "zero_optimization.offload_param.device=cpu",
        ],
    ];
    let mut gaps = Vec::new();
    for (i, sets) in variants.iter().enumerate() {
        let params = tempfile::tempdir().unwrap();
        let param_nvme = format!(
            "zero_optimization.offload_param.nvme_path={}",
            params.path().display()
        );
        let mut all = vec!["train.steps=4"];
        all.extend(sets.iter().map(|&s| {
            if s.starts_with('(') {
                param_nvme.as_str()
            } else {
                s
            }
        }));
        let (_dir, plan) = crate::default_run::default_config(&format!("simulated-device-{i}"), &all);
        let plain = train(
            &plan,
            TrainOptions {
                lanes: Some(checked),
                collect_master: true,
                ..TrainOptions::default()
            },
        )
        .unwrap();
        for profile in [&gpu, &cpu] {
            let simulated = train(
                &plan,
                TrainOptions {
                    lanes: Some(checked),
                    collect_master: true,
                    simulate: Some(profile),
                    ..TrainOptions::default()
                },
            )
            .unwrap();
            let losses = |r: &tierzero::run::TrainResult| -> Vec<u64> {
                r.steps.iter().map(|s| s.loss.to_bits()).collect()
            };
            assert_eq!(
                losses(&simulated),
                losses(&plain),
                "{sets:?}: losses on the simulated device"
            );
            assert_eq!(
                simulated.master, plain.master,
                "{sets:?}: master weights on the simulated device"
            );
            let device = simulated.steps[3].simulated.as_ref().unwrap().step_seconds;
            let replay = simulate_as_the_device(&plan, profile).step_s;
            gaps.push((sets.to_vec(), profile.device.clone(), device / replay - 1.0));
        }
    }
    for (sets, device, gap) in &gaps {
        eprintln!("{device:>4} {:+.3}%  {sets:?}", 100.0 * gap);
    }
    for (sets, device, gap) in &gaps {
        assert!(
            gap.abs() < 1e-6,
            "{sets:?} on {device}: the simulated device's step {:+.4}% from the replay's",
            100.0 * gap
        );
    }
}

/// The dry run's tracks share the rank's disk (`disk::Disk`): a track's NVMe transfers go
/// one at a time, the h2d lane's parameter reads meet the optimizer's transfers and share
/// the disk with them (where two meet, the one placed second is slower than alone), and
/// sharing it makes the step of
/// `llama-8b-1gpu-nvme` (parameters and optimizer state on NVMe) longer than with a disk
/// per track, as the simulated device keeps them. The sums accumulate on the host here,
/// so the last micro-batch's gradients go to the disk during the backward, beside the
/// parameter reads (held on the device, they would not touch it; nor would the
/// parameters, with their shards kept on the device).
#[test]
fn every_nvme_transfer_of_a_rank_shares_one_disk() {
    // without latencies a transfer's span is its time on the disk (with them, the disk
    // serves the next during a transfer's latency: `disk.rs`'s tests)
    let mut profile = Profile::load("h100-pcie5").unwrap();
    profile.nvme.latency = None;
    let plan = plan_on(
        "llama-8b-1gpu-nvme.json",
        &["train.accumulate_on_device=false", "train.shards_on_device=false"],
        &profile,
    );
    assert!(tierzero::plan::rules::stored_gradients(&plan).contains(&true));
    let shared = simulate(&plan, &profile);
    let own = simulate_as_the_device(&plan, &profile);
    let transfers = |sim: &Simulation| -> Vec<(f64, f64, Track, u64, &'static str)> {
        let mut spans: Vec<_> = sim
            .clocks
            .spans()
            .iter()
            .filter(|s| s.waited_for.is_none() && s.bytes > 0)
            .filter(|s| s.what == "nvme_read" || s.what == "nvme_write")
            .map(|s| (s.start, s.end, s.track, s.bytes, s.what))
            .collect();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        spans
    };
    let disk = transfers(&shared);
    assert!(disk.iter().any(|t| t.2 == Track::H2d) && disk.iter().any(|t| t.2 == Track::Optimizer));
    for track in Track::ALL {
        let own: Vec<_> = disk.iter().filter(|t| t.2 == track).collect();
        for w in own.windows(2) {
            assert!(
                w[0].1 <= w[1].0 + 1e-9,
                "{track:?}: {:?} and {:?} at once",
                w[0],
                w[1]
            );
        }
    }
    // where a parameter read and the optimizer's transfers meet, one of them moves at
    // part of the disk's rate: whichever came second shares the disk with the other
    // one rank, one rate for every file size: each transfer's rate alone
    assert!(profile.nvme.by_file_size.is_empty() && plan.train.devices == 1);
    let (read, write) = (profile.nvme.read_gb_s.value, profile.nvme.write_gb_s.value);
    let slower = |t: &(f64, f64, Track, u64, &str)| {
        let alone = if t.4 == "nvme_read" { read } else { write };
        (t.3 as f64 / (t.1 - t.0) / 1e9) < alone * (1.0 - 1e-6)
    };
    let met: Vec<_> = disk
        .iter()
        .filter(|r| r.2 == Track::H2d)
        .flat_map(|r| {
            disk.iter()
                .filter(move |o| {
                    // at once for more than rounding
                    let both = r.1.min(o.1) - r.0.max(o.0);
                    o.2 == Track::Optimizer && both > 1e-6 * (r.1 - r.0).min(o.1 - o.0)
                })
                .map(move |o| (r, o))
        })
        .collect();
    assert!(!met.is_empty());
    let apart = met.iter().filter(|(r, o)| !slower(r) && !slower(o)).count();
    assert_eq!(apart, 0, "of {} meetings", met.len());
    // a disk per track lets the h2d lane read beside the optimizer's transfers
    assert!(transfers(&own).windows(2).any(|w| w[0].1 > w[1].0 + 1e-9));
    assert!(
        shared.step_s > own.step_s,
        "shared {} s, a disk per track {} s",
        shared.step_s,
        own.step_s
    );
}

/// The optimizer thread's updates of one step and the next forward's parameter reads
/// take the rank's disk in the order they are submitted: the forward's read of a unit
/// follows that unit's update, and the updates of the units after it follow the read,
/// so the forward runs beside the optimizer, as it does on the machine (where all the
/// updates went first, the forward waited for the last of them).
#[test]
fn the_next_forward_reads_its_parameters_between_the_updates() {
    let profile = Profile::load("h100-pcie5").unwrap();
    let plan = plan_on(
        "llama-8b-1gpu-nvme.json",
        &["train.accumulate_on_device=false", "train.shards_on_device=false"],
        &profile,
    );
    let sim = simulate(&plan, &profile);
    let window = sim.step_start..sim.step_start + sim.step_s;
    let last = plan.model.config.unit_numels().len() - 1;
    let in_window = |s: &&tierzero::plan::simulate::clock::Span| window.contains(&s.start);
    let spans = sim.clocks.spans();
    // the last unit's update of the step before, which ends in this step's forward
    let last_update = spans
        .iter()
        .filter(in_window)
        .filter(|s| s.track == Track::Optimizer && s.what == "optimizer" && s.unit == Some(last))
        .map(|s| s.end)
        .fold(f64::NAN, f64::max);
    let first_read = spans
        .iter()
        .filter(in_window)
        .filter(|s| s.track == Track::H2d && s.what == "nvme_read" && s.unit == Some(1))
        .map(|s| s.start)
        .fold(f64::NAN, f64::min);
    assert!(
        first_read < last_update,
        "unit 1's parameters read at {first_read} s, the last update ends at {last_update} s"
    );
}
