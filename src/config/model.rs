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
                llama_unsupported_keys(&json, &path, heads)?;
                let (rope_theta, rope_scaling) = llama_rope(&json, &path)?;
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
                    rope_theta,
                    rope_scaling,
                    norm_eps: json.get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-6),
                })
            }
            "gpt2" => {
                gpt2_unsupported_keys(&json, &path)?;
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

/// RoPE settings of a Llama `config.json`, in either of the forms transformers writes:
/// `rope_parameters` (transformers 5: `rope_theta`, `rope_type`, the scaling fields) or
/// top-level `rope_theta` + `rope_scaling` (transformers 4). A form tierzero cannot run,
/// or two forms that disagree, is an error naming the key: never a silent default.
fn llama_rope(json: &serde_json::Value, path: &Path) -> Result<(f64, Option<RopeScaling>), String> {
    let present = |key: &str| json.get(key).filter(|v| !v.is_null());
    let old_theta = match present("rope_theta") {
        None => None,
        Some(v) => Some(
            v.as_f64()
                .ok_or_else(|| format!("{}: `rope_theta` is not a number", path.display()))?,
        ),
    };
    let old = match present("rope_scaling") {
        None => None,
        Some(s) => rope_scaling(s, "rope_scaling", path)?,
    };
    let Some(params) = present("rope_parameters") else {
        // transformers' LlamaConfig default theta when the key is absent.
        return Ok((old_theta.unwrap_or(10000.0), old));
    };
    let theta = params
        .get("rope_theta")
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| format!("{}: `rope_parameters` has no number `rope_theta`", path.display()))?;
    let scaling = rope_scaling(params, "rope_parameters", path)?;
    if old_theta.is_some_and(|t| t != theta) || (present("rope_scaling").is_some() && old != scaling) {
        return Err(format!(
            "{}: `rope_parameters` and the top-level `rope_theta`/`rope_scaling` disagree; keep one form",
            path.display()
        ));
    }
    Ok((theta, scaling))
}

/// The frequency scaling of a `rope_scaling` or `rope_parameters` object (`key` names it):
/// none for `rope_type` "default", Llama-3's four fields (all required, as transformers
/// requires them) for "llama3", an error for any other type.
fn rope_scaling(s: &serde_json::Value, key: &str, path: &Path) -> Result<Option<RopeScaling>, String> {
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(|v| v.as_str());
    match kind {
        Some("default") => return Ok(None),
        None if key == "rope_parameters" => return Ok(None),
        Some("llama3") => {}
        other => {
            return Err(format!(
                "{}: `{key}.rope_type` {other:?} is not supported (supported: \"default\", \"llama3\")",
                path.display()
            ))
        }
    }
    let number = |k: &str| {
        s.get(k).and_then(serde_json::Value::as_f64).ok_or_else(|| {
            format!(
                "{}: `{key}` of type \"llama3\" has no number `{k}`",
                path.display()
            )
        })
    };
    Ok(Some(RopeScaling {
        factor: number("factor")?,
        low_freq_factor: number("low_freq_factor")?,
        high_freq_factor: number("high_freq_factor")?,
        original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
    }))
}

/// GPT-2 `config.json` keys whose non-default values change the model in ways tierzero's
/// blocks do not implement (GELU-tanh, attention scaled by 1/√head_dim only, attention
/// in the blocks' precision): an error naming the key, not a model that silently differs.
fn gpt2_unsupported_keys(json: &serde_json::Value, path: &Path) -> Result<(), String> {
    let unsupported = |key: &str, why: String| Err(format!("{}: `{key}` {why}", path.display()));
    if let Some(act) = json.get("activation_function").and_then(|v| v.as_str()) {
        // transformers' "gelu_new" and "gelu_pytorch_tanh" are the same tanh approximation
        if !["gelu_new", "gelu_pytorch_tanh"].contains(&act) {
            return unsupported(
                "activation_function",
                format!("is {act:?}; tierzero's GPT-2 MLP uses the tanh GELU (\"gelu_new\")"),
            );
        }
    }
    let flag = |key: &str| json.get(key).and_then(serde_json::Value::as_bool);
    if flag("scale_attn_weights") == Some(false) {
        return unsupported(
            "scale_attn_weights",
            "is false; tierzero's GPT-2 attention always scales by 1/√head_dim".into(),
        );
    }
    for key in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if flag(key) == Some(true) {
            return unsupported(
                key,
                "is true; tierzero's GPT-2 attention does not implement it (set it to false or drop it)"
                    .into(),
            );
        }
    }
    Ok(())
}

/// Llama `config.json` keys that would change the model in ways tierzero's blocks do not
/// implement: an error naming the key rather than a model that silently differs.
fn llama_unsupported_keys(json: &serde_json::Value, path: &Path, heads: usize) -> Result<(), String> {
    let unsupported = |key: &str, why: String| Err(format!("{}: `{key}` {why}", path.display()));
    for key in ["attention_bias", "mlp_bias"] {
        if json.get(key).and_then(serde_json::Value::as_bool) == Some(true) {
            return unsupported(key, "is true; tierzero's Llama blocks have no biases".into());
        }
    }
    if let Some(act) = json.get("hidden_act").and_then(|v| v.as_str()) {
        if act != "silu" {
            return unsupported(
                "hidden_act",
                format!("is {act:?}; tierzero's Llama MLP is SwiGLU (\"silu\")"),
            );
        }
    }
    let hidden = json
        .get("hidden_size")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0) as usize;
    if let Some(head_dim) = json.get("head_dim").and_then(serde_json::Value::as_u64) {
        if heads > 0 && head_dim as usize != hidden / heads {
            return unsupported(
                "head_dim",
                format!("is {head_dim}, not hidden_size / num_attention_heads = {}; tierzero does not support a separate head_dim", hidden / heads),
            );
        }
    }
    Ok(())
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
            (json!({"head_dim": 32}), "`head_dim` is 32"),
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
