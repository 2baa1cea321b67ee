//! Portable AdamW kernel: fixed-width blocks with no branches in the loop body, which
//! LLVM vectorises on any target (NEON `fmla` on aarch64, where `mul_add` is one
//! instruction). The fallback when no x86 SIMD kernel applies.

use super::reference::{non_finite_bits, update_one};
use super::{Coefficients, GradSlice, LowPrecisionOut, Sweep};
use crate::convert::{bf16_to_f32, f32_to_bf16, f32_to_f16};

const BLOCK: usize = 16;

pub(super) fn sweep(c: &Coefficients, s: Sweep<'_>) -> bool {
    let Sweep {
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        mut low,
    } = s;
    let n = master.len();
    // OR of (g - g) bit patterns: zero unless some g was NaN or ±inf
    let mut poison = 0u32;
    let mut g = [0f32; BLOCK];
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let range = start..start + len;
        match grad {
            GradSlice::F32(src) => g[..len].copy_from_slice(&src[range.clone()]),
            GradSlice::Bf16(src) => {
                for (dst, &b) in g[..len].iter_mut().zip(&src[range.clone()]) {
                    *dst = bf16_to_f32(b);
                }
            }
        }
        let p = &mut master[range.clone()];
        let m = &mut exp_avg[range.clone()];
        let v = &mut exp_avg_sq[range.clone()];
        for i in 0..len {
            poison |= non_finite_bits(g[i]);
            (p[i], m[i], v[i]) = update_one(c, p[i], m[i], v[i], g[i]);
        }
        match &mut low {
            LowPrecisionOut::None => {}
            LowPrecisionOut::Bf16(o) => {
                for (dst, &x) in o[range].iter_mut().zip(p.iter()) {
                    *dst = f32_to_bf16(x);
                }
            }
            LowPrecisionOut::F16(o) => {
                for (dst, &x) in o[range].iter_mut().zip(p.iter()) {
                    *dst = f32_to_f16(x);
                }
            }
            LowPrecisionOut::F32(o) => o[range].copy_from_slice(p),
        }
        start += len;
    }
    poison != 0
}
