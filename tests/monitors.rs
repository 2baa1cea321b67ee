//! DeepSpeed's `tensorboard` and `csv_monitor` sections: a short run's event file read
//! back by TensorBoard's own reader (`tests/data/read_tensorboard.py`, in the project's
//! venv) and its CSV files, step by step against `metrics.jsonl`.

use std::path::Path;
use std::process::Command;

fn train(dir: &Path, extra: &[&str]) -> std::process::Output {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/default.json");
    let out_dir = dir.join("run");
    let nvme = dir.join("nvme");
    let mut args = vec![
        "train".to_string(),
        "--config".into(),
        config.into(),
        "--set".into(),
        "train.steps=6".into(),
        "--set".into(),
        format!("train.output_dir={}", out_dir.display()),
        "--set".into(),
        format!("zero_optimization.offload_optimizer.nvme_path={}", nvme.display()),
    ];
    for set in extra {
        args.push("--set".into());
        args.push(set.to_string());
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(&args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (tag in the monitors, key in metrics.jsonl)
const SHARED: [(&str, &str); 6] = [
    ("Train/Samples/train_loss", "loss"),
    ("Train/Samples/lr", "lr"),
    ("Train/Samples/loss_scale", "loss_scale"),
    ("Train/Samples/grad_norm", "grad_norm"),
    ("Train/Samples/tokens_per_s", "tokens_per_s"),
    ("Train/Samples/mfu", "mfu"),
];

fn files_named(dir: &Path, part: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().unwrap().to_string_lossy().contains(part) {
                found.push(path);
            }
        }
    }
    found
}

#[test]
fn tensorboard_and_csv_hold_every_scalar_of_metrics_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    train(
        dir.path(),
        &[
            // fp16: the loss scale is logged too (and early steps may overflow)
            "fp16.enabled=true",
            "steps_per_print=4",
            "tensorboard.enabled=true",
            &format!("tensorboard.output_path={}", logs.display()),
            "tensorboard.job_name=tb_job",
            "csv_monitor.enabled=true",
            &format!("csv_monitor.output_path={}", logs.display()),
            "csv_monitor.job_name=csv_job",
        ],
    );
    let metrics = metrics(dir.path());
    assert_eq!(metrics.len(), 6);
    // samples seen after each step: train_batch_size 16 (micro 8 × 2 ranks)
    let samples: Vec<u64> = (1..=6).map(|s| 16 * s).collect();

    let python = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/read_tensorboard.py");
    let out = Command::new(python)
        .args([script, logs.join("tb_job").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tb: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for (tag, key) in SHARED {
        let points = tb[tag].as_array().unwrap_or_else(|| panic!("no {tag} in {tb}"));
        assert_eq!(points.len(), 6, "{tag}");
        for ((point, m), s) in points.iter().zip(&metrics).zip(&samples) {
            assert_eq!(point[0].as_u64(), Some(*s), "{tag}");
            // TensorBoard keeps simple values as float32
            let expected = m[key].as_f64().unwrap() as f32;
            assert_eq!(point[1].as_f64().unwrap() as f32, expected, "{tag} at {s}");
        }
    }
    for tag in [
        "Train/Samples/seconds/forward",
        "Train/Samples/memory/host_rss_bytes",
    ] {
        assert_eq!(tb[tag].as_array().map(Vec::len), Some(6), "{tag}");
    }

    for (tag, key) in SHARED {
        let path = logs
            .join("csv_job")
            .join(format!("{}.csv", tag.replace('/', "_")));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some(format!("step,{}", tag.rsplit('/').next().unwrap()).as_str())
        );
        let rows: Vec<(u64, f64)> = lines
            .map(|l| {
                let (s, v) = l.split_once(',').unwrap();
                (s.parse().unwrap(), v.parse().unwrap())
            })
            .collect();
        let expected: Vec<(u64, f64)> = samples
            .iter()
            .zip(&metrics)
            .map(|(s, m)| (*s, m[key].as_f64().unwrap()))
            .collect();
        assert_eq!(rows, expected, "{}", path.display());
    }
}

#[test]
fn a_run_without_monitor_keys_writes_neither() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), &["train.steps=2"]);
    assert!(files_named(dir.path(), "tfevents").is_empty());
    assert!(files_named(dir.path(), ".csv").is_empty());
}

#[test]
fn wandb_is_named_as_not_sent() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args([
            "plan",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/configs/default.json"),
            "--set",
            "wandb.enabled=true",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("wandb accepted but not acted on"), "{text}");
    assert!(text.contains("tensorboard"), "{text}");
}
