//! Model shapes: presets, Hugging Face `config.json`, and the unit layout they imply.
//!
//! Field names are Hugging Face's (`hidden_size`, `num_key_value_heads`, …) so a user's
//! overrides read like the model card. A model is a list of units (embedding, each
//! block, final norm + head): what ZeRO-3 gathers and releases together. Parameter counts
//! follow `LlamaForCausalLM` and `GPT2LMHeadModel` exactly (Llama-3.2-1B: 1,235,814,400;
//! GPT-2: 124,439,808 — both from the published checkpoints' tensor shapes).

use serde::{Deserialize, Serialize};

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

/// The Llama-shaped families: one block, with what each adds (fields of
/// [`ModelConfig`]); the name is what `config.json` calls the model on export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    #[default]
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
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
    /// Which Llama-shaped family (Llama for GPT-2, where it means nothing).
    #[serde(default)]
    pub family: Family,
    /// q, k and v projections carry biases (Qwen2; `attention_bias`).
    #[serde(default)]
    pub attention_bias: bool,
    /// Each head's q and k pass an RMSNorm before RoPE (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// A head width other than hidden_size / num_attention_heads (`head_dim`).
    #[serde(default)]
    pub attention_head_dim: Option<usize>,
    /// The attention window the model was trained with (Mistral's `sliding_window`):
    /// longer sequences are refused.
    #[serde(default)]
    pub sliding_window: Option<usize>,
}

/// Preset names, smallest first.
pub const PRESETS: &[&str] = &[
    "llama-tiny",
    "gpt2-tiny",
    "mistral-tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "gpt2-124m",
    "llama-1b",
    "llama-8b",
    "llama-13b",
    "llama-70b",
];

impl ModelConfig {
    /// A Llama shape with every family feature off (the base the presets and readers
    /// fill in).
    pub fn plain() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 0,
            intermediate_size: 0,
            num_hidden_layers: 0,
            num_attention_heads: 0,
            num_key_value_heads: 0,
            vocab_size: 0,
            max_position_embeddings: 0,
            tie_word_embeddings: false,
            rope_theta: 10000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
            family: Family::Llama,
            attention_bias: false,
            qk_norm: false,
            attention_head_dim: None,
            sliding_window: None,
        }
    }

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
            ..ModelConfig::plain()
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
            ..ModelConfig::plain()
        };
        // tiny members of the other Llama families (tests, examples)
        let tiny = llama(64, 176, 2, 4, 2, 256, 512, false, 10000.0, None);
        Some(match name {
            "llama-tiny" => tiny,
            "mistral-tiny" => ModelConfig {
                family: Family::Mistral,
                sliding_window: Some(256),
                ..tiny
            },
            "qwen2-tiny" => ModelConfig {
                family: Family::Qwen2,
                attention_bias: true,
                tie_word_embeddings: true,
                rope_theta: 1_000_000.0,
                norm_eps: 1e-6,
                ..tiny
            },
            "qwen3-tiny" => ModelConfig {
                family: Family::Qwen3,
                qk_norm: true,
                attention_head_dim: Some(32),
                tie_word_embeddings: true,
                rope_theta: 1_000_000.0,
                norm_eps: 1e-6,
                ..tiny
            },
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

    pub fn head_dim(&self) -> usize {
        self.attention_head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Width of all heads' queries (and of the attention output).
    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim()
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
        if self.attention_head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
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
                let q = self.q_width();
                let biases = if self.attention_bias { q + 2 * kv } else { 0 };
                let norms = if self.qk_norm { 2 * self.head_dim() } else { 0 };
                let attention = h * q + 2 * h * kv + q * h + biases + norms;
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
        6.0 * non_embedding as f64 + 12.0 * (self.num_hidden_layers * self.q_width() * seq_len) as f64
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

    /// Llama-3.2-1B's `config.json` fields (published on the Hugging Face hub), with the
    /// RoPE settings supplied by `rope`.
    fn llama_1b_json(rope: serde_json::Value) -> ModelConfig {
        let mut json = serde_json::json!({
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": true, "hidden_act": "silu", "head_dim": 64,
        });
        for (k, v) in rope.as_object().unwrap() {
            json[k] = v.clone();
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
        ModelConfig::from_hf_dir(dir.path()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn llama_json_error(extra: serde_json::Value) -> String {
        let mut json = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
        });
        for (k, v) in extra.as_object().unwrap() {
            json[k] = v.clone();
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
        ModelConfig::from_hf_dir(dir.path()).unwrap_err()
    }

    #[test]
    fn rope_settings_read_in_both_transformers_forms() {
        let scaling = serde_json::json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        // transformers 4: top-level rope_theta + rope_scaling.
        let v4 = llama_1b_json(serde_json::json!({"rope_theta": 500000.0, "rope_scaling": scaling}));
        // transformers 5: everything under rope_parameters.
        let mut params = scaling.clone();
        params["rope_theta"] = 500000.0.into();
        let v5 = llama_1b_json(serde_json::json!({ "rope_parameters": params }));
        assert_eq!(v4, v5);
        assert_eq!(v5, ModelConfig::preset("llama-1b").unwrap());
        // default RoPE in the new form: theta read, no scaling.
        let plain = llama_1b_json(
            serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}),
        );
        assert_eq!((plain.rope_theta, plain.rope_scaling), (123.0, None));
    }

    #[test]
    fn rope_and_shape_keys_tierzero_cannot_run_are_errors() {
        use serde_json::json;
        let cases = [
            (
                json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}),
                "`rope_parameters.rope_type` Some(\"yarn\")",
            ),
            (
                json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
                "`rope_scaling.rope_type`",
            ),
            (
                json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}),
                "has no number `low_freq_factor`",
            ),
            (
                json!({"rope_parameters": {"rope_type": "default"}}),
                "`rope_parameters` has no number `rope_theta`",
            ),
            (
                json!({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
                "disagree",
            ),
            (json!({"attention_bias": true}), "`attention_bias` is true"),
            (json!({"mlp_bias": true}), "`mlp_bias` is true"),
            (json!({"hidden_act": "gelu"}), "`hidden_act` is \"gelu\""),
        ];
        for (extra, want) in cases {
            let e = llama_json_error(extra.clone());
            assert!(e.contains(want), "{extra}: {e}");
        }
    }

    #[test]
    fn gpt2_keys_that_change_the_model_are_errors() {
        use serde_json::json;
        let read = |extra: serde_json::Value| {
            let mut config = json!({
                "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
            });
            for (k, v) in extra.as_object().unwrap() {
                config[k] = v.clone();
            }
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
            ModelConfig::from_hf_dir(dir.path())
        };
        // the defaults transformers writes are accepted
        let defaults = json!({"activation_function": "gelu_new", "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false, "reorder_and_upcast_attn": false});
        read(defaults).unwrap();
        read(json!({"activation_function": "gelu_pytorch_tanh"})).unwrap();
        let cases = [
            (
                json!({"activation_function": "relu"}),
                "`activation_function` is \"relu\"",
            ),
            (
                json!({"activation_function": "gelu"}),
                "`activation_function` is \"gelu\"",
            ),
            (
                json!({"scale_attn_weights": false}),
                "`scale_attn_weights` is false",
            ),
            (
                json!({"scale_attn_by_inverse_layer_idx": true}),
                "`scale_attn_by_inverse_layer_idx` is true",
            ),
            (
                json!({"reorder_and_upcast_attn": true}),
                "`reorder_and_upcast_attn` is true",
            ),
        ];
        for (extra, want) in cases {
            let e = read(extra.clone()).unwrap_err();
            assert!(e.contains(want), "{extra}: {e}");
        }
    }
}
