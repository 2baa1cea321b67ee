//! Device memory: the plan's per-rank prediction against the measured peak, stage-3
//! memory shrinking with the number of ranks, and the out-of-memory error.

use serde_json::json;
use tierzero::config::{from_json, DeviceFacts, Plan};
use tierzero::zero::memory::predict;
use tierzero::zero::trainer::{train, TrainError, TrainOptions};

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

#[test]
fn prediction_is_within_ten_percent_of_the_measured_peak() {
    for world in [1, 2, 3] {
        for stage in 0..=3u8 {
            for optimizer in ["none", "cpu"] {
                if stage == 0 && optimizer == "cpu" {
                    continue;
                }
                let p = plan(world, stage, optimizer, &["model.tie_word_embeddings=true"]);
                let predicted = predict(&p).total as f64;
                let result = train(&p, TrainOptions::default()).unwrap();
                for (rank, &peak) in result.device_peaks.iter().enumerate() {
                    let error = (peak as f64 - predicted).abs() / predicted;
                    assert!(error <= 0.10, "world {world} stage {stage} {optimizer} rank {rank}: measured {peak}, predicted {predicted}");
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
            let predicted = predict(&p).total as f64;
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
            "zero_optimization.stage3_prefetch_bucket_size=50000000".to_string(),
            format!("zero_optimization.stage3_max_live_parameters={max_live}"),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let p = plan(2, 3, "none", &sets);
        let predicted = predict(&p).total as f64;
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

/// `stage3_prefetch_bucket_size: 0` (DeepSpeed: no prefetch) gathers each unit only when
/// compute needs it: the peak is the lowest of all buckets, within the prediction, and
/// the losses are the prefetching run's bits.
#[test]
fn a_zero_prefetch_bucket_gathers_only_what_compute_needs() {
    let run = |bucket: &str| {
        let set = format!("zero_optimization.stage3_prefetch_bucket_size={bucket}");
        let p = plan(
            2,
            3,
            "none",
            &["zero_optimization.stage3_param_persistence_threshold=0", &set],
        );
        let predicted = predict(&p).total as f64;
        let result = train(&p, TrainOptions::default()).unwrap();
        let peak = *result.device_peaks.iter().max().unwrap();
        assert!(
            (peak as f64 - predicted).abs() / predicted <= 0.10,
            "bucket {bucket}: measured {peak}, predicted {predicted}"
        );
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
