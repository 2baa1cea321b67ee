//! The memory roofline of the AdamW sweep, for `tierzero bench adam`.
//!
//! The limit for a streaming kernel is the bandwidth it can get for exactly its own
//! traffic. This sweep reads master, exp_avg, exp_avg_sq and the gradient and writes
//! master, both moments and the low-precision copy, in place, with the same vector width,
//! the same chunking and the same threads as the AdamW kernel, but with one add per array
//! instead of the AdamW arithmetic. STREAM triad is not the limit: it moves 12 bytes per
//! element where this kernel moves 28 (bf16 grads) or 30 (fp32 grads).

use super::{avx2, avx512, GradSlice, Kernel, LowPrecisionOut, Sweep, TASK_ELEMENTS};
use crate::convert::bf16_to_f32;

/// Scalar roofline, for the reference and portable kernels.
fn scalar(s: Sweep<'_>) -> bool {
    let Sweep {
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        mut low,
    } = s;
    let mut poison = 0u32;
    for i in 0..master.len() {
        let g = match grad {
            GradSlice::F32(g) => g[i],
            GradSlice::Bf16(g) => bf16_to_f32(g[i]),
        };
        poison |= super::reference::non_finite_bits(g);
        master[i] += g;
        exp_avg[i] += g;
        exp_avg_sq[i] += g;
        match &mut low {
            LowPrecisionOut::None => {}
            LowPrecisionOut::Bf16(o) | LowPrecisionOut::F16(o) => o[i] = (master[i].to_bits() >> 16) as u16,
            LowPrecisionOut::F32(o) => o[i] = master[i],
        }
    }
    poison != 0
}

/// One roofline sweep with `kernel`'s vector width, split across the current rayon pool
/// exactly as [`super::step_with`] splits the AdamW sweep. Arrays are modified.
pub fn roofline_sweep(kernel: Kernel, s: Sweep<'_>) -> Result<bool, super::AdamError> {
    if !kernel.is_supported() {
        return Err(super::AdamError::Unsupported(kernel));
    }
    s.check()?;
    Ok(s.par_fold(TASK_ELEMENTS, &|piece| match kernel {
        Kernel::Reference | Kernel::Portable => scalar(piece),
        Kernel::Avx2 => avx2::roofline(piece).unwrap_or(false),
        Kernel::Avx512 => avx512::roofline(piece).unwrap_or(false),
    }))
}
