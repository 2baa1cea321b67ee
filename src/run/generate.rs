//! `generate` as a process: a checkpoint's master weights or a Hugging Face directory
//! loaded onto one device, the tokenizer and chat template it was trained with, and
//! [`crate::model::generate`] over them.

use crate::checkpoint::Checkpoint;
use crate::config::model::ModelConfig;
use crate::data::encode::EOS_CANDIDATES;
use crate::model::chat::ChatTemplate;
use crate::model::generate::{self, Sampling};
use crate::model::hf::{self, Companions};
use crate::model::Model;
use crate::torch;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Hf(#[from] hf::HfError),
    #[error(transparent)]
    Chat(#[from] crate::model::chat::ChatError),
    #[error("{0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Input(String),
}

/// Where the weights come from.
pub enum Weights<'a> {
    Checkpoint(&'a Path),
    Hf(&'a Path),
}

/// What to continue.
pub enum Prompt {
    Text(String),
    /// Chat messages, templated with the generation prompt.
    Chat(Vec<serde_json::Value>),
    Ids(Vec<i64>),
}

pub struct Generator {
    model: Model,
    params: Vec<Tensor>,
    tokenizer: Option<(tokenizers::Tokenizer, PathBuf)>,
    template: Option<ChatTemplate>,
    stop: Vec<i64>,
}

/// The `eos_token_id` (a number or a list) of a `generation_config.json` or `config.json`.
fn eos_ids(file: &Path) -> Vec<i64> {
    let Ok(text) = std::fs::read_to_string(file) else {
        return Vec::new();
    };
    let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    match &value["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_i64().into_iter().collect(),
        serde_json::Value::Array(a) => a.iter().filter_map(serde_json::Value::as_i64).collect(),
        _ => Vec::new(),
    }
}

impl Generator {
    /// Loads the weights onto `device` in fp32; `tokenizer` overrides the one the
    /// weights were trained with.
    pub fn open(
        weights: Weights,
        tokenizer: Option<&Path>,
        device: tch::Device,
    ) -> Result<Generator, GenerateError> {
        let (config, flat, companions, dir): (ModelConfig, Vec<Vec<f32>>, Companions, PathBuf) = match weights
        {
            Weights::Checkpoint(dir) => {
                let ckpt = Checkpoint::open(dir)?;
                let flat = (0..ckpt.manifest.units.len())
                    .map(|u| ckpt.master_unit(u))
                    .collect::<Result<_, _>>()?;
                let companions = Companions::from_plan_json(&ckpt.manifest.config);
                (ckpt.manifest.model.clone(), flat, companions, dir.to_path_buf())
            }
            Weights::Hf(dir) => {
                let config =
                    ModelConfig::from_hf_dir(dir).map_err(|e| GenerateError::Input(e.to_string()))?;
                let flat = hf::load(dir, &config)?;
                let companions = Companions {
                    tokenizer: None,
                    hf_dir: Some(dir.to_path_buf()),
                    chat_template: None,
                };
                (config, flat, companions, dir.to_path_buf())
            }
        };
        let model = Model::new(config, Kind::Float);
        let params = flat
            .iter()
            .map(|w| torch::tensor_f32(w, device))
            .collect::<Result<Vec<_>, _>>()?;
        let tokenizer_path = tokenizer
            .map(Path::to_path_buf)
            .or(companions.tokenizer.clone())
            .or_else(|| companions.hf_dir.as_ref().map(|d| d.join("tokenizer.json")))
            .filter(|p| p.is_file());
        let tokenizer = match tokenizer_path {
            Some(path) => {
                let t = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
                    GenerateError::Input(format!("{}: not a tokenizer.json: {e}", path.display()))
                })?;
                Some((t, path))
            }
            None => None,
        };
        let template = match &tokenizer {
            Some((_, path)) => {
                crate::data::chat_template(companions.chat_template.as_deref(), path)
                    .map_err(|e| GenerateError::Input(e.to_string()))?
                    .0
            }
            None => None,
        };
        // the stop tokens: generation_config's, else the template's or tokenizer's EOS
        let mut stop: Vec<i64> = [dir.join("generation_config.json"), dir.join("config.json")]
            .iter()
            .flat_map(|f| eos_ids(f))
            .collect();
        if let (true, Some((t, _))) = (stop.is_empty(), &tokenizer) {
            let named = template.as_ref().map(|t| t.eos().to_string()).into_iter();
            stop = named
                .chain(EOS_CANDIDATES.iter().map(|s| s.to_string()))
                .filter_map(|s| t.token_to_id(&s))
                .map(i64::from)
                .take(1)
                .collect();
        }
        Ok(Generator {
            model,
            params,
            tokenizer,
            template,
            stop,
        })
    }

    /// The prompt's token ids.
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<i64>, GenerateError> {
        let text = match prompt {
            Prompt::Ids(ids) => {
                let vocab = self.model.config.vocab_size as i64;
                if let Some(bad) = ids.iter().find(|&&i| i < 0 || i >= vocab) {
                    return Err(GenerateError::Input(format!(
                        "prompt token {bad} is outside the model's vocabulary (0..{vocab})"
                    )));
                }
                return Ok(ids.clone());
            }
            Prompt::Text(text) => text.clone(),
            Prompt::Chat(messages) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    GenerateError::Input(
                        "chat messages need a chat template, and the tokenizer has none beside it \
                         (tokenizer_config.json); give --prompt text instead, or --tokenizer of a model with one"
                            .into(),
                    )
                })?;
                template.render(messages, true)?
            }
        };
        let (tokenizer, _) = self.tokenizer.as_ref().ok_or_else(|| {
            GenerateError::Input(
                "the weights come with no tokenizer.json: give --tokenizer, or --prompt-ids".into(),
            )
        })?;
        // a plain prompt gets the tokenizer's special tokens (BOS); a templated one has them
        let special = matches!(prompt, Prompt::Text(_));
        let encoding = tokenizer
            .encode(text, special)
            .map_err(|e| GenerateError::Input(format!("cannot tokenize the prompt: {e}")))?;
        Ok(encoding.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// Up to `max_new` tokens after `prompt`, stopping after an end-of-sequence token.
    pub fn generate(
        &self,
        prompt: &[i64],
        max_new: usize,
        sampling: &Sampling,
    ) -> Result<Vec<i64>, GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::Input("the prompt is empty".into()));
        }
        let config = &self.model.config;
        let room = config
            .sliding_window
            .unwrap_or(usize::MAX)
            .min(config.max_position_embeddings);
        if prompt.len() + max_new > room {
            return Err(GenerateError::Input(format!(
                "{} prompt tokens + {max_new} new ones exceed the model's {room} positions (max_position_embeddings, sliding_window); lower --max-new-tokens",
                prompt.len()
            )));
        }
        Ok(generate::generate(
            &self.model,
            &self.params,
            prompt,
            max_new,
            &self.stop,
            sampling,
        )?)
    }

    /// `ids` as text without special tokens, where there is a tokenizer.
    pub fn decode(&self, ids: &[i64]) -> Option<String> {
        let (tokenizer, _) = self.tokenizer.as_ref()?;
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        tokenizer.decode(&ids, true).ok()
    }
}
