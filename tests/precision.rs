//! fp16 with DeepSpeed's dynamic loss scaling, end to end: an initial scale of 2³²
//! overflows, the step is skipped and the scale backs off (after `hysteresis`
//! overflows), then training proceeds and the loss falls.

use serde_json::json;
use tierzero::plan::{from_json, DeviceFacts};
use tierzero::run::{train, TrainOptions};

#[test]
fn fp16_overflow_skips_backs_off_and_then_trains() {
    let config = json!({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": { "type": "AdamW", "params": { "lr": 3e-3 } },
        "fp16": { "enabled": true, "initial_scale_power": 32, "hysteresis": 2, "loss_scale_window": 1000 },
        "zero_optimization": { "stage": 2 },
        "model": { "preset": "llama-tiny" },
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": 40, "devices": 2 }
    });
    let plan = from_json(config, &[], DeviceFacts::default()).unwrap().plan;
    let steps = train(&plan, TrainOptions::default()).unwrap().steps;
    assert!(steps[0].skipped && steps[0].loss_scale == 2f64.powi(32));
    // hysteresis 2: the second overflow halves the scale
    assert!(
        steps[1].skipped && steps[2].loss_scale == 2f64.powi(31),
        "{:?}",
        steps[2].loss_scale
    );
    // afterwards every overflow halves (hysteresis is spent and the 1000-step window
    // never refills it here), so the scale only falls, and training settles
    for pair in steps.windows(2) {
        assert!(pair[1].loss_scale <= pair[0].loss_scale);
        if pair[0].skipped && pair[0].loss_scale < 2f64.powi(32) {
            assert_eq!(pair[1].loss_scale, pair[0].loss_scale / 2.0);
        }
    }
    assert!(steps[30..].iter().all(|s| !s.skipped), "the last 10 steps apply");
    let last = steps.last().unwrap();
    assert!(
        last.loss < steps[0].loss - 1.0,
        "loss {} -> {}",
        steps[0].loss,
        last.loss
    );
}

/// DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py),
/// written out here from its source so the test does not lean on tierzero's scaler:
/// returns the scale each step runs with, given which steps overflowed.
fn deepspeed_scales(initial: f64, window: i64, hysteresis: u32, overflowed: &[bool]) -> Vec<f64> {
    let (mut scale, mut cur_hysteresis, mut last_overflow) = (initial, hysteresis, -1i64);
    let mut scales = Vec::new();
    for (iteration, &overflow) in overflowed.iter().enumerate() {
        scales.push(scale);
        let iteration = iteration as i64;
        if overflow {
            if hysteresis == 1 || cur_hysteresis == 1 {
                scale = (scale / 2.0).max(1.0);
            } else {
                cur_hysteresis -= 1;
            }
            last_overflow = iteration;
        } else if (iteration - last_overflow) % window == 0 {
            cur_hysteresis = hysteresis;
            scale *= 2.0;
        }
    }
    scales
}

#[test]
fn fp16_skipped_steps_do_not_advance_the_schedule_and_the_scale_grows_on_deepspeeds_iteration() {
    // a scale of 2^24 overflows in the first steps; a window of 3 makes it grow (and
    // overflow again) several times within 30 steps
    let config = json!({
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
        "scheduler": { "type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20, "warmup_type": "linear" } },
        "fp16": { "enabled": true, "initial_scale_power": 24, "hysteresis": 2, "loss_scale_window": 3 },
        "zero_optimization": { "stage": 3 },
        "model": { "preset": "llama-tiny" },
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": 30, "devices": 2 }
    });
    let plan = from_json(config, &[], DeviceFacts::default()).unwrap().plan;
    let steps = train(&plan, TrainOptions::default()).unwrap().steps;
    let skipped: Vec<bool> = steps.iter().map(|s| s.skipped).collect();
    assert!(skipped[0], "2^24 overflows at the first step: {skipped:?}");
    assert!(skipped.iter().filter(|&&s| !s).count() >= 10, "{skipped:?}");
    // WarmupLR, linear: the k-th applied step (0-based) runs at the rate of iteration
    // k − 1, 1e-3 · (k−1) / 20 (warmup_min_lr for k = 0), whatever number of skipped
    // steps came before it
    let mut applied: u64 = 0;
    for s in &steps {
        if !s.skipped {
            let want = 1e-3 * applied.saturating_sub(1) as f64 / 20.0;
            assert!(
                (s.lr - want).abs() < 1e-12,
                "step {}: lr {} want {want} ({skipped:?})",
                s.step,
                s.lr
            );
            applied += 1;
        }
    }
    let scales: Vec<f64> = steps.iter().map(|s| s.loss_scale).collect();
    assert_eq!(
        scales,
        deepspeed_scales(2f64.powi(24), 3, 2, &skipped),
        "{skipped:?}"
    );
    assert!(
        scales.windows(2).any(|w| w[1] > w[0]),
        "the scale grows at least once: {scales:?}"
    );
}
