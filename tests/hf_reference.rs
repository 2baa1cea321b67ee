//! tierzero's blocks against Hugging Face transformers, and HF directory round trips.
//!
//! `tests/data/hf_reference.json` holds logits and the loss that transformers'
//! `LlamaForCausalLM` / `GPT2LMHeadModel` compute on tierzero's seeded initial weights
//! (exported as HF directories); `tests/data/hf_reference.py` produced it.

use tch::{Kind, Tensor};
use tierzero::config::{load, DeviceFacts};
use tierzero::model::hf::{self, SaveDtype};
use tierzero::model::Model;
use tierzero::torch::tensor_f32;
use tierzero::zero::trainer::initial_weights;

fn plan_for(sets: &[String]) -> tierzero::config::Plan {
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
        x = model.forward_unit(u, p, &x).unwrap();
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

#[test]
fn logits_match_transformers() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/hf_reference.json"
    ))
    .unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (name, case) in expected.as_object().unwrap() {
        let sets: Vec<String> = case["sets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect();
        let plan = plan_for(&sets);
        let model = Model::new(plan.model.config.clone(), Kind::Float);
        let (logits, loss) = logits(&model, &initial_weights(&plan).unwrap());
        for (key, row, pos) in [("logits_row0_pos0", 0, 0), ("logits_row1_pos15", 1, 15)] {
            let want: Vec<f64> = case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let got: Vec<f32> = Vec::try_from(logits.get(row).get(pos).narrow(0, 0, 8)).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (f64::from(*g) - w).abs() < 1e-4,
                    "{name} {key}: {got:?} vs {want:?}"
                );
            }
        }
        let want = case["loss"].as_f64().unwrap();
        assert!(
            (loss - want).abs() < 1e-4,
            "{name}: loss {loss} vs transformers {want}"
        );
    }
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
            let config = tierzero::model::config::ModelConfig::from_hf_dir(&out).unwrap();
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
