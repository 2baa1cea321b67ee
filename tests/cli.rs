//! The binary: exit statuses, `plan --json`, and that a bad config writes nothing.

use std::process::Command;

fn tierzero() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tierzero"))
}

fn default_config() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/configs/default.json").to_string()
}

#[test]
fn plan_json_has_the_resolved_plan() {
    let out = tierzero()
        .args(["plan", "--config", &default_config(), "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["plan"]["zero"]["stage"], 3);
    assert_eq!(v["plan"]["world_size"], 2);
    assert_eq!(v["plan"]["zero"]["offload_optimizer"]["tier"], "nvme");
    assert!(v["parameters"].as_u64().unwrap() > 0);
}

#[test]
fn config_errors_exit_2_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let output_dir = format!("train.output_dir={}", out_dir.display());
    let config = default_config();
    for bad in ["fp16.enabled=true", "zero_optimization.bogus_key=1"] {
        let mut args = vec!["train", "--config", &config, "--set", &output_dir, "--set", bad];
        if bad.starts_with("fp16") {
            args.extend(["--set", "bf16.enabled=true"]);
        }
        let out = tierzero().args(&args).output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("error:"));
        assert!(
            !out_dir.exists(),
            "{bad}: a failed config wrote {}",
            out_dir.display()
        );
    }
    let out = tierzero()
        .args(["plan", "--config", "/nonexistent/ds_config.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/ds_config.json"));
}

#[test]
fn estimate_prints_the_deepspeed_table() {
    let out = tierzero()
        .args([
            "estimate",
            "--params",
            "2851e6",
            "--largest-layer",
            "32e6",
            "--gpus-per-node",
            "8",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1"),
        "{text}"
    );
}

#[test]
fn bench_adam_reports_against_its_roofline() {
    let out = tierzero()
        .args([
            "bench",
            "adam",
            "--params",
            "300000",
            "--repeats",
            "1",
            "--json",
            "--grad-dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "params_per_s",
        "bytes_per_param",
        "gbps",
        "roofline_gbps",
        "ratio_to_roofline",
        "kernel",
        "grad_dtype",
    ] {
        assert!(!v[field].is_null(), "missing {field}");
    }
    assert_eq!(v["bytes_per_param"], 28);
    assert_eq!(v["grad_dtype"], "bf16");
    assert_eq!(v["copy_dtype"], "bf16");
    // an fp32 run's update writes its parameters' copy in fp32: with the fp32 gradient,
    // 4 × 4 read and 4 × 4 written a parameter
    let out = tierzero()
        .args(["bench", "adam", "--params", "300000", "--repeats", "1", "--json"])
        .args(["--copy-dtype", "fp32"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["bytes_per_param"].as_u64(), v["copy_dtype"].as_str()),
        (Some(32), Some("fp32"))
    );
}

/// `bench unit` times a block as the engine computes it beside torch with a tensor per
/// parameter, and the host adds beside memcpy, in one run; an out-of-range block is an
/// error that names the blocks.
#[test]
fn bench_unit_times_a_block_beside_torch_and_the_adds_beside_memcpy() {
    let out = tierzero()
        .args(["bench", "unit", "--config", "configs/default.json", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "forward_s",
        "backward_recompute_s",
        "backward_kept_s",
        "torch_forward_backward_s",
        "recompute_ratio",
        "kept_ratio",
    ] {
        assert!(v[field].as_f64().is_some_and(|x| x > 0.0), "{field}: {v}");
    }
    for field in ["add_gb_s", "first_squared_gb_s", "memcpy_gb_s", "ratio"] {
        assert!(
            v["reductions"][field].as_f64().is_some_and(|x| x > 0.0),
            "{field}: {v}"
        );
    }
    let out = tierzero()
        .args(["bench", "unit", "--config", "configs/default.json", "--unit", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--unit 0: the blocks of this model are units 1 to"),
        "{err}"
    );
}

/// A scratch directory on the build disk (O_DIRECT works there; /tmp may be tmpfs).
fn disk_dir() -> tempfile::TempDir {
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

#[test]
fn bench_nvme_reports_both_engines_against_the_baseline() {
    let dir = disk_dir();
    let out = tierzero()
        .args([
            "bench",
            "nvme",
            "--size-mb",
            "8",
            "--block-size",
            "1M",
            "--queue-depth",
            "8",
            "--repeats",
            "1",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert!(rows.iter().any(|r| r["engine"] == "pread"));
    for r in rows {
        assert!(r["gbps"].as_f64().unwrap() > 0.0 && r["ratio_to_baseline"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the bench removes its file"
    );
}

#[test]
fn bench_swap_reports_the_pipeline_against_its_legs() {
    let dir = disk_dir();
    let out = tierzero()
        .args([
            "bench",
            "swap",
            "--params",
            "200000",
            "--sub-group-size",
            "16384",
            "--repeats",
            "1",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "read_seconds",
        "adam_seconds",
        "write_seconds",
        "read_write_seconds",
        "pipeline_seconds",
        "ratio_to_bound",
        "ratio_to_duplex_bound",
    ] {
        assert!(v[field].as_f64().unwrap() > 0.0, "{field}");
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the swap store removes its files"
    );
}

/// An error names its cause once (a missing token file used to print "No such file or
/// directory (os error 2)" twice).
#[test]
fn an_error_says_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("tokens.bin");
    let out = tierzero()
        .args(["eval", "--config", &default_config()])
        .args([
            "--set",
            &format!("data.path={}", missing.display()),
            "--set",
            "data.synthetic=null",
        ])
        .args([
            "--set",
            &format!("train.output_dir={}", dir.path().join("run").display()),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("tokens.bin"), "{stderr}");
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "{stderr}");
}

/// `plan` opens the data as `train` would: a missing token file, or ids outside the
/// vocabulary, exit 2 naming `data.path` before any job starts.
#[test]
fn plan_checks_the_data_train_would_read() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.bin");
    let plan = |path: &std::path::Path| {
        tierzero()
            .args(["plan", "--config", &default_config()])
            .args([
                "--set",
                &format!("data.path={}", path.display()),
                "--set",
                "data.synthetic=null",
            ])
            .args(["--set", "data.dtype=u16"])
            .output()
            .unwrap()
    };
    let out = plan(&tokens);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("`data.path`") && stderr.contains("tokens.bin"),
        "{stderr}"
    );
    // llama-tiny's vocabulary is 256: id 300 is outside it
    let ids: Vec<u8> = (0..200u16)
        .map(|i| if i == 7 { 300 } else { i % 256 })
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(&tokens, ids).unwrap();
    let out = plan(&tokens);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("token id 300 is outside the model's vocabulary"),
        "{stderr}"
    );
    // within the vocabulary, with more than one window: plan succeeds
    let ids: Vec<u8> = (0..200u16).flat_map(|t| (t % 256).to_le_bytes()).collect();
    std::fs::write(&tokens, ids).unwrap();
    assert!(plan(&tokens).status.success());
}

#[test]
fn bench_comm_measures_gloo_beside_memcpy() {
    let out = tierzero()
        .args([
            "bench",
            "comm",
            "--backend",
            "gloo",
            "--size",
            "1M",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backend"], "Gloo");
    for key in ["memcpy_gbs", "all_gather_gbs", "reduce_scatter_gbs"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
}

/// `plan --largest` on one H100's capacities (the profile's 80 GB, 128 GiB of host memory,
/// 64 GiB of disk): tierzero's largest Llama-8B-shaped model, its state over all three
/// tiers, fits each of them and is at least twice the largest DeepSpeed places by its
/// own rules on the same capacities (its ZeRO-3 estimator's rows, or ZeRO-Infinity's swap
/// files on the disk).
#[test]
fn plan_largest_fills_every_tier_to_twice_deepspeeds_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    let config = dir.path().join("ds_config.json");
    let text = serde_json::json!({
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 8,
        "bf16": { "enabled": true },
        "zero_optimization": {
            "stage": 3,
            "offload_param": { "device": "nvme", "nvme_path": nvme, "max_in_cpu": "auto" },
            "offload_optimizer": { "device": "nvme", "nvme_path": nvme, "ratio": "auto" }
        },
        "model": { "preset": "llama-8b" },
        "data": { "synthetic": "markov", "seq_len": 2048 },
        "train": { "optimizer_max_in_cpu": "auto", "host_memory": 137438953472u64, "nvme_space": 68719476736u64 }
    });
    std::fs::write(&config, text.to_string()).unwrap();
    let out = tierzero()
        .args([
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--largest",
            "--simulate",
            "h100-pcie5",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ours = &v["tierzero"];
    let fit = &ours["fit"];
    for (bytes, cap) in [
        ("device", "device_budget"),
        ("host", "host_memory"),
        ("nvme", "nvme_space"),
    ] {
        assert!(fit[bytes].as_u64().unwrap() > 0, "{bytes}: {fit}");
        assert!(fit[bytes].as_u64() <= fit[cap].as_u64(), "{bytes}: {fit}");
    }
    let theirs = v["deepspeed_estimator"]["parameters"].as_u64().unwrap();
    let ours = ours["parameters"].as_u64().unwrap();
    assert!(
        ours >= 2 * theirs,
        "tierzero {ours} vs DeepSpeed's estimator {theirs}"
    );
}

#[test]
fn no_save_trains_and_writes_no_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let set = |k: &str, v: String| ["--set".to_string(), format!("{k}={v}")];
    let mut args = vec![
        "train".to_string(),
        "--config".into(),
        default_config(),
        "--no-save".into(),
    ];
    args.extend(set("train.output_dir", out_dir.display().to_string()));
    args.extend(set("train.steps", "3".into()));
    args.extend(set("train.save_interval", "1".into()));
    args.extend(set(
        "zero_optimization.offload_optimizer.nvme_path",
        dir.path().join("nvme").display().to_string(),
    ));
    let out = tierzero().args(&args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--no-save"));
    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3);
    assert!(!out_dir.join("checkpoints").exists(), "a checkpoint was written");
}
