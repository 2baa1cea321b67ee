//! tierzero's blocks against Hugging Face transformers, and HF directory round trips.
//!
//! `tests/data/hf_reference.json` holds logits and the loss that transformers'
//! `LlamaForCausalLM` / `GPT2LMHeadModel` compute on tierzero's seeded initial weights
//! with every norm scale and bias perturbed, Llama-3 RoPE scaling in both config forms,
//! and the tensor names transformers saves; `tests/data/hf_reference.py` produced it.

use tch::{Kind, Tensor};
use tierzero::model::hf::{self, SaveDtype};
use tierzero::model::Model;
use tierzero::plan::{load, DeviceFacts};
use tierzero::run::initial_weights;
use tierzero::torch::tensor_f32;

pub(crate) fn plan_for(sets: &[String]) -> tierzero::plan::Plan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json");
    load(&path, sets, DeviceFacts::default()).unwrap().plan
}

/// Logits and mean loss of a fixed batch (shared with the checkpoint tests).
pub(crate) fn logits(model: &Model, weights: &[Vec<f32>]) -> (Tensor, f64) {
    let v = model.config.vocab_size as i64;
    let tokens = Tensor::from_slice(&(0..32).map(|i| (i * 7 + 3) % v).collect::<Vec<i64>>()).view([2, 16]);
    let targets = Tensor::from_slice(&(0..32).map(|i| (i * 5 + 1) % v).collect::<Vec<i64>>()).view([2, 16]);
    let params: Vec<Tensor> = weights
        .iter()
        .map(|w| tensor_f32(w, tch::Device::Cpu).unwrap())
        .collect();
    let mut x = tokens;
    for (u, p) in params.iter().enumerate() {
        x = model.forward_unit(u, p, &x, None).unwrap();
    }
    let h = model.config.hidden_size as i64;
    let head = if model.config.tie_word_embeddings {
        params[0].narrow(0, 0, v * h).view([v, h])
    } else {
        let last = model.units.last().unwrap();
        let spec = last.param("lm_head.weight").unwrap();
        params[params.len() - 1]
            .narrow(0, spec.offset as i64, spec.numel as i64)
            .view([v, h])
    };
    let logits = x.matmul(&head.tr());
    let loss = logits
        .view([-1, v])
        .log_softmax(-1, Kind::Float)
        .gather(1, &targets.view([-1, 1]), false)
        .mean(Kind::Float)
        .neg();
    (logits, loss.double_value(&[]))
}

/// `perturbed()` of `tests/data/hf_reference.py`: norm scales around 1, biases around 0,
/// different per tensor (a seed from the name's bytes) and per element.
fn perturbed(name: &str, numel: usize) -> Vec<f32> {
    let seed = f64::from(name.bytes().map(u32::from).sum::<u32>() % 101) * 0.1;
    let bias = name.ends_with(".bias");
    (0..numel)
        .map(|j| {
            let wave = (0.37 * j as f64 + seed).sin();
            (if bias { 0.1 * wave } else { 1.0 + 0.5 * wave }) as f32
        })
        .collect()
}

fn is_perturbed(name: &str) -> bool {
    name.ends_with(".bias") || name.contains("norm") || name.contains(".ln_")
}

/// The plan's seeded initial weights with every norm scale and bias perturbed.
pub(crate) fn perturbed_weights(plan: &tierzero::plan::Plan) -> Vec<Vec<f32>> {
    let model = Model::new(plan.model.config.clone(), Kind::Float);
    let mut weights = initial_weights(plan).unwrap();
    let mut perturbed_count = 0;
    for (unit, w) in model.units.iter().zip(&mut weights) {
        for spec in unit.params.iter().filter(|p| is_perturbed(&p.name)) {
            w[spec.offset..spec.offset + spec.numel].copy_from_slice(&perturbed(&spec.name, spec.numel));
            perturbed_count += 1;
        }
    }
    assert!(perturbed_count >= 5, "only {perturbed_count} tensors perturbed");
    weights
}

/// `weights` of the plan's model written as a Hugging Face directory (fp32, one file).
pub(crate) fn exported(plan: &tierzero::plan::Plan, weights: &[Vec<f32>]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    hf::save(
        dir.path(),
        &plan.model.config,
        weights,
        SaveDtype::F32,
        usize::MAX,
    )
    .unwrap();
    dir
}

/// A JSON array of strings.
pub(crate) fn strings(array: &serde_json::Value) -> Vec<String> {
    array
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Tensor names in a safetensors file's header.
fn safetensors_keys(path: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let mut keys: Vec<String> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    keys.sort();
    keys
}

/// Largest |tierzero − transformers| over the logits and the loss seen in this test is
/// about 1e-6 (fp32, different summation orders); 2e-5 keeps 20x of that, while the
/// cases differ from each other by 1e-3 or more (RoPE scaling past
/// `original_max_position_embeddings` moves position 15's logits by 1.2e-3 to 3.6e-3).
const TOLERANCE: f64 = 2e-5;

#[test]
fn logits_match_transformers_with_random_norms_biases_and_llama3_rope() {
    check_logits("hf_reference.json");
}

/// Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, head width 32 beside a
/// hidden size of 64 over 4 heads) against transformers' own classes; the export's
/// config.json reads back as the same shape.
#[test]
fn llama_relatives_match_transformers_and_round_trip_their_config() {
    check_logits("families_reference.json");
    for preset in ["mistral-tiny", "qwen2-tiny", "qwen3-tiny"] {
        let plan = plan_for(&[format!("model.preset={preset}")]);
        let dir = exported(&plan, &initial_weights(&plan).unwrap());
        let config = tierzero::config::model::ModelConfig::from_hf_dir(dir.path()).unwrap();
        assert_eq!(config, plan.model.config, "{preset}");
    }
}

/// Every case of a reference file: exported names, logits and loss.
fn check_logits(file: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file);
    let text = std::fs::read_to_string(path).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut worst: f64 = 0.0;
    for (name, case) in expected.as_object().unwrap() {
        let plan = plan_for(&strings(&case["sets"]));
        let mut config = plan.model.config.clone();
        if let Some(json) = case.get("config_json") {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
            config = tierzero::config::model::ModelConfig::from_hf_dir(dir.path()).unwrap();
            let scaling = config.rope_scaling.expect("the case's RoPE scaling was read");
            assert_eq!(scaling.original_max_position_embeddings, 8, "{name}");
            assert_eq!(scaling.factor, 4.0, "{name}");
        }
        let model = Model::new(config.clone(), Kind::Float);
        let weights = perturbed_weights(&plan);
        // Through tierzero's export and import: the file holds exactly the tensors
        // transformers' save_pretrained writes for this model.
        let dir = tempfile::tempdir().unwrap();
        hf::save(dir.path(), &config, &weights, SaveDtype::F32, usize::MAX).unwrap();
        assert_eq!(
            safetensors_keys(&dir.path().join("model.safetensors")),
            strings(&case["keys"]),
            "{name}: exported tensor names"
        );
        let loaded = hf::load(dir.path(), &config).unwrap();
        let (logits, loss) = logits(&model, &loaded);
        for (key, row, pos) in [("logits_row0_pos0", 0, 0), ("logits_row1_pos15", 1, 15)] {
            let want: Vec<f64> = case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let got: Vec<f32> = Vec::try_from(logits.get(row).get(pos).narrow(0, 0, 8)).unwrap();
            for (g, w) in got.iter().zip(&want) {
                worst = worst.max((f64::from(*g) - w).abs());
                assert!(
                    (f64::from(*g) - w).abs() < TOLERANCE,
                    "{name} {key}: {got:?} vs {want:?}"
                );
            }
        }
        let want = case["loss"].as_f64().unwrap();
        worst = worst.max((loss - want).abs());
        assert!(
            (loss - want).abs() < TOLERANCE,
            "{name}: loss {loss} vs transformers {want}"
        );
    }
    println!("largest difference from transformers: {worst:.2e}");
}

#[test]
fn save_then_load_round_trips_single_and_sharded() {
    for preset in ["llama-tiny", "gpt2-tiny"] {
        let plan = plan_for(&[format!("model.preset={preset}")]);
        let weights = initial_weights(&plan).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for (shard, dtype) in [
            (usize::MAX, SaveDtype::F32),
            (50_000, SaveDtype::F32),
            (50_000, SaveDtype::Bf16),
        ] {
            let out = dir.path().join(format!("{shard}-{dtype:?}"));
            hf::save(&out, &plan.model.config, &weights, dtype, shard).unwrap();
            assert_eq!(
                out.join("model.safetensors.index.json").exists(),
                shard != usize::MAX
            );
            let config = tierzero::config::model::ModelConfig::from_hf_dir(&out).unwrap();
            assert_eq!(config, plan.model.config, "{preset}: config.json round trip");
            let back = hf::load(&out, &config).unwrap();
            for (a, b) in back.iter().zip(&weights) {
                for (x, y) in a.iter().zip(b) {
                    let tolerance = if dtype == SaveDtype::Bf16 {
                        y.abs() / 128.0
                    } else {
                        0.0
                    };
                    assert!((x - y).abs() <= tolerance, "{preset} {dtype:?}: {x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn a_truncated_safetensors_file_names_itself() {
    let plan = plan_for(&["model.preset=llama-tiny".to_string()]);
    let dir = tempfile::tempdir().unwrap();
    hf::save(
        dir.path(),
        &plan.model.config,
        &initial_weights(&plan).unwrap(),
        SaveDtype::F32,
        usize::MAX,
    )
    .unwrap();
    let file = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = hf::load(dir.path(), &plan.model.config).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}

/// Llama-3 RoPE at Llama-3.2-1B's real settings (head_dim 64, theta 500000, factor 32,
/// original context 8192) against the tables transformers builds
/// (`tests/data/rope_reference.json`, from `tests/data/rope_reference.py`): there every
/// branch of the frequency rule runs — 15 frequencies kept, 3 smoothed, 14 divided by the
/// factor — where the tiny test models' head_dim 16 reach only one.
#[test]
fn llama3_rope_tables_match_transformers_at_llama_3_2_1b_settings() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/rope_reference.json");
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let branches = strings(&reference["branch"]);
    for branch in ["high", "smooth", "low"] {
        assert!(
            branches.iter().any(|b| b == branch),
            "the reference has no {branch:?} frequency"
        );
    }
    let config = tierzero::config::model::ModelConfig::preset("llama-1b").unwrap();
    assert_eq!(config.head_dim(), 64);
    let positions: Vec<i64> = floats(&reference["positions"])
        .iter()
        .map(|&p| p as i64)
        .collect();
    let seq_len = positions.iter().max().unwrap() + 1;
    let (cos, sin) = tierzero::model::blocks::rope_tables(&config, seq_len, Kind::Float).unwrap();
    // inv_freq is the angle at position 1: acos of the cos table's second row gives it
    // back only near 0; read it from the sines of position 1 instead (angles ≤ 1 rad)
    let expected_inv = floats(&reference["inv_freq"]);
    let sin_1: Vec<f64> = Vec::<f32>::try_from(sin.get(1))
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    for (i, &inv) in expected_inv.iter().enumerate() {
        let got = sin_1[i].asin();
        assert!(
            (got - inv).abs() <= 1e-6 * inv.max(1e-3),
            "inv_freq[{i}] ({}): {got} against transformers' {inv}",
            branches[i]
        );
    }
    // the tables, row by row: both round the angle to fp32, and the fp32 frequency may
    // differ by an ulp, so the tolerance grows with the position
    for (row, &p) in positions.iter().enumerate() {
        let tolerance = 1e-5 + 2e-7 * p as f64;
        for (name, table) in [("cos", &cos), ("sin", &sin)] {
            let got = Vec::<f32>::try_from(table.get(p)).unwrap();
            let want = floats(&reference[name][row]);
            assert_eq!(got.len(), want.len());
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= tolerance,
                    "{name}[{p}][{j}]: {g} against transformers' {w}"
                );
            }
        }
    }
}

/// A relative's config.json key whose value the blocks do not implement is refused by
/// name; Mistral's attention window bounds the sequence length.
#[test]
fn relatives_refuse_what_they_do_not_implement_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_for(&["model.preset=qwen3-tiny".to_string()]);
    let base = hf::config_json(&plan.model.config, SaveDtype::F32);
    for (key, value, words) in [
        ("hidden_act", serde_json::json!("gelu"), "SwiGLU"),
        ("attention_dropout", serde_json::json!(0.1), "no dropout"),
        (
            "layer_types",
            serde_json::json!(["full_attention", "sliding_attention"]),
            "full attention",
        ),
        ("mlp_bias", serde_json::json!(true), "no biases"),
        ("model_type", serde_json::json!("phi3"), "not supported"),
    ] {
        let mut c = base.clone();
        c[key] = value;
        std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
        let e = tierzero::config::model::ModelConfig::from_hf_dir(dir.path()).unwrap_err();
        assert!(e.contains(key) || key == "model_type", "{key}: {e}");
        assert!(e.contains(words), "{key}: {e}");
    }
    let e = tierzero::plan::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json"),
        &[
            "model.preset=mistral-tiny".to_string(),
            "data.seq_len=300".to_string(),
        ],
        DeviceFacts::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("data.seq_len") && e.contains("sliding_window (256)"),
        "{e}"
    );
}
