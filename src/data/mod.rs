//! Token data: where each sample of each step comes from.
//!
//! A sample is `seq_len + 1` tokens (inputs and shifted targets) chosen by a pure
//! function of (seed, step, global micro-batch index, row): the same global batch is
//! drawn whatever the world size, so an N-rank run and a single-rank run with N× the
//! accumulation steps see the same samples, and a resumed run continues the stream
//! exactly (the position is just the step number).
//!
//! - `synthetic.rs`: built-in corpora with a known loss floor, for the default run
//! - `tokens.rs`: nanoGPT-style `.bin` token files (u16/u32), memory-mapped
//! - `text.rs`: `.txt`/`.jsonl` tokenized with a `tokenizer.json`, cached as a token file
//! - `records.rs`, `encode.rs`, `samples.rs`, `packing.rs`: fine-tuning records (text,
//!   prompt/completion, chat), tokenized with loss masks, cached, packed into rows
//!
//! Record data sets are samples, not a stream: row r of the run is a pure function of
//! (seed, r) (`packing.rs`), and the loss is the mean over the global batch's counted
//! tokens ([`Dataset::counted`]), so any split of the global batch over micro-batches,
//! accumulation and ranks trains the same.

pub mod encode;
pub mod packing;
pub mod records;
pub mod samples;
pub mod synthetic;
pub mod text;
pub mod tokens;

use crate::model::chat::ChatTemplate;
use crate::plan::{DataSource, EvalSplit, Plan, TokenDtype};
use packing::{Packer, Scanned};
use samples::Samples;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read token file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("token file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// One micro-batch: inputs and targets, each [rows × seq_len], row-major. Targets < 0
/// are not counted in the loss. `segments` numbers the samples packed into each row
/// (each attends only to itself); `None` when a row is one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub rows: usize,
    pub seq_len: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub segments: Option<Vec<i64>>,
}

/// A source of samples.
pub enum Dataset {
    Synthetic(synthetic::Corpus),
    /// A token stream: training windows, and evaluation windows (the same file, its
    /// held-out tail, or a file of its own).
    Tokens {
        train: tokens::TokenFile,
        eval: tokens::TokenFile,
    },
    Samples(SampleSet),
}

/// A record data set's samples, as training and evaluation rows.
pub struct SampleSet {
    train: Packer,
    eval: Packer,
    /// Rows of one optimizer step (the global batch).
    step_rows: u64,
    report: String,
}

impl Dataset {
    pub fn open(plan: &Plan) -> Result<Dataset, DataError> {
        let seq_len = plan.data.seq_len;
        let vocab = plan.model.config.vocab_size;
        let eval = &plan.data.records.eval;
        match &plan.data.source {
            DataSource::Synthetic { name } => Ok(Dataset::Synthetic(synthetic::Corpus::new(name))),
            DataSource::Tokens { path, dtype } => {
                let file = tokens::TokenFile::open(path, *dtype, seq_len, vocab)?;
                Ok(Dataset::Tokens {
                    eval: file.clone(),
                    train: file,
                })
            }
            DataSource::Text { path, tokenizer } => {
                // a .txt, or a .jsonl of documents, is a stream; other records are samples
                let extension = path.extension().and_then(|e| e.to_str());
                let stream = extension == Some("txt")
                    || (extension == Some("jsonl")
                        && !plan.data.records.packing_given
                        && records::first_is_text(&records::files(path)?)?);
                if !stream {
                    return SampleSet::open(plan, path, tokenizer).map(Dataset::Samples);
                }
                let open = |path: &Path| -> Result<tokens::TokenFile, DataError> {
                    let cache = text::tokenize_cached(path, tokenizer)?;
                    tokens::TokenFile::open(&cache, TokenDtype::U32, seq_len, vocab)
                };
                let file = open(path)?;
                let (train, eval) = match eval {
                    EvalSplit::Train => (file.clone(), file),
                    EvalSplit::Fraction { fraction } => file.split(*fraction, seq_len)?,
                    EvalSplit::Path { path } => (file, open(path)?),
                };
                Ok(Dataset::Tokens { train, eval })
            }
        }
    }

    /// Counted targets of optimizer step `step`'s global batch, where samples count
    /// different numbers of tokens (record data sets); `None` where each micro-batch's
    /// own mean is the global mean's share (token streams count every position).
    pub fn counted(&self, step: u64) -> Option<u64> {
        match self {
            Dataset::Samples(s) => Some(s.train.counted_in(step * s.step_rows..(step + 1) * s.step_rows)),
            _ => None,
        }
    }

    /// What the start-up report says of the data, where there is something to say.
    pub fn describe(&self) -> Option<&str> {
        match self {
            Dataset::Samples(s) => Some(&s.report),
            _ => None,
        }
    }

    /// Tokens the source uses (the model's vocabulary must cover them).
    pub fn vocab_needed(&self) -> usize {
        match self {
            Dataset::Synthetic(c) => c.vocab_size(),
            Dataset::Tokens { .. } | Dataset::Samples(_) => 0,
        }
    }

    /// The loss a perfect model would reach, when the source knows it.
    pub fn loss_floor(&self, seq_len: usize) -> Option<f64> {
        match self {
            Dataset::Synthetic(c) => Some(c.loss_floor(seq_len)),
            Dataset::Tokens { .. } | Dataset::Samples(_) => None,
        }
    }

    /// The micro-batch `micro` (global index across ranks and accumulation steps) of
    /// optimizer step `step`, `rows` samples. `split` distinguishes train (0) from eval
    /// (1) streams. Each sample is keyed by (seed, split, step, global sample index
    /// `micro × rows + row`), as a `DistributedSampler` split is: any micro-batch ×
    /// accumulation × world decomposition of one global batch draws the same samples.
    pub fn batch(&self, seed: u64, split: u64, step: u64, micro: u64, rows: usize, seq_len: usize) -> Batch {
        if let Dataset::Samples(s) = self {
            // rows of the run in order: training by step, evaluation from its start
            return match split {
                0 => s.train.batch(step * s.step_rows + micro * rows as u64, rows),
                _ => s.eval.batch(micro * rows as u64, rows),
            };
        }
        let mut inputs = Vec::with_capacity(rows * seq_len);
        let mut targets = Vec::with_capacity(rows * seq_len);
        for row in 0..rows {
            let key = sample_key(seed, split, step, micro * rows as u64 + row as u64);
            let (i, t) = match self {
                Dataset::Synthetic(c) => c.sample(key, seq_len),
                Dataset::Tokens { train, eval } => match split {
                    0 => train.sample(key, seq_len),
                    _ => eval.sample(key, seq_len),
                },
                Dataset::Samples(_) => unreachable!("sample sets return above"),
            };
            inputs.extend(i);
            targets.extend(t);
        }
        Batch {
            rows,
            seq_len,
            inputs,
            targets,
            segments: None,
        }
    }
}

impl SampleSet {
    fn open(plan: &Plan, path: &Path, tokenizer: &Path) -> Result<SampleSet, DataError> {
        let options = &plan.data.records;
        let invalid = |path: &Path, message: String| DataError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let tokenizer_bytes = std::fs::read(tokenizer).map_err(|source| DataError::Read {
            path: tokenizer.to_path_buf(),
            source,
        })?;
        let tok = tokenizers::Tokenizer::from_bytes(&tokenizer_bytes)
            .map_err(|e| invalid(tokenizer, format!("not a tokenizer.json: {e}")))?;
        let (template, template_file) = chat_template(options.chat_template.as_deref(), tokenizer)?;
        let no_template = format!(
            "chat messages need a chat template, and {} has none; use an instruction-tuned \
             model's tokenizer, or set data.chat_template to a Jinja file",
            template_file.display()
        );
        let template_bytes = std::fs::read(&template_file).unwrap_or_default();
        let encoder = encode::Encoder::new(tok, template, no_template, options.train_on_prompt);
        let key = samples::fnv1a(
            &template_bytes,
            samples::fnv1a(&tokenizer_bytes, samples::FNV_OFFSET),
        );
        let key = samples::fnv1a(&[u8::from(options.train_on_prompt)], key);
        let (seq, vocab) = (plan.data.seq_len, plan.model.config.vocab_size);
        let scan = |path: &Path| -> Result<Arc<Scanned>, DataError> {
            Ok(Arc::new(Scanned::new(
                Samples::cached(path, key, &encoder)?,
                seq,
                vocab,
            )?))
        };
        let set = scan(path)?;
        let usable = set.usable();
        let held_out = |i: &u32| match options.eval {
            EvalSplit::Fraction { fraction } => unit_interval(mix(u64::from(*i) ^ 0x5eed_e7a1)) < fraction,
            _ => false,
        };
        let (eval_members, train_members): (Vec<u32>, Vec<u32>) = usable.iter().partition(|i| held_out(i));
        if train_members.is_empty()
            || (matches!(options.eval, EvalSplit::Fraction { .. }) && eval_members.is_empty())
        {
            return Err(invalid(
                path,
                format!("{} samples with a counted token leave a split empty; add data or change data.eval_fraction", usable.len()),
            ));
        }
        let packer = |set: &Arc<Scanned>, members: Vec<u32>, shuffle: bool| {
            Packer::new(set.clone(), members, options.packing, shuffle, plan.train.seed)
        };
        let eval = match &options.eval {
            EvalSplit::Train => packer(&set, train_members.clone(), false),
            EvalSplit::Fraction { .. } => packer(&set, eval_members.clone(), false),
            EvalSplit::Path { path } => {
                let other = scan(path)?;
                packer(&other, other.usable(), false)
            }
        };
        let (tokens, counted, truncated) = (set.tokens, set.trained(&usable), set.truncated);
        let report = format!(
            "data: {} samples ({} held out for eval), {tokens} tokens of which {counted} trained{}{}; {}",
            usable.len(),
            eval_members.len(),
            if truncated > 0 {
                format!(", {truncated} truncated to data.seq_len + 1 = {}", seq + 1)
            } else {
                String::new()
            },
            if usable.len() < set.len() {
                format!(", {} without a target skipped", set.len() - usable.len())
            } else {
                String::new()
            },
            if options.packing {
                "packed, each sample attending only to itself"
            } else {
                "one per row, padded"
            },
        );
        Ok(SampleSet {
            train: packer(&set, train_members, true),
            eval,
            step_rows: plan.batch.train_batch_size as u64,
            report,
        })
    }
}

/// The chat template to use and the file it comes from (or would come from): the
/// configured one (a Jinja file or a tokenizer_config.json), else the tokenizer's.
pub fn chat_template(
    configured: Option<&Path>,
    tokenizer: &Path,
) -> Result<(Option<ChatTemplate>, PathBuf), DataError> {
    let chat_err = |path: &Path| {
        let path = path.to_path_buf();
        move |e: crate::model::chat::ChatError| DataError::Invalid {
            path: path.clone(),
            message: e.to_string(),
        }
    };
    match configured {
        Some(file) if file.extension().and_then(|e| e.to_str()) != Some("json") => {
            let source = std::fs::read_to_string(file).map_err(|source| DataError::Read {
                path: file.to_path_buf(),
                source,
            })?;
            // the special tokens still come from the tokenizer's configuration
            let (bos, eos) = ChatTemplate::special_tokens(tokenizer);
            let template = ChatTemplate::new(&source, &bos, &eos).map_err(|message| DataError::Invalid {
                path: file.to_path_buf(),
                message: format!("the chat template does not compile: {message}"),
            })?;
            Ok((Some(template), file.to_path_buf()))
        }
        Some(config) => {
            let found = ChatTemplate::beside(config).map_err(chat_err(config))?;
            Ok((found.map(|(t, _)| t), config.to_path_buf()))
        }
        None => {
            let dir = tokenizer.parent().unwrap_or(Path::new("."));
            let found = ChatTemplate::beside(tokenizer).map_err(chat_err(tokenizer))?;
            Ok((found.map(|(t, _)| t), dir.join("tokenizer_config.json")))
        }
    }
}

/// SplitMix64's finaliser (the seeded init's hash).
pub use crate::model::layout::splitmix as mix;

/// A hash as a number in [0, 1).
fn unit_interval(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

fn sample_key(seed: u64, split: u64, step: u64, sample: u64) -> u64 {
    mix(mix(mix(mix(seed) ^ split) ^ step) ^ sample)
}
