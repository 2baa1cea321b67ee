//! What a Hugging Face directory carries beside the weights so transformers (and
//! `tierzero generate`) can use it as it is: the tokenizer training read, the chat
//! template it rendered with, and a `generation_config.json`.

use super::hf::{io, HfError};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Tokenizer files a Hugging Face model directory may carry.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
];

/// Where an export finds what `transformers` needs beside the weights to generate.
#[derive(Clone, Debug, Default)]
pub struct Companions {
    /// The `tokenizer.json` training read (`data.tokenizer`).
    pub tokenizer: Option<PathBuf>,
    /// The model directory training started from (`model.hf_dir`).
    pub hf_dir: Option<PathBuf>,
    /// The chat template training used in place of the tokenizer's
    /// (`data.chat_template`: a Jinja file or a tokenizer_config.json).
    pub chat_template: Option<PathBuf>,
}

impl Companions {
    /// From a serialized plan (a checkpoint manifest's `config`).
    pub fn from_plan_json(plan: &Value) -> Companions {
        let path = |v: &Value| v.as_str().map(PathBuf::from);
        Companions {
            tokenizer: path(&plan["data"]["source"]["tokenizer"]),
            hf_dir: path(&plan["model"]["hf_dir"]),
            chat_template: path(&plan["data"]["records"]["chat_template"]),
        }
    }

    /// Copies the tokenizer into `out` (the tokenizer files of `hf_dir`, else the
    /// `tokenizer.json` training read and its tokenizer_config/special_tokens_map
    /// siblings) and writes a `generation_config.json` unless one was copied. A source
    /// that has vanished since training is skipped: the weights are still a model.
    pub fn write(&self, out: &Path) -> Result<(), HfError> {
        let copy = |from: &Path, name: &str| -> Result<(), HfError> {
            if from.is_file() {
                std::fs::copy(from, out.join(name)).map_err(io(from))?;
            }
            Ok(())
        };
        if let Some(dir) = &self.hf_dir {
            for name in TOKENIZER_FILES {
                copy(&dir.join(name), name)?;
            }
        }
        if let Some(tokenizer) = &self.tokenizer {
            if !out.join("tokenizer.json").exists() {
                copy(tokenizer, "tokenizer.json")?;
                if let Some(dir) = tokenizer.parent() {
                    for name in ["tokenizer_config.json", "special_tokens_map.json"] {
                        copy(&dir.join(name), name)?;
                    }
                }
            }
        }
        // the template training rendered with wins over a copied one: transformers reads
        // a chat_template.jinja beside tokenizer_config.json before the latter's key
        if let Some(template) = &self.chat_template {
            if template.extension().and_then(|e| e.to_str()) == Some("json") {
                let text = std::fs::read_to_string(template).map_err(io(template))?;
                let config: Value = serde_json::from_str(&text).map_err(|e| HfError::Format {
                    path: template.clone(),
                    message: e.to_string(),
                })?;
                if let Some(source) = config["chat_template"].as_str() {
                    let jinja = out.join("chat_template.jinja");
                    std::fs::write(&jinja, source).map_err(io(&jinja))?;
                }
                // its special tokens, where nothing else gave the export a configuration
                if !out.join("tokenizer_config.json").exists() {
                    copy(template, "tokenizer_config.json")?;
                }
            } else {
                copy(template, "chat_template.jinja")?;
            }
        }
        let generation = out.join("generation_config.json");
        if !generation.exists() {
            // transformers takes the token ids from the model config
            let text = serde_json::to_string_pretty(&json!({ "_from_model_config": true })).map_err(|e| {
                HfError::Format {
                    path: generation.clone(),
                    message: e.to_string(),
                }
            })?;
            std::fs::write(&generation, text).map_err(io(&generation))?;
        }
        Ok(())
    }
}
