//! The LM head and cross-entropy, chunked over tokens.
//!
//! Logits are computed `CHUNK` tokens at a time in fp32, so a [tokens, vocab] logits
//! tensor never exists whole (Liger-Kernel's fused linear cross-entropy does the same on
//! GPU). The backward is written by hand for the same reason: per chunk,
//! dlogits = softmax − onehot(target) scaled by the upstream gradient ÷ the token count,
//! then dh = dlogits · W and dW += dlogitsᵀ · h. Targets < 0 are ignored.

use tch::{Kind, TchError, Tensor};

/// Tokens per logits chunk.
pub const CHUNK: i64 = 1024;

/// Sum of per-token losses and the number of counted tokens.
pub fn loss_sum(h: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<(f64, i64), TchError> {
    let (hf, wf, tg) = flatten(h, weight, targets)?;
    let n = tg.size()[0];
    let mut total = 0.0;
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        let (logits, target, valid) = chunk(&hf, &wf, &tg, start, len)?;
        let lse = logits.f_logsumexp([-1], false)?;
        let picked = logits
            .f_gather(1, &target.f_unsqueeze(1)?, false)?
            .f_squeeze_dim(1)?;
        total += lse
            .f_sub(&picked)?
            .f_mul(&valid)?
            .f_sum(Kind::Double)?
            .f_double_value(&[])?;
        start += len;
    }
    let count = tg.f_ge(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    Ok((total, count))
}

fn flatten(h: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor, Tensor), TchError> {
    let hidden = h.size().last().copied().unwrap_or(0);
    Ok((
        h.f_reshape([-1, hidden])?.f_to_kind(Kind::Float)?,
        weight.f_to_kind(Kind::Float)?,
        targets.f_reshape([-1])?,
    ))
}

/// fp32 logits of tokens [start, start+len), their targets (ignored ones clamped to 0)
/// and a 0/1 mask of counted tokens.
fn chunk(
    hf: &Tensor,
    wf: &Tensor,
    tg: &Tensor,
    start: i64,
    len: i64,
) -> Result<(Tensor, Tensor, Tensor), TchError> {
    let logits = hf.f_narrow(0, start, len)?.f_matmul(&wf.f_tr()?)?;
    let target = tg.f_narrow(0, start, len)?;
    let valid = target.f_ge(0)?.f_to_kind(Kind::Float)?;
    Ok((logits, target.f_clamp_min(0)?, valid))
}

/// Gradients of `scale · loss_sum / count` with respect to h [.., H] (as fp32, h's
/// shape) and W [V, H] (fp32). `count` is the number of counted tokens.
pub fn backward(
    h: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor, f64, i64), TchError> {
    let (hf, wf, tg) = flatten(h, weight, targets)?;
    let n = tg.size()[0];
    let count = tg.f_ge(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    let factor = scale / count.max(1) as f64;
    let dh = Tensor::f_zeros_like(&hf)?;
    // accumulated in place: one [V, H] fp32 buffer, not one per chunk
    let mut dw: Option<Tensor> = None;
    let mut total = 0.0;
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        let (logits, target, valid) = chunk(&hf, &wf, &tg, start, len)?;
        let lse = logits.f_logsumexp([-1], true)?;
        let picked = logits.f_gather(1, &target.f_unsqueeze(1)?, false)?;
        total += lse
            .f_sub(&picked)?
            .f_squeeze_dim(1)?
            .f_mul(&valid)?
            .f_sum(Kind::Double)?
            .f_double_value(&[])?;
        // dlogits = (softmax - onehot) · valid · factor
        let mut d = logits.f_sub(&lse)?.f_exp()?;
        let minus_one = Tensor::f_full([len, 1], -1.0, (Kind::Float, hf.device()))?;
        d = d.f_scatter_add(1, &target.f_unsqueeze(1)?, &minus_one)?;
        d = d.f_mul(&valid.f_unsqueeze(1)?.f_mul_scalar(factor)?)?;
        dh.f_narrow(0, start, len)?.f_copy_(&d.f_matmul(&wf)?)?;
        let (dt, hc) = (d.f_tr()?, hf.f_narrow(0, start, len)?);
        match dw.as_mut() {
            None => dw = Some(dt.f_matmul(&hc)?),
            Some(dw) => {
                let _ = dw.f_addmm_(&dt, &hc)?;
            }
        }
        start += len;
    }
    let dw = match dw {
        Some(dw) => dw,
        None => Tensor::f_zeros_like(&wf)?,
    };
    Ok((dh.f_view(h.size().as_slice())?, dw, total, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two chunks, the second partial (1400 tokens), ignored targets in both: the
    /// chunked loss and hand-written backward against torch autograd through one
    /// unchunked cross-entropy.
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
        let (dh, dw, loss_b, count_b) = backward(&h, &w, &targets, scale).unwrap();
        assert_eq!((count, count_b), (1396, 1396));

        let hr = h.detach().set_requires_grad(true);
        let wr = w.detach().set_requires_grad(true);
        let logits = hr.view([-1, hidden]).matmul(&wr.tr());
        let sum =
            logits.cross_entropy_loss::<Tensor>(&targets.view([-1]), None, tch::Reduction::Sum, -100, 0.0);
        (&sum * (scale / count as f64)).backward();
        let reference = sum.double_value(&[]);
        for got in [loss, loss_b] {
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
    }
}
