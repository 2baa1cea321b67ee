//! Model shapes from a Hugging Face `config.json`, as transformers reads them: the
//! Llama family (Llama, Mistral, Qwen2/2.5 with q/k/v biases, Qwen3 with per-head q/k
//! RMSNorm and its own head width) and GPT-2. A key whose value would change the model
//! in a way the blocks do not implement is an error naming it, never a silent default.

use super::model::{Architecture, Family, ModelConfig, RopeScaling};
use std::path::Path;

impl ModelConfig {
    /// Reads a Hugging Face `config.json`: `LlamaForCausalLM`, `MistralForCausalLM`,
    /// `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `GPT2LMHeadModel`.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig, String> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
        let get = |key: &str| integer(&json, key);
        let require = |key: &str| required(&json, &path, key);
        let model_type = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let family = match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gpt2" => return gpt2_config(&json, &path),
            other => {
                return Err(format!(
                    "{}: model_type {other:?} is not supported (supported: \"llama\", \"mistral\", \"qwen2\", \"qwen3\", \"gpt2\")",
                    path.display()
                ))
            }
        };
        let heads = require("num_attention_heads")?;
        let hidden = require("hidden_size")?;
        llama_unsupported_keys(&json, &path)?;
        let (rope_theta, rope_scaling) = llama_rope(&json, &path)?;
        let flag = |key: &str, default: bool| {
            json.get(key)
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(default)
        };
        // Qwen2 has q/k/v biases (no key says so); elsewhere `attention_bias` would put
        // one on o_proj too, which the blocks do not carry
        if family != Family::Qwen2 && flag("attention_bias", false) {
            return Err(format!(
                "{}: `attention_bias` is true; tierzero implements Qwen2's q/k/v biases, not biases on every projection",
                path.display()
            ));
        }
        let attention_bias = family == Family::Qwen2;
        let head_dim = get("head_dim").filter(|&d| d != hidden / heads.max(1));
        Ok(ModelConfig {
            architecture: Architecture::Llama,
            family,
            hidden_size: hidden,
            intermediate_size: require("intermediate_size")?,
            num_hidden_layers: require("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: get("num_key_value_heads").unwrap_or(heads),
            vocab_size: require("vocab_size")?,
            max_position_embeddings: get("max_position_embeddings").unwrap_or(2048),
            tie_word_embeddings: flag("tie_word_embeddings", false),
            rope_theta,
            rope_scaling,
            norm_eps: json.get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-6),
            attention_bias,
            qk_norm: family == Family::Qwen3,
            attention_head_dim: head_dim,
            sliding_window: sliding_window(&json, family),
        })
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

/// Llama-family `config.json` keys that would change the model in ways tierzero's blocks
/// do not implement: an error naming the key rather than a model that silently differs.
fn llama_unsupported_keys(json: &serde_json::Value, path: &Path) -> Result<(), String> {
    let unsupported = |key: &str, why: String| Err(format!("{}: `{key}` {why}", path.display()));
    if json.get("mlp_bias").and_then(serde_json::Value::as_bool) == Some(true) {
        return unsupported("mlp_bias", "is true; tierzero's MLP has no biases".into());
    }
    if let Some(act) = json.get("hidden_act").and_then(|v| v.as_str()) {
        if act != "silu" {
            return unsupported(
                "hidden_act",
                format!("is {act:?}; tierzero's MLP is SwiGLU (\"silu\")"),
            );
        }
    }
    if let Some(p) = json.get("attention_dropout").and_then(serde_json::Value::as_f64) {
        if p != 0.0 {
            return unsupported(
                "attention_dropout",
                format!("is {p}; tierzero's attention has no dropout (set it to 0.0)"),
            );
        }
    }
    // per-layer attention kinds (newer Qwen configs): sliding layers are not implemented
    if let Some(kinds) = json.get("layer_types").and_then(serde_json::Value::as_array) {
        if let Some(k) = kinds
            .iter()
            .filter_map(|k| k.as_str())
            .find(|k| *k != "full_attention")
        {
            return unsupported(
                "layer_types",
                format!("has {k:?}; tierzero runs full attention in every layer"),
            );
        }
    }
    Ok(())
}

/// The attention window a config imposes, if any: Mistral's `sliding_window`, Qwen2's
/// when `use_sliding_window` is true. A sequence longer than it is refused by the plan
/// (tierzero attends to the whole sequence).
fn sliding_window(json: &serde_json::Value, family: Family) -> Option<usize> {
    let window = json.get("sliding_window").and_then(serde_json::Value::as_u64)? as usize;
    let used = match family {
        Family::Mistral => true,
        _ => {
            json.get("use_sliding_window")
                .and_then(serde_json::Value::as_bool)
                == Some(true)
        }
    };
    used.then_some(window)
}

/// An integer key of a `config.json`.
fn integer(json: &serde_json::Value, key: &str) -> Option<usize> {
    json.get(key)
        .and_then(serde_json::Value::as_u64)
        .map(|v| v as usize)
}

/// An integer key the model cannot do without.
fn required(json: &serde_json::Value, path: &Path, key: &str) -> Result<usize, String> {
    integer(json, key).ok_or_else(|| format!("{} has no integer `{key}`", path.display()))
}

/// GPT-2's `config.json`.
fn gpt2_config(json: &serde_json::Value, path: &Path) -> Result<ModelConfig, String> {
    let get = |key: &str| integer(json, key);
    let require = |key: &str| required(json, path, key);
    gpt2_unsupported_keys(json, path)?;
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
        ..ModelConfig::plain()
    })
}
