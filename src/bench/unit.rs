//! `tierzero bench unit`: one transformer block of a config as the engine computes it,
//! beside torch computing the same block the way a module holds it, in the same run; and
//! the host's gradient reductions beside a memcpy of the same bytes.
//!
//! The engine keeps a unit's parameters in one flat tensor (a view per parameter, a
//! flat gradient out: `model/blocks.rs`, `Params`) and, where it does not keep the
//! forward's graph, its backward recomputes the forward. The reference is the same
//! block's operations on a tensor of its own per parameter, forward with autograd and
//! backward (what `torch.nn.Module` training does): the backward by recompute is
//! compared with that forward plus backward, the same arithmetic. The reductions are the
//! engine's host adds of a block's gradient (in the training precision) into an fp32
//! accumulator: onto a step's earlier sums, and a step's first and last contribution
//! into a stale accumulator with Σ g² gathered as it adds (`engine/staging.rs`), each
//! against a memcpy of the accumulator's bytes on every core.

use super::timed;
use crate::engine::grads::{Grads, Values};
use crate::model::Model;
use crate::plan::Plan;
use crate::run::rank_threads;
use crate::torch::shim;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

#[derive(Clone, Debug, Serialize)]
pub struct UnitReport {
    pub model: String,
    pub precision: String,
    /// Rows × sequence length of a micro-batch.
    pub tokens: usize,
    /// Torch threads (a rank's of this config).
    pub threads: usize,
    /// Parameters of the block.
    pub parameters: usize,
    /// Median seconds: the engine's forward (no graph), its backward by recompute, its
    /// backward through a kept graph (the forward before it untimed).
    pub forward_s: f64,
    pub backward_recompute_s: f64,
    pub backward_kept_s: f64,
    /// The reference: a tensor per parameter, forward with autograd, then backward.
    pub torch_forward_s: f64,
    pub torch_forward_backward_s: f64,
    /// Backward by recompute ÷ the reference's forward + backward (issue target ≤ 1.15).
    pub recompute_ratio: f64,
    /// The engine's forward + kept backward ÷ the reference's forward + backward.
    pub kept_ratio: f64,
    pub reductions: Reductions,
}

/// GB/s of the accumulator's bytes (4 per element) through each host add, beside a
/// memcpy of as many bytes on every core.
#[derive(Clone, Debug, Serialize)]
pub struct Reductions {
    pub elements: usize,
    /// The gradient's kind as it reaches the host.
    pub values: String,
    pub add_gb_s: f64,
    pub first_squared_gb_s: f64,
    /// The same first add into a bf16 accumulator (`plan::rules::bf16_gradients`), of bf16
    /// values only; over the same 4 bytes per element, so the rates compare as times do.
    pub first_squared_bf16_gb_s: Option<f64>,
    pub memcpy_gb_s: f64,
    /// The slower add's rate ÷ memcpy's (issue target ≥ 0.5).
    pub ratio: f64,
}

impl UnitReport {
    pub fn human(&self) -> String {
        let r = &self.reductions;
        format!(
            "unit bench: a block of {} ({} parameters), {} tokens, {}, {} torch thread(s)\n\
             \x20 engine forward            {:>9.4} s\n\
             \x20 engine backward, recompute {:>8.4} s   {:.2}x torch's forward + backward\n\
             \x20 engine backward, kept graph {:>7.4} s   forward + it: {:.2}x torch's\n\
             \x20 torch forward + backward   {:>8.4} s   (forward {:.4} s; a tensor per parameter)\n\
             host reductions of the block's gradient ({} elements of {} into fp32):\n\
             \x20 add onto sums   {:>6.2} GB/s   first add with Σ g² {:>6.2} GB/s{}   memcpy {:>6.2} GB/s   slower ÷ memcpy {:.2}",
            self.model,
            self.parameters,
            self.tokens,
            self.precision,
            self.threads,
            self.forward_s,
            self.backward_recompute_s,
            self.recompute_ratio,
            self.backward_kept_s,
            self.kept_ratio,
            self.torch_forward_backward_s,
            self.torch_forward_s,
            r.elements,
            r.values,
            r.add_gb_s,
            r.first_squared_gb_s,
            r.first_squared_bf16_gb_s
                .map_or(String::new(), |b| format!(" (into bf16 {b:.2})")),
            r.memcpy_gb_s,
            r.ratio
        )
    }
}

/// Measures block `unit` (1: the first block) of `plan`'s model on this CPU with a rank's
/// torch threads.
pub fn run(plan: &Plan, unit: usize) -> anyhow::Result<UnitReport> {
    let threads = rank_threads(plan);
    tch::set_num_threads(threads as i32);
    let config = plan.model.config.clone();
    let kind = crate::torch::compute_kind(&plan.precision);
    let model = Model::new(config.clone(), kind);
    let last = model.units.len() - 1;
    anyhow::ensure!(
        (1..last).contains(&unit),
        "--unit {unit}: the blocks of this model are units 1 to {}",
        last - 1
    );
    let (rows, seq) = (plan.batch.micro_batch_per_gpu as i64, plan.data.seq_len as i64);
    let h = config.hidden_size as i64;
    let options = (kind, Device::Cpu);
    let layout = &model.units[unit];
    let params = Tensor::f_randn([layout.numel as i64], options)?.f_mul_scalar(0.02)?;
    let x = Tensor::f_randn([rows, seq, h], options)?;
    let dy = Tensor::f_randn([rows, seq, h], options)?.f_mul_scalar(1e-3)?;

    let forward_s = timed(|| {
        let _ = model.forward_unit(unit, &params, &x, None)?;
        Ok(())
    })?;
    let backward_recompute_s = timed(|| {
        let _ = model.backward_unit(unit, &params, &x, &dy, None)?;
        Ok(())
    })?;
    let backward_kept_s = timed_after(
        || Ok(model.forward_keep(unit, &params, &x, None)?.1),
        |graph| {
            let _ = model.backward_kept(graph, &dy)?;
            Ok(())
        },
    )?;

    // the reference: a tensor of its own per parameter, as a module holds them
    let pieces: Vec<Tensor> = layout
        .params
        .iter()
        .map(|p| {
            let view = params.f_narrow(0, p.offset as i64, p.numel as i64)?;
            let mut own = Tensor::f_empty([p.numel as i64], options)?;
            own.f_copy_(&view.f_detach()?)?;
            own.f_set_requires_grad(true)
        })
        .collect::<Result<_, _>>()?;
    let x_leaf = x.f_detach()?.f_set_requires_grad(true)?;
    let torch_forward_s = timed(|| {
        let _ = model.forward_pieces(unit, &pieces, &x_leaf)?;
        Ok(())
    })?;
    let torch_forward_backward_s = timed(|| {
        let y = model.forward_pieces(unit, &pieces, &x_leaf)?;
        let inputs: Vec<&Tensor> = pieces.iter().chain(std::iter::once(&x_leaf)).collect();
        shim::grad(&[&y], &[&dy], &inputs, false)?;
        Ok(())
    })?;

    let reductions = reductions(layout.numel, kind)?;
    Ok(UnitReport {
        model: plan.model.source.clone(),
        precision: plan.precision.name().to_string(),
        tokens: (rows * seq) as usize,
        threads,
        parameters: layout.numel,
        forward_s,
        backward_recompute_s,
        backward_kept_s,
        torch_forward_s,
        torch_forward_backward_s,
        recompute_ratio: backward_recompute_s / torch_forward_backward_s,
        kept_ratio: (forward_s + backward_kept_s) / torch_forward_backward_s,
        reductions,
    })
}

/// Median seconds of `f` on what an untimed `before` made for it, each run.
fn timed_after<T>(
    mut before: impl FnMut() -> anyhow::Result<T>,
    mut f: impl FnMut(T) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..4 {
        let made = before()?;
        let start = std::time::Instant::now();
        f(made)?;
        times.push(start.elapsed().as_secs_f64());
    }
    // the first run warms up
    Ok(super::median(times.split_off(1)))
}

/// The host adds of `n` gradient elements of `kind` into fp32 accumulators, and a memcpy
/// of the accumulator's bytes, on every core.
fn reductions(n: usize, kind: Kind) -> anyhow::Result<Reductions> {
    use rayon::prelude::*;
    use tierzero_offload::convert::{f32_to_bf16, f32_to_f16};
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
    let to_16 = if kind == Kind::Half {
        f32_to_f16
    } else {
        f32_to_bf16
    };
    let bits: Vec<u16> = x.iter().map(|&v| to_16(v)).collect();
    let values = || match kind {
        Kind::Float => Values::F32(&x),
        Kind::Half => Values::F16(&bits),
        _ => Values::Bf16(&bits),
    };
    let mut acc = Grads::zeros(n, false)?;
    let bytes = 4 * n;
    let gb_s = |seconds: f64| bytes as f64 / seconds / 1e9;
    let add = gb_s(timed(|| {
        acc.add_values(0, values());
        Ok(())
    })?);
    let first = gb_s(timed(|| {
        acc.set_values_squared(0, values(), 0.0);
        Ok(())
    })?);
    let first_bf16 = match kind {
        Kind::BFloat16 => {
            let mut low = Grads::zeros(n, true)?;
            Some(gb_s(timed(|| {
                low.set_values_squared(0, values(), 0.0);
                Ok(())
            })?))
        }
        _ => None,
    };
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let memcpy = gb_s(timed(|| {
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    })?);
    Ok(Reductions {
        elements: n,
        values: match kind {
            Kind::Float => "fp32",
            Kind::Half => "fp16",
            _ => "bf16",
        }
        .to_string(),
        add_gb_s: add,
        first_squared_gb_s: first,
        first_squared_bf16_gb_s: first_bf16,
        memcpy_gb_s: memcpy,
        ratio: add.min(first) / memcpy,
    })
}
