//! fp16 with DeepSpeed's dynamic loss scaling, end to end: an initial scale of 2³²
//! overflows, the step is skipped and the scale backs off (after `hysteresis`
//! overflows), then training proceeds and the loss falls.

use serde_json::json;
use tierzero::config::{from_json, DeviceFacts};
use tierzero::zero::trainer::{train, TrainOptions};

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
