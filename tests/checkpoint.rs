//! Checkpoints: resume equals the uninterrupted run (bit for bit on the same world size
//! in fp32; within fp32 tolerance on other world sizes), every tier combination;
//! damaged checkpoints are refused naming the file; export loads back identically.

use serde_json::json;
use std::path::{Path, PathBuf};
use tierzero::checkpoint::{save, Checkpoint, CheckpointError};
use tierzero::model::hf;
use tierzero::plan::{from_json, DeviceFacts, Plan, Tier};
use tierzero::run::{train, TrainError, TrainOptions, TrainResult};

/// A plan whose global batch (micro 1 × world × accumulation = 6) is the same on 1, 2 and 3 ranks.
fn plan(world: usize, stage: u8, param: &str, optimizer: &str, steps: u64, dir: &Path) -> Plan {
    plan_with(world, stage, param, optimizer, steps, dir, &|_| {})
}

/// `plan` with `edit` applied to its ds_config first.
fn plan_with(
    world: usize,
    stage: u8,
    param: &str,
    optimizer: &str,
    steps: u64,
    dir: &Path,
    edit: &dyn Fn(&mut serde_json::Value),
) -> Plan {
    let mut zero = json!({
        "stage": stage,
        "sub_group_size": 1000,
        "stage3_param_persistence_threshold": 0,
        "offload_param": { "device": param },
        "offload_optimizer": { "device": optimizer, "buffer_count": 2 }
    });
    if param == "nvme" {
        zero["offload_param"]["nvme_path"] = json!(dir.join("nvme-params"));
        zero["offload_param"]["max_in_cpu"] = json!(0);
    }
    if optimizer == "nvme" {
        zero["offload_optimizer"]["nvme_path"] = json!(dir.join("nvme-optimizer"));
    }
    let config = json!({
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 6 / world,
        "gradient_clipping": 0.5,
        "optimizer": { "type": "AdamW", "params": { "lr": 1e-2, "weight_decay": 0.1 } },
        "scheduler": { "type": "WarmupLR", "params": { "warmup_num_steps": 3, "warmup_max_lr": 1e-2 } },
        "zero_optimization": zero,
        "model": { "preset": "llama-tiny", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96 },
        "data": { "synthetic": "addition", "seq_len": 16 },
        "train": { "steps": steps, "devices": world, "seed": 11, "save_interval": 2, "keep_last": 5, "output_dir": dir.join("out") }
    });
    let mut config = config;
    edit(&mut config);
    from_json(config, &[], DeviceFacts::default()).unwrap().plan
}

fn run(plan: &Plan, resume: Option<&Path>) -> TrainResult {
    try_run(plan, resume).unwrap()
}

fn try_run(plan: &Plan, resume: Option<&Path>) -> Result<TrainResult, TrainError> {
    train(
        plan,
        TrainOptions {
            collect_master: true,
            save_checkpoints: true,
            resume,
            ..TrainOptions::default()
        },
    )
}

fn step_dir(plan: &Plan, step: u64) -> PathBuf {
    save::root(&plan.train.output_dir).join(format!("step-{step}"))
}

/// Largest |a − b| over the units, relative to the largest |b| of each unit (shared
/// with the PyTorch reference test).
pub(crate) fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// Every stage, and at stage 3 every layout the shipped configs use (default.json:
/// none/nvme; llama-8b-8gpu-cpu: none/cpu; the others cpu/cpu and nvme/nvme).
const TIERS: &[(u8, &str, &str)] = &[
    (0, "none", "none"),
    (1, "none", "cpu"),
    (2, "none", "nvme"),
    (3, "none", "cpu"),
    (3, "none", "nvme"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
];

/// The resumed run's steps are the uninterrupted run's from `from` on, bit for bit
/// (loss, rate, loss scale, skipped), and it ends with the same master weights.
fn assert_resumed_bit_exact(full: &TrainResult, resumed: &TrainResult, from: usize, what: &str) {
    assert_eq!(resumed.steps.len(), full.steps.len() - from, "{what}");
    for (a, b) in full.steps[from..].iter().zip(&resumed.steps) {
        assert_eq!(a.step, b.step, "{what}");
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}: step {} loss", a.step);
        assert_eq!(
            (a.lr, a.loss_scale, a.skipped),
            (b.lr, b.loss_scale, b.skipped),
            "{what}: step {}",
            a.step
        );
    }
    assert_eq!(full.master, resumed.master, "{what}: final master weights");
}

#[test]
fn resume_on_the_same_world_size_is_bit_exact() {
    for &(stage, param, optimizer) in TIERS {
        let tmp = tempfile::tempdir().unwrap();
        let whole = plan(2, stage, param, optimizer, 4, tmp.path());
        let full = run(&whole, None);
        let resumed_plan = plan(2, stage, param, optimizer, 4, &tmp.path().join("again"));
        let resumed = run(&resumed_plan, Some(&step_dir(&whole, 2)));
        let what = format!("stage {stage} param {param} optimizer {optimizer}");
        assert_resumed_bit_exact(&full, &resumed, 2, &what);
        // both runs end with the same step-4 checkpoint, byte for byte
        for name in ["master", "exp_avg", "exp_avg_sq", "param"] {
            let file = format!("{name}.safetensors");
            let a = std::fs::read(step_dir(&whole, 4).join(&file)).unwrap();
            let b = std::fs::read(step_dir(&resumed_plan, 4).join(&file)).unwrap();
            assert!(a == b, "{what}: {file} differs");
        }
    }
}

/// Resume in fp16 and bf16 on every tier, with persistent units at stage 3: bit for
/// bit the uninterrupted run, loss scale and skipped steps included. fp16 resumes from
/// every step, so the loss scaler is saved in each of its states: mid-window before a
/// growth, with its hysteresis half spent, right after a backoff.
#[test]
fn resume_in_fp16_and_bf16_and_with_persistent_units_is_bit_exact() {
    let fp16 = json!({ "enabled": true, "initial_scale_power": 17, "hysteresis": 2, "loss_scale_window": 2 });
    let bf16 = json!({ "enabled": true });
    let mut scales_seen = Vec::new();
    for (precision, settings, resume_from) in [("fp16", fp16, 1..=5), ("bf16", bf16, 2..=2)] {
        for &(stage, param, optimizer) in TIERS {
            let persistent = stage == 3;
            let edit = |config: &mut serde_json::Value| {
                config[precision] = settings.clone();
                // the scaler pattern below was found with gradients reduced in fp32
                config["communication_data_type"] = json!("fp32");
                if persistent {
                    // the embedding (96·32) and the final unit stay gathered
                    config["zero_optimization"]["stage3_param_persistence_threshold"] = json!(4000);
                }
            };
            let tmp = tempfile::tempdir().unwrap();
            let mut whole = plan_with(2, stage, param, optimizer, 6, tmp.path(), &edit);
            (whole.train.save_interval, whole.train.keep_last) = (1, 10);
            let full = run(&whole, None);
            for from in resume_from.clone() {
                let what = format!(
                    "{precision} stage {stage} param {param} optimizer {optimizer} persistent {persistent}, from step {from}"
                );
                let dir = tmp.path().join(format!("from-{from}"));
                let again = plan_with(2, stage, param, optimizer, 6, &dir, &edit);
                let resumed = run(&again, Some(&step_dir(&whole, from)));
                assert_resumed_bit_exact(&full, &resumed, from as usize, &what);
            }
            if precision == "fp16" {
                scales_seen.push(
                    full.steps
                        .iter()
                        .map(|s| (s.skipped, s.loss_scale))
                        .collect::<Vec<_>>(),
                );
            }
        }
    }
    // the scaler passes through the states above: a growth, skipped steps, a backoff
    let pattern = &scales_seen[0];
    assert!(
        pattern.windows(2).any(|w| w[1].1 > w[0].1),
        "a growth: {pattern:?}"
    );
    assert!(pattern.iter().any(|s| s.0), "skipped steps: {pattern:?}");
    assert!(
        pattern.windows(2).any(|w| w[1].1 < w[0].1),
        "a backoff: {pattern:?}"
    );
}

#[test]
fn resume_on_other_world_sizes_matches_the_uninterrupted_run() {
    for &(stage, param, optimizer) in TIERS {
        let tmp = tempfile::tempdir().unwrap();
        let what = format!("stage {stage} param {param} optimizer {optimizer}");
        let whole = plan(2, stage, param, optimizer, 6, tmp.path());
        let full = run(&whole, None);
        // 2 ranks → 3 ranks from step 2 → 1 rank from step 4
        let three = plan(3, stage, param, optimizer, 4, &tmp.path().join("three"));
        let middle = run(&three, Some(&step_dir(&whole, 2)));
        let one = plan(1, stage, param, optimizer, 6, &tmp.path().join("one"));
        let last = run(&one, Some(&step_dir(&three, 4)));
        let losses: Vec<f64> = middle.steps.iter().chain(&last.steps).map(|s| s.loss).collect();
        // tolerances at the measured gap (losses ≤ 1.2e-8, master weights ≤ 4.0e-7
        // relative: other worlds sum gradients in another order) with room for another
        // CPU's kernels; a lost moment or weight decay moves them by ~1e-3
        for (a, b) in full.steps[2..].iter().zip(&losses) {
            assert!(
                (a.loss - b).abs() <= 1e-7 * a.loss.abs(),
                "{what}: step {}: {} vs {b}",
                a.step,
                a.loss
            );
        }
        let diff = max_rel_diff(&last.master, &full.master);
        assert!(diff <= 2e-6, "{what}: master weights differ by {diff:e} relative");
    }
}

#[test]
fn saves_keep_the_last_n_and_point_latest_at_the_newest() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = plan(2, 3, "none", "cpu", 9, tmp.path());
    p.train.keep_last = 2;
    run(&p, None);
    let root = save::root(&p.train.output_dir);
    let steps: Vec<u64> = save::list(&root).into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, vec![8, 9], "save_interval 2 and the final step, two kept");
    assert_eq!(save::follow_latest(&root).unwrap(), root.join("step-9"));
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "leftovers: {names:?}");
    let checkpoint = Checkpoint::open(&root).unwrap();
    assert_eq!(checkpoint.manifest.step, 9);
    checkpoint.verify().unwrap();
    let human = checkpoint.manifest.human();
    assert!(human.contains("world size at save    2"), "{human}");
}

fn expect_corrupt(result: Result<impl Sized, CheckpointError>, file: &str, words: &str) {
    match result {
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains(file) && text.contains(words),
                "error {text:?} should name {file} and say {words:?}"
            );
        }
        Ok(_) => panic!("damaged checkpoint accepted ({file}: {words})"),
    }
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(2, 3, "none", "cpu", 2, tmp.path());
    run(&p, None);
    let good = step_dir(&p, 2);
    let copy = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
        dir
    };
    // a flipped byte in the data: found by the slice checksum, on verify and on resume
    let flipped = copy("flipped");
    let path = flipped.join("exp_avg.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    expect_corrupt(
        Checkpoint::open(&flipped).unwrap().verify(),
        "exp_avg.safetensors",
        "checksum",
    );
    let err = try_run(
        &plan(2, 3, "none", "cpu", 4, &tmp.path().join("r1")),
        Some(&flipped),
    )
    .err();
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("exp_avg.safetensors") && text.contains("checksum"),
        "{text}"
    );
    // a flipped byte in a header
    let header = copy("header");
    let path = header.join("master.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[20] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    expect_corrupt(Checkpoint::open(&header), "master.safetensors", "header");
    // truncated
    let truncated = copy("truncated");
    let path = truncated.join("param.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 4)
        .unwrap();
    expect_corrupt(Checkpoint::open(&truncated), "param.safetensors", "truncated");
    // deleted
    let deleted = copy("deleted");
    std::fs::remove_file(deleted.join("exp_avg_sq.safetensors")).unwrap();
    expect_corrupt(Checkpoint::open(&deleted), "exp_avg_sq.safetensors", "missing");
    std::fs::remove_file(deleted.join("manifest.json")).unwrap();
    expect_corrupt(Checkpoint::open(&deleted), "manifest.json", "missing");
    // an edited manifest
    let edited = copy("edited");
    let path = edited.join("manifest.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replacen("\"step\": 2", "\"step\": 3", 1);
    std::fs::write(&path, text).unwrap();
    expect_corrupt(Checkpoint::open(&edited), "manifest.json", "checksum");
    // a newer format version
    let newer = copy("newer");
    let path = newer.join("manifest.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replacen("\"version\": 1", "\"version\": 3", 1);
    std::fs::write(&path, text).unwrap();
    expect_corrupt(Checkpoint::open(&newer), "newer", "format version 3");
    // another model
    let mut other = plan(2, 3, "none", "cpu", 4, &tmp.path().join("r2"));
    other.model.config.hidden_size = 64;
    other.model.config.intermediate_size = 128;
    let err = try_run(&other, Some(&good))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("different model") && err.contains("hidden_size"),
        "{err}"
    );
}

#[test]
fn export_loads_back_with_identical_weights_and_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(2, 3, "nvme", "nvme", 2, tmp.path());
    let result = run(&p, None);
    let out = tmp.path().join("hf");
    let report =
        tierzero::checkpoint::export::export(&step_dir(&p, 2), &out, hf::SaveDtype::F32, 20_000).unwrap();
    assert_eq!(report.step, 2);
    assert!(
        out.join("model.safetensors.index.json").exists(),
        "small shards: an index"
    );
    let config = tierzero::config::model::ModelConfig::from_hf_dir(&out).unwrap();
    assert_eq!(config, p.model.config);
    let loaded = hf::load(&out, &config).unwrap();
    assert_eq!(loaded, result.master, "exported weights");
    // a rank that reads after another let go of the mapped pages reads the same bytes
    let weights = hf::HfWeights::open(&out, &config).unwrap();
    let mut again = vec![0f32; loaded[1].len()];
    weights.release_pages();
    weights.read(1, 0..again.len(), &mut again).unwrap();
    assert_eq!(again, loaded[1], "read after release_pages");
    let model = tierzero::model::Model::new(config, tch::Kind::Float);
    let (a, loss_a) = crate::hf_reference::logits(&model, &loaded);
    let (b, loss_b) = crate::hf_reference::logits(&model, &result.master);
    assert!(a.equal(&b), "logits differ");
    assert_eq!(loss_a, loss_b);
    // training from the exported directory starts from exactly these weights, each of
    // 3 stage-3 ranks reading only its shard
    let config = json!({
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": { "stage": 3 },
        "model": { "hf_dir": out },
        "data": { "synthetic": "addition", "seq_len": 16 },
        "train": { "steps": 0, "devices": 3 }
    });
    let pretrained = from_json(config, &[], DeviceFacts::default()).unwrap().plan;
    let start = train(
        &pretrained,
        TrainOptions {
            collect_master: true,
            ..TrainOptions::default()
        },
    )
    .unwrap();
    assert_eq!(start.master, result.master, "weights a run starts from");
}

/// `stage3_gather_16bit_weights_on_model_save`: every checkpoint carries the model in its
/// training precision as a Hugging Face directory, equal to exporting the checkpoint.
#[test]
fn gathered_16bit_model_is_saved_inside_each_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = plan(2, 3, "cpu", "cpu", 4, tmp.path());
    p.precision = tierzero::plan::Precision::Bf16;
    p.zero.gather_16bit_weights_on_model_save = true;
    run(&p, None);
    for step in [2, 4] {
        let dir = step_dir(&p, step);
        let hf_dir = dir.join("hf");
        assert!(!dir.join(".hf.tmp").exists());
        let config = tierzero::config::model::ModelConfig::from_hf_dir(&hf_dir).unwrap();
        let saved = hf::load(&hf_dir, &config).unwrap();
        let out = tmp.path().join(format!("export-{step}"));
        tierzero::checkpoint::export::export(&dir, &out, hf::SaveDtype::Bf16, 5_000_000_000).unwrap();
        assert_eq!(saved, hf::load(&out, &config).unwrap(), "step {step}");
        let text = std::fs::read_to_string(hf_dir.join("config.json")).unwrap();
        assert!(text.contains("bfloat16"), "{text}");
        // the checkpoint itself still verifies with the extra directory inside
        tierzero::checkpoint::Checkpoint::open(&dir)
            .unwrap()
            .verify()
            .unwrap();
    }
    // an export a crash interrupted (its temporary directory inside a published
    // checkpoint) is removed by the next save
    let partial = step_dir(&p, 4).join(".hf.tmp");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("model.safetensors"), b"half").unwrap();
    let mut longer = p.clone();
    longer.train.steps = 6;
    run(&longer, Some(&step_dir(&p, 4)));
    assert!(!partial.exists());
    assert!(step_dir(&p, 6).join("hf").join("config.json").exists());
}

/// A run of 2 ranks × micro-batch 3 resumed on 3 ranks × micro-batch 2 (the same global
/// batch of 6) follows the uninterrupted run within fp32 rounding: samples are keyed by
/// their index in the global batch, not by micro-batch.
#[test]
fn resume_with_another_micro_batch_split_matches_the_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let split = |world: usize, micro: usize, steps: u64, dir: &Path| {
        let mut p = plan(world, 3, "none", "cpu", steps, dir);
        p.batch.micro_batch_per_gpu = micro;
        p.batch.gradient_accumulation_steps = 1;
        p
    };
    let whole = split(2, 3, 6, tmp.path());
    let full = run(&whole, None);
    let three = split(3, 2, 6, &tmp.path().join("three"));
    let resumed = run(&three, Some(&step_dir(&whole, 2)));
    assert_eq!((full.steps.len(), resumed.steps.len()), (6, 4));
    // measured: losses within 1.2e-8, master weights 2.3e-7 relative
    for (a, b) in full.steps[2..].iter().zip(&resumed.steps) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-7 * a.loss.abs(),
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    let diff = max_rel_diff(&resumed.master, &full.master);
    assert!(diff <= 2e-6, "master weights differ by {diff:e} relative");
}

/// A run whose parameters all live on NVMe resumes with `offload_param.max_in_cpu`
/// keeping its first units in host memory, and the other way round: bit for bit the
/// uninterrupted run (checkpoints do not record where state lived).
#[test]
fn resume_across_parameter_placements_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let placed = |dir: &Path, max_in_cpu: usize| {
        let mut plan = plan(2, 3, "nvme", "nvme", 4, dir);
        plan.zero.offload_param.max_in_cpu = max_in_cpu;
        plan
    };
    let numels = placed(tmp.path(), 0).model.config.unit_numels();
    let mixed = numels[0] + numels[1];
    for (saved, resumed) in [(0, mixed), (mixed, 0)] {
        let dir = tmp.path().join(format!("from-{saved}"));
        let whole = placed(&dir, saved);
        let full = run(&whole, None);
        let again = placed(&dir.join("again"), resumed);
        let tiers = tierzero::plan::rules::param_tiers(&again);
        assert!(tiers.contains(&Tier::Cpu) || tiers.iter().all(|t| *t == Tier::Nvme));
        let what = format!("saved with max_in_cpu {saved}, resumed with {resumed}");
        assert_resumed_bit_exact(&full, &run(&again, Some(&step_dir(&whole, 2))), 2, &what);
    }
}

/// A run whose optimizer state is all on NVMe resumes with its first units' state in host
/// memory (`train.optimizer_max_in_cpu`), and the other way round, bit for bit:
/// checkpoints do not record the placement. (A unit on the device, DeepSpeed's partial
/// offload, updates with torch's fused AdamW instead of the CPU kernel: the same state,
/// other roundings; `a_mixed_optimizer_placement_trains_the_bits_of_one_tier` covers it.)
#[test]
fn resume_across_optimizer_placements_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let placed = |dir: &Path, spread: bool| {
        let mut plan = plan(2, 3, "cpu", "nvme", 4, dir);
        if spread {
            let numels = plan.model.config.unit_numels();
            plan.zero.offload_optimizer.max_in_cpu = numels[0] + numels[1];
        }
        plan
    };
    for (saved, resumed) in [(false, true), (true, false)] {
        let dir = tmp.path().join(format!("from-{saved}"));
        let whole = placed(&dir, saved);
        let full = run(&whole, None);
        let again = placed(&dir.join("again"), resumed);
        let tiers =
            tierzero::plan::rules::optimizer_tiers(&if saved { whole.clone() } else { again.clone() });
        assert_eq!(&tiers[..3], &[Tier::Cpu, Tier::Cpu, Tier::Nvme]);
        let what = format!("saved spread {saved}, resumed spread {resumed}");
        assert_resumed_bit_exact(&full, &run(&again, Some(&step_dir(&whole, 2))), 2, &what);
    }
}

/// A run's final save takes its NVMe swap files into the checkpoint as they are (renamed:
/// no second copy of the state on NVMe): the manifest places those slices in
/// `nvme/<store>/r<rank>.<state>.swp`, the state files leave them as holes, and the
/// checkpoint reads — every byte verified — exactly as the same step saved mid-run by
/// copying, and resumes the run bit for bit. The run's swap directories are left empty.
#[test]
fn the_final_save_takes_the_swap_files_without_a_copy() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    // optimizer state on NVMe past the first unit, parameters on NVMe
    let placed = |dir: &Path, steps: u64| {
        let mut plan = plan(2, 3, "nvme", "nvme", steps, dir);
        plan.zero.offload_optimizer.max_in_cpu = plan.model.config.unit_numels()[0];
        plan
    };
    let long = placed(&tmp.path().join("long"), 4);
    let full = run(&long, None);
    let short = placed(&tmp.path().join("short"), 2);
    run(&short, None);
    let (copied, taken) = (step_dir(&long, 2), step_dir(&short, 2));
    let copied = Checkpoint::open(&copied).unwrap();
    let taken = Checkpoint::open(&taken).unwrap();
    taken.verify().unwrap();
    let placed_files: Vec<_> = taken
        .manifest
        .files
        .iter()
        .map(|f| (f.state.clone(), f.placed.len()))
        .collect();
    assert!(copied.manifest.files.iter().all(|f| f.placed.is_empty()));
    for (state, n) in &placed_files {
        // parameters: every unit on NVMe; optimizer state: every unit but the first;
        // each of both ranks' slices
        let units = taken.manifest.units.len();
        let expected = if state == "param" {
            2 * units
        } else {
            2 * (units - 1)
        };
        assert_eq!(*n, expected, "{state}: {placed_files:?}");
    }
    for state in ["master", "exp_avg", "exp_avg_sq"] {
        assert!(taken.dir.join(format!("nvme/optimizer/r1.{state}.swp")).is_file());
    }
    assert!(taken.dir.join("nvme/params/r0.param.swp").is_file());
    let master = std::fs::metadata(taken.dir.join("master.safetensors")).unwrap();
    assert!(
        master.blocks() * 512 < master.len(),
        "the placed slices are holes"
    );
    for state in tierzero_offload::nvme::swap::State::ALL {
        for (u, unit) in taken.manifest.units.iter().enumerate() {
            assert_eq!(
                taken.read(state, u, 0..unit.numel).unwrap(),
                copied.read(state, u, 0..unit.numel).unwrap(),
                "{state:?} unit {u}"
            );
        }
    }
    for store in ["nvme-optimizer/tierzero-optimizer", "nvme-params/tierzero-params"] {
        let left = tmp.path().join("short").join(store);
        assert!(
            !left.exists() || std::fs::read_dir(&left).unwrap().next().is_none(),
            "{store}"
        );
    }
    let again = placed(&tmp.path().join("again"), 4);
    assert_resumed_bit_exact(
        &full,
        &run(&again, Some(&step_dir(&short, 2))),
        2,
        "from the taken files",
    );
}
