//! Fine-tuning records: chat templates and loss masks against transformers' and TRL's
//! (stored references, `tests/data/chat/reference.py`), samples as rows of a run, and
//! bad input named by file, line and field.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tierzero::data::encode::Encoder;
use tierzero::data::records::Record;
use tierzero::data::Dataset;
use tierzero::device::lanes::Mode;
use tierzero::engine::context::LaneOptions;
use tierzero::engine::prefetch::DroppedWait;
use tierzero::model::chat::ChatTemplate;
use tierzero::plan::{from_json, DeviceFacts, Plan};
use tierzero::run::generate::{Generator, Prompt, Weights};
use tierzero::run::{train, TrainOptions};

pub fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat")
}

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(chat_dir().join("tokenizer.json")).unwrap()
}

fn encoder(family: &str, train_on_prompt: bool) -> Encoder {
    let (template, _) = ChatTemplate::beside(&chat_dir().join(family).join("tokenizer_config.json"))
        .unwrap()
        .unwrap();
    Encoder::new(tokenizer(), Some(template), String::new(), train_on_prompt)
}

fn mask(counted: &[bool]) -> Vec<u64> {
    counted.iter().map(|&c| u64::from(c)).collect()
}

/// Four families (Llama 3, Qwen 2.5, Mistral, Gemma), each with its published template
/// (assistant spans found as the text each answer adds to its prompt) and with TRL-style
/// `{% generation %}` blocks (the spans transformers reads): the same text, token ids
/// and assistant mask as transformers' `apply_chat_template(…, return_assistant_tokens_mask=True)`,
/// TRL's completion mask for a conversational prompt/completion, and the template's own
/// refusal for conversations it rejects.
#[test]
fn chat_templates_render_tokenize_and_mask_as_transformers_does() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(chat_dir().join("reference.json")).unwrap()).unwrap();
    let mut checked = 0;
    for (family, cases) in reference.as_object().unwrap() {
        for variant in [family.clone(), format!("{family}-marked")] {
            let enc = encoder(&variant, false);
            let (template, _) = ChatTemplate::beside(&chat_dir().join(&variant)).unwrap().unwrap();
            for case in cases.as_array().unwrap() {
                let messages = case["messages"].as_array().unwrap().clone();
                let what = format!("{variant}: {}", case["messages"]);
                if let Some(error) = case["error"].as_str() {
                    if variant.ends_with("-marked") {
                        continue; // the marked templates keep only the rendering
                    }
                    let e = template.render_spans(&messages).unwrap_err().to_string();
                    assert!(e.contains(error), "{what}: {e}");
                    continue;
                }
                assert_eq!(
                    template.render(&messages, false).unwrap(),
                    case["text"].as_str().unwrap(),
                    "{what}"
                );
                let e = enc.encode(&Record::Messages(messages.clone())).unwrap();
                let ids: Vec<u64> = e.ids.iter().map(|&i| u64::from(i)).collect();
                let expected: Vec<u64> = serde_json::from_value(case["ids"].clone()).unwrap();
                assert_eq!(ids, expected, "{what}");
                let masks: Vec<u64> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
                assert_eq!(mask(&e.counted), masks, "{what}: assistant mask");
                // the last answer as the completion of the rest
                let (prompt, completion) = messages.split_at(messages.len() - 1);
                let record = Record::Prompt {
                    prompt: Value::Array(prompt.to_vec()),
                    completion: Value::Array(completion.to_vec()),
                };
                let e = enc.encode(&record).unwrap();
                let completion_mask: Vec<u64> =
                    serde_json::from_value(case["completion_mask"].clone()).unwrap();
                assert_eq!(mask(&e.counted), completion_mask, "{what}: completion mask");
                // train_on_prompt counts every token
                let all = encoder(&variant, true)
                    .encode(&Record::Messages(messages))
                    .unwrap();
                assert!(all.counted.iter().all(|&c| c) && all.ids == e.ids, "{what}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 20);
}

/// A config for `data` (a .jsonl or directory) with the reference tokenizer and the
/// Llama 3 template, a Llama big enough for its vocabulary; `extra` is merged into the
/// data section.
pub fn config(data: &Path, micro: usize, accumulation: usize, world: usize, extra: Value) -> Value {
    let mut d = json!({
        "path": data,
        "tokenizer": chat_dir().join("tokenizer.json"),
        "chat_template": chat_dir().join("llama3/tokenizer_config.json"),
        "seq_len": 48,
    });
    for (k, v) in extra.as_object().unwrap() {
        d[k] = v.clone();
    }
    json!({
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "model": { "preset": "llama-tiny", "vocab_size": 640 },
        "data": d,
        "train": { "steps": 4, "devices": world, "seed": 3 }
    })
}

pub fn plan(data: &Path, micro: usize, accumulation: usize, world: usize, extra: Value) -> Plan {
    from_json(
        config(data, micro, accumulation, world, extra),
        &[],
        DeviceFacts::default(),
    )
    .unwrap()
    .plan
}

pub fn capitals() -> Vec<(&'static str, &'static str)> {
    vec![
        ("France", "Paris"),
        ("Italy", "Rome"),
        ("Spain", "Madrid"),
        ("Peru", "Lima"),
        ("Japan", "Tokyo"),
        ("Egypt", "Cairo"),
        ("Kenya", "Nairobi"),
        ("Chile", "Santiago"),
    ]
}

/// Chat records asking for capitals, `n` of them, some with a system turn and two turns.
pub fn write_chat(path: &Path, n: usize) {
    let c = capitals();
    let mut lines = String::new();
    for i in 0..n {
        let (country, city) = c[i % c.len()];
        let mut messages = vec![];
        if i % 3 == 0 {
            messages.push(json!({"role": "system", "content": "Answer in one word."}));
        }
        messages.push(json!({"role": "user", "content": format!("What is the capital of {country}?")}));
        messages.push(json!({"role": "assistant", "content": city}));
        if i % 4 == 1 {
            let (country, city) = c[(i + 3) % c.len()];
            messages.push(json!({"role": "user", "content": format!("And of {country}?")}));
            messages.push(json!({"role": "assistant", "content": city}));
        }
        lines.push_str(&json!({ "messages": messages }).to_string());
        lines.push('\n');
    }
    std::fs::write(path, lines).unwrap();
}

/// Rows are a function of their global index: micro-batches of any size, accumulation
/// and world size see the same rows, each sample whole in one row; counted targets are
/// the assistant tokens; the global batch's count is what the engine divides by.
#[test]
fn samples_fill_rows_the_same_way_for_any_split_of_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    write_chat(&data, 40);
    let whole = Dataset::open(&plan(&data, 8, 1, 1, json!({}))).unwrap();
    let split = Dataset::open(&plan(&data, 2, 2, 2, json!({}))).unwrap();
    let report = whole.describe().unwrap();
    assert!(
        report.starts_with("data: 40 samples (0 held out for eval)"),
        "{report}"
    );
    for step in 0..3 {
        let a = whole.batch(3, 0, step, 0, 8, 48);
        let mut rows = Vec::new();
        for micro in 0..4 {
            let b = split.batch(3, 0, step, micro, 2, 48);
            rows.extend(
                b.inputs
                    .chunks(48)
                    .zip(b.targets.chunks(48))
                    .map(|(i, t)| (i.to_vec(), t.to_vec())),
            );
        }
        let whole_rows: Vec<_> = a
            .inputs
            .chunks(48)
            .zip(a.targets.chunks(48))
            .map(|(i, t)| (i.to_vec(), t.to_vec()))
            .collect();
        assert_eq!(rows, whole_rows, "step {step}");
        let counted = a.targets.iter().filter(|&&t| t >= 0).count() as u64;
        assert_eq!(whole.counted(step), Some(counted));
        assert_eq!(split.counted(step), Some(counted));
        // every row starts a sample, samples are whole, and the segments say where
        let segments = a.segments.unwrap();
        for row in segments.chunks(48) {
            assert_eq!(row[0], 0);
            assert!(row.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
        }
    }
    // a counted target is never the template's: the tokens trained are the answers and
    // the turn's end
    let tok = tokenizer();
    let a = whole.batch(3, 0, 0, 0, 8, 48);
    let trained: Vec<u32> = a.targets.iter().filter(|&&t| t >= 0).map(|&t| t as u32).collect();
    let text = tok.decode(&trained, false).unwrap();
    assert!(
        text.contains("<|eot_id|>") && !text.contains("user") && !text.contains("capital"),
        "{text}"
    );
    // without packing: one sample per row, padded, no segments
    let padded = Dataset::open(&plan(&data, 8, 1, 1, json!({"packing": false}))).unwrap();
    let b = padded.batch(3, 0, 0, 0, 8, 48);
    assert!(b.segments.is_none());
    let ends = b.targets.chunks(48).filter(|row| row[47] == -1).count();
    assert!(ends >= 6, "rows end in padding: {:?}", b.inputs);
}

/// A held-out fraction takes samples out of training; epochs reshuffle the rest.
#[test]
fn a_held_out_fraction_is_not_trained_and_epochs_reshuffle() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    write_chat(&data, 200);
    let data_set = Dataset::open(&plan(
        &data,
        4,
        1,
        1,
        json!({"eval_fraction": 0.1, "packing": false}),
    ))
    .unwrap();
    let report = data_set.describe().unwrap();
    let held: usize = report["data: 200 samples (".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((5..40).contains(&held), "{report}");
    let train = 200 - held;
    let rows: Vec<Vec<i64>> = (0..(2 * train).div_ceil(4) as u64)
        .flat_map(|step| {
            let b = data_set.batch(3, 0, step, 0, 4, 48);
            b.inputs.chunks(48).map(<[i64]>::to_vec).collect::<Vec<_>>()
        })
        .collect();
    let (epoch0, epoch1) = rows[..2 * train].split_at(train);
    let (mut a, mut b) = (epoch0.to_vec(), epoch1.to_vec());
    assert_ne!(a, b, "the second epoch is reshuffled");
    a.sort();
    b.sort();
    assert_eq!(a, b, "each epoch is the training samples once");
}

/// Bad records are named by file, line and field, and no cache is written.
#[test]
fn bad_records_name_file_line_and_field_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"question\": \"q\"}\n",
            "line 2: has none of the fields",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": 7}]}\n",
            "line 1: messages[0].content is not a string",
        ),
        ("{\"prompt\": \"q\"}\n", "line 1: has none of the fields"),
        ("{\"messages\": [{\"role\": \"user\"\n", "line 1: not JSON"),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let e = Dataset::open(&plan(&path, 2, 1, 1, json!({})))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(&format!("bad{i}.jsonl")) && e.contains(expected),
            "{e}"
        );
    }
    // a role the template rejects: Mistral's alternation, in its own words
    let path = dir.path().join("roles.jsonl");
    std::fs::write(
        &path,
        "{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}]}\n",
    )
    .unwrap();
    let e = Dataset::open(&plan(
        &path,
        2,
        1,
        1,
        json!({"chat_template": chat_dir().join("mistral/tokenizer_config.json")}),
    ))
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("roles.jsonl") && e.contains("line 1") && e.contains("Conversation roles must alternate"),
        "{e}"
    );
    // chat data and a tokenizer without a template: the key and the fix
    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    std::fs::copy(chat_dir().join("tokenizer.json"), bare.join("tokenizer.json")).unwrap();
    let good = dir.path().join("good.jsonl");
    write_chat(&good, 4);
    let mut p = plan(&good, 2, 1, 1, json!({}));
    p.data.source = tierzero::plan::DataSource::Text {
        path: good.clone(),
        tokenizer: bare.join("tokenizer.json"),
    };
    p.data.records.chat_template = None;
    let e = Dataset::open(&p).err().unwrap().to_string();
    assert!(
        e.contains("need a chat template") && e.contains("data.chat_template"),
        "{e}"
    );
    let written: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("samples") || n.contains("partial"))
        .collect();
    assert!(written.is_empty(), "{written:?}");
}

const CHECKED: LaneOptions = LaneOptions {
    mode: Mode::Checked {
        seed: 11,
        max_delay_us: 300,
    },
    dropped: DroppedWait::None,
};

/// Chat data trains the same whatever the split of its global batch of 8 packed rows:
/// one rank with one micro-batch of 8, two ranks with 2 micro-batches of 2, two ranks
/// with 4 of 1 (rows with more or fewer answer tokens weigh by their tokens, not by
/// their micro-batch), ZeRO-3 with the optimizer on the host, checked lanes: the same
/// losses and master weights up to the order of fp32 sums. Adam's eps is 1e-3 here:
/// with 1e-8, elements whose gradient is near eps turn sum-order rounding into update
/// differences of 3e-5 relative (measured); with 1e-3 the runs agree within 6e-7.
#[test]
fn chat_data_trains_the_same_for_any_split_of_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    write_chat(&data, 64);
    let run = |micro: usize, accumulation: usize, world: usize| {
        let mut c = config(&data, micro, accumulation, world, json!({}));
        c["zero_optimization"] = json!({
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": { "device": "cpu" }
        });
        checked_run(c)
    };
    let reference = run(8, 1, 1);
    for (micro, accumulation, world) in [(4, 2, 1), (2, 2, 2), (1, 4, 2)] {
        let r = run(micro, accumulation, world);
        assert_same_training(&r, &reference, &format!("{micro} × {accumulation} × {world}"));
    }
}

/// A run of `config` (Adam's eps 1e-3, see above) under checked lanes, with its master
/// weights.
fn checked_run(mut config: Value) -> tierzero::run::TrainResult {
    config["optimizer"] = json!({ "type": "AdamW", "params": { "lr": 1e-2, "eps": 1e-3 } });
    let plan = from_json(config, &[], DeviceFacts::default()).unwrap().plan;
    let options = TrainOptions {
        collect_master: true,
        lanes: Some(CHECKED),
        ..TrainOptions::default()
    };
    train(&plan, options).unwrap()
}

/// The same losses (1e-5 relative) and master weights (2e-6 of each unit's largest).
fn assert_same_training(got: &tierzero::run::TrainResult, want: &tierzero::run::TrainResult, what: &str) {
    for (a, b) in got.steps.iter().zip(&want.steps) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * b.loss,
            "{what}: step {} loss {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    for (u, (a, b)) in got.master.iter().zip(&want.master).enumerate() {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 2e-6 * scale,
            "{what}: unit {u}: max |Δ| {diff:e} vs max |w| {scale:e}"
        );
    }
}

/// A small Llama fine-tuned on a chat data set made here learns the answers (the loss,
/// over answer tokens only, falls near its floor of 0: each answer is a function of its
/// question) while the prompts are not trained: on the same conversations scored on
/// every token (`eval_path`, text records), the loss stays high.
#[test]
fn a_chat_fine_tune_learns_the_answers_and_not_the_prompts() {
    const STEPS: u64 = 150;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    write_chat(&data, 64);
    // the same conversations as plain text: every token scored
    let (template, _) = ChatTemplate::beside(&chat_dir().join("llama3")).unwrap().unwrap();
    let texts: String = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let text = template.render(v["messages"].as_array().unwrap(), false).unwrap();
            format!("{}\n", json!({ "text": text }))
        })
        .collect();
    let whole = dir.path().join("whole.jsonl");
    std::fs::write(&whole, texts).unwrap();
    let mut c = config(&data, 8, 1, 1, json!({ "eval_path": whole }));
    c["train"]["steps"] = json!(STEPS);
    c["train"]["eval_interval"] = json!(STEPS);
    c["optimizer"] = json!({ "type": "AdamW", "params": { "lr": 3e-3 } });
    let plan = from_json(c, &[], DeviceFacts::default()).unwrap().plan;
    let result = train(&plan, TrainOptions::default()).unwrap();
    // the device row counts the packed rows' mask and positions the engine reserves
    assert_eq!(
        result.device_peaks[0],
        tierzero::plan::memory::predict(&plan).reserved()
    );
    let mean = |from: usize, to: usize| {
        result.steps[from..to].iter().map(|s| s.loss).sum::<f64>() / (to - from) as f64
    };
    let (first, last) = (mean(0, 10), mean(STEPS as usize - 10, STEPS as usize));
    let every_token = result.evals.last().unwrap().1;
    // measured: answers 5.18 -> 0.013, every token 8.4 (above ln 640 = 6.5: the
    // untrained prompt tokens are pushed down by the trained ones)
    assert!(first > 2.0 && last < 0.1, "answer loss {first} -> {last}");
    assert!(
        every_token > 2.0,
        "the prompts were learned: every token's loss is {every_token}"
    );
}

/// Parquet files as pyarrow writes them (snappy with two row groups, zstd; nested
/// list-of-struct messages) give the samples their JSON-lines twins give; a directory
/// of shards is one data set; a column of the wrong type is named with its row.
#[test]
fn parquet_records_read_as_their_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "chat.parquet",
        "chat.jsonl",
        "prompt.parquet",
        "prompt.jsonl",
        "bad.parquet",
    ] {
        std::fs::copy(chat_dir().join(name), dir.path().join(name)).unwrap();
    }
    for stem in ["chat", "prompt"] {
        let open = |ext: &str| {
            let p = plan(
                &dir.path().join(format!("{stem}.{ext}")),
                4,
                1,
                1,
                json!({ "packing": false }),
            );
            Dataset::open(&p).unwrap()
        };
        let (parquet, jsonl) = (open("parquet"), open("jsonl"));
        assert_eq!(parquet.describe(), jsonl.describe(), "{stem}");
        for step in 0..3 {
            assert_eq!(
                parquet.batch(3, 0, step, 0, 4, 48),
                jsonl.batch(3, 0, step, 0, 4, 48),
                "{stem}"
            );
        }
    }
    // the shards of a directory, in name order: chat then prompt records
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    std::fs::copy(chat_dir().join("chat.parquet"), shards.join("a.parquet")).unwrap();
    std::fs::copy(chat_dir().join("prompt.jsonl"), shards.join("b.jsonl")).unwrap();
    let both = Dataset::open(&plan(&shards, 4, 1, 1, json!({}))).unwrap();
    assert!(
        both.describe().unwrap().starts_with("data: 15 samples"),
        "{:?}",
        both.describe()
    );
    let e = Dataset::open(&plan(&dir.path().join("bad.parquet"), 4, 1, 1, json!({})))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("bad.parquet") && e.contains("row 1: messages[0].content is not a string"),
        "{e}"
    );
}

/// A chat run saved at step 3 by 2 ranks and resumed by 1 rank (twice the accumulation)
/// continues with the rows the uninterrupted run trained on: the same losses (to the
/// order of fp32 sums), across epoch boundaries (32 samples fill about a dozen rows; a
/// step takes 8).
#[test]
fn a_resumed_chat_run_continues_the_same_rows_on_any_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    write_chat(&data, 32);
    let plan_of = |micro: usize, accumulation: usize, world: usize, out: &str| {
        let mut c = config(&data, micro, accumulation, world, json!({}));
        c["train"]["steps"] = json!(6);
        c["train"]["output_dir"] = json!(dir.path().join(out));
        c["train"]["save_interval"] = json!(3);
        c["optimizer"] = json!({ "type": "AdamW", "params": { "lr": 1e-2, "eps": 1e-3 } });
        from_json(c, &[], DeviceFacts::default()).unwrap().plan
    };
    let options = |resume| TrainOptions {
        save_checkpoints: true,
        resume,
        ..TrainOptions::default()
    };
    let full_plan = plan_of(2, 2, 2, "full");
    let full = train(&full_plan, options(None)).unwrap();
    let saved = tierzero::checkpoint::save::root(&full_plan.train.output_dir).join("step-3");
    let resumed = train(&plan_of(2, 4, 1, "resumed"), options(Some(&saved))).unwrap();
    assert_eq!(resumed.steps.len(), 3);
    for (a, b) in full.steps[3..].iter().zip(&resumed.steps) {
        assert_eq!(a.step, b.step);
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * a.loss,
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
}

/// Through the engine under checked lanes, packed rows train what the same samples
/// train one per row: documents of 5 positions each (a word-level tokenizer), two to a
/// row of 10 with packing against one to a padded row of 10 at twice the micro-batch,
/// so every step sees the same samples in the same order; ZeRO-3, two ranks.
#[test]
fn packed_rows_train_what_one_sample_per_row_trains() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(
        &tokenizer,
        r#"{"version":"1.0","truncation":null,"padding":null,
 "added_tokens":[{"id":3,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
 "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
 "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"</s>":3,"tier":4,"zero":5},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let words = ["hello", "world", "tier", "zero"];
    let docs: String = (0..40)
        .map(|i| {
            let text: Vec<&str> = (0..5).map(|j| words[(i * 7 + j * (i % 3 + 1)) % 4]).collect();
            format!("{}\n", json!({ "text": text.join(" ") }))
        })
        .collect();
    let data = dir.path().join("docs.jsonl");
    std::fs::write(&data, docs).unwrap();
    let run = |micro: usize, packing: bool| {
        let mut c = config(
            &data,
            micro,
            1,
            2,
            json!({ "packing": packing, "seq_len": 10, "tokenizer": tokenizer }),
        );
        c["data"].as_object_mut().unwrap().remove("chat_template");
        c["zero_optimization"] = json!({ "stage": 3, "stage3_param_persistence_threshold": 0 });
        checked_run(c)
    };
    assert_same_training(&run(2, true), &run(4, false), "packed against padded");
}

/// An export of a chat fine-tune carries the template training used (here
/// `data.chat_template`, not the tokenizer's) as `chat_template.jinja`, which
/// transformers reads first and `generate --hf` finds: the same prompt ids, the same
/// greedy answer as from the checkpoint.
#[test]
fn an_export_carries_the_chat_template_training_used() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    write_chat(&data, 16);
    let mut c = config(&data, 4, 1, 1, json!({}));
    c["train"]["output_dir"] = json!(dir.path().join("run"));
    c["train"]["steps"] = json!(2);
    let plan = from_json(c, &[], DeviceFacts::default()).unwrap().plan;
    let options = TrainOptions {
        save_checkpoints: true,
        ..TrainOptions::default()
    };
    train(&plan, options).unwrap();
    let checkpoint = dir.path().join("run/checkpoints/latest");
    let out = dir.path().join("hf");
    tierzero::checkpoint::export::export(&checkpoint, &out, tierzero::model::hf::SaveDtype::F32, usize::MAX)
        .unwrap();
    assert!(out.join("chat_template.jinja").is_file() && out.join("tokenizer.json").is_file());
    let question = Prompt::Chat(vec![
        json!({"role": "user", "content": "What is the capital of Peru?"}),
    ]);
    let from_checkpoint = Generator::open(Weights::Checkpoint(&checkpoint), None, tch::Device::Cpu).unwrap();
    let from_export = Generator::open(Weights::Hf(&out), None, tch::Device::Cpu).unwrap();
    let ids = from_checkpoint.encode(&question).unwrap();
    assert_eq!(from_export.encode(&question).unwrap(), ids);
    let greedy = tierzero::model::generate::Sampling::greedy();
    assert_eq!(
        from_export.generate(&ids, 6, &greedy).unwrap(),
        from_checkpoint.generate(&ids, 6, &greedy).unwrap()
    );
}
