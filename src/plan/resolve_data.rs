//! Resolving the `data` section: the source (synthetic, a token file, text, chat or
//! completion records), sequence length against the model's positions, the held-out
//! split, and the record options (chat template, packing, loss masks), refused with the
//! key and the fix.

use super::types::*;
use crate::config::ds::*;
use crate::config::value::positive;
use crate::config::ConfigError;

pub(super) fn build_data(d: DataSection, plan: &ModelPlan) -> Result<Data, ConfigError> {
    let model = &plan.config;
    let seq_len = positive("data.seq_len", d.seq_len, 128.min(model.max_position_embeddings))?;
    if seq_len > model.max_position_embeddings {
        return Err(ConfigError::invalid(
            "data.seq_len",
            format!(
                "{seq_len} exceeds model.max_position_embeddings ({})",
                model.max_position_embeddings
            ),
            "shorten data.seq_len or raise model.max_position_embeddings",
        ));
    }
    if let Some(window) = model.sliding_window.filter(|&w| seq_len > w) {
        return Err(ConfigError::invalid(
            "data.seq_len",
            format!(
                "{seq_len} exceeds the model's sliding_window ({window}); tierzero attends over the whole sequence, which this model was not trained to do past its window"
            ),
            format!("set data.seq_len to {window} or less"),
        ));
    }
    let source = match (d.synthetic.clone(), d.path.clone()) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::invalid(
                "data.synthetic",
                "both data.synthetic and data.path are set",
                "keep one of them",
            ))
        }
        (Some(name), None) => {
            if !SYNTHETIC.contains(&name.as_str()) {
                return Err(ConfigError::invalid(
                    "data.synthetic",
                    format!("unknown synthetic corpus {name:?}"),
                    format!("use one of: {}", SYNTHETIC.join(", ")),
                ));
            }
            DataSource::Synthetic { name }
        }
        (None, None) => DataSource::Synthetic {
            name: "addition".into(),
        },
        (None, Some(path)) => {
            let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            match extension {
                "bin" => {
                    let dtype = match d.dtype.as_deref() {
                        None | Some("u16") | Some("uint16") => TokenDtype::U16,
                        Some("u32") | Some("uint32") => TokenDtype::U32,
                        Some(other) => {
                            return Err(ConfigError::invalid(
                                "data.dtype",
                                format!("unknown token dtype {other:?}"),
                                "use \"u16\" or \"u32\"",
                            ))
                        }
                    };
                    DataSource::Tokens { path, dtype }
                }
                _ if ["txt", "jsonl", "parquet"].contains(&extension) || path.is_dir() => {
                    // the model directory's tokenizer, as the HF Trainer uses the model's
                    let beside_model = plan.hf_dir.as_ref().map(|d| d.join("tokenizer.json"));
                    let tokenizer = d.tokenizer.clone().or(beside_model).ok_or_else(|| {
                        ConfigError::invalid(
                            "data.tokenizer",
                            format!("{} is text and needs a tokenizer", path.display()),
                            "set data.tokenizer to a tokenizer.json (or model.hf_dir to a model directory with one)",
                        )
                    })?;
                    DataSource::Text { path, tokenizer }
                }
                _ => {
                    return Err(ConfigError::invalid(
                        "data.path",
                        format!("{} has an unknown extension", path.display()),
                        "use a .bin token file, a .txt, .jsonl or .parquet file, or a directory of .jsonl/.parquet files",
                    ))
                }
            }
        }
    };
    let records = build_records(&d, &source)?;
    Ok(Data {
        source,
        seq_len,
        records,
    })
}

/// The record options, refused where the data has no records.
fn build_records(d: &DataSection, source: &DataSource) -> Result<Records, ConfigError> {
    let text = match source {
        DataSource::Text { path, .. } => path.extension().and_then(|e| e.to_str()) != Some("txt"),
        _ => false,
    };
    let given = [
        ("data.train_on_prompt", d.train_on_prompt.is_some()),
        ("data.packing", d.packing.is_some()),
        ("data.chat_template", d.chat_template.is_some()),
    ];
    if let (false, Some((key, _))) = (text, given.iter().find(|(_, g)| *g)) {
        return Err(ConfigError::invalid(
            *key,
            "applies to .jsonl records (text, prompt/completion or chat), not to this data",
            "remove it, or point data.path at a .jsonl file or a directory of them",
        ));
    }
    let eval = match (d.eval_fraction, &d.eval_path) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::invalid(
                "data.eval_fraction",
                "both data.eval_fraction and data.eval_path are set",
                "keep one of them",
            ))
        }
        (Some(f), None) if !(f > 0.0 && f < 1.0) => {
            return Err(ConfigError::invalid(
                "data.eval_fraction",
                format!("{f} is not between 0 and 1"),
                "hold out a fraction such as 0.05",
            ))
        }
        (Some(fraction), None) => EvalSplit::Fraction { fraction },
        (None, Some(path)) => EvalSplit::Path { path: path.clone() },
        (None, None) => EvalSplit::Train,
    };
    if !matches!(eval, EvalSplit::Train) && !matches!(source, DataSource::Text { .. }) {
        return Err(ConfigError::invalid(
            if d.eval_path.is_some() {
                "data.eval_path"
            } else {
                "data.eval_fraction"
            },
            "applies to text and record data, not to token files or synthetic data",
            "remove it",
        ));
    }
    Ok(Records {
        train_on_prompt: d.train_on_prompt.unwrap_or(false),
        packing: d.packing.unwrap_or(true),
        packing_given: d.packing.is_some(),
        eval,
        chat_template: d.chat_template.clone(),
    })
}
