//! Generation against transformers: the models of `hf_reference.rs` (seeded initial
//! weights, perturbed norms and biases), exported and read back as a Hugging Face
//! directory, continue a prompt greedily with exactly the tokens transformers'
//! `generate` chose (`tests/data/generate_reference.json`, from
//! `tests/data/generate_reference.py`; Mistral, Qwen2 and Qwen3 from
//! `tests/data/families_reference.py`).

use crate::hf_reference::{exported, perturbed_weights, plan_for, strings};
use tierzero::model::generate::Sampling;
use tierzero::run::generate::{Generator, Prompt, Weights};

#[test]
fn greedy_generation_equals_transformers_generate() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/generate_reference.json"
    ))
    .unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompt: Vec<i64> = serde_json::from_value(expected["prompt"].clone()).unwrap();
    let families: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/families_reference.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let cases = ["llama-untied", "llama-tied", "gpt2"]
        .iter()
        .map(|n| (n, &expected[n]))
        .chain(
            ["mistral-tiny", "qwen2-tiny", "qwen3-tiny"]
                .iter()
                .map(|n| (n, &families[n])),
        );
    for (name, case) in cases {
        let plan = plan_for(&strings(&case["sets"]));
        let dir = exported(&plan, &perturbed_weights(&plan));
        let generator = Generator::open(Weights::Hf(dir.path()), None, tch::Device::Cpu).unwrap();
        let ids = generator.encode(&Prompt::Ids(prompt.clone())).unwrap();
        let got = generator.generate(&ids, 24, &Sampling::greedy()).unwrap();
        let want: Vec<i64> = serde_json::from_value(case["greedy"].clone()).unwrap();
        assert_eq!(got, want, "{name}");
    }
}
