//! Models as lists of units, each a function of its flat parameter buffer.
//!
//! - model shapes (presets, Hugging Face `config.json`) are `config::model`
//! - `layout.rs`: tensor names, shapes and offsets inside each unit's flat buffer
//! - `blocks.rs`: Llama and GPT-2 blocks, embeddings, final norms (tch)
//! - `head.rs`: chunked LM head + cross-entropy with a hand-written backward
//! - `hf.rs`, `safetensors.rs`: Hugging Face directories and the container they use
//!
//! [`Model`] runs one unit forward without autograd, and one unit backward by
//! recomputing its forward with the flat buffer as a leaf that requires grad and
//! back-propagating the incoming gradient: the leaf's grad is the unit's flat gradient.
//! Only unit inputs are kept between forward and backward (activation checkpointing at
//! unit boundaries).

pub mod blocks;
pub mod head;
pub mod hf;
pub mod layout;
pub mod safetensors;

use crate::config::model::{Architecture, ModelConfig};
use crate::torch::shim;
use blocks::Params;
use layout::{UnitKind, UnitLayout};
use std::sync::Mutex;
use tch::{Kind, TchError, Tensor};

pub struct Model {
    pub config: ModelConfig,
    pub units: Vec<UnitLayout>,
    /// Element type of parameters and activations.
    pub kind: Kind,
    rope: Mutex<Vec<(i64, tch::Device, Tensor, Tensor)>>,
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
            rope: Mutex::new(Vec::new()),
        }
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
            (false, _) => Params::new(self.units.last().unwrap_or_else(|| unreachable!()), final_params)
                .get("lm_head.weight"),
        }
    }

    /// Forward of unit `u` (not the final one) under no_grad: tokens or hidden → hidden.
    pub fn forward_unit(&self, u: usize, params: &Tensor, input: &Tensor) -> Result<Tensor, TchError> {
        tch::no_grad(|| self.forward_graph(u, params, input))
    }

    fn forward_graph(&self, u: usize, params: &Tensor, input: &Tensor) -> Result<Tensor, TchError> {
        let layout = &self.units[u];
        let p = Params::new(layout, params);
        match layout.kind {
            UnitKind::Embedding => blocks::embed(&self.config, &p, input),
            UnitKind::Block(_) => match self.config.architecture {
                Architecture::Llama => blocks::llama_block(
                    &self.config,
                    &p,
                    input,
                    &self.rope(input.size()[1], input.device())?,
                ),
                Architecture::Gpt2 => blocks::gpt2_block(&self.config, &p, input),
            },
            UnitKind::Final => blocks::final_norm(&self.config, &p, input),
        }
    }

    /// Forward of unit `u` inside the caller's autograd graph (tests build whole-model
    /// references with it). Panics on a tch error.
    #[doc(hidden)]
    pub fn forward_graph_for_tests(&self, u: usize, params: &Tensor, input: &Tensor) -> Tensor {
        self.forward_graph(u, params, input)
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
            let h = self.forward_graph(self.units.len() - 1, params, x)?;
            head::loss_sum(&h, &self.head_weight(params, tied)?, targets)
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
    ) -> Result<(Tensor, Option<Tensor>), TchError> {
        let leaf = params.f_detach()?.f_set_requires_grad(true)?;
        let is_block = matches!(self.units[u].kind, UnitKind::Block(_));
        let x = if is_block {
            input.f_detach()?.f_set_requires_grad(true)?
        } else {
            input.shallow_clone()
        };
        let y = self.forward_graph(u, &leaf, &x)?;
        let dy = grad_out.f_to_kind(y.kind())?;
        let inputs: Vec<&Tensor> = if is_block { vec![&leaf, &x] } else { vec![&leaf] };
        let mut grads = shim::grad(&[&y], &[&dy], &inputs, false)?;
        let grad_input = if is_block { grads.pop().flatten() } else { None };
        // in the parameters' kind: the reduction reads it chunk by chunk as fp32 (exact
        // from bf16/fp16), so no whole fp32 copy of a unit's gradient is made here
        let grad_params = match grads.pop().flatten() {
            Some(g) => g,
            None => Tensor::f_zeros(leaf.size(), (leaf.kind(), leaf.device()))?,
        };
        Ok((grad_params, grad_input))
    }

    /// Backward of the final unit for loss `scale · Σloss / count`.
    pub fn backward_final(
        &self,
        params: &Tensor,
        tied: Option<&Tensor>,
        x: &Tensor,
        targets: &Tensor,
        scale: f64,
    ) -> Result<FinalGrads, TchError> {
        let last = self.units.len() - 1;
        let leaf = params.f_detach()?.f_set_requires_grad(true)?;
        let x_leaf = x.f_detach()?.f_set_requires_grad(true)?;
        let h = self.forward_graph(last, &leaf, &x_leaf)?;
        let weight = tch::no_grad(|| self.head_weight(params, tied))?;
        let (dh, dw, loss_sum, count) = head::backward(&h.f_detach()?, &weight, targets, scale)?;
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
