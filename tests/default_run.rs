//! The default config (what `make train` runs) learns: in 120 steps the loss falls from
//! ln(vocab) ≈ 5.55 to within 0.2 nats of the synthetic Markov corpus's exact floor
//! (its entropy rate, ≈ 1.21; src/data/synthetic.rs), through the real engine: 2 CPU
//! ranks, ZeRO-3, optimizer state on NVMe. `tierzero generate` from the run's final
//! checkpoint continues the chain: every generated token is a successor of the one
//! before it, greedy or sampled.

use tierzero::model::generate::Sampling;
use tierzero::plan::{load, DeviceFacts, Plan};
use tierzero::run::generate::{Generator, Prompt, Weights};
use tierzero::run::{train, TrainOptions};

/// `configs/default.json` with `sets` on top, writing its outputs and NVMe files into a
/// fresh directory under the target's `name` (removed when the returned guard drops).
pub(crate) fn default_config(name: &str, sets: &[&str]) -> (tempfile::TempDir, Plan) {
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&base).unwrap();
    let dir = tempfile::tempdir_in(base).unwrap();
    let mut all: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    all.push(format!("train.output_dir={}", dir.path().join("run").display()));
    all.push(format!(
        "zero_optimization.offload_optimizer.nvme_path={}",
        dir.path().join("nvme").display()
    ));
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json");
    let plan = load(&path, &all, DeviceFacts::default()).unwrap().plan;
    (dir, plan)
}

#[test]
fn default_config_loss_falls_below_threshold() {
    let (dir, plan) = default_config("default-run", &["train.steps=120"]);
    assert_eq!((plan.world_size, plan.zero.stage), (2, 3));
    let result = train(
        &plan,
        TrainOptions {
            write_outputs: true,
            save_checkpoints: true,
            ..TrainOptions::default()
        },
    )
    .unwrap();
    let first = result.steps[0].loss;
    let tail: f64 = result.steps[110..].iter().map(|s| s.loss).sum::<f64>() / 10.0;
    let floor = result.loss_floor.unwrap();
    assert!((first - 256f64.ln()).abs() < 0.2, "initial loss {first}");
    assert!(
        tail < floor + 0.2,
        "mean loss over steps 111-120 is {tail}, floor {floor}"
    );
    // the final checkpoint continues its training data
    let corpus = tierzero::data::synthetic::Corpus::new("markov");
    let generator = Generator::open(
        Weights::Checkpoint(&dir.path().join("run/checkpoints/latest")),
        None,
        tch::Device::Cpu,
    )
    .unwrap();
    let prompt = generator.encode(&Prompt::Ids(vec![5])).unwrap();
    // sampled among the 4 most likely tokens (the chain's fan-out): after 120 steps
    // some mass still sits off the chain, which sampling from the whole softmax finds
    for temperature in [0.0, 0.8] {
        let sampling = Sampling {
            temperature,
            top_k: 4,
            top_p: 1.0,
            seed: 1,
        };
        let new = generator.generate(&prompt, 40, &sampling).unwrap();
        assert_eq!(new.len(), 40);
        let whole: Vec<i64> = prompt.iter().chain(&new).copied().collect();
        let wrong = whole
            .windows(2)
            .filter(|w| !corpus.successors(w[0]).contains(&w[1]))
            .count();
        assert!(
            wrong <= 1,
            "temperature {temperature}: {wrong} of 40 transitions leave the chain: {whole:?}"
        );
    }
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 120);
    let line: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    for field in [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "tokens",
        "tokens_per_s",
        "mfu",
    ] {
        assert!(!line[field].is_null(), "metrics.jsonl lacks {field}");
    }
    // MFU is a fraction of the peak of the model's own matmul shapes, measured in the run
    // for one rank: the denominator is every rank's peak (2 ranks here), the numerator
    // the model FLOPs of every rank's tokens
    let flops_per_token = plan.model.config.flops_per_token(plan.data.seq_len);
    assert!(result.rank_peak_flops > 0.0);
    for s in &result.steps {
        assert!(s.mfu > 0.0 && s.mfu <= 1.0, "step {}: mfu {}", s.step, s.mfu);
        let all_ranks = s.mfu * result.rank_peak_flops * plan.world_size as f64;
        let model = flops_per_token * s.tokens_per_s;
        assert!(
            (all_ranks / model - 1.0).abs() < 1e-9,
            "step {}: mfu × rank peak × ranks = {all_ranks}, model FLOP/s {model}",
            s.step
        );
    }
}
