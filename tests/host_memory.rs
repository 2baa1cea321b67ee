//! Host memory: the plan's per-process prediction (`plan/host_memory.rs`) against the
//! peak resident set the kernel measured over a run's steps (`summary.json`), for a
//! model whose state outweighs the runtime (29 M parameters) on several tiers.

use std::process::Command;

fn run(dir: &std::path::Path, sets: &[&str]) -> serde_json::Value {
    let mut args: Vec<String> = [
        "train",
        "--config",
        concat!(env!("CARGO_MANIFEST_DIR"), "/configs/default.json"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let base = [
        "train.steps=3".to_string(),
        format!("train.output_dir={}", dir.join("run").display()),
        format!(
            "zero_optimization.offload_optimizer.nvme_path={}",
            dir.join("nvme").display()
        ),
        format!(
            "zero_optimization.offload_param.nvme_path={}",
            dir.join("nvme").display()
        ),
        "model.hidden_size=512".into(),
        "model.intermediate_size=1408".into(),
        "model.num_hidden_layers=4".into(),
        "model.vocab_size=16000".into(),
        "model.num_attention_heads=8".into(),
        "model.num_key_value_heads=8".into(),
        "data.seq_len=32".into(),
        "train_micro_batch_size_per_gpu=2".into(),
    ];
    for set in base.iter().map(String::as_str).chain(sets.iter().copied()) {
        args.push("--set".into());
        args.push(set.into());
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(&args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(dir.join("run/summary.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The measured peak is within 10% below the prediction and at most 35% above it: what
/// the prediction leaves out is the allocator's slack (blocks freed and kept for
/// reuse). Since the final unit's gradients are released before the blocks' backward
/// (they were held through it), the three configurations measure 0.98–1.03, 1.22 and
/// 1.01 of the prediction, moving by ±3% from run to run, and the fourth (gradients kept
/// with device-tier state, no host accumulators) 1.07. Under tcmalloc, the binary's
/// allocator since `979cb08`, a process holds less than under glibc: 0.94–0.97, 0.97,
/// 0.99 and 1.02 (the lower bound was 0.95). A term of the state missing from the
/// prediction, or counted twice, leaves this band.
#[test]
fn the_host_prediction_bounds_the_measured_peak_resident_set() {
    let cases: [(&str, &[&str]); 4] = [
        (
            "stage 3, optimizer on cpu, 2 ranks",
            &["zero_optimization.offload_optimizer.device=cpu"],
        ),
        (
            "stage 3, params and optimizer on nvme, 1 rank",
            &[
                "train.devices=1",
                "zero_optimization.offload_param.device=nvme",
                "zero_optimization.offload_param.max_in_cpu=0",
            ],
        ),
        (
            "stage 2, optimizer on cpu, 2 ranks",
            &[
                "zero_optimization.stage=2",
                "zero_optimization.offload_optimizer.device=cpu",
            ],
        ),
        // no host accumulators: the gradients stay with the state on the (CPU) device
        (
            "stage 3, optimizer and its gradients on the device, 2 ranks",
            &[
                "zero_optimization.offload_optimizer.device=none",
                "train.accumulate_on_device=true",
            ],
        ),
    ];
    for (name, sets) in cases {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let summary = run(dir.path(), sets);
        let measured = summary["host"]["steps"]["peak_rss"].as_f64().unwrap();
        let predicted = summary["host_bytes_predicted"]["total"].as_f64().unwrap();
        let ratio = measured / predicted;
        println!("{name}: measured {measured:.3e} predicted {predicted:.3e} ({ratio:.3})");
        assert!(
            (0.90..=1.35).contains(&ratio),
            "{name}: measured {measured} predicted {predicted}"
        );
    }
}
