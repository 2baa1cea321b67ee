//! The LM head and cross-entropy, chunked over tokens and sliced over the vocabulary.
//!
//! Logits are computed `HEAD_CHUNK` tokens at a time in fp32 against one slice of the weight at
//! a time (at most `plan::rules::HEAD_SLICE_ELEMENTS` of it, converted to fp32 on the fly), so neither a
//! [tokens, vocab] logits tensor nor an fp32 copy of a 16-bit [vocab, hidden] weight ever
//! exists whole (Liger-Kernel's fused linear cross-entropy does the same on GPU). The
//! backward is written by hand for the same reason, in two passes: the log-normaliser of
//! every token (over the slices), then per slice, per chunk, dlogits = softmax −
//! onehot(target) scaled by the upstream gradient ÷ the token count, dh += dlogits · W_s
//! and dW_s += dlogitsᵀ · h, the slice's fp32 dW_s written once into dW in the weight's
//! kind. Targets < 0 are ignored. With the whole vocabulary in one slice (small models)
//! this is exactly the unsliced computation, bit for bit.

use tch::{Kind, TchError, Tensor};

use crate::plan::rules::{head_slice_rows, HEAD_CHUNK};

/// [start, start + len) ranges of `n` in steps of `step`.
fn ranges(n: i64, step: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..n)
        .step_by(step.max(1) as usize)
        .map(move |s| (s, step.min(n - s)))
}

/// Tokens flattened to [n, H] in fp32, the targets to [n].
fn flatten(h: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor), TchError> {
    let hidden = h.size().last().copied().unwrap_or(0);
    Ok((
        h.f_reshape([-1, hidden])?.f_to_kind(Kind::Float)?,
        targets.f_reshape([-1])?,
    ))
}

/// The weight's vocabulary slices, each in fp32 (a view when the weight is fp32).
struct Slices<'w> {
    weight: &'w Tensor,
    rows: i64,
    vocab: i64,
}

impl<'w> Slices<'w> {
    /// Slices of `rows` rows, or of [`head_slice_rows`] when None.
    fn new(weight: &'w Tensor, rows: Option<i64>) -> Slices<'w> {
        let size = weight.size();
        let (vocab, hidden) = (size[0], size.get(1).copied().unwrap_or(1));
        Slices {
            weight,
            rows: rows
                .unwrap_or_else(|| head_slice_rows(vocab, hidden))
                .clamp(1, vocab.max(1)),
            vocab,
        }
    }

    fn ranges(&self) -> impl Iterator<Item = (i64, i64)> {
        ranges(self.vocab, self.rows)
    }

    fn one(&self) -> bool {
        self.rows >= self.vocab
    }

    fn fp32(&self, (start, len): (i64, i64)) -> Result<Tensor, TchError> {
        self.weight.f_narrow(0, start, len)?.f_to_kind(Kind::Float)
    }
}

/// One chunk of tokens: its fp32 hidden states, targets (ignored ones clamped to 0) and a
/// 0/1 mask of counted tokens.
struct Chunk {
    h: Tensor,
    target: Tensor,
    valid: Tensor,
}

impl Chunk {
    fn new(hf: &Tensor, tg: &Tensor, (start, len): (i64, i64)) -> Result<Chunk, TchError> {
        let target = tg.f_narrow(0, start, len)?;
        Ok(Chunk {
            h: hf.f_narrow(0, start, len)?,
            valid: target.f_ge(0)?.f_to_kind(Kind::Float)?,
            target: target.f_clamp_min(0)?,
        })
    }

    /// Σ (lse − logit of the target) over counted tokens, and the log-normalisers
    /// [len, 1]; with one slice, the chunk's logits too (the backward reuses them).
    fn normalise(&self, slices: &Slices) -> Result<(f64, Tensor, Option<Tensor>), TchError> {
        let target = self.target.f_unsqueeze(1)?;
        let (lse, picked, logits) = if slices.one() {
            let logits = self.h.f_matmul(&slices.fp32((0, slices.vocab))?.f_tr()?)?;
            let lse = logits.f_logsumexp([-1], true)?;
            let picked = logits.f_gather(1, &target, false)?;
            (lse, picked, Some(logits))
        } else {
            let mut parts = Vec::new();
            let mut picked = Tensor::f_zeros_like(&target.f_to_kind(Kind::Float)?)?;
            for (start, len) in slices.ranges() {
                let logits = self.h.f_matmul(&slices.fp32((start, len))?.f_tr()?)?;
                parts.push(logits.f_logsumexp([-1], true)?);
                let local = target.f_sub_scalar(start)?;
                let inside = local.f_ge(0)?.f_logical_and(&local.f_lt(len)?)?;
                let at = logits.f_gather(1, &local.f_clamp(0, len - 1)?, false)?;
                picked = picked.f_add(&at.f_masked_fill(&inside.f_logical_not()?, 0.0)?)?;
            }
            (Tensor::f_cat(&parts, 1)?.f_logsumexp([1], true)?, picked, None)
        };
        let loss = lse
            .f_sub(&picked)?
            .f_squeeze_dim(1)?
            .f_mul(&self.valid)?
            .f_sum(Kind::Double)?
            .f_double_value(&[])?;
        Ok((loss, lse, logits))
    }

    /// dlogits of one slice: (softmax − onehot) · valid · factor.
    fn dlogits(
        &self,
        logits: &Tensor,
        lse: &Tensor,
        (start, len): (i64, i64),
        factor: f64,
    ) -> Result<Tensor, TchError> {
        let mut d = logits.f_sub(lse)?.f_exp()?;
        let local = self.target.f_sub_scalar(start)?;
        let inside = local.f_ge(0)?.f_logical_and(&local.f_lt(len)?)?;
        let minus_one = inside.f_to_kind(Kind::Float)?.f_neg()?.f_unsqueeze(1)?;
        d = d.f_scatter_add(1, &local.f_clamp(0, len - 1)?.f_unsqueeze(1)?, &minus_one)?;
        d.f_mul(&self.valid.f_unsqueeze(1)?.f_mul_scalar(factor)?)
    }
}

/// Sum of per-token losses and the number of counted tokens.
pub fn loss_sum(h: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<(f64, i64), TchError> {
    loss_sum_in(h, weight, targets, None)
}

/// [`loss_sum`] with slices of `rows` vocabulary rows.
fn loss_sum_in(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    rows: Option<i64>,
) -> Result<(f64, i64), TchError> {
    let (hf, tg) = flatten(h, targets)?;
    let slices = Slices::new(weight, rows);
    let mut total = 0.0;
    for chunk in ranges(tg.size()[0], HEAD_CHUNK) {
        total += Chunk::new(&hf, &tg, chunk)?.normalise(&slices)?.0;
    }
    let count = tg.f_ge(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    Ok((total, count))
}

/// What the head's gradients are taken of.
#[derive(Clone, Copy, Debug)]
pub enum Weight {
    /// `s · loss_sum / count`: the mean over this batch's counted tokens, scaled.
    Mean(f64),
    /// `f · loss_sum`: each counted token weighs `f` (the mean over a larger batch whose
    /// count is known in advance).
    PerToken(f64),
}

/// Gradients of the loss weighted by `weight` with respect to h [.., H] (as fp32, h's
/// shape) and W [V, H] (in W's kind), with the loss sum and `count`, the number of
/// counted tokens.
pub fn backward(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: Weight,
) -> Result<(Tensor, Tensor, f64, i64), TchError> {
    backward_in(h, weight, targets, scale, None)
}

/// [`backward`] with slices of `rows` vocabulary rows.
fn backward_in(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: Weight,
    rows: Option<i64>,
) -> Result<(Tensor, Tensor, f64, i64), TchError> {
    let (hf, tg) = flatten(h, targets)?;
    let n = tg.size()[0];
    let count = tg.f_ge(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    let factor = match scale {
        Weight::Mean(s) => s / count.max(1) as f64,
        Weight::PerToken(f) => f,
    };
    let slices = Slices::new(weight, rows);
    let dh = Tensor::f_zeros_like(&hf)?;
    let dw = Tensor::f_zeros_like(weight)?;
    let mut total = 0.0;
    // adds one chunk's share of a slice's dW (fp32)
    let accumulate = |dws: &mut Option<Tensor>, d: &Tensor, h: &Tensor| -> Result<(), TchError> {
        let dt = d.f_tr()?;
        match dws.as_mut() {
            None => *dws = Some(dt.f_matmul(h)?),
            Some(dws) => {
                let _ = dws.f_addmm_(&dt, h)?;
            }
        }
        Ok(())
    };
    if slices.one() {
        // the whole vocabulary at once: one pass, chunk by chunk, each chunk's logits
        // used for its loss and its gradients
        let whole = (0, slices.vocab);
        let w = slices.fp32(whole)?;
        let mut dws = None;
        for range in ranges(n, HEAD_CHUNK) {
            let chunk = Chunk::new(&hf, &tg, range)?;
            let (loss, lse, logits) = chunk.normalise(&slices)?;
            total += loss;
            let logits = match logits {
                Some(logits) => logits,
                None => chunk.h.f_matmul(&w.f_tr()?)?,
            };
            let d = chunk.dlogits(&logits, &lse, whole, factor)?;
            dh.f_narrow(0, range.0, range.1)?.f_copy_(&d.f_matmul(&w)?)?;
            accumulate(&mut dws, &d, &chunk.h)?;
        }
        if let Some(dws) = dws {
            dw.f_narrow(0, 0, slices.vocab)?.f_copy_(&dws)?;
        }
        return Ok((dh.f_view(h.size().as_slice())?, dw, total, count));
    }
    // pass 1: every token's log-normaliser over the slices
    let mut chunks = Vec::new();
    for range in ranges(n, HEAD_CHUNK) {
        let chunk = Chunk::new(&hf, &tg, range)?;
        let (loss, lse, _) = chunk.normalise(&slices)?;
        total += loss;
        chunks.push((range, chunk, lse));
    }
    // pass 2: per slice, its dW accumulated over the chunks in fp32, written once
    for slice in slices.ranges() {
        let ws = slices.fp32(slice)?;
        let mut dws = None;
        for ((start, len), chunk, lse) in &chunks {
            let logits = chunk.h.f_matmul(&ws.f_tr()?)?;
            let d = chunk.dlogits(&logits, lse, slice, factor)?;
            drop(logits);
            let _ = dh.f_narrow(0, *start, *len)?.f_add_(&d.f_matmul(&ws)?)?;
            accumulate(&mut dws, &d, &chunk.h)?;
        }
        if let Some(dws) = dws {
            dw.f_narrow(0, slice.0, slice.1)?.f_copy_(&dws)?;
        }
    }
    Ok((dh.f_view(h.size().as_slice())?, dw, total, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two chunks, the second partial (1400 tokens), ignored targets in both, the whole
    /// vocabulary in one slice and in slices of 7 rows: the chunked loss and hand-written
    /// backward against torch autograd through one unchunked cross-entropy.
    #[test]
    fn chunked_loss_and_backward_equal_autograd_over_the_whole_batch() {
        tch::manual_seed(5);
        let (rows, seq, hidden, vocab) = (2, 700, 16, 50);
        let h = Tensor::randn([rows, seq, hidden], (Kind::Float, tch::Device::Cpu));
        let w = Tensor::randn([vocab, hidden], (Kind::Float, tch::Device::Cpu)) * 0.3;
        let targets = Tensor::randint(vocab, [rows, seq], (Kind::Int64, tch::Device::Cpu));
        for i in [3, 1023, 1024, 1399] {
            let _ = targets.view([-1]).get(i).fill_(-100);
        }
        let scale = 2.5;
        let (loss, count) = loss_sum(&h, &w, &targets).unwrap();
        let (dh, dw, loss_b, count_b) = backward(&h, &w, &targets, Weight::Mean(scale)).unwrap();
        assert_eq!((count, count_b), (1396, 1396));
        // the vocabulary in slices of 7 rows (the last of 1), and a bf16 weight whose
        // gradient comes back in bf16
        let (loss_s, _) = loss_sum_in(&h, &w, &targets, Some(7)).unwrap();
        let (dh_s, dw_s, loss_sb, _) =
            backward_in(&h, &w, &targets, Weight::PerToken(scale / 1396.0), Some(7)).unwrap();
        let w16 = w.to_kind(Kind::BFloat16);
        let (_, dw16, _, _) = backward_in(&h, &w16, &targets, Weight::Mean(scale), Some(7)).unwrap();
        assert_eq!(dw16.kind(), Kind::BFloat16);

        let hr = h.detach().set_requires_grad(true);
        let wr = w.detach().set_requires_grad(true);
        let logits = hr.view([-1, hidden]).matmul(&wr.tr());
        let sum =
            logits.cross_entropy_loss::<Tensor>(&targets.view([-1]), None, tch::Reduction::Sum, -100, 0.0);
        (&sum * (scale / count as f64)).backward();
        let reference = sum.double_value(&[]);
        for got in [loss, loss_b, loss_s, loss_sb] {
            assert!(
                (got - reference).abs() < 1e-5 * reference.abs(),
                "{got} vs {reference}"
            );
        }
        let close = |a: &Tensor, b: &Tensor| {
            let diff = (a - b).abs().max().double_value(&[]);
            let size = b.abs().max().double_value(&[]);
            assert!(diff <= 1e-5 * size, "max diff {diff} of {size}");
        };
        close(&dh, &hr.grad());
        close(&dw, &wr.grad());
        close(&dh_s, &hr.grad());
        close(&dw_s, &wr.grad());
        // bf16: the reference with the weight rounded as the head saw it, to bf16 resolution
        let wr16 = w16.to_kind(Kind::Float).set_requires_grad(true);
        let logits = h.view([-1, hidden]).matmul(&wr16.tr());
        let sum =
            logits.cross_entropy_loss::<Tensor>(&targets.view([-1]), None, tch::Reduction::Sum, -100, 0.0);
        (&sum * (scale / count as f64)).backward();
        let diff = (dw16.to_kind(Kind::Float) - wr16.grad())
            .abs()
            .max()
            .double_value(&[]);
        let size = wr16.grad().abs().max().double_value(&[]);
        assert!(diff <= size / 256.0, "bf16 dW: max diff {diff} of {size}");
    }
}
