//! The scalar AdamW reference: the oracle every SIMD kernel is tested against.
//!
//! Formula (PyTorch `torch.optim.AdamW`, `foreach=False`; DeepSpeed `cpu_adam_impl.h`):
//!
//! ```text
//! g  = grad · grad_scale (+ wd · p in L2 mode)
//! m  = β1 · m + (1 − β1) · g
//! v  = β2 · v + (1 − β2) · g²
//! p  = p · (1 − lr · wd)                      (decoupled mode)
//! p  = p − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)
//! ```
//!
//! Fused multiply-adds sit exactly where the SIMD kernels put them, so results agree to
//! the bit.

use super::{Coefficients, LowPrecisionOut, Sweep};
use crate::convert::{f32_to_bf16, f32_to_f16};

/// Updates one element; returns the new (master, exp_avg, exp_avg_sq).
#[inline(always)]
pub fn update_one(c: &Coefficients, p: f32, m: f32, v: f32, grad: f32) -> (f32, f32, f32) {
    // scale the gradient (unscale fp16 loss scaling, apply the clip coefficient)
    let mut g = grad * c.grad_scale;
    // L2 mode folds weight decay into the gradient (c.l2 is 0 in decoupled mode)
    g = c.l2.mul_add(p, g);
    // update the first moment
    let m = c.beta1.mul_add(m, c.one_minus_beta1 * g);
    // update the second moment
    let v = c.beta2.mul_add(v, (c.one_minus_beta2 * g) * g);
    // bias-corrected denominator, eps after the square root
    let denom = v.sqrt().mul_add(c.inv_sqrt_bias2, c.eps);
    // decoupled weight decay (c.decay is 1 in L2 mode), then the Adam step
    let p = p * c.decay;
    let p = c.neg_step_size.mul_add(m / denom, p);
    (p, m, v)
}

/// The reference sweep: one element at a time. Returns whether a gradient was non-finite.
pub fn sweep(c: &Coefficients, s: Sweep<'_>) -> bool {
    let mut non_finite = false;
    let Sweep {
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        mut low,
    } = s;
    for i in 0..master.len() {
        let g = grad.get(i);
        non_finite |= !g.is_finite();
        let (p, m, v) = update_one(c, master[i], exp_avg[i], exp_avg_sq[i], g);
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        match &mut low {
            LowPrecisionOut::None => {}
            LowPrecisionOut::Bf16(o) => o[i] = f32_to_bf16(p),
            LowPrecisionOut::F16(o) => o[i] = f32_to_f16(p),
            LowPrecisionOut::F32(o) => o[i] = p,
        }
    }
    non_finite
}

/// Bits of `g − g`: zero for finite `g`, a NaN pattern for NaN or ±inf. OR-ing these
/// over a sweep flags a non-finite gradient without a branch, as the SIMD kernels do.
#[inline(always)]
#[allow(clippy::eq_op)] // x − x is the point: it is NaN exactly when x is not finite
pub fn non_finite_bits(g: f32) -> u32 {
    (g - g).to_bits()
}
