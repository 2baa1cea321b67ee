//! Configuration: DeepSpeed spellings, defaults, `"auto"`, batch math, and every
//! contradiction refused with the key named.

use serde_json::{json, Value};
use tierzero::config::ConfigError;
use tierzero::plan::{from_json, DeviceFacts, Loaded, Tier};
use tierzero::plan::{Precision, Scheduler};

fn load(v: Value) -> Result<Loaded, ConfigError> {
    from_json(v, &[], DeviceFacts::default())
}

fn base() -> Value {
    json!({ "train_micro_batch_size_per_gpu": 2, "model": {"preset": "llama-tiny"} })
}

fn with(mut v: Value, sets: &[&str]) -> Result<Loaded, ConfigError> {
    for s in sets {
        tierzero::config::overrides::apply(&mut v, s).unwrap();
    }
    load(v)
}

fn error_of(v: Value, sets: &[&str]) -> String {
    match with(v, sets) {
        Ok(_) => panic!("expected an error for {sets:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_shipped_config_loads() {
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue; // a config's data (configs/chat/)
        }
        tierzero::plan::load(&path, &[], DeviceFacts::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn deepspeed_defaults_apply() {
    let plan = load(base()).unwrap().plan;
    assert_eq!(plan.zero.stage, 0);
    assert_eq!(plan.zero.reduce_bucket_size, 500_000_000);
    assert_eq!(plan.zero.sub_group_size, 1_000_000_000);
    assert_eq!(plan.zero.prefetch_bucket_size, 50_000_000);
    assert_eq!(plan.zero.param_persistence_threshold, 100_000);
    assert_eq!(plan.zero.offload_param.buffer_count, 5);
    assert_eq!(plan.zero.offload_optimizer.buffer_count, 4);
    assert_eq!(plan.aio.block_size, 1_048_576);
    assert_eq!(plan.aio.queue_depth, 8);
    assert!(plan.aio.overlap_events);
    assert_eq!(plan.steps_per_print, 10);
    assert_eq!(plan.gradient_clipping, 0.0);
    assert_eq!(plan.precision, Precision::Fp32);
    assert_eq!(plan.scheduler, Scheduler::Constant);
    assert_eq!(plan.batch.gradient_accumulation_steps, 1);
}

#[test]
fn numbers_in_every_spelling() {
    for spelling in [json!(5e8), json!("5e8"), json!(500000000), json!("500_000_000")] {
        let mut v = base();
        v["zero_optimization"] = json!({ "reduce_bucket_size": spelling });
        assert_eq!(load(v).unwrap().plan.zero.reduce_bucket_size, 500_000_000);
    }
    let mut v = base();
    v["zero_optimization"] = json!({ "reduce_bucket_size": 2.5 });
    assert!(load(v)
        .unwrap_err()
        .to_string()
        .contains("zero_optimization.reduce_bucket_size"));
}

#[test]
fn auto_resolves_from_the_model_like_the_hf_integration() {
    let mut v = base();
    v["zero_optimization"] = json!({
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"
    });
    v["gradient_clipping"] = json!("auto");
    v["bf16"] = json!({"enabled": "auto"});
    let plan = load(v.clone()).unwrap().plan;
    let h = 64; // llama-tiny hidden size
    assert_eq!(plan.zero.reduce_bucket_size, h * h);
    // Hugging Face's 0.9·hidden² is under one unit here: auto covers the next two units
    let largest = plan.model.config.unit_numels().into_iter().max().unwrap();
    assert!((0.9 * (h * h) as f64) < largest as f64);
    assert_eq!(plan.zero.prefetch_bucket_size, 2 * largest);
    assert_eq!(plan.zero.param_persistence_threshold, 10 * h);
    assert_eq!(plan.gradient_clipping, 1.0);
    // precision from the device: no CUDA bf16 here → fp32; a bf16 GPU → bf16
    assert_eq!(plan.precision, Precision::Fp32);
    let gpu = from_json(
        v,
        &[],
        DeviceFacts {
            cuda_bf16: true,
            cpu_bf16: false,
            cuda_devices: 1,
            cuda_memory: None,
            host_memory: None,
        },
    )
    .unwrap()
    .plan;
    assert_eq!(gpu.precision, Precision::Bf16);
}

/// The batch keys as Hugging Face's and LLaMA-Factory's published ds_configs set them:
/// tierzero decides. The micro-batch is the largest power of two whose planned device
/// bytes fit the budget (checked against `plan::memory::predict` on both sides of the
/// choice); accumulation is 1 unless train_batch_size is set; `plan` says why.
#[test]
fn auto_batch_sizes_are_decided_from_the_memory_plan() {
    let all_auto = |extra: &[&str]| {
        let mut v = json!({
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "model": {"preset": "llama-tiny"},
            "data": {"synthetic": "markov", "seq_len": 64},
            "train": {"devices": 2}
        });
        for s in extra {
            tierzero::config::overrides::apply(&mut v, s).unwrap();
        }
        load(v).unwrap().plan
    };
    // no budget: the Hugging Face Trainer's default per-device batch
    let plan = all_auto(&[]);
    assert_eq!(
        (
            plan.batch.micro_batch_per_gpu,
            plan.batch.gradient_accumulation_steps,
            plan.batch.train_batch_size
        ),
        (8, 1, 16)
    );
    // the three batch keys, and kept activations (stage 0: the replicas stay on the device)
    assert_eq!(plan.auto.len(), 4);
    assert_eq!(plan.auto[3].key, "train.keep_activations");
    // a budget: the largest power of two that fits, and twice it does not
    let one = |micro: usize| {
        let mut p = plan.clone();
        p.batch.micro_batch_per_gpu = micro;
        tierzero::plan::memory::predict(&p).total
    };
    let budget = (one(4) + one(8)) / 2;
    let plan = all_auto(&[&format!("train.device_memory={budget}")]);
    let micro = plan.batch.micro_batch_per_gpu;
    assert_eq!(micro, 4);
    assert!(one(micro) <= budget && one(2 * micro) > budget);
    let text = tierzero::plan::plan_table(&plan);
    assert!(
        text.contains("\"auto\" train_micro_batch_size_per_gpu") && text.contains("largest power of two"),
        "{text}"
    );
    // train_batch_size given: the micro-batch divides its share, accumulation makes up the rest
    let plan = all_auto(&["train_batch_size=24"]);
    assert_eq!(
        (
            plan.batch.micro_batch_per_gpu,
            plan.batch.gradient_accumulation_steps,
            plan.batch.train_batch_size
        ),
        (4, 3, 24)
    );
    // a budget even one sample exceeds: 1, and the reason says so
    let plan = all_auto(&["train.device_memory=1000"]);
    assert_eq!(plan.batch.micro_batch_per_gpu, 1);
    assert!(plan.auto[0].why.contains("even 1"), "{:?}", plan.auto);
    // a layered step holds every micro-batch's activations: each candidate is sized with
    // the accumulation it makes up train_batch_size with, and the choice fits
    let layered = |extra: &str| {
        let budget = format!("train.device_memory={}", one(8) + one(8) / 2);
        all_auto(&[
            "train_batch_size=64",
            "train.layered_accumulation=true",
            &budget,
            extra,
        ])
    };
    let plan = layered("train.keep_activations=false");
    assert!(plan.train.layered_accumulation);
    assert!(plan.batch.gradient_accumulation_steps > 1, "{:?}", plan.batch);
    let budget = plan.train.device_memory.unwrap();
    assert!(tierzero::plan::memory::predict(&plan).total <= budget);
    // with one micro-batch a step there is nothing to layer
    let plan = all_auto(&["train_batch_size=16", "train.layered_accumulation=true"]);
    assert_eq!(plan.batch.gradient_accumulation_steps, 1);
    assert!(!plan.train.layered_accumulation);
}

#[test]
fn auto_learning_rate_says_which_set_supplies_it() {
    let mut v = base();
    v["optimizer"] = json!({"type": "AdamW", "params": {"lr": "auto"}});
    let e = load(v).unwrap_err().to_string();
    assert!(
        e.contains("optimizer.params.lr") && e.contains("--set optimizer.params.lr="),
        "{e}"
    );
}

#[test]
fn unknown_keys_name_the_closest_valid_key() {
    let mut v = base();
    v["zero_optimization"] = json!({"stage3_prefetch_bukcet_size": 1});
    let e = load(v).unwrap_err().to_string();
    assert!(e.contains("zero_optimization.stage3_prefetch_bukcet_size"), "{e}");
    assert!(
        e.contains("did you mean `zero_optimization.stage3_prefetch_bucket_size`"),
        "{e}"
    );
    let e = error_of(base(), &["train.stesp=3"]);
    assert!(e.contains("did you mean `train.steps`"), "{e}");
}

#[test]
fn deepspeed_only_keys_are_accepted_and_listed_once() {
    let mut v = base();
    v["tensorboard"] = json!({"enabled": true});
    v["activation_checkpointing"] = json!({"partition_activations": true});
    v["zero_allow_untested_optimizer"] = json!(true);
    v["zero_optimization"] = json!({"round_robin_gradients": true});
    let loaded = load(v).unwrap();
    let listed: Vec<&String> = loaded
        .warnings
        .iter()
        .filter(|w| w.contains("not acted on by tierzero"))
        .collect();
    assert_eq!(listed.len(), 1);
    // tensorboard is acted on now (tests/monitors.rs)
    assert!(!listed[0].contains("tensorboard"), "{}", listed[0]);
    // activation_checkpointing is acted on: it asks for recompute
    assert!(!listed[0].contains("activation_checkpointing"), "{}", listed[0]);
    assert!(loaded.plan.train.activation_checkpointing && !loaded.plan.train.kept_activations);
    for key in [
        "zero_allow_untested_optimizer",
        "zero_optimization.round_robin_gradients",
    ] {
        assert!(listed[0].contains(key), "{key} missing from {}", listed[0]);
    }
}

#[test]
fn parsed_but_unacted_keys_are_reported() {
    let loaded = with(base(), &["zero_optimization.contiguous_gradients=true"]).unwrap();
    assert!(loaded
        .warnings
        .iter()
        .any(|w| w.contains("zero_optimization.contiguous_gradients")));
}

#[test]
fn deprecated_aliases_are_accepted_with_a_warning() {
    let mut v = base();
    v["zero_optimization"] = json!({"stage": 2, "cpu_offload": true});
    let loaded = load(v).unwrap();
    assert_eq!(loaded.plan.zero.offload_optimizer.tier, Tier::Cpu);
    assert!(loaded
        .warnings
        .iter()
        .any(|w| w.contains("cpu_offload is deprecated")));
    let mut v = base();
    v["zero_optimization"] =
        json!({"stage": 3, "prefetch_bucket_size": 123, "stage3_gather_fp16_weights_on_model_save": true});
    let loaded = load(v).unwrap();
    assert_eq!(loaded.plan.zero.prefetch_bucket_size, 123);
    assert!(loaded.plan.zero.gather_16bit_weights_on_model_save);
    v = base();
    v["bfloat16"] = json!({"enabled": true});
    assert_eq!(load(v).unwrap().plan.precision, Precision::Bf16);
}

#[test]
fn batch_triple_is_completed_or_refused_like_deepspeed() {
    let batch = |sets: &[&str]| with(json!({}), sets).map(|l| l.plan.batch);
    let b = batch(&["train_batch_size=32", "train.devices=4"]).unwrap();
    assert_eq!((b.micro_batch_per_gpu, b.gradient_accumulation_steps), (8, 1));
    let b = batch(&[
        "train_batch_size=32",
        "train_micro_batch_size_per_gpu=2",
        "train.devices=4",
    ])
    .unwrap();
    assert_eq!(b.gradient_accumulation_steps, 4);
    let b = batch(&[
        "train_micro_batch_size_per_gpu=2",
        "gradient_accumulation_steps=3",
        "train.devices=2",
    ])
    .unwrap();
    assert_eq!(b.train_batch_size, 12);
    let e = batch(&[
        "train_batch_size=30",
        "train_micro_batch_size_per_gpu=2",
        "gradient_accumulation_steps=2",
        "train.devices=2",
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("train_batch_size") && e.contains("30 != "), "{e}");
    let e = batch(&[]).unwrap_err().to_string();
    assert!(e.contains("--set train_micro_batch_size_per_gpu"), "{e}");
}

#[test]
fn contradictions_name_the_keys_and_the_fix() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "zero_optimization.stage=3",
                "zero_optimization.offload_optimizer.device=nvme",
            ],
            "offload_optimizer.nvme_path",
        ),
        (&["fp16.enabled=true", "bf16.enabled=true"], "fp16.enabled"),
        (
            &[
                "zero_optimization.stage=2",
                "zero_optimization.offload_param.device=cpu",
            ],
            "needs ZeRO stage 3",
        ),
        (&["zero_optimization.offload_optimizer.device=cpu"], "stage 0"),
        (
            &[
                "zero_optimization.stage=3",
                "zero_optimization.offload_param.device=nvme",
                "zero_optimization.offload_param.nvme_path=/tmp",
            ],
            "optimizer state off the device",
        ),
        (&["zero_optimization.reduce_bucket_size=0"], "must be positive"),
        (&["train.devices=0"], "train.devices"),
        (
            &["train_micro_batch_size_per_gpu=-1"],
            "train_micro_batch_size_per_gpu",
        ),
        (&["aio.block_size=1000"], "aio.block_size"),
        (
            &["train.layered_accumulation=true", "train.keep_activations=true"],
            "recomputes every unit's forward",
        ),
        (&["zero_optimization.stage=4"], "zero_optimization.stage"),
        (
            &["zero_optimization.offload_optimizer.device=disk"],
            "\"none\", \"cpu\" or \"nvme\"",
        ),
        (&["optimizer.type=Lamb"], "optimizer.type"),
        (
            &["scheduler.type=WarmupLR", "scheduler.params.total_num_steps=10"],
            "scheduler.params.total_num_steps",
        ),
        (&["model.preset=llama-tiyn"], "did you mean \"llama-tiny\""),
        (&["model.num_attention_heads=3"], "num_attention_heads"),
        (&["data.seq_len=100000"], "data.seq_len"),
        (&["data.synthetic=poetry"], "data.synthetic"),
        (
            &[
                "zero_optimization.stage=3",
                "zero_optimization.offload_optimizer.device=nvme",
                "zero_optimization.offload_optimizer.nvme_path=/etc/hostname/x",
            ],
            "is a file",
        ),
    ];
    for (sets, needle) in cases {
        let e = error_of(base(), sets);
        assert!(e.contains(needle), "{sets:?}: {e:?} lacks {needle:?}");
    }
}

#[test]
fn type_errors_name_the_key_path() {
    let mut v = base();
    v["zero_optimization"] = json!({"offload_optimizer": {"pin_memory": "yes please"}});
    let e = load(v).unwrap_err().to_string();
    assert!(
        e.contains("zero_optimization.offload_optimizer.pin_memory"),
        "{e}"
    );
}

#[test]
fn fp16_loss_scaling_keys_follow_deepspeed() {
    let mut v = base();
    v["fp16"] = json!({"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 0.5});
    match load(v).unwrap().plan.precision {
        Precision::Fp16(s) => {
            assert_eq!(
                (
                    s.static_scale,
                    s.initial_scale_power,
                    s.window,
                    s.hysteresis,
                    s.min_scale
                ),
                (0.0, 12, 500, 3, 0.5)
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn accelerator_follows_the_machine_and_refuses_what_it_lacks() {
    let mut v = base();
    let cpu = DeviceFacts::default();
    let gpu = DeviceFacts {
        cuda_bf16: true,
        cpu_bf16: false,
        cuda_devices: 2,
        cuda_memory: None,
        host_memory: None,
    };
    let plan = from_json(v.clone(), &[], cpu).unwrap().plan;
    assert_eq!(plan.train.accelerator, tierzero::plan::Accelerator::Cpu);
    let plan = from_json(v.clone(), &[], gpu).unwrap().plan;
    assert_eq!(plan.train.accelerator, tierzero::plan::Accelerator::Cuda);
    let plan = from_json(v.clone(), &["train.accelerator=cpu".into()], gpu)
        .unwrap()
        .plan;
    assert_eq!(plan.train.accelerator, tierzero::plan::Accelerator::Cpu);
    let e = from_json(v.clone(), &["train.accelerator=cuda".into()], cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.accelerator") && e.contains("no GPU"), "{e}");
    let e = from_json(v.clone(), &["train.accelerator=tpu".into()], gpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown accelerator \"tpu\""), "{e}");
    v["train_batch_size"] = json!(null);
    let e = from_json(v, &["train.devices=3".into()], gpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.devices") && e.contains("2 GPU(s)"), "{e}");
}

#[test]
fn launch_keys_set_the_world_and_refuse_a_bad_node_rank() {
    let mut v = base();
    v["train_batch_size"] = json!(null);
    let sets = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let plan = from_json(
        v.clone(),
        &sets(&[
            "train.devices=2",
            "train.nnodes=3",
            "train.node_rank=2",
            "train.master_port=4000",
        ]),
        DeviceFacts::default(),
    )
    .unwrap()
    .plan;
    assert_eq!(plan.world_size, 6);
    assert_eq!(plan.train.local_ranks(), 4..6);
    assert_eq!(plan.train.launch.master_port, 4000);
    assert_eq!(plan.train.compute_device(5), tch::Device::Cpu);
    let e = from_json(
        v.clone(),
        &sets(&["train.nnodes=2", "train.node_rank=2"]),
        DeviceFacts::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("train.node_rank") && e.contains("not below train.nnodes (2)"),
        "{e}"
    );
    let e = from_json(
        v.clone(),
        &sets(&["train.master_port=70000"]),
        DeviceFacts::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("train.master_port") && e.contains("not a port"), "{e}");
    // on CUDA, a process's ranks take GPUs from first_device on
    let gpu = DeviceFacts {
        cuda_bf16: true,
        cpu_bf16: false,
        cuda_devices: 4,
        cuda_memory: None,
        host_memory: None,
    };
    let plan = from_json(
        v.clone(),
        &sets(&["train.devices=2", "train.first_device=2"]),
        gpu,
    )
    .unwrap()
    .plan;
    assert_eq!(plan.train.compute_device(1), tch::Device::Cuda(3));
    let e = from_json(v, &sets(&["train.devices=2", "train.first_device=3"]), gpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.devices") && e.contains("from GPU 3 on"), "{e}");
    // one visible GPU per process (per-task CUDA_VISIBLE_DEVICES): LOCAL_RANK 3 is GPU 0
    let one = DeviceFacts {
        cuda_devices: 1,
        ..gpu
    };
    let plan = from_json(base(), &sets(&["train.first_device=3"]), one)
        .unwrap()
        .plan;
    assert_eq!(plan.train.compute_device(0), tch::Device::Cuda(0));
}

/// DeepSpeed accepts a warm-up longer than the run (it warns): so does tierzero, and the
/// rate follows DeepSpeed's formula, which stays in the warm-up for the whole run.
#[test]
fn a_warmup_longer_than_the_run_warns_and_runs() {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/default.json")).unwrap(),
    )
    .unwrap();
    let loaded = with(config, &["train.steps=8"]).unwrap();
    let warning: Vec<&String> = loaded
        .warnings
        .iter()
        .filter(|w| w.contains("warmup_num_steps"))
        .collect();
    assert_eq!(warning.len(), 1, "{:?}", loaded.warnings);
    assert!(
        warning[0].contains("(20) exceeds total_num_steps (8)"),
        "{}",
        warning[0]
    );
    // WarmupCosineLR, linear warm-up over 20 steps from warmup_min_ratio 0: step k runs
    // at the rate of iteration k − 1, lr · (k−1)/20 (0 for step 0, as DeepSpeed's engine
    // runs it), never reaching the cosine part
    let lr = 3e-3;
    for k in 0..8u64 {
        let got = tierzero::plan::schedule::learning_rate(&loaded.plan.scheduler, lr, k);
        let want = lr * k.saturating_sub(1) as f64 / 20.0;
        assert!((got - want).abs() < 1e-15, "step {k}: {got}");
    }
}

/// `stage3_prefetch_bucket_size: 0` and `stage3_param_persistence_threshold: 0` are
/// DeepSpeed values (no prefetch, nothing persists); `reduce_bucket_size: 0` DeepSpeed
/// refuses too.
#[test]
fn zero_buckets_take_deepspeeds_meaning() {
    let loaded = with(
        base(),
        &[
            "zero_optimization.stage=3",
            "zero_optimization.stage3_prefetch_bucket_size=0",
            "zero_optimization.stage3_param_persistence_threshold=0",
        ],
    )
    .unwrap();
    assert_eq!(loaded.plan.zero.prefetch_bucket_size, 0);
    assert_eq!(loaded.plan.zero.param_persistence_threshold, 0);
    assert!(error_of(base(), &["zero_optimization.reduce_bucket_size=0"]).contains("must be positive"));
}

/// `communication_data_type` as DeepSpeed reads it: case-insensitive "fp32", "fp16" or
/// "bf16"; left out, the training precision; anything else names the key and the values.
#[test]
fn communication_data_type_takes_deepspeeds_values_and_default() {
    use tierzero::plan::Wire;
    let wire = |precision: Option<&str>, value: Option<&str>| {
        let mut v = base();
        if let Some(p) = precision {
            v[p] = json!({ "enabled": true });
        }
        if let Some(value) = value {
            v["communication_data_type"] = json!(value);
        }
        load(v).map(|l| l.plan.communication)
    };
    assert_eq!(wire(None, None).unwrap(), Wire::Fp32);
    assert_eq!(wire(Some("bf16"), None).unwrap(), Wire::Bf16);
    assert_eq!(wire(Some("fp16"), None).unwrap(), Wire::Fp16);
    assert_eq!(wire(Some("bf16"), Some("FP32")).unwrap(), Wire::Fp32);
    assert_eq!(wire(None, Some("bf16")).unwrap(), Wire::Bf16);
    let e = wire(None, Some("int8")).unwrap_err().to_string();
    assert!(
        e.contains("communication_data_type") && e.contains("\"bf16\""),
        "{e}"
    );
}

/// A stage-3 prefetch bucket smaller than one unit fetches nothing ahead: `plan` says so
/// (0, DeepSpeed's "no prefetch", is a choice and is not warned about).
#[test]
fn a_prefetch_bucket_under_one_unit_is_warned_about() {
    for (bucket, warned) in [(1000, true), (0, false), (10_000_000, false)] {
        let mut v = base();
        v["zero_optimization"] = json!({ "stage": 3, "stage3_prefetch_bucket_size": bucket });
        let loaded = load(v).unwrap();
        let said = loaded
            .warnings
            .iter()
            .any(|w| w.contains("stage3_prefetch_bucket_size 1000 is smaller than the largest unit"));
        assert_eq!(said, warned, "bucket {bucket}: {:?}", loaded.warnings);
    }
}

/// `offload_param.max_in_cpu: "auto"` keeps in host memory the most units whose
/// parameters fit `train.host_memory` (with the plan's margin) beside the rest of the
/// process: all of them when memory is plenty, none when even the NVMe layout is over, a
/// prefix in between — and the plan's host prediction then fits.
#[test]
fn max_in_cpu_auto_fills_host_memory_with_whole_units() {
    let nvme = std::env::temp_dir();
    let plan_with = |memory: &str| {
        with(
            base(),
            &[
                "zero_optimization.stage=3",
                "zero_optimization.offload_optimizer.device=nvme",
                "zero_optimization.offload_param.device=nvme",
                "zero_optimization.offload_param.max_in_cpu=auto",
                // enough blocks that their parameters outweigh the NVMe tier's buffers
                "model.num_hidden_layers=8",
                &format!("zero_optimization.offload_param.nvme_path={}", nvme.display()),
                &format!("zero_optimization.offload_optimizer.nvme_path={}", nvme.display()),
                &format!("train.host_memory={memory}"),
            ],
        )
        .unwrap()
        .plan
    };
    let tiers = |plan: &tierzero::plan::Plan| tierzero::plan::rules::param_tiers(plan);
    let host = |plan: &tierzero::plan::Plan| tierzero::plan::host_memory::predict_host(plan).total;
    let all_nvme = host(&{
        let mut p = plan_with("1e12");
        p.zero.offload_param.max_in_cpu = 0;
        p
    });
    assert!(tiers(&plan_with("1e12")).iter().all(|t| *t == Tier::Cpu));
    assert!(tiers(&plan_with("1e6")).iter().all(|t| *t == Tier::Nvme));
    // room for the embedding and the first block in host memory, not the second
    let two_units = host(&{
        let mut p = plan_with("1e12");
        p.zero.offload_param.max_in_cpu = p.model.config.unit_numels()[..2].iter().sum();
        p
    });
    assert!(all_nvme < two_units);
    let memory = (two_units as f64 / tierzero::plan::HOST_MARGIN).ceil() as u64;
    let plan = plan_with(&memory.to_string());
    let split = tiers(&plan);
    assert!(
        split.contains(&Tier::Cpu) && split.contains(&Tier::Nvme),
        "{split:?}"
    );
    assert!(host(&plan) as f64 <= memory as f64 * tierzero::plan::HOST_MARGIN);
    let choice = plan
        .auto
        .iter()
        .find(|c| c.key == "zero_optimization.offload_param.max_in_cpu")
        .unwrap();
    assert!(choice.why.contains("fit in host memory"), "{}", choice.why);
}

/// A plan whose host bytes exceed `train.host_memory` says so once, with the change that
/// makes it fit (each tried on top of the one before) or what it needs at least.
#[test]
fn a_plan_over_the_host_memory_names_the_change_that_fits() {
    let warning_with = |memory: &str, (param, optimizer): (&str, &str)| {
        let loaded = with(
            json!({ "train_micro_batch_size_per_gpu": 1, "model": {"preset": "llama-1b"}, "data": { "seq_len": 128 } }),
            &[
                "zero_optimization.stage=3",
                &format!("zero_optimization.offload_optimizer.device={optimizer}"),
                &format!("zero_optimization.offload_param.device={param}"),
                "zero_optimization.offload_param.nvme_path=/tmp",
                "zero_optimization.offload_optimizer.nvme_path=/tmp",
                &format!("train.host_memory={memory}"),
            ],
        )
        .unwrap();
        let found: Vec<_> = loaded
            .warnings
            .iter()
            .filter(|w| w.contains("train.host_memory"))
            .collect();
        assert!(found.len() <= 1, "{found:?}");
        found.first().map(|w| w.to_string())
    };
    let warning = |memory: &str| warning_with(memory, ("cpu", "cpu"));
    assert_eq!(warning("1e12"), None);
    let both = warning("8e9").unwrap();
    assert!(
        both.contains("--set zero_optimization.offload_optimizer.device=nvme --set zero_optimization.offload_param.device=nvme"),
        "{both}"
    );
    let none = warning("1e8").unwrap();
    assert!(
        none.contains("even with --set zero_optimization.offload_optimizer.device=nvme"),
        "{none}"
    );
}

/// `"auto"` settings fit the device; forced ones are taken as given, and a plan whose
/// device bytes then exceed the GPU's memory (or `train.device_memory`) says so once,
/// with the change that fits: the forced keys back to `"auto"`, then offloads and a
/// smaller micro-batch.
#[test]
fn a_plan_over_the_device_memory_names_the_change_that_fits() {
    let gpu = DeviceFacts {
        cuda_bf16: true,
        cuda_devices: 8,
        cuda_memory: Some(80_000_000_000),
        ..DeviceFacts::default()
    };
    let warning = |sets: &[&str]| {
        let mut v = json!({
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 8,
            "model": {"preset": "llama-70b"},
            "data": { "seq_len": 2048, "synthetic": "markov" },
            "zero_optimization": { "stage": 3, "offload_param": { "device": "cpu" },
                                   "offload_optimizer": { "device": "cpu" } },
            "train": { "accelerator": "cuda", "devices": 8, "host_memory": 1e13 }
        });
        for s in sets {
            tierzero::config::overrides::apply(&mut v, s).unwrap();
        }
        let loaded = from_json(v, &[], gpu).unwrap();
        let found: Vec<String> = loaded
            .warnings
            .iter()
            .filter(|w| w.contains("device memory per rank"))
            .cloned()
            .collect();
        assert!(found.len() <= 1, "{found:?}");
        found.into_iter().next()
    };
    assert_eq!(warning(&[]), None);
    let gathered = warning(&["train.keep_gathered=true"]).unwrap();
    assert!(
        gathered.contains("over the GPU's memory")
            && gathered.contains("--set train.keep_gathered=auto plans"),
        "{gathered}"
    );
    let threshold = warning(&["zero_optimization.stage3_param_persistence_threshold=1e12"]).unwrap();
    assert!(
        threshold.contains("--set zero_optimization.stage3_param_persistence_threshold=auto plans"),
        "{threshold}"
    );
}

/// DeepSpeed's partial offload: `offload_optimizer.ratio` is the fraction of units whose
/// optimizer state is offloaded, the first `⌊(1 − ratio)·units⌋` stay on the device; it
/// needs the state offloaded and a fraction, and `"auto"` keeps on the device as many
/// units as fit its budget. `train.optimizer_max_in_cpu` then keeps the next units' state
/// in host memory, the rest on NVMe; its `"auto"` fills host memory, and the plan prints
/// the placement.
#[test]
fn optimizer_state_spreads_over_device_host_and_nvme() {
    let nvme = std::env::temp_dir();
    let sets = |extra: &[&str]| {
        let mut sets = vec![
            "zero_optimization.stage=3".to_string(),
            "zero_optimization.offload_optimizer.device=nvme".into(),
            format!("zero_optimization.offload_optimizer.nvme_path={}", nvme.display()),
        ];
        sets.extend(extra.iter().map(|s| s.to_string()));
        sets
    };
    let plan_with = |extra: &[&str]| {
        let sets = sets(extra);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        with(base(), &sets).unwrap().plan
    };
    let tiers = |plan: &tierzero::plan::Plan| tierzero::plan::rules::optimizer_tiers(plan);
    // DeepSpeed's default swaps every unit
    assert!(tiers(&plan_with(&[])).iter().all(|t| *t == Tier::Nvme));
    let plan = plan_with(&["zero_optimization.offload_optimizer.ratio=0.5"]);
    let n = tiers(&plan).len();
    let numels = plan.model.config.unit_numels();
    let spread = plan_with(&[
        "zero_optimization.offload_optimizer.ratio=0.5",
        &format!("train.optimizer_max_in_cpu={}", numels[n / 2]),
    ]);
    let t = tiers(&spread);
    assert!(t[..n / 2].iter().all(|t| *t == Tier::Device), "{t:?}");
    assert_eq!(t[n / 2], Tier::Cpu);
    assert!(t[n / 2 + 1..].iter().all(|t| *t == Tier::Nvme), "{t:?}");
    let table = tierzero::plan::plan_table(&spread);
    assert_eq!(n, 4);
    let expected = "units 0–1 on the device, 2 in host memory, 3 on nvme";
    assert!(table.contains(expected), "{table}");
    // a fraction, of offloaded state
    for (set, needle) in [
        (
            "zero_optimization.offload_optimizer.ratio=1.5",
            "is not a fraction",
        ),
        (
            "zero_optimization.offload_optimizer.device=none",
            "needs the optimizer state offloaded",
        ),
    ] {
        let err = error_of(
            base(),
            &[
                "zero_optimization.stage=3",
                "zero_optimization.offload_optimizer.ratio=0.5",
                set,
            ],
        );
        assert!(err.contains(needle), "{set}: {err}");
    }
    // "auto": as many units on a device budget as fit, and host memory filled after them
    let device = plan_with(&[
        "zero_optimization.offload_optimizer.ratio=auto",
        "train.device_memory=1e12",
    ]);
    assert!(tiers(&device).iter().all(|t| *t == Tier::Device));
    let none = plan_with(&[
        "zero_optimization.offload_optimizer.ratio=auto",
        "train.device_memory=1",
    ]);
    assert!(!tiers(&none).contains(&Tier::Device));
    let host = plan_with(&["train.optimizer_max_in_cpu=auto", "train.host_memory=1e12"]);
    assert!(tiers(&host).iter().all(|t| *t == Tier::Cpu));
    let choice = host
        .auto
        .iter()
        .find(|c| c.key == "train.optimizer_max_in_cpu")
        .unwrap();
    assert!(choice.why.contains("fit in host memory"), "{}", choice.why);
    // without NVMe the key has nothing to place: said once
    let loaded = with(
        base(),
        &["zero_optimization.stage=3", "train.optimizer_max_in_cpu=5"],
    )
    .unwrap();
    assert!(loaded
        .warnings
        .iter()
        .any(|w| w.contains("train.optimizer_max_in_cpu has no effect")));
}

/// `pipeline_read`/`pipeline_write` with DeepSpeed's default `buffer_count` (one sub-group's
/// buffers) have next to nothing to overlap: said once, with the count DeepSpeed's
/// swapper needs for the flags; not said with two sets, nor where no optimizer state is
/// on NVMe.
#[test]
fn pipelining_with_one_buffer_set_is_said() {
    let nvme = std::env::temp_dir();
    let path = format!("zero_optimization.offload_optimizer.nvme_path={}", nvme.display());
    let sets = |extra: &[&'static str]| -> Vec<String> {
        let mut all = vec![
            "zero_optimization.stage=3".to_string(),
            "zero_optimization.offload_optimizer.device=nvme".to_string(),
            path.clone(),
            "zero_optimization.offload_optimizer.pipeline_read=true".to_string(),
        ];
        all.extend(extra.iter().map(|s| s.to_string()));
        all
    };
    let warned = |sets: Vec<String>| -> Vec<String> {
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let loaded = with(base(), &sets).unwrap();
        loaded
            .warnings
            .into_iter()
            .filter(|w| w.contains("next to no effect with buffer_count"))
            .collect()
    };
    let one = warned(sets(&[]));
    assert_eq!(one.len(), 1, "{one:?}");
    assert!(
        one[0].contains("offload_optimizer.pipeline_read") && one[0].contains("set buffer_count to"),
        "{}",
        one[0]
    );
    assert!(warned(sets(&["zero_optimization.offload_optimizer.buffer_count=8"])).is_empty());
    // both flags: the three sets DeepSpeed's swapper needs for them
    let both = warned(sets(&["zero_optimization.offload_optimizer.pipeline_write=true"]));
    assert!(
        both[0].contains("pipeline_read and pipeline_write have") && both[0].contains("3 sets"),
        "{both:?}"
    );
    let mut on_host = sets(&[]);
    on_host[1] = "zero_optimization.offload_optimizer.device=cpu".into();
    assert!(warned(on_host).is_empty());
}

/// The backward reads ahead as many sub-groups of NVMe state as the pipeline has buffer
/// sets only where it moves nothing of its own on the disk: with gradients in the swap
/// store or parameters on NVMe, one, so that its own transfers never queue behind more.
#[test]
fn the_backward_reads_ahead_deeply_only_where_it_leaves_the_disk_alone() {
    use tierzero::plan::rules::{pipeline_sets, read_ahead_sets};
    let nvme = std::env::temp_dir();
    let optimizer = format!("zero_optimization.offload_optimizer.nvme_path={}", nvme.display());
    let param = format!("zero_optimization.offload_param.nvme_path={}", nvme.display());
    let sets_of = |extra: &[&str]| -> (usize, usize) {
        let mut all = vec![
            "zero_optimization.stage=3",
            "zero_optimization.offload_optimizer.device=nvme",
            "zero_optimization.offload_optimizer.buffer_count=12",
            optimizer.as_str(),
        ];
        all.extend(extra);
        let plan = with(base(), &all).unwrap().plan;
        (pipeline_sets(&plan), read_ahead_sets(&plan))
    };
    let held = ["gradient_accumulation_steps=2", "train.accumulate_on_device=true"];
    // the step's sums held on the device: nothing of the backward's on the disk
    assert_eq!(sets_of(&held), (4, 4));
    // one micro-batch: the gradients go through the swap store during the backward
    assert_eq!(sets_of(&[]), (3, 1));
    // parameters read from NVMe during the backward
    let mut on_nvme = held.to_vec();
    on_nvme.extend([
        "zero_optimization.offload_param.device=nvme",
        "zero_optimization.offload_param.max_in_cpu=0",
        "zero_optimization.stage3_param_persistence_threshold=0",
        param.as_str(),
    ]);
    assert_eq!(sets_of(&on_nvme), (4, 1));
}

/// Swap files over `train.nvme_space` are said at plan time, with what would fit them.
#[test]
fn swap_files_over_the_nvme_space_are_said() {
    let nvme = std::env::temp_dir();
    let warnings = |space: &str| {
        with(
            base(),
            &[
                "zero_optimization.stage=3",
                "zero_optimization.offload_optimizer.device=nvme",
                &format!("zero_optimization.offload_optimizer.nvme_path={}", nvme.display()),
                &format!("train.nvme_space={space}"),
            ],
        )
        .unwrap()
        .warnings
    };
    assert!(!warnings("1e12").iter().any(|w| w.contains("train.nvme_space")));
    let over = warnings("1000");
    assert!(
        over.iter()
            .any(|w| w.contains("over train.nvme_space") && w.contains("train.optimizer_max_in_cpu")),
        "{over:?}"
    );
}
