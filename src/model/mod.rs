//! Models as lists of units, each a function of its flat parameter buffer.
//!
//! - model shapes (presets, Hugging Face `config.json`) are `config::model`
//! - `layout.rs`: tensor names, shapes and offsets inside each unit's flat buffer
//! - `blocks.rs`: Llama and GPT-2 blocks, embeddings, final norms (tch)
//! - `chat.rs`: chat templates rendered as transformers renders them, with assistant spans
//! - `generate.rs`: generation with a key/value cache, greedy or sampled
//! - `head.rs`: chunked LM head + cross-entropy with a hand-written backward
//! - `hf.rs`, `safetensors.rs`: Hugging Face directories and the container they use;
//!   `companions.rs`: the tokenizer, chat template and generation config beside them
//!
//! [`Model`] runs one unit forward without autograd, and one unit backward by
//! recomputing its forward with the flat buffer as a leaf that requires grad and
//! back-propagating the incoming gradient: the leaf's grad is the unit's flat gradient.
//! Only unit inputs are kept between forward and backward (activation checkpointing at
//! unit boundaries).

pub mod blocks;
pub mod chat;
pub mod companions;
pub mod generate;
pub mod head;
pub mod hf;
pub mod layout;
pub mod safetensors;

use crate::config::model::{Architecture, ModelConfig};
use crate::torch::shim;
use blocks::{Attend, Params};
use layout::{UnitKind, UnitLayout};
use std::sync::Mutex;
use tch::{Kind, TchError, Tensor};

pub struct Model {
    pub config: ModelConfig,
    pub units: Vec<UnitLayout>,
    /// Element type of parameters and activations.
    pub kind: Kind,
    /// What the LM head's products run in (fp32 unless [`Model::with_head`] says).
    pub head: head::Matmul,
    rope: Mutex<Vec<(i64, tch::Device, Tensor, Tensor)>>,
}

/// How the samples packed into a micro-batch's rows attend: each token only to earlier
/// tokens of its own sample, at positions counted from its sample's start.
pub struct Segments {
    /// [B, T] int64 positions within each sample.
    pub positions: Tensor,
    /// [B, 1, T, T] bool, true where a query may attend (block-diagonal causal).
    pub mask: Tensor,
}

impl Segments {
    /// From each token's sample number within its row ([B, T], row-major, samples
    /// contiguous), on `device`.
    pub fn new(segment: &[i64], rows: usize, seq: usize, device: tch::Device) -> Result<Segments, TchError> {
        let mut positions = Vec::with_capacity(segment.len());
        for row in segment.chunks(seq) {
            let mut start = 0;
            for (j, s) in row.iter().enumerate() {
                if j > 0 && *s != row[j - 1] {
                    start = j;
                }
                positions.push((j - start) as i64);
            }
        }
        let shape = [rows as i64, seq as i64];
        let positions = Tensor::f_from_slice(&positions)?.f_view(shape)?.f_to(device)?;
        let ids = Tensor::f_from_slice(segment)?.f_view(shape)?.f_to(device)?;
        let same = ids.f_unsqueeze(2)?.f_eq_tensor(&ids.f_unsqueeze(1)?)?;
        let causal = Tensor::f_ones([seq as i64, seq as i64], (Kind::Bool, device))?.f_tril(0)?;
        let mask = same.f_logical_and(&causal)?.f_unsqueeze(1)?;
        Ok(Segments { positions, mask })
    }
}

/// Where a unit's rows sit: positions `start..start + T` of one sequence, or packed
/// rows' own.
#[derive(Clone, Copy)]
enum Positions<'a> {
    From(i64),
    Packed(&'a Tensor),
}

/// A generation's keys and values, per unit (only blocks fill theirs), and how many
/// positions they cover.
#[derive(Default)]
pub struct Cache {
    units: Vec<blocks::Kv>,
    len: i64,
}

impl Cache {
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A unit's forward kept for its backward: the output with its graph, the parameters'
/// leaf and (for blocks) the input's.
pub struct Graph {
    y: Tensor,
    leaf: Tensor,
    x: Option<Tensor>,
}

/// Gradients of the final unit.
pub struct FinalGrads {
    /// Flat gradient of the final unit's own parameters (fp32).
    pub params: Tensor,
    /// Gradient of the tied embedding matrix [V, H] (fp32), when embeddings are tied.
    pub tied: Option<Tensor>,
    /// Gradient of the unit's input [B, T, H].
    pub input: Tensor,
    pub loss_sum: f64,
    pub count: i64,
}

impl Model {
    pub fn new(config: ModelConfig, kind: Kind) -> Model {
        let units = layout::units(&config);
        Model {
            config,
            units,
            kind,
            head: head::Matmul::Fp32,
            rope: Mutex::new(Vec::new()),
        }
    }

    /// The same model with the LM head's products in `head` (the plan's
    /// `train.low_precision_head`).
    pub fn with_head(mut self, head: head::Matmul) -> Model {
        self.head = head;
        self
    }

    /// cos/sin tables for `seq_len` positions on `device` (cached per length and device).
    fn rope(&self, seq_len: i64, device: tch::Device) -> Result<(Tensor, Tensor), TchError> {
        let mut cache = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, cos, sin)) = cache.iter().find(|(t, d, _, _)| *t == seq_len && *d == device) {
            return Ok((cos.shallow_clone(), sin.shallow_clone()));
        }
        let (cos, sin) = blocks::rope_tables(&self.config, seq_len, self.kind)?;
        let (cos, sin) = (cos.f_to(device)?, sin.f_to(device)?);
        cache.push((seq_len, device, cos.shallow_clone(), sin.shallow_clone()));
        Ok((cos, sin))
    }

    /// The LM head matrix [V, H]: the final unit's own, or the tied embedding's.
    fn head_weight(&self, final_params: &Tensor, tied: Option<&Tensor>) -> Result<Tensor, TchError> {
        let (v, h) = (self.config.vocab_size as i64, self.config.hidden_size as i64);
        match (self.config.tie_word_embeddings, tied) {
            (true, Some(embedding)) => embedding.f_narrow(0, 0, v * h)?.f_view([v, h]),
            (true, None) => Err(TchError::Kind(
                "tied embeddings: the embedding unit's parameters are needed".into(),
            )),
            (false, _) => Params::new(self.units.last().unwrap_or_else(|| unreachable!()), final_params)?
                .get("lm_head.weight"),
        }
    }

    /// Forward of unit `u` (not the final one) under no_grad: tokens or hidden → hidden.
    pub fn forward_unit(
        &self,
        u: usize,
        params: &Tensor,
        input: &Tensor,
        segments: Option<&Segments>,
    ) -> Result<Tensor, TchError> {
        tch::no_grad(|| self.forward_graph(u, params, input, segments))
    }

    fn forward_graph(
        &self,
        u: usize,
        params: &Tensor,
        input: &Tensor,
        segments: Option<&Segments>,
    ) -> Result<Tensor, TchError> {
        match segments {
            None => self.run_unit(u, params, input, Positions::From(0), Attend::Causal),
            Some(s) => self.run_unit(
                u,
                params,
                input,
                Positions::Packed(&s.positions),
                Attend::Masked(&s.mask),
            ),
        }
    }

    /// Unit `u` on rows at `positions`, its blocks attending as `attend` says.
    fn run_unit(
        &self,
        u: usize,
        params: &Tensor,
        input: &Tensor,
        positions: Positions,
        attend: Attend,
    ) -> Result<Tensor, TchError> {
        let p = Params::new(&self.units[u], params)?;
        self.run_params(u, &p, input, positions, attend)
    }

    /// Unit `u`'s forward on causal rows from position 0 with a tensor of its own for
    /// each parameter (flat, in the layout's order), as a torch module holds them: the
    /// reference `tierzero bench unit` times the engine's flat parameters against.
    pub fn forward_pieces(&self, u: usize, pieces: &[Tensor], input: &Tensor) -> Result<Tensor, TchError> {
        let p = Params::from_pieces(&self.units[u], pieces)?;
        self.run_params(u, &p, input, Positions::From(0), Attend::Causal)
    }

    fn run_params(
        &self,
        u: usize,
        p: &Params,
        input: &Tensor,
        positions: Positions,
        attend: Attend,
    ) -> Result<Tensor, TchError> {
        let layout = &self.units[u];
        let (t, device) = (input.size()[1], input.device());
        match layout.kind {
            UnitKind::Embedding => {
                let at = match positions {
                    Positions::From(0) => None,
                    Positions::From(start) => Some(
                        Tensor::f_arange_start(start, start + t, (Kind::Int64, device))?.f_unsqueeze(0)?,
                    ),
                    Positions::Packed(p) => Some(p.shallow_clone()),
                };
                blocks::embed(&self.config, p, input, at.as_ref())
            }
            UnitKind::Block(_) => match self.config.architecture {
                Architecture::Llama => {
                    let rope = match positions {
                        Positions::From(start) => {
                            // a generation's growing length takes tables by powers of two
                            // (a table's rows do not depend on its length)
                            let len = if start == 0 {
                                t
                            } else {
                                (start + t)
                                    .max(1)
                                    .cast_unsigned()
                                    .next_power_of_two()
                                    .cast_signed()
                            };
                            let (cos, sin) = self.rope(len, device)?;
                            (cos.f_narrow(0, start, t)?, sin.f_narrow(0, start, t)?)
                        }
                        Positions::Packed(at) => {
                            let (cos, sin) = self.rope(t, device)?;
                            let gather = |table: &Tensor| {
                                let s = at.size();
                                table
                                    .f_index_select(0, &at.f_view([-1])?)?
                                    .f_view([s[0], 1, s[1], -1])
                            };
                            (gather(&cos)?, gather(&sin)?)
                        }
                    };
                    blocks::llama_block(&self.config, p, input, &rope, attend)
                }
                Architecture::Gpt2 => blocks::gpt2_block(&self.config, p, input, attend),
            },
            UnitKind::Final => blocks::final_norm(&self.config, p, input),
        }
    }

    /// Logits (fp32, [V]) of the token after `tokens` ([1, t]), which continue the
    /// sequence `cache` holds; the cache grows by them (generation, one sequence: each
    /// token's keys and values computed once).
    pub fn decode(&self, params: &[Tensor], tokens: &Tensor, cache: &mut Cache) -> Result<Tensor, TchError> {
        let last = self.units.len() - 1;
        if cache.units.len() != self.units.len() {
            cache.units = (0..self.units.len()).map(|_| blocks::Kv::default()).collect();
        }
        let start = cache.len;
        let mut x = tokens.shallow_clone();
        tch::no_grad(|| -> Result<Tensor, TchError> {
            for (u, kv) in cache.units.iter_mut().enumerate() {
                x = self.run_unit(u, &params[u], &x, Positions::From(start), Attend::Cached(kv))?;
            }
            cache.len += tokens.size()[1];
            let tied = self.config.tie_word_embeddings.then(|| &params[0]);
            let w = self.head_weight(&params[last], tied)?.f_to_kind(Kind::Float)?;
            let h = x.f_select(1, -1)?.f_to_kind(Kind::Float)?;
            h.f_matmul(&w.f_tr()?)?.f_squeeze_dim(0)
        })
    }

    /// Forward of unit `u` inside the caller's autograd graph (tests build whole-model
    /// references with it). Panics on a tch error.
    #[doc(hidden)]
    pub fn forward_graph_for_tests(
        &self,
        u: usize,
        params: &Tensor,
        input: &Tensor,
        segments: Option<&Segments>,
    ) -> Tensor {
        self.forward_graph(u, params, input, segments)
            .unwrap_or_else(|e| panic!("unit {u}: {e}"))
    }

    /// Loss of the final unit: (sum of token losses, counted tokens).
    pub fn loss(
        &self,
        params: &Tensor,
        tied: Option<&Tensor>,
        x: &Tensor,
        targets: &Tensor,
    ) -> Result<(f64, i64), TchError> {
        tch::no_grad(|| {
            let h = self.forward_graph(self.units.len() - 1, params, x, None)?;
            head::loss_sum(&h, &self.head_weight(params, tied)?, targets, self.head)
        })
    }

    /// Backward of unit `u` (not the final one) by recompute: returns the flat gradient
    /// of its parameters (in their kind) and, for blocks, the gradient of its input.
    pub fn backward_unit(
        &self,
        u: usize,
        params: &Tensor,
        input: &Tensor,
        grad_out: &Tensor,
        segments: Option<&Segments>,
    ) -> Result<(Tensor, Option<Tensor>), TchError> {
        let (_, graph) = self.forward_keep(u, params, input, segments)?;
        self.backward_kept(graph, grad_out)
    }

    /// Forward of unit `u` that keeps its autograd graph for [`Self::backward_kept`]
    /// (no recompute): the output, and the graph. The graph holds the unit's
    /// activations and references `params`, which must not change before the backward.
    pub fn forward_keep(
        &self,
        u: usize,
        params: &Tensor,
        input: &Tensor,
        segments: Option<&Segments>,
    ) -> Result<(Tensor, Graph), TchError> {
        let leaf = params.f_detach()?.f_set_requires_grad(true)?;
        let x = match self.units[u].kind {
            UnitKind::Block(_) => Some(input.f_detach()?.f_set_requires_grad(true)?),
            _ => None,
        };
        let y = self.forward_graph(u, &leaf, x.as_ref().unwrap_or(input), segments)?;
        let out = y.f_detach()?;
        Ok((out, Graph { y, leaf, x }))
    }

    /// Backward through a kept graph: the flat gradient of the unit's parameters (in
    /// their kind) and, for blocks, the gradient of its input.
    pub fn backward_kept(
        &self,
        graph: Graph,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>), TchError> {
        let Graph { y, leaf, x } = graph;
        let dy = grad_out.f_to_kind(y.kind())?;
        let inputs: Vec<&Tensor> = std::iter::once(&leaf).chain(x.as_ref()).collect();
        let mut grads = shim::grad(&[&y], &[&dy], &inputs, false)?;
        let grad_input = if x.is_some() { grads.pop().flatten() } else { None };
        // in the parameters' kind: the reduction reads it chunk by chunk as fp32 (exact
        // from bf16/fp16), so no whole fp32 copy of a unit's gradient is made here
        let grad_params = match grads.pop().flatten() {
            Some(g) => g,
            None => Tensor::f_zeros(leaf.size(), (leaf.kind(), leaf.device()))?,
        };
        Ok((grad_params, grad_input))
    }

    /// Backward of the final unit for the loss weighted by `weight`.
    pub fn backward_final(
        &self,
        params: &Tensor,
        tied: Option<&Tensor>,
        x: &Tensor,
        targets: &Tensor,
        weight: head::Weight,
    ) -> Result<FinalGrads, TchError> {
        let last = self.units.len() - 1;
        let leaf = params.f_detach()?.f_set_requires_grad(true)?;
        let x_leaf = x.f_detach()?.f_set_requires_grad(true)?;
        // the final unit is the norm: it works token by token, no segments needed
        let h = self.forward_graph(last, &leaf, &x_leaf, None)?;
        let head_weight = tch::no_grad(|| self.head_weight(params, tied))?;
        let (dh, dw, loss_sum, count) =
            head::backward(&h.f_detach()?, &head_weight, targets, weight, self.head)?;
        let dh = dh.f_to_kind(h.kind())?;
        let mut grads = shim::grad(&[&h], &[&dh], &[&leaf, &x_leaf], false)?;
        let missing = || TchError::Kind("autograd returned no gradient for the final unit".into());
        let grad_input = grads.pop().flatten().ok_or_else(missing)?;
        // in the parameters' kind, as every unit's (the reduction reads it as fp32)
        let mut grad_params = grads.pop().flatten().ok_or_else(missing)?;
        let tied_grad = if self.config.tie_word_embeddings {
            Some(dw)
        } else {
            let spec = self.units[last]
                .param("lm_head.weight")
                .ok_or_else(|| TchError::Kind("untied model without lm_head.weight".into()))?;
            grad_params
                .f_narrow(0, spec.offset as i64, spec.numel as i64)?
                .f_copy_(&dw.f_reshape([-1])?)?;
            grad_params = grad_params.f_contiguous()?;
            None
        };
        Ok(FinalGrads {
            params: grad_params,
            tied: tied_grad,
            input: grad_input,
            loss_sum,
            count,
        })
    }
}
