//! Transformer blocks and embeddings as functions of (flat parameters, input).
//!
//! Llama (RMSNorm, RoPE with Llama-3 frequency scaling, grouped-query attention through
//! `scaled_dot_product_attention`, SwiGLU) follows Hugging Face `modeling_llama.py`, with
//! what its relatives add: q/k/v biases (`modeling_qwen2.py`), per-head q/k RMSNorm
//! before RoPE and a head width of its own (`modeling_qwen3.py`); Mistral is Llama's
//! block;
//! GPT-2 (LayerNorm, learned positions, GELU-tanh, Conv1D weights stored [in, out])
//! follows `modeling_gpt2.py`. Norm statistics are computed in fp32 as HF does.

use super::layout::UnitLayout;
use crate::config::model::{Architecture, ModelConfig};
use tch::{Kind, TchError, Tensor};

/// The named tensors of one unit, as views into its flat buffer.
///
/// The buffer is split once into every parameter (and what follows the last: padding),
/// so that autograd's backward to a flat leaf writes one gradient buffer (a split's
/// backward is one concatenation) instead of a zero-filled buffer of the whole unit per
/// parameter added together (a narrow's): the same values, a fraction of the memory
/// traffic.
pub struct Params<'a> {
    layout: &'a UnitLayout,
    pieces: Vec<Tensor>,
}

impl<'a> Params<'a> {
    pub fn new(layout: &'a UnitLayout, flat: &Tensor) -> Result<Self, TchError> {
        // the parameters lie one after the other from offset 0 (layout.rs)
        let mut sizes: Vec<i64> = layout.params.iter().map(|p| p.numel as i64).collect();
        let total = flat.size().first().copied().unwrap_or(0);
        let used: i64 = sizes.iter().sum();
        if total > used {
            sizes.push(total - used);
        }
        Ok(Params {
            layout,
            pieces: flat.f_split_with_sizes(&sizes, 0)?,
        })
    }

    /// The parameters as tensors of their own (flat, in the layout's order).
    pub fn from_pieces(layout: &'a UnitLayout, pieces: &[Tensor]) -> Result<Self, TchError> {
        if pieces.len() != layout.params.len() {
            return Err(TchError::Shape(format!(
                "{} parameter tensors for a unit of {}",
                pieces.len(),
                layout.params.len()
            )));
        }
        Ok(Params {
            layout,
            pieces: pieces.iter().map(Tensor::shallow_clone).collect(),
        })
    }

    pub fn get(&self, suffix: &str) -> Result<Tensor, TchError> {
        let i = self
            .layout
            .params
            .iter()
            .position(|p| p.name.ends_with(suffix))
            .ok_or_else(|| TchError::Kind(format!("unit has no parameter ending in {suffix}")))?;
        self.pieces[i].f_view(self.layout.params[i].shape.as_slice())
    }
}

/// HF `LlamaRMSNorm`: normalise in fp32, cast back, then scale.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor, TchError> {
    let kind = x.kind();
    let xf = x.f_to_kind(Kind::Float)?;
    let variance = xf.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
    let normed = xf
        .f_mul(&variance.f_add_scalar(eps)?.f_rsqrt()?)?
        .f_to_kind(kind)?;
    weight.f_mul(&normed)
}

/// GPT-2 LayerNorm, with fp32 statistics.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor, TchError> {
    let kind = x.kind();
    let h = x.size().last().copied().unwrap_or(0);
    x.f_to_kind(Kind::Float)?
        .f_layer_norm(
            [h],
            Some(weight.f_to_kind(Kind::Float)?),
            Some(bias.f_to_kind(Kind::Float)?),
            eps,
            false,
        )?
        .f_to_kind(kind)
}

/// RoPE cos/sin tables [T, head_dim] in `kind` (HF `LlamaRotaryEmbedding`, with the
/// Llama-3 `_compute_llama3_parameters` frequency scaling).
pub fn rope_tables(config: &ModelConfig, seq_len: i64, kind: Kind) -> Result<(Tensor, Tensor), TchError> {
    let hd = config.head_dim();
    let mut inv_freq: Vec<f64> = (0..hd / 2)
        .map(|i| 1.0 / config.rope_theta.powf((2 * i) as f64 / hd as f64))
        .collect();
    if let Some(s) = config.rope_scaling {
        let old = s.original_max_position_embeddings as f64;
        let low_wavelen = old / s.low_freq_factor;
        let high_wavelen = old / s.high_freq_factor;
        for f in inv_freq.iter_mut() {
            let wavelen = std::f64::consts::TAU / *f;
            if wavelen > low_wavelen {
                *f /= s.factor;
            } else if wavelen >= high_wavelen {
                let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
            }
        }
    }
    let inv: Vec<f32> = inv_freq.iter().map(|&f| f as f32).collect();
    let inv = Tensor::f_from_slice(&inv)?;
    let positions = Tensor::f_arange(seq_len, (Kind::Float, tch::Device::Cpu))?;
    let freqs = positions.f_unsqueeze(1)?.f_mul(&inv.f_unsqueeze(0)?)?;
    let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
    Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
}

fn rotate_half(x: &Tensor) -> Result<Tensor, TchError> {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.f_narrow(-1, 0, half)?;
    let x2 = x.f_narrow(-1, half, half)?;
    Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)
}

fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, TchError> {
    x.f_mul(cos)?.f_add(&rotate_half(x)?.f_mul(sin)?)
}

/// [B, T, heads·hd] → [B, heads, T, hd]
fn split_heads(x: &Tensor, heads: i64) -> Result<Tensor, TchError> {
    let s = x.size();
    x.f_view([s[0], s[1], heads, s[2] / heads])?.f_transpose(1, 2)
}

/// [B, heads, T, hd] → [B, T, heads·hd]
fn merge_heads(x: &Tensor) -> Result<Tensor, TchError> {
    let s = x.size();
    x.f_transpose(1, 2)?
        .f_contiguous()?
        .f_view([s[0], s[2], s[1] * s[3]])
}

fn linear(x: &Tensor, weight_out_in: &Tensor) -> Result<Tensor, TchError> {
    x.f_matmul(&weight_out_in.f_tr()?)
}

/// Keys and values of a generation's earlier positions, one block's, grown by each
/// call.
#[derive(Default)]
pub struct Kv {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

/// How a block's queries see keys: causally along the row, under a packed row's mask
/// ([B, 1, T, T], true where a query may attend), or after the cached keys and values
/// of earlier positions (generation).
pub enum Attend<'a> {
    Causal,
    Masked(&'a Tensor),
    Cached(&'a mut Kv),
}

/// Appends `new` to a cached [B, heads, past, hd] tensor along positions.
fn extend(cached: &mut Option<Tensor>, new: Tensor) -> Result<Tensor, TchError> {
    let whole = match cached.take() {
        Some(past) => Tensor::f_cat(&[&past, &new], 2)?,
        None => new,
    };
    *cached = Some(whole.shallow_clone());
    Ok(whole)
}

/// Scaled dot-product attention of q over k, v as `attend` says.
fn attention(q: &Tensor, k: Tensor, v: Tensor, attend: Attend, gqa: bool) -> Result<Tensor, TchError> {
    let sdpa = |k: &Tensor, v: &Tensor, mask: Option<&Tensor>, causal: bool| {
        Tensor::f_scaled_dot_product_attention(q, k, v, mask, 0.0, causal, None, gqa)
    };
    match attend {
        Attend::Causal => sdpa(&k, &v, None, true),
        Attend::Masked(mask) => sdpa(&k, &v, Some(mask), false),
        Attend::Cached(kv) => {
            let past = kv.k.as_ref().map_or(0, |k| k.size()[2]);
            let (k, v) = (extend(&mut kv.k, k)?, extend(&mut kv.v, v)?);
            let t = q.size()[2];
            match (past, t) {
                (0, _) => sdpa(&k, &v, None, true),
                (_, 1) => sdpa(&k, &v, None, false),
                _ => {
                    // query i sits at position past + i
                    let rows = Tensor::f_arange(t, (tch::Kind::Int64, q.device()))?.f_add_scalar(past)?;
                    let cols = Tensor::f_arange(past + t, (tch::Kind::Int64, q.device()))?;
                    let mask = cols.f_unsqueeze(0)?.f_le_tensor(&rows.f_unsqueeze(1)?)?;
                    sdpa(&k, &v, Some(&mask), false)
                }
            }
        }
    }
}

/// A Llama block. `rope` is (cos, sin) at the rows' positions: [T, hd] for rows of one
/// sequence, [B, 1, T, hd] gathered at packed rows' positions.
pub fn llama_block(
    config: &ModelConfig,
    p: &Params,
    x: &Tensor,
    rope: &(Tensor, Tensor),
    attend: Attend,
) -> Result<Tensor, TchError> {
    let (heads, kv_heads) = (
        config.num_attention_heads as i64,
        config.num_key_value_heads as i64,
    );
    let h = rms_norm(x, &p.get("input_layernorm.weight")?, config.norm_eps)?;
    // q, k, v [B, heads, T, hd], with Qwen2's biases and Qwen3's per-head norms
    let project = |name: &str, heads: i64| -> Result<Tensor, TchError> {
        let mut y = linear(&h, &p.get(&format!("self_attn.{name}.weight"))?)?;
        if config.attention_bias {
            y = y.f_add(&p.get(&format!("self_attn.{name}.bias"))?)?;
        }
        split_heads(&y, heads)
    };
    let (mut q, mut k) = (project("q_proj", heads)?, project("k_proj", kv_heads)?);
    let v = project("v_proj", kv_heads)?;
    if config.qk_norm {
        q = rms_norm(&q, &p.get("self_attn.q_norm.weight")?, config.norm_eps)?;
        k = rms_norm(&k, &p.get("self_attn.k_norm.weight")?, config.norm_eps)?;
    }
    let (q, k) = (
        apply_rope(&q, &rope.0, &rope.1)?,
        apply_rope(&k, &rope.0, &rope.1)?,
    );
    let attn = attention(&q, k, v, attend, kv_heads != heads)?;
    let x = x.f_add(&linear(&merge_heads(&attn)?, &p.get("o_proj.weight")?)?)?;
    let h = rms_norm(&x, &p.get("post_attention_layernorm.weight")?, config.norm_eps)?;
    let gate = linear(&h, &p.get("gate_proj.weight")?)?.f_silu()?;
    let up = linear(&h, &p.get("up_proj.weight")?)?;
    x.f_add(&linear(&gate.f_mul(&up)?, &p.get("down_proj.weight")?)?)
}

/// GPT-2's Conv1D: `x @ W + b` with W stored [in, out].
fn conv1d(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor, TchError> {
    x.f_matmul(weight)?.f_add(bias)
}

pub fn gpt2_block(config: &ModelConfig, p: &Params, x: &Tensor, attend: Attend) -> Result<Tensor, TchError> {
    let heads = config.num_attention_heads as i64;
    let hidden = config.hidden_size as i64;
    let h = layer_norm(x, &p.get("ln_1.weight")?, &p.get("ln_1.bias")?, config.norm_eps)?;
    let qkv = conv1d(&h, &p.get("attn.c_attn.weight")?, &p.get("attn.c_attn.bias")?)?;
    let parts = qkv.f_split(hidden, -1)?;
    let (q, k, v) = (
        split_heads(&parts[0], heads)?,
        split_heads(&parts[1], heads)?,
        split_heads(&parts[2], heads)?,
    );
    let attn = attention(&q, k, v, attend, false)?;
    let x = x.f_add(&conv1d(
        &merge_heads(&attn)?,
        &p.get("attn.c_proj.weight")?,
        &p.get("attn.c_proj.bias")?,
    )?)?;
    let h = layer_norm(&x, &p.get("ln_2.weight")?, &p.get("ln_2.bias")?, config.norm_eps)?;
    let m = conv1d(&h, &p.get("mlp.c_fc.weight")?, &p.get("mlp.c_fc.bias")?)?.f_gelu("tanh")?;
    x.f_add(&conv1d(
        &m,
        &p.get("mlp.c_proj.weight")?,
        &p.get("mlp.c_proj.bias")?,
    )?)
}

/// Token (and, for GPT-2, position) embeddings: tokens [B, T] → [B, T, H]. `positions`
/// [B, T] are packed rows' positions; without them a row's positions are 0..T.
pub fn embed(
    config: &ModelConfig,
    p: &Params,
    tokens: &Tensor,
    positions: Option<&Tensor>,
) -> Result<Tensor, TchError> {
    match config.architecture {
        Architecture::Llama => Tensor::f_embedding(&p.get("embed_tokens.weight")?, tokens, -1, false, false),
        Architecture::Gpt2 => {
            let wte = Tensor::f_embedding(&p.get("wte.weight")?, tokens, -1, false, false)?;
            match positions {
                Some(positions) => wte.f_add(&Tensor::f_embedding(
                    &p.get("wpe.weight")?,
                    positions,
                    -1,
                    false,
                    false,
                )?),
                None => {
                    let wpe = p.get("wpe.weight")?.f_narrow(0, 0, tokens.size()[1])?;
                    wte.f_add(&wpe.f_unsqueeze(0)?)
                }
            }
        }
    }
}

/// The final norm: [B, T, H] → [B, T, H].
pub fn final_norm(config: &ModelConfig, p: &Params, x: &Tensor) -> Result<Tensor, TchError> {
    match config.architecture {
        Architecture::Llama => rms_norm(x, &p.get("model.norm.weight")?, config.norm_eps),
        Architecture::Gpt2 => layer_norm(x, &p.get("ln_f.weight")?, &p.get("ln_f.bias")?, config.norm_eps),
    }
}
