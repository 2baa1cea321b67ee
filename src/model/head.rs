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
//!
//! With [`Matmul::Low`] (the plan's `train.low_precision_head`: a 16-bit weight on a GPU,
//! or on a CPU with bf16 units) the products run in the weight's kind (fp32 accumulation
//! inside each product), as Hugging Face models compute their logits: the logits are
//! widened to fp32 for the log-sum-exp and dlogits, and a slice's dW is one product over
//! every token, rounded once into the weight's kind. On a CPU without bf16 units, where
//! 16-bit products are slow, the head stays fp32. The loss is summed on the device and
//! read once per call, not once per chunk.

use tch::{Kind, TchError, Tensor};

use crate::plan::rules::{head_slice_rows, HEAD_CHUNK};

/// [start, start + len) ranges of `n` in steps of `step`.
fn ranges(n: i64, step: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..n)
        .step_by(step.max(1) as usize)
        .map(move |s| (s, step.min(n - s)))
}

/// The kind the head's products run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matmul {
    /// fp32 operands (a 16-bit weight converted slice by slice).
    Fp32,
    /// The weight's own kind, hidden states rounded to it; logits widened to fp32 (for a
    /// 16-bit weight; an fp32 weight computes in fp32 either way).
    Low,
}

/// Tokens flattened to [n, H] in the products' kind, the targets to [n].
fn flatten(h: &Tensor, targets: &Tensor, kind: Kind) -> Result<(Tensor, Tensor), TchError> {
    let hidden = h.size().last().copied().unwrap_or(0);
    Ok((
        h.f_reshape([-1, hidden])?.f_to_kind(kind)?,
        targets.f_reshape([-1])?,
    ))
}

/// The weight's vocabulary slices, each in the products' kind (a view when the weight
/// is of that kind).
struct Slices<'w> {
    weight: &'w Tensor,
    rows: i64,
    vocab: i64,
    /// The products' kind: fp32, or the weight's own ([`Matmul::Low`]).
    kind: Kind,
}

impl<'w> Slices<'w> {
    /// Slices of `rows` rows, or of [`head_slice_rows`] when None.
    fn new(weight: &'w Tensor, rows: Option<i64>, matmul: Matmul) -> Slices<'w> {
        let size = weight.size();
        let (vocab, hidden) = (size[0], size.get(1).copied().unwrap_or(1));
        Slices {
            weight,
            rows: rows
                .unwrap_or_else(|| head_slice_rows(vocab, hidden))
                .clamp(1, vocab.max(1)),
            vocab,
            kind: match matmul {
                Matmul::Fp32 => Kind::Float,
                Matmul::Low => weight.kind(),
            },
        }
    }

    /// fp32 logits of hidden states `h` (in the products' kind) against slice `w`.
    fn logits(&self, h: &Tensor, w: &Tensor) -> Result<Tensor, TchError> {
        h.f_matmul(&w.f_tr()?)?.f_to_kind(Kind::Float)
    }

    fn ranges(&self) -> impl Iterator<Item = (i64, i64)> {
        ranges(self.vocab, self.rows)
    }

    fn one(&self) -> bool {
        self.rows >= self.vocab
    }

    /// A slice of the weight in the products' kind.
    fn get(&self, (start, len): (i64, i64)) -> Result<Tensor, TchError> {
        self.weight.f_narrow(0, start, len)?.f_to_kind(self.kind)
    }
}

/// One chunk of tokens: its hidden states (in the products' kind), targets (ignored ones
/// clamped to 0) and a 0/1 mask of counted tokens.
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

    /// Σ (lse − logit of the target) over counted tokens (an fp64 scalar on the device),
    /// and the log-normalisers [len, 1]; with one slice, the chunk's fp32 logits too (the
    /// backward reuses them).
    fn normalise(&self, slices: &Slices) -> Result<(Tensor, Tensor, Option<Tensor>), TchError> {
        let target = self.target.f_unsqueeze(1)?;
        let (lse, picked, logits) = if slices.one() {
            let logits = slices.logits(&self.h, &slices.get((0, slices.vocab))?)?;
            let lse = logits.f_logsumexp([-1], true)?;
            let picked = logits.f_gather(1, &target, false)?;
            (lse, picked, Some(logits))
        } else {
            let mut parts = Vec::new();
            let mut picked = Tensor::f_zeros_like(&target.f_to_kind(Kind::Float)?)?;
            for (start, len) in slices.ranges() {
                let logits = slices.logits(&self.h, &slices.get((start, len))?)?;
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
            .f_sum(Kind::Double)?;
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

/// Sum of per-token losses and the number of counted tokens, products in `matmul`.
pub fn loss_sum(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    matmul: Matmul,
) -> Result<(f64, i64), TchError> {
    loss_sum_in(h, weight, targets, None, matmul)
}

/// The chunks' loss sums, added in chunk order in fp64 on the device (the bits of adding
/// them on the host one by one), read once.
struct Total(Option<Tensor>);

impl Total {
    fn add(&mut self, loss: Tensor) -> Result<(), TchError> {
        self.0 = Some(match self.0.take() {
            None => loss,
            Some(total) => total.f_add(&loss)?,
        });
        Ok(())
    }

    fn value(&self) -> Result<f64, TchError> {
        self.0.as_ref().map_or(Ok(0.0), |t| t.f_double_value(&[]))
    }
}

/// [`loss_sum`] with slices of `rows` vocabulary rows and products in `matmul`.
fn loss_sum_in(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    rows: Option<i64>,
    matmul: Matmul,
) -> Result<(f64, i64), TchError> {
    let slices = Slices::new(weight, rows, matmul);
    let (hf, tg) = flatten(h, targets, slices.kind)?;
    let mut total = Total(None);
    for chunk in ranges(tg.size()[0], HEAD_CHUNK) {
        total.add(Chunk::new(&hf, &tg, chunk)?.normalise(&slices)?.0)?;
    }
    let count = tg.f_ge(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    Ok((total.value()?, count))
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
/// counted tokens; products in `matmul`.
pub fn backward(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: Weight,
    matmul: Matmul,
) -> Result<(Tensor, Tensor, f64, i64), TchError> {
    backward_in(h, weight, targets, scale, None, matmul)
}

/// A slice's dW over the chunks: added chunk by chunk in fp32 (fp32 products), or one
/// product over every token's dlogits, accumulated in fp32 inside it and rounded once
/// into the weight's kind ([`Matmul::Low`]).
enum SliceGrad {
    /// fp32 products summed in the slice of an fp32 dW itself: the first written into it
    /// (`started` after), the rest added there, with no sum of its own to allocate and
    /// copy, which for a whole vocabulary is the size of the weight.
    InPlace {
        out: Tensor,
        started: bool,
    },
    /// fp32 products summed apart, rounded once into a 16-bit dW.
    Fp32(Option<Tensor>),
    Low(Vec<Tensor>),
}

impl SliceGrad {
    /// The gradient of dW's rows `start..start + len`.
    fn new(matmul: Matmul, dw: &Tensor, (start, len): (i64, i64)) -> Result<SliceGrad, TchError> {
        Ok(match matmul {
            Matmul::Fp32 if dw.kind() == Kind::Float => SliceGrad::InPlace {
                out: dw.f_narrow(0, start, len)?,
                started: false,
            },
            Matmul::Fp32 => SliceGrad::Fp32(None),
            Matmul::Low => SliceGrad::Low(Vec::new()),
        })
    }

    /// One chunk's dlogits `d` (in the products' kind) against its hidden states `h`.
    fn add(&mut self, d: &Tensor, h: &Tensor) -> Result<(), TchError> {
        match self {
            // the same product as `matmul`'s, written where it is kept
            SliceGrad::InPlace { out, started } if !*started => {
                let _ = d.f_tr()?.f_mm_out(out, h)?;
                *started = true;
            }
            SliceGrad::InPlace { out, .. } | SliceGrad::Fp32(Some(out)) => {
                let _ = out.f_addmm_(&d.f_tr()?, h)?;
            }
            SliceGrad::Fp32(None) => *self = SliceGrad::Fp32(Some(d.f_tr()?.f_matmul(h)?)),
            SliceGrad::Low(ds) => ds.push(d.shallow_clone()),
        }
        Ok(())
    }

    /// Writes the slice's gradient into `dw` (rows `start..start + len`) where it is not
    /// there already; `hf` holds every chunk's hidden states in order.
    fn write(self, dw: &Tensor, (start, len): (i64, i64), hf: &Tensor) -> Result<(), TchError> {
        let dws = match self {
            SliceGrad::InPlace { .. } | SliceGrad::Fp32(None) => return Ok(()),
            SliceGrad::Fp32(Some(dws)) => dws,
            SliceGrad::Low(ds) if ds.is_empty() => return Ok(()),
            SliceGrad::Low(ds) => Tensor::f_cat(&ds, 0)?.f_tr()?.f_matmul(hf)?,
        };
        dw.f_narrow(0, start, len)?.f_copy_(&dws)?;
        Ok(())
    }
}

/// [`backward`] with slices of `rows` vocabulary rows and products in `matmul`.
fn backward_in(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: Weight,
    rows: Option<i64>,
    matmul: Matmul,
) -> Result<(Tensor, Tensor, f64, i64), TchError> {
    let slices = Slices::new(weight, rows, matmul);
    let (hf, tg) = flatten(h, targets, slices.kind)?;
    let n = tg.size()[0];
    let count = tg.f_ge(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    let factor = match scale {
        Weight::Mean(s) => s / count.max(1) as f64,
        Weight::PerToken(f) => f,
    };
    let dh = Tensor::f_zeros(hf.size(), (Kind::Float, hf.device()))?;
    // with a token, every slice's rows are written (from its first chunk's product)
    let dw = if n > 0 {
        Tensor::f_empty_like(weight)?
    } else {
        Tensor::f_zeros_like(weight)?
    };
    let mut total = Total(None);
    if slices.one() {
        // the whole vocabulary at once: one pass, chunk by chunk, each chunk's logits
        // used for its loss and its gradients
        let whole = (0, slices.vocab);
        let w = slices.get(whole)?;
        let mut dws = SliceGrad::new(matmul, &dw, whole)?;
        for range in ranges(n, HEAD_CHUNK) {
            let chunk = Chunk::new(&hf, &tg, range)?;
            let (loss, lse, logits) = chunk.normalise(&slices)?;
            total.add(loss)?;
            let logits = match logits {
                Some(logits) => logits,
                None => slices.logits(&chunk.h, &w)?,
            };
            let d = chunk
                .dlogits(&logits, &lse, whole, factor)?
                .f_to_kind(slices.kind)?;
            dh.f_narrow(0, range.0, range.1)?.f_copy_(&d.f_matmul(&w)?)?;
            dws.add(&d, &chunk.h)?;
        }
        dws.write(&dw, whole, &hf)?;
        return Ok((dh.f_view(h.size().as_slice())?, dw, total.value()?, count));
    }
    // pass 1: every token's log-normaliser over the slices
    let mut chunks = Vec::new();
    for range in ranges(n, HEAD_CHUNK) {
        let chunk = Chunk::new(&hf, &tg, range)?;
        let (loss, lse, _) = chunk.normalise(&slices)?;
        total.add(loss)?;
        chunks.push((range, chunk, lse));
    }
    // pass 2: per slice, its dW accumulated over the chunks, written once
    for slice in slices.ranges() {
        let ws = slices.get(slice)?;
        let mut dws = SliceGrad::new(matmul, &dw, slice)?;
        for ((start, len), chunk, lse) in &chunks {
            let logits = slices.logits(&chunk.h, &ws)?;
            let d = chunk
                .dlogits(&logits, lse, slice, factor)?
                .f_to_kind(slices.kind)?;
            drop(logits);
            let _ = dh.f_narrow(0, *start, *len)?.f_add_(&d.f_matmul(&ws)?)?;
            dws.add(&d, &chunk.h)?;
        }
        dws.write(&dw, slice, &hf)?;
    }
    Ok((dh.f_view(h.size().as_slice())?, dw, total.value()?, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU's 16-bit head ([`Matmul::Low`], run here on CPU tensors) against the fp32
    /// head of the same bf16 weight, in one slice and in slices of 64 rows over two
    /// chunks: the loss, dh and dW within the gaps that bf16 logits and products leave
    /// (measured: loss 1.3e-5 to 2.2e-5 relative, dh 6.5e-3 to 7.1e-3 and dW 5.5e-3 to
    /// 5.8e-3 of their largest element, about two bf16 roundings); the bounds are about
    /// twice those.
    #[test]
    fn the_bf16_head_follows_the_fp32_head_within_bf16_rounding() {
        tch::manual_seed(11);
        let (tokens, hidden, vocab) = (1100, 64, 300);
        let h = Tensor::randn([1, tokens, hidden], (Kind::Float, tch::Device::Cpu)).to_kind(Kind::BFloat16);
        let w =
            (Tensor::randn([vocab, hidden], (Kind::Float, tch::Device::Cpu)) * 0.3).to_kind(Kind::BFloat16);
        let targets = Tensor::randint(vocab, [1, tokens], (Kind::Int64, tch::Device::Cpu));
        let _ = targets.view([-1]).get(7).fill_(-100);
        let scale = Weight::Mean(1.0);
        for rows in [None, Some(64)] {
            let (dh, dw, loss, count) = backward_in(&h, &w, &targets, scale, rows, Matmul::Fp32).unwrap();
            let (dh16, dw16, loss16, count16) =
                backward_in(&h, &w, &targets, scale, rows, Matmul::Low).unwrap();
            let (loss16b, _) = loss_sum_in(&h, &w, &targets, rows, Matmul::Low).unwrap();
            assert_eq!((count, count16), (tokens - 1, tokens - 1));
            assert_eq!(dw16.kind(), Kind::BFloat16);
            assert_eq!(loss16, loss16b, "the loss alone and with the backward");
            let gap = |a: &Tensor, b: &Tensor| {
                let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
                (&a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])
            };
            let loss_gap = (loss16 - loss).abs() / loss.abs();
            let (dh_gap, dw_gap) = (gap(&dh16, &dh), gap(&dw16, &dw));
            println!("rows {rows:?}: loss {loss_gap:.2e}, dh {dh_gap:.2e}, dW {dw_gap:.2e}");
            assert!(loss_gap < 5e-5, "loss {loss16} vs {loss}");
            assert!(dh_gap < 1.5e-2, "dh {dh_gap:.2e}");
            assert!(dw_gap < 1.2e-2, "dW {dw_gap:.2e}");
        }
    }

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
        let (loss, count) = loss_sum(&h, &w, &targets, Matmul::Fp32).unwrap();
        let (dh, dw, loss_b, count_b) =
            backward(&h, &w, &targets, Weight::Mean(scale), Matmul::Fp32).unwrap();
        assert_eq!((count, count_b), (1396, 1396));
        // the vocabulary in slices of 7 rows (the last of 1), and a bf16 weight whose
        // gradient comes back in bf16
        let (loss_s, _) = loss_sum_in(&h, &w, &targets, Some(7), Matmul::Fp32).unwrap();
        let (dh_s, dw_s, loss_sb, _) = backward_in(
            &h,
            &w,
            &targets,
            Weight::PerToken(scale / 1396.0),
            Some(7),
            Matmul::Fp32,
        )
        .unwrap();
        let w16 = w.to_kind(Kind::BFloat16);
        let (_, dw16, _, _) =
            backward_in(&h, &w16, &targets, Weight::Mean(scale), Some(7), Matmul::Fp32).unwrap();
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

    /// An fp32 dW summed in place (the slice of dW itself) has the bits of the sum kept
    /// apart and copied in, as it was before the head wrote into dW: the first product
    /// by `mm_out` is `matmul`'s, the rest are the same in-place adds.
    #[test]
    fn an_fp32_slice_summed_in_place_has_the_bits_of_its_own_sum() {
        tch::manual_seed(3);
        let (tokens, hidden, rows) = (300, 24, 40);
        let d = Tensor::randn([tokens, rows], (Kind::Float, tch::Device::Cpu));
        let h = Tensor::randn([tokens, hidden], (Kind::Float, tch::Device::Cpu));
        let (in_place, apart) = (
            Tensor::zeros([rows + 8, hidden], (Kind::Float, tch::Device::Cpu)),
            Tensor::zeros([rows + 8, hidden], (Kind::Float, tch::Device::Cpu)),
        );
        let slice = (8, rows);
        let mut a = SliceGrad::new(Matmul::Fp32, &in_place, slice).unwrap();
        let mut b = SliceGrad::Fp32(None);
        for (start, len) in ranges(tokens, 128) {
            let (dc, hc) = (d.narrow(0, start, len), h.narrow(0, start, len));
            a.add(&dc, &hc).unwrap();
            b.add(&dc, &hc).unwrap();
        }
        a.write(&in_place, slice, &h).unwrap();
        b.write(&apart, slice, &h).unwrap();
        assert!(in_place.equal(&apart));
        assert!(
            in_place
                .narrow(0, 8, rows)
                .abs()
                .sum(Kind::Float)
                .double_value(&[])
                > 0.0
        );
    }
}
