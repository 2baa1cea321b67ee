//! Device memory: the plan's prediction against libtorch's own allocator (counted by the
//! bridge where tensors are made, in a process of its own), the engine's reservations
//! against the replay of its schedule, stage-3 memory shrinking with the number of
//! ranks, and the out-of-memory error.

use serde_json::json;
use tierzero::metrics::timeline::Phase;
use tierzero::plan::memory::predict;
use tierzero::plan::{from_json, DeviceFacts, Plan};
use tierzero::run::{train, TrainError, TrainOptions};

fn plan(world: usize, stage: u8, optimizer: &str, extra: &[&str]) -> Plan {
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "bf16": { "enabled": true },
        "zero_optimization": { "stage": stage, "offload_optimizer": { "device": optimizer } },
        "model": { "preset": "gpt2-tiny" },
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": 2, "devices": world }
    });
    let sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    from_json(config, &sets, DeviceFacts::default()).unwrap().plan
}

/// The engine's own reservation counter follows the predicted reservations (a check of
/// the schedule's replay, not of memory: `prediction_matches_libtorchs_allocator` is).
#[test]
fn the_engines_reservations_follow_the_prediction() {
    for world in [1, 2, 3] {
        for stage in 0..=3u8 {
            for optimizer in ["none", "cpu"] {
                if stage == 0 && optimizer == "cpu" {
                    continue;
                }
                // gradient sums on the device (stages 2–3, several micro-batches) are
                // reserved, and so are the gradients of device-tier state kept there (with
                // two ranks)
                let sums: &[&str] = if stage >= 2 && optimizer == "cpu" {
                    &["gradient_accumulation_steps=2", "train.accumulate_on_device=true"]
                } else if world == 2 && optimizer == "none" {
                    &["train.accumulate_on_device=true"]
                } else {
                    &[]
                };
                let sets: Vec<&str> = ["model.tie_word_embeddings=true"]
                    .iter()
                    .chain(sums)
                    .copied()
                    .collect();
                let p = plan(world, stage, optimizer, &sets);
                let predicted = predict(&p).reserved() as f64;
                let result = train(&p, TrainOptions::default()).unwrap();
                for (rank, &peak) in result.device_peaks.iter().enumerate() {
                    let error = (peak as f64 - predicted).abs() / predicted;
                    assert!(error <= 0.10, "world {world} stage {stage} {optimizer} {sums:?} rank {rank}: measured {peak}, predicted {predicted}");
                }
            }
        }
    }
}

/// Stage 3 with prefetching: no unit kept gathered, and buckets from one unit ahead to
/// everything ahead; the prediction replays the prefetcher's schedule.
#[test]
fn stage3_prefetch_memory_is_predicted() {
    for bucket in ["1", "120000", "50000000"] {
        for world in [1, 2, 3] {
            let sets = [
                "zero_optimization.stage3_param_persistence_threshold=0".to_string(),
                format!("zero_optimization.stage3_prefetch_bucket_size={bucket}"),
                "gradient_accumulation_steps=2".to_string(),
            ];
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let p = plan(world, 3, "none", &sets);
            let predicted = predict(&p).reserved() as f64;
            let result = train(&p, TrainOptions::default()).unwrap();
            for (rank, &peak) in result.device_peaks.iter().enumerate() {
                let error = (peak as f64 - predicted).abs() / predicted;
                assert!(
                    error <= 0.10,
                    "bucket {bucket} world {world} rank {rank}: measured {peak}, predicted {predicted}"
                );
            }
        }
    }
}

/// `stage3_max_live_parameters` caps what is gathered at once (in use plus prefetched):
/// the peak falls with it, the prediction follows, and the training math does not change.
#[test]
fn max_live_parameters_caps_the_gathered_units() {
    let mut peaks = Vec::new();
    let mut losses = Vec::new();
    // gpt2-tiny's units hold ~50k elements: 1e9 lets both fetches in flight through
    // (at most two are, as DeepSpeed bounds them), 120000 and 1 only the next unit's
    for max_live in ["1000000000", "120000", "1"] {
        let sets = [
            "zero_optimization.stage3_param_persistence_threshold=0".to_string(),
            // the prefetcher alone: no unit held for its backward
            "zero_optimization.stage3_max_reuse_distance=0".to_string(),
            "zero_optimization.stage3_prefetch_bucket_size=50000000".to_string(),
            format!("zero_optimization.stage3_max_live_parameters={max_live}"),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let p = plan(2, 3, "none", &sets);
        let predicted = predict(&p).reserved() as f64;
        let result = train(&p, TrainOptions::default()).unwrap();
        let peak = *result.device_peaks.iter().max().unwrap();
        let error = (peak as f64 - predicted).abs() / predicted;
        assert!(
            error <= 0.10,
            "max_live {max_live}: measured {peak}, predicted {predicted}"
        );
        peaks.push(peak);
        losses.push(result.steps.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>());
    }
    assert!(peaks[0] > peaks[1] && peaks[1] >= peaks[2], "{peaks:?}");
    assert!(losses.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn stage3_memory_per_rank_shrinks_with_the_world_size() {
    let peaks: Vec<u64> = (1..=4)
        .map(|world| {
            *train(&plan(world, 3, "none", &[]), TrainOptions::default())
                .unwrap()
                .device_peaks
                .iter()
                .max()
                .unwrap()
        })
        .collect();
    for pair in peaks.windows(2) {
        assert!(pair[1] < pair[0], "{peaks:?}");
    }
    // model states divide by N; activations do not: 4 ranks need well under half of 1
    assert!((peaks[3] as f64) < 0.5 * peaks[0] as f64, "{peaks:?}");
}

#[test]
fn over_budget_is_an_out_of_memory_error_naming_the_rank_request_and_budget() {
    let p = plan(2, 3, "none", &["train.device_memory=200000"]);
    match train(&p, TrainOptions::default()) {
        Err(TrainError::Engine(e)) => {
            let text = e.to_string();
            assert!(
                text.contains("out of device memory") && text.contains("of 200000 bytes"),
                "{text}"
            );
            assert!(text.starts_with("rank "), "{text}");
        }
        other => panic!("expected out of memory, got {:?}", other.map(|r| r.device_peaks)),
    }
}

/// A stage-3 run of 2 ranks with nothing persistent and `sets`, its device peak within
/// 10% of the prediction; returns the peak and the run.
fn stage3_within_prediction(sets: &[&str]) -> (u64, tierzero::run::TrainResult) {
    let sets: Vec<&str> = ["zero_optimization.stage3_param_persistence_threshold=0"]
        .into_iter()
        .chain(sets.iter().copied())
        .collect();
    let p = plan(2, 3, "none", &sets);
    let predicted = predict(&p).reserved() as f64;
    let result = train(&p, TrainOptions::default()).unwrap();
    let peak = *result.device_peaks.iter().max().unwrap();
    assert!(
        (peak as f64 - predicted).abs() / predicted <= 0.10,
        "{sets:?}: measured {peak}, predicted {predicted}"
    );
    (peak, result)
}

/// `stage3_prefetch_bucket_size: 0` (DeepSpeed: no prefetch) gathers each unit only when
/// compute needs it: the peak is the lowest of all buckets, within the prediction, and
/// the losses are the prefetching run's bits.
#[test]
fn a_zero_prefetch_bucket_gathers_only_what_compute_needs() {
    let run = |bucket: &str| {
        let set = format!("zero_optimization.stage3_prefetch_bucket_size={bucket}");
        let (peak, result) =
            stage3_within_prediction(&["zero_optimization.stage3_max_reuse_distance=0", &set]);
        (
            peak,
            result.steps.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>(),
        )
    };
    let (none, none_losses) = run("0");
    let (ahead, ahead_losses) = run("50000000");
    assert!(none < ahead, "no prefetch {none} vs prefetch {ahead}");
    assert_eq!(none_losses, ahead_losses);
}

/// `stage3_max_reuse_distance` (DeepSpeed's meaning): after its forward a unit stays
/// gathered for its backward when the elements gathered between are fewer than the
/// distance, so it is not gathered again; the peak holds those units as predicted, and
/// the losses are the bits of a run that gathers every use.
#[test]
fn units_reused_within_the_distance_are_not_gathered_again() {
    let run = |distance: &str| {
        let set = format!("zero_optimization.stage3_max_reuse_distance={distance}");
        let (_, result) = stage3_within_prediction(&[&set]);
        let gathered: u64 = result
            .steps
            .iter()
            .flat_map(|m| &m.breakdown.bytes)
            .filter(|(phase, _)| *phase == Phase::AllGather)
            .map(|(_, bytes)| bytes)
            .sum();
        let losses: Vec<u64> = result.steps.iter().map(|m| m.loss.to_bits()).collect();
        (gathered, losses)
    };
    let config = plan(2, 3, "none", &[]).model.config;
    let numels = config.unit_numels();
    let last = numels.len() - 1;
    // the unit before the final one: only the final unit (and a tied embedding) is
    // gathered between its uses
    let between = numels[last] + if config.tie_word_embeddings { numels[0] } else { 0 };
    let one = between.to_string();
    // (each run's peak is checked against its prediction: held units take the place of
    // units fetched ahead, so the peaks need not rise with the distance)
    let (every_gathered, every_losses) = run("0");
    let (some_gathered, some_losses) = run(&(between + 1).to_string());
    let (all_gathered, all_losses) = run("1000000000");
    assert!(
        every_gathered > some_gathered && some_gathered > all_gathered && all_gathered > 0,
        "{every_gathered} {some_gathered} {all_gathered}"
    );
    assert_eq!(
        run(&one).0,
        every_gathered,
        "a distance of exactly the final unit keeps none"
    );
    assert_eq!(every_losses, some_losses);
    assert_eq!(every_losses, all_losses);
}

/// `tierzero train` in a process of its own (the bridge's allocator counts the whole
/// process): libtorch's CPU allocator peak over the steps, and the plan's prediction
/// of what torch tensors hold (all ranks of the process).
fn allocator_peak(sets: &[&str]) -> (u64, u64) {
    let tmp = tempfile::tempdir().unwrap();
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "bf16": { "enabled": true },
        "zero_optimization": { "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "offload_optimizer": { "device": "cpu" } },
        "model": { "preset": "llama-tiny" },
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": 3, "devices": 1, "output_dir": tmp.path().join("out"), "keep_activations": false }
    });
    let path = tmp.path().join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"));
    command.arg("train").arg("-c").arg(&path);
    for set in sets {
        command.args(["--set", set]);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{sets:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("out/summary.json")).unwrap()).unwrap();
    let predicted = &summary["device_bytes_predicted"];
    let ranks = summary["device_bytes_measured_peak"].as_array().unwrap().len() as u64;
    let compute: u64 = ["parameters", "working", "transient", "optimizer"]
        .iter()
        .map(|k| predicted[k].as_u64().unwrap())
        .sum();
    (summary["cpu_allocator_peak"].as_u64().unwrap(), ranks * compute)
}

/// The prediction of what torch tensors hold (the parameters stored on the device,
/// gathered units, kept activations, the compute temporaries — a block's recompute and
/// backward, the head's logits chunk and fp32 weight gradient, the embedding's gradient
/// — and device-tier optimizer state) against the bytes libtorch's allocator held. The
/// runs keep the optimizer state on the host (`cpu`) except two, so the compute's share
/// is measured on its own, and recompute in backward except two. Measured gap over this grid: −7.2% to +3.8% (before the
/// parameters were device tensors, over a wider grid — GPT-2 and Llama, stages 0–3, 1–2
/// ranks, batch 2–8, sequence 32–256, fp32, tied, a 32000-word vocabulary, a head in two
/// vocabulary slices — −11% to +15%); tolerance 15% (20% below), as the moment of the peak depends
/// on the lanes' timing (one config measured 757 KB and 837 KB in two runs). Without the
/// temporaries the prediction was 61–96% low.
#[test]
fn prediction_matches_libtorchs_allocator() {
    let cases: &[&[&str]] = &[
        &["model.preset=gpt2-tiny", "zero_optimization.stage=1"],
        &[
            "model.preset=gpt2-tiny",
            "data.seq_len=256",
            "train_micro_batch_size_per_gpu=8",
        ],
        // on one rank: two ranks of one process reach their peaks at moments that drift
        // apart under load (measured 2.6-3.3 MB against 3.7 predicted for both at stage 2
        // once the LM head's peak fell with its 16-bit products); two ranks below
        &["zero_optimization.stage=2", "data.seq_len=128"],
        // kept activations (a graph per block, no recompute), on one rank, likewise
        &[
            "zero_optimization.stage=2",
            "train.keep_activations=true",
            "data.seq_len=128",
        ],
        &[
            "zero_optimization.stage=1",
            "train.keep_activations=true",
            "model.preset=gpt2-tiny",
        ],
        &["train.devices=2", "data.seq_len=128"],
        &[
            "bf16.enabled=false",
            "data.seq_len=256",
            "train_micro_batch_size_per_gpu=8",
        ],
        &["model.tie_word_embeddings=true", "data.seq_len=128"],
        &["model.vocab_size=32000"],
        // the optimizer state as tensors on the device (the default tier)
        &["zero_optimization.offload_optimizer.device=none"],
        &[
            "zero_optimization.offload_optimizer.device=none",
            "zero_optimization.stage=0",
        ],
        // a layered step: every micro-batch's checkpoints and gradients flowing back at
        // once, and the fp32 sums
        &[
            "gradient_accumulation_steps=4",
            "train.layered_accumulation=true",
            "data.seq_len=128",
        ],
    ];
    for sets in cases {
        let (measured, predicted) = allocator_peak(sets);
        let gap = measured as f64 / predicted as f64 - 1.0;
        println!(
            "{sets:?}: libtorch peak {measured}, predicted {predicted} ({:+.1}%)",
            100.0 * gap
        );
        // two ranks of one process: the prediction is both at their peaks at once, which
        // they reach only when their steps run in step (measured −8% to −20% under load)
        // (on an Intel Xeon with AMX, where oneDNN takes the 16-bit products, every case
        // held less than predicted: −1.2% to −16.6%, the least the smallest model's)
        let below = if sets.contains(&"train.devices=2") {
            0.3
        } else {
            0.2
        };
        assert!(
            (-below..=0.15).contains(&gap),
            "{sets:?}: libtorch held {measured} bytes at its peak, predicted {predicted}"
        );
    }
}

/// A larger prefetch bucket gathers more units ahead: libtorch's peak rises with it, as
/// the prediction does. (The parameters are in host memory: with one rank, shards on the
/// device are used where they are, never fetched.)
#[test]
fn the_allocator_peak_rises_with_the_prefetch_bucket() {
    let run = |bucket: &str| {
        // four blocks of 0.26 M parameters: a unit gathered ahead is ~0.5 MB, well
        // above the run-to-run spread of the peak
        allocator_peak(&[
            &format!("zero_optimization.stage3_prefetch_bucket_size={bucket}"),
            "zero_optimization.offload_param.device=cpu",
            "gradient_accumulation_steps=2",
            "model.hidden_size=128",
            "model.intermediate_size=512",
            "model.num_hidden_layers=4",
        ])
    };
    let (small, small_predicted) = run("1");
    let (large, large_predicted) = run("50000000");
    println!(
        "bucket 1: {small} (predicted {small_predicted}); bucket 5e7: {large} (predicted {large_predicted})"
    );
    assert!(
        large > small,
        "bucket 5e7 peaked at {large} bytes, bucket 1 at {small}"
    );
    assert!(large_predicted > small_predicted);
}

/// A plan on 2 GPUs of `memory` bytes each (None: unknown), with accumulation 2.
fn gpu_plan(memory: Option<u64>, zero: serde_json::Value, model: serde_json::Value, sets: &[&str]) -> Plan {
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": { "enabled": true },
        "zero_optimization": zero,
        "model": model,
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": 2, "devices": 2, "accelerator": "cuda" }
    });
    let facts = DeviceFacts {
        cuda_bf16: true,
        cpu_bf16: false,
        cuda_devices: 2,
        cuda_memory: memory,
        host_memory: None,
    };
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    from_json(config, &sets, facts).unwrap().plan
}

/// Gradient accumulation keeps its sums on the device (4 bytes per partition element in
/// the device row): on a GPU where its memory has room for them, not where it has not;
/// on a CPU (whose device memory is the host's, where the accumulators are) only when
/// `train.accumulate_on_device` asks.
#[test]
fn device_sums_of_gradient_accumulation_fit_the_gpu_or_stay_on_the_host() {
    use tierzero::plan::rules::device_accumulation;
    let on_gpu = |memory| {
        let zero = json!({ "stage": 3, "offload_optimizer": { "device": "cpu" } });
        gpu_plan(
            memory,
            zero,
            json!({ "preset": "gpt2-tiny" }),
            &["train.keep_activations=false"],
        )
    };
    let roomy = on_gpu(None);
    assert!(device_accumulation(&roomy));
    let with = predict(&roomy);
    assert!(with.accumulators > 0 && with.accumulators <= with.gradients);
    assert!(device_accumulation(&on_gpu(Some(with.total))));
    let tight = on_gpu(Some(with.total - 1));
    assert!(!device_accumulation(&tight));
    let without = predict(&tight);
    assert_eq!(without.accumulators, 0);
    assert_eq!(with.total - without.total, with.accumulators);
    let cpu = |sets: &[&str]| device_accumulation(&plan(2, 3, "cpu", sets));
    assert!(!cpu(&["gradient_accumulation_steps=2"]));
    assert!(cpu(&[
        "gradient_accumulation_steps=2",
        "train.accumulate_on_device=true"
    ]));
}

/// Stage 3 keeps gathered units on a GPU for the whole step, the largest that fit its
/// memory (by raising `stage3_param_persistence_threshold`, which `plan` reports), and
/// none where none fits; on a CPU only when `train.keep_gathered` asks.
#[test]
fn gathered_units_stay_on_the_gpu_as_far_as_its_memory_has_room() {
    let on_gpu = |memory, sets: &[&str]| {
        // no unit held for its backward: in a model this small every one would be
        let zero =
            json!({ "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0 });
        let sets: Vec<&str> = sets
            .iter()
            .copied()
            .chain(["train.keep_activations=false"])
            .collect();
        gpu_plan(
            memory,
            zero,
            json!({ "preset": "llama-tiny", "num_hidden_layers": 8 }),
            &sets,
        )
    };
    let numels = on_gpu(None, &[]).model.config.unit_numels();
    let largest = numels.iter().copied().max().unwrap();
    let all = on_gpu(None, &[]);
    assert_eq!(all.zero.param_persistence_threshold, largest);
    assert!(all.auto.iter().any(|c| c.key == "train.keep_gathered"));
    let off = on_gpu(None, &["train.keep_gathered=false"]);
    assert_eq!(off.zero.param_persistence_threshold, 0);
    // a budget between "nothing kept" and "everything kept" keeps the smaller units
    let (low, high) = (predict(&off).total, predict(&all).total);
    assert!(low < high, "{:?} vs {:?}", predict(&off), predict(&all));
    let some = on_gpu(Some((low + high) / 2), &[]);
    let t = some.zero.param_persistence_threshold;
    assert!(predict(&some).total <= (low + high) / 2);
    assert!(t < largest && (t == 0 || numels.contains(&t)), "{t}");
    assert_eq!(on_gpu(Some(low), &[]).zero.param_persistence_threshold, 0);
    let cpu = |sets: &[&str]| plan(2, 3, "cpu", sets).zero.param_persistence_threshold;
    let cpu_largest = plan(2, 3, "cpu", &[])
        .model
        .config
        .unit_numels()
        .into_iter()
        .max()
        .unwrap();
    let given = cpu(&["train.keep_gathered=false"]);
    assert_eq!(cpu(&[]), given);
    assert_eq!(cpu(&["train.keep_gathered=true"]), given.max(cpu_largest));
}
