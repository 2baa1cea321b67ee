//! Text data through a Hugging Face `tokenizer.json`: tokenized once, cached next to
//! the text, sampled like a token file; bad input names the file.

use serde_json::json;
use tierzero::data::Dataset;
use tierzero::plan::{from_json, DeviceFacts};

/// A WordLevel tokenizer: whitespace pre-tokenizer, six words, `</s>` as end of text.
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
 "added_tokens":[{"id":3,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
 "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
 "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"</s>":3,"tier":4,"zero":5},"unk_token":"[UNK]"}}"#;

fn dataset(path: &std::path::Path, tokenizer: &std::path::Path) -> Result<Dataset, String> {
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "model": { "preset": "llama-tiny" },
        "data": { "path": path, "tokenizer": tokenizer, "seq_len": 8 },
    });
    let plan = from_json(config, &[], DeviceFacts::default())
        .map_err(|e| e.to_string())?
        .plan;
    Dataset::open(&plan).map_err(|e| e.to_string())
}

#[test]
fn txt_and_jsonl_are_tokenized_cached_and_sampled() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, TOKENIZER).unwrap();
    let txt = dir.path().join("corpus.txt");
    std::fs::write(
        &txt,
        "hello world tier zero\nhello zero\n\nworld tier hello world zero tier\n",
    )
    .unwrap();
    let jsonl = dir.path().join("corpus.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\": \"hello world tier zero hello\"}\n{\"text\": \"zero tier world hello world\"}\n",
    )
    .unwrap();
    for path in [&txt, &jsonl] {
        let data = dataset(path, &tokenizer).unwrap();
        let batch = data.batch(1, 0, 0, 0, 2, 8);
        assert_eq!(batch.inputs.len(), 16);
        assert!(
            batch.inputs.iter().all(|&t| (1..=5).contains(&t)),
            "{path:?}: {:?}",
            batch.inputs
        );
        assert!(
            batch.inputs.contains(&3),
            "documents end with </s>: {:?}",
            batch.inputs
        );
        let caches: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tokens.bin"))
            .collect();
        assert!(!caches.is_empty());
        // a second open uses the cache and samples the same
        assert_eq!(dataset(path, &tokenizer).unwrap().batch(1, 0, 0, 0, 2, 8), batch);
    }
}

#[test]
fn bad_tokenizer_and_bad_jsonl_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, "{ not a tokenizer").unwrap();
    let txt = dir.path().join("a.txt");
    std::fs::write(&txt, "hello world\n").unwrap();
    let e = dataset(&txt, &tokenizer).err().unwrap();
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::write(&tokenizer, TOKENIZER).unwrap();
    let jsonl = dir.path().join("b.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"hello\"}\n{\"body\": \"x\"}\n").unwrap();
    let e = dataset(&jsonl, &tokenizer).err().unwrap();
    assert!(e.contains("b.jsonl") && e.contains("line 2"), "{e}");
}

/// An export is a complete model directory: the tokenizer training read and a
/// generation_config.json come with the weights (from `data.tokenizer`, and from
/// `model.hf_dir` when the run started from one).
#[test]
fn an_export_carries_the_tokenizer_and_a_generation_config() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, TOKENIZER).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token":"</s>"}"#,
    )
    .unwrap();
    let text = dir.path().join("corpus.txt");
    std::fs::write(&text, "hello world tier zero\n".repeat(40)).unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        json!({
            "train_micro_batch_size_per_gpu": 2,
            "model": { "preset": "llama-tiny" },
            "data": { "path": text, "tokenizer": tokenizer, "seq_len": 8 },
        })
        .to_string(),
    )
    .unwrap();
    let export = |out: &std::path::Path, sets: &[String]| {
        let mut args = vec![
            "export".to_string(),
            "--config".into(),
            config.display().to_string(),
        ];
        args.extend(["--hf".into(), out.display().to_string()]);
        for s in sets {
            args.extend(["--set".into(), s.clone()]);
        }
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stderr)
        );
    };
    let first = dir.path().join("first");
    export(&first, &[]);
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap();
    assert_eq!(read(first.join("tokenizer.json")), TOKENIZER);
    assert_eq!(
        read(first.join("tokenizer_config.json")),
        r#"{"eos_token":"</s>"}"#
    );
    let generation: serde_json::Value =
        serde_json::from_str(&read(first.join("generation_config.json"))).unwrap();
    assert_eq!(generation["_from_model_config"], true);
    // a run from that directory exports its tokenizer files again
    let second = dir.path().join("second");
    export(
        &second,
        &[
            "model.preset=null".into(),
            format!("model.hf_dir={}", first.display()),
        ],
    );
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert_eq!(read(second.join(name)), read(first.join(name)), "{name}");
    }
}
