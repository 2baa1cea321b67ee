//! Where each parameter sits in its unit's flat buffer, under its Hugging Face name.
//!
//! A unit's parameters are one flat buffer (what ZeRO-3 shards, gathers and releases);
//! a [`UnitLayout`] lists the tensors in it with shapes and offsets, in the order the
//! `LlamaForCausalLM` / `GPT2LMHeadModel` state dicts name them. Initialisation follows
//! the Hugging Face `_init_weights` of each family (normal(0, 0.02) for matrices and
//! embeddings, ones for norm scales, zeros for biases; GPT-2's residual projections
//! scaled by 1/√(2·layers) as in the GPT-2 paper) and is a pure function of
//! (seed, tensor name, element index), so every world size initialises identically.

use crate::config::model::{Architecture, ModelConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitKind {
    Embedding,
    Block(usize),
    /// Final norm, plus the LM head when embeddings are untied.
    Final,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Normal(f32),
    Ones,
    Zeros,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Hugging Face state-dict name (`model.layers.3.self_attn.q_proj.weight`).
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: usize,
    pub numel: usize,
    pub init: Init,
}

#[derive(Clone, Debug, PartialEq)]
pub struct UnitLayout {
    pub kind: UnitKind,
    pub params: Vec<ParamSpec>,
    pub numel: usize,
}

impl UnitLayout {
    fn new(kind: UnitKind, specs: Vec<(String, Vec<i64>, Init)>) -> UnitLayout {
        let mut offset = 0;
        let params = specs
            .into_iter()
            .map(|(name, shape, init)| {
                let numel = shape.iter().product::<i64>() as usize;
                let spec = ParamSpec {
                    name,
                    shape,
                    offset,
                    numel,
                    init,
                };
                offset += numel;
                spec
            })
            .collect();
        UnitLayout {
            kind,
            params,
            numel: offset,
        }
    }

    pub fn param(&self, suffix: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name.ends_with(suffix))
    }

    /// Fills `out` (this unit's full flat buffer) with the initial values.
    pub fn init(&self, seed: u64, out: &mut [f32]) {
        self.init_range(seed, 0..self.numel, out);
    }

    /// Fills `out` with the initial values of elements `range` of the flat buffer: the
    /// same values [`Self::init`] puts there (each is a function of seed, tensor and
    /// index), so a rank builds its slice without the whole unit.
    pub fn init_range(&self, seed: u64, range: std::ops::Range<usize>, out: &mut [f32]) {
        for p in &self.params {
            let start = p.offset.max(range.start);
            let end = (p.offset + p.numel).min(range.end);
            if start >= end {
                continue;
            }
            let dst = &mut out[start - range.start..end - range.start];
            match p.init {
                Init::Ones => dst.fill(1.0),
                Init::Zeros => dst.fill(0.0),
                Init::Normal(std) => {
                    let stream = seed ^ fnv1a(&p.name);
                    for (i, x) in (start - p.offset..).zip(dst.iter_mut()) {
                        *x = std * standard_normal(stream, i as u64);
                    }
                }
            }
        }
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64's finaliser: the one hash behind the seeded init, the data order
/// (`data::mix`) and the sampler of `generate`.
pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A standard normal sample that depends only on (stream, index): Box–Muller on two
/// SplitMix64 uniforms.
fn standard_normal(stream: u64, index: u64) -> f32 {
    let a = splitmix(stream ^ splitmix(index.wrapping_mul(2)));
    let b = splitmix(stream ^ splitmix(index.wrapping_mul(2) + 1));
    let u1 = ((a >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// The units of a model, in forward order.
pub fn units(config: &ModelConfig) -> Vec<UnitLayout> {
    let h = config.hidden_size as i64;
    let i = config.intermediate_size as i64;
    let v = config.vocab_size as i64;
    let kv = (config.num_key_value_heads * config.head_dim()) as i64;
    let std = Init::Normal(0.02);
    let s = |name: String, shape: Vec<i64>, init: Init| (name, shape, init);
    let mut out = Vec::with_capacity(config.num_hidden_layers + 2);
    match config.architecture {
        Architecture::Llama => {
            out.push(UnitLayout::new(
                UnitKind::Embedding,
                vec![s("model.embed_tokens.weight".into(), vec![v, h], std)],
            ));
            let q = config.q_width() as i64;
            let hd = config.head_dim() as i64;
            for l in 0..config.num_hidden_layers {
                let p = |n: &str| format!("model.layers.{l}.{n}");
                let mut block = vec![s(p("input_layernorm.weight"), vec![h], Init::Ones)];
                for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    block.push(s(p(&format!("self_attn.{name}.weight")), vec![rows, h], std));
                    if config.attention_bias {
                        block.push(s(p(&format!("self_attn.{name}.bias")), vec![rows], Init::Zeros));
                    }
                }
                block.push(s(p("self_attn.o_proj.weight"), vec![h, q], std));
                if config.qk_norm {
                    block.push(s(p("self_attn.q_norm.weight"), vec![hd], Init::Ones));
                    block.push(s(p("self_attn.k_norm.weight"), vec![hd], Init::Ones));
                }
                block.extend([
                    s(p("post_attention_layernorm.weight"), vec![h], Init::Ones),
                    s(p("mlp.gate_proj.weight"), vec![i, h], std),
                    s(p("mlp.up_proj.weight"), vec![i, h], std),
                    s(p("mlp.down_proj.weight"), vec![h, i], std),
                ]);
                out.push(UnitLayout::new(UnitKind::Block(l), block));
            }
            let mut last = vec![s("model.norm.weight".into(), vec![h], Init::Ones)];
            if !config.tie_word_embeddings {
                last.push(s("lm_head.weight".into(), vec![v, h], std));
            }
            out.push(UnitLayout::new(UnitKind::Final, last));
        }
        Architecture::Gpt2 => {
            let pos = config.max_position_embeddings as i64;
            out.push(UnitLayout::new(
                UnitKind::Embedding,
                vec![
                    s("transformer.wte.weight".into(), vec![v, h], std),
                    s("transformer.wpe.weight".into(), vec![pos, h], Init::Normal(0.01)),
                ],
            ));
            let residual = Init::Normal(0.02 / (2.0 * config.num_hidden_layers as f32).sqrt());
            for l in 0..config.num_hidden_layers {
                let p = |n: &str| format!("transformer.h.{l}.{n}");
                out.push(UnitLayout::new(
                    UnitKind::Block(l),
                    vec![
                        s(p("ln_1.weight"), vec![h], Init::Ones),
                        s(p("ln_1.bias"), vec![h], Init::Zeros),
                        s(p("attn.c_attn.weight"), vec![h, 3 * h], std),
                        s(p("attn.c_attn.bias"), vec![3 * h], Init::Zeros),
                        s(p("attn.c_proj.weight"), vec![h, h], residual),
                        s(p("attn.c_proj.bias"), vec![h], Init::Zeros),
                        s(p("ln_2.weight"), vec![h], Init::Ones),
                        s(p("ln_2.bias"), vec![h], Init::Zeros),
                        s(p("mlp.c_fc.weight"), vec![h, i], std),
                        s(p("mlp.c_fc.bias"), vec![i], Init::Zeros),
                        s(p("mlp.c_proj.weight"), vec![i, h], residual),
                        s(p("mlp.c_proj.bias"), vec![h], Init::Zeros),
                    ],
                ));
            }
            out.push(UnitLayout::new(
                UnitKind::Final,
                vec![
                    s("transformer.ln_f.weight".into(), vec![h], Init::Ones),
                    s("transformer.ln_f.bias".into(), vec![h], Init::Zeros),
                ],
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_parameter_counts() {
        for name in crate::config::model::PRESETS {
            let config = ModelConfig::preset(name).unwrap();
            let layouts = units(&config);
            let numels: Vec<usize> = layouts.iter().map(|u| u.numel).collect();
            assert_eq!(numels, config.unit_numels(), "{name}");
        }
    }

    #[test]
    fn init_is_deterministic_and_roughly_normal() {
        let config = ModelConfig::preset("llama-tiny").unwrap();
        let unit = &units(&config)[1];
        let mut a = vec![0f32; unit.numel];
        let mut b = vec![0f32; unit.numel];
        unit.init(7, &mut a);
        unit.init(7, &mut b);
        assert_eq!(a, b);
        let q = unit.param("q_proj.weight").unwrap();
        let xs = &a[q.offset..q.offset + q.numel];
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        let std = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / xs.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.002 && (std - 0.02).abs() < 0.002,
            "mean {mean} std {std}"
        );
        let norm = unit.param("input_layernorm.weight").unwrap();
        assert!(a[norm.offset..norm.offset + norm.numel].iter().all(|&x| x == 1.0));
    }

    #[test]
    fn a_range_holds_what_the_whole_unit_holds_there() {
        let config = ModelConfig::preset("llama-tiny").unwrap();
        let unit = &units(&config)[1];
        // the reference: each tensor in turn over the whole buffer
        let mut whole = vec![f32::NAN; unit.numel];
        for p in &unit.params {
            let stream = 7 ^ fnv1a(&p.name);
            for i in 0..p.numel {
                whole[p.offset + i] = match p.init {
                    Init::Ones => 1.0,
                    Init::Zeros => 0.0,
                    Init::Normal(std) => std * standard_normal(stream, i as u64),
                };
            }
        }
        let q = unit.param("q_proj.weight").unwrap();
        let boundary = q.offset + q.numel;
        for range in [
            0..unit.numel,
            3..boundary + 5,
            boundary - 1..boundary + 1,
            unit.numel - 7..unit.numel,
        ] {
            let mut part = vec![f32::NAN; range.len()];
            unit.init_range(7, range.clone(), &mut part);
            assert_eq!(part, whole[range.clone()], "{range:?}");
        }
    }
}
