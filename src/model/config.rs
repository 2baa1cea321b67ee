//! Model shapes: presets, Hugging Face `config.json`, and the unit layout they imply.
//!
//! Field names are Hugging Face's (`hidden_size`, `num_key_value_heads`, …) so a user's
//! overrides read like the model card. A model is a list of units (embedding, each
//! block, final norm + head): what ZeRO-3 gathers and releases together. Parameter counts
//! follow `LlamaForCausalLM` and `GPT2LMHeadModel` exactly (Llama-3.2-1B: 1,235,814,400;
//! GPT-2: 124,439,808 — both from the published checkpoints' tensor shapes).

use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Gpt2,
}

/// Llama-3 style RoPE frequency scaling (`rope_scaling` with `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm eps (Llama) or LayerNorm eps (GPT-2).
    pub norm_eps: f64,
}

/// Preset names, smallest first.
pub const PRESETS: &[&str] = &[
    "llama-tiny",
    "gpt2-tiny",
    "gpt2-124m",
    "llama-1b",
    "llama-8b",
    "llama-13b",
    "llama-70b",
];

impl ModelConfig {
    /// A preset by name; `None` for an unknown name.
    pub fn preset(name: &str) -> Option<ModelConfig> {
        let llama3_scaling = |factor: f64| {
            Some(RopeScaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })
        };
        let llama = |h, i, l, heads, kv, v, pos, tie, theta, scaling| ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: h,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            vocab_size: v,
            max_position_embeddings: pos,
            tie_word_embeddings: tie,
            rope_theta: theta,
            rope_scaling: scaling,
            norm_eps: 1e-5,
        };
        let gpt2 = |h, l, heads, v, pos| ModelConfig {
            architecture: Architecture::Gpt2,
            hidden_size: h,
            intermediate_size: 4 * h,
            num_hidden_layers: l,
            num_attention_heads: heads,
            num_key_value_heads: heads,
            vocab_size: v,
            max_position_embeddings: pos,
            tie_word_embeddings: true,
            rope_theta: 0.0,
            rope_scaling: None,
            norm_eps: 1e-5,
        };
        Some(match name {
            "llama-tiny" => llama(64, 176, 2, 4, 2, 256, 512, false, 10000.0, None),
            "gpt2-tiny" => gpt2(64, 2, 4, 256, 512),
            "gpt2-124m" => gpt2(768, 12, 12, 50257, 1024),
            // Llama-3.2-1B
            "llama-1b" => llama(
                2048,
                8192,
                16,
                32,
                8,
                128_256,
                131_072,
                true,
                500_000.0,
                llama3_scaling(32.0),
            ),
            // Llama-3.1-8B
            "llama-8b" => llama(
                4096,
                14336,
                32,
                32,
                8,
                128_256,
                131_072,
                false,
                500_000.0,
                llama3_scaling(8.0),
            ),
            // Llama-2-13B
            "llama-13b" => llama(5120, 13824, 40, 40, 40, 32000, 4096, false, 10000.0, None),
            // Llama-3.1-70B
            "llama-70b" => llama(
                8192,
                28672,
                80,
                64,
                8,
                128_256,
                131_072,
                false,
                500_000.0,
                llama3_scaling(8.0),
            ),
            _ => return None,
        })
    }

    /// Reads a Hugging Face `config.json` (`LlamaForCausalLM` or `GPT2LMHeadModel`).
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig, String> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
        let get = |key: &str| {
            json.get(key)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
        };
        let require =
            |key: &str| get(key).ok_or_else(|| format!("{} has no integer `{key}`", path.display()));
        let model_type = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        match model_type {
            "llama" => {
                let heads = require("num_attention_heads")?;
                let scaling = json.get("rope_scaling").filter(|v| !v.is_null());
                let rope_scaling = match scaling {
                    None => None,
                    Some(s) => {
                        let kind = s
                            .get("rope_type")
                            .or_else(|| s.get("type"))
                            .and_then(|v| v.as_str());
                        if kind != Some("llama3") {
                            return Err(format!(
                                "{}: rope_scaling type {kind:?} is not supported (only \"llama3\")",
                                path.display()
                            ));
                        }
                        let f = |k: &str| s.get(k).and_then(|v| v.as_f64());
                        Some(RopeScaling {
                            factor: f("factor").unwrap_or(8.0),
                            low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                            high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                            original_max_position_embeddings: s
                                .get("original_max_position_embeddings")
                                .and_then(|v| v.as_u64())
                                .unwrap_or(8192)
                                as usize,
                        })
                    }
                };
                Ok(ModelConfig {
                    architecture: Architecture::Llama,
                    hidden_size: require("hidden_size")?,
                    intermediate_size: require("intermediate_size")?,
                    num_hidden_layers: require("num_hidden_layers")?,
                    num_attention_heads: heads,
                    num_key_value_heads: get("num_key_value_heads").unwrap_or(heads),
                    vocab_size: require("vocab_size")?,
                    max_position_embeddings: get("max_position_embeddings").unwrap_or(2048),
                    tie_word_embeddings: json
                        .get("tie_word_embeddings")
                        .and_then(|v| v.as_bool())
                        .unwrap_or(false),
                    rope_theta: json.get("rope_theta").and_then(|v| v.as_f64()).unwrap_or(10000.0),
                    rope_scaling,
                    norm_eps: json.get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-6),
                })
            }
            "gpt2" => {
                let hidden = require("n_embd")?;
                Ok(ModelConfig {
                    architecture: Architecture::Gpt2,
                    hidden_size: hidden,
                    intermediate_size: get("n_inner").unwrap_or(4 * hidden),
                    num_hidden_layers: require("n_layer")?,
                    num_attention_heads: require("n_head")?,
                    num_key_value_heads: require("n_head")?,
                    vocab_size: require("vocab_size")?,
                    max_position_embeddings: get("n_positions").unwrap_or(1024),
                    tie_word_embeddings: true,
                    rope_theta: 0.0,
                    rope_scaling: None,
                    norm_eps: json
                        .get("layer_norm_epsilon")
                        .and_then(|v| v.as_f64())
                        .unwrap_or(1e-5),
                })
            }
            other => Err(format!(
                "{}: model_type {other:?} is not supported (supported: \"llama\", \"gpt2\")",
                path.display()
            )),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Checks the shape is one the blocks can run; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(format!("model.{name} must be positive"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "model.hidden_size ({}) must be a multiple of model.num_attention_heads ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "model.num_attention_heads ({}) must be a multiple of model.num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.architecture == Architecture::Llama && !self.head_dim().is_multiple_of(2) {
            return Err(format!("head dim {} must be even for RoPE", self.head_dim()));
        }
        Ok(())
    }

    /// Parameters per unit, in forward order: embedding, each block, final norm (+ head).
    pub fn unit_numels(&self) -> Vec<usize> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let (embedding, block, final_norm) = match self.architecture {
            Architecture::Llama => {
                let attention = h * h + 2 * h * kv + h * h;
                let mlp = 3 * h * i;
                (v * h, attention + mlp + 2 * h, h)
            }
            Architecture::Gpt2 => {
                let attention = h * 3 * h + 3 * h + h * h + h;
                let mlp = h * i + i + i * h + h;
                (
                    v * h + self.max_position_embeddings * h,
                    attention + mlp + 4 * h,
                    2 * h,
                )
            }
        };
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        let mut units = vec![embedding];
        units.extend(std::iter::repeat_n(block, self.num_hidden_layers));
        units.push(final_norm + head);
        units
    }

    pub fn num_parameters(&self) -> usize {
        self.unit_numels().iter().sum()
    }

    /// Training FLOPs per token: 6·N for the matmuls plus 12·L·H·T for attention
    /// (PaLM appendix B; nanoGPT's `estimate_mfu`), with N excluding embeddings.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let units = self.unit_numels();
        let non_embedding: usize = units[1..].iter().sum::<usize>()
            + if self.tie_word_embeddings {
                self.vocab_size * self.hidden_size
            } else {
                0
            };
        6.0 * non_embedding as f64 + 12.0 * (self.num_hidden_layers * self.hidden_size * seq_len) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_published_checkpoints() {
        // GPT-2 small: 124,439,808 parameters in the HF checkpoint (wte, wpe, 12 blocks, ln_f)
        assert_eq!(
            ModelConfig::preset("gpt2-124m").unwrap().num_parameters(),
            124_439_808
        );
        // Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)
        assert_eq!(
            ModelConfig::preset("llama-1b").unwrap().num_parameters(),
            1_235_814_400
        );
        // Llama-3.1-8B: 8,030,261,248 parameters
        assert_eq!(
            ModelConfig::preset("llama-8b").unwrap().num_parameters(),
            8_030_261_248
        );
        // Llama-2-13B: 13,015,864,320 parameters
        assert_eq!(
            ModelConfig::preset("llama-13b").unwrap().num_parameters(),
            13_015_864_320
        );
        // Llama-3.1-70B: 70,553,706,496 parameters
        assert_eq!(
            ModelConfig::preset("llama-70b").unwrap().num_parameters(),
            70_553_706_496
        );
    }

    #[test]
    fn every_preset_is_valid() {
        for name in PRESETS {
            ModelConfig::preset(name).unwrap().validate().unwrap();
        }
    }
}
