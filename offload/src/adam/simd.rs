//! The SIMD AdamW loop, written once for every vector ISA.
//!
//! `simd_kernels!` expands, inside an ISA module, to the AdamW sweep and its roofline
//! twin (same loads and stores, trivial arithmetic). The module supplies the vector type
//! `V`, `LANES` and small `#[inline]` primitives carrying its `#[target_feature]`s:
//! `splat, load, store, fmadd, mul, add, sqrt, div, load_bf16, store_bf16,
//! store_bf16_truncated, store_f16, poison_zero, poison_accumulate, poison_any`.
//! The per-element formula and the placement of fused multiply-adds are those of
//! [`super::reference::update_one`], so results agree with it to the bit; tails shorter
//! than one vector go through the reference itself.

macro_rules! simd_kernels {
    ($features:literal) => {
        use super::super::{Coefficients, GradSlice, LowPrecisionOut, Sweep};

        /// Runs the sweep; falls back to the reference where the CPU lacks the features.
        pub(in super::super) fn sweep(c: &Coefficients, s: Sweep<'_>) -> bool {
            if is_supported() {
                // SAFETY: the features were detected just above.
                return unsafe { sweep_unchecked(c, s) };
            }
            super::super::reference::sweep(c, s)
        }

        /// The roofline twin of `sweep`; `None` where the CPU lacks the features.
        pub(in super::super) fn roofline(s: Sweep<'_>) -> Option<bool> {
            // SAFETY: the features are detected before the call.
            is_supported().then(|| unsafe { roofline_unchecked(s) })
        }

        /// The AdamW sweep over whole vectors; the tail goes to the reference.
        ///
        /// # Safety
        /// The CPU must support the features named by `is_supported`.
        #[target_feature(enable = $features)]
        unsafe fn sweep_unchecked(c: &Coefficients, s: Sweep<'_>) -> bool {
            let whole = s.len() / LANES * LANES;
            let (body, tail) = s.split_at(whole);
            let Sweep {
                master,
                exp_avg,
                exp_avg_sq,
                grad,
                mut low,
            } = body;
            let (p, m, v) = (
                master.as_mut_ptr(),
                exp_avg.as_mut_ptr(),
                exp_avg_sq.as_mut_ptr(),
            );
            let beta1 = splat(c.beta1);
            let one_minus_beta1 = splat(c.one_minus_beta1);
            let beta2 = splat(c.beta2);
            let one_minus_beta2 = splat(c.one_minus_beta2);
            let grad_scale = splat(c.grad_scale);
            let l2 = splat(c.l2);
            let inv_sqrt_bias2 = splat(c.inv_sqrt_bias2);
            let eps = splat(c.eps);
            let decay = splat(c.decay);
            let neg_step_size = splat(c.neg_step_size);
            let mut poison = poison_zero();
            let mut i = 0;
            while i < whole {
                // SAFETY: i + LANES <= whole <= the length of every array in `body`
                // (Sweep::check ran before any kernel), and each pointer is offset from
                // its own array's start.
                unsafe {
                    let raw = match grad {
                        GradSlice::F32(g) => load(g.as_ptr().add(i)),
                        GradSlice::Bf16(g) => load_bf16(g.as_ptr().add(i)),
                    };
                    poison = poison_accumulate(poison, raw);
                    // scale the gradient, then fold in L2 decay (0 in decoupled mode)
                    let pv = load(p.add(i));
                    let g = fmadd(l2, pv, mul(raw, grad_scale));
                    // update the first moment
                    let mv = fmadd(beta1, load(m.add(i)), mul(one_minus_beta1, g));
                    // update the second moment
                    let vv = fmadd(beta2, load(v.add(i)), mul(mul(one_minus_beta2, g), g));
                    // bias-corrected denominator with eps after the square root
                    let denom = fmadd(sqrt(vv), inv_sqrt_bias2, eps);
                    // decoupled weight decay, then the Adam step
                    let pv = fmadd(neg_step_size, div(mv, denom), mul(pv, decay));
                    store(p.add(i), pv);
                    store(m.add(i), mv);
                    store(v.add(i), vv);
                    match &mut low {
                        LowPrecisionOut::None => {}
                        LowPrecisionOut::Bf16(o) => store_bf16(o.as_mut_ptr().add(i), pv),
                        LowPrecisionOut::F16(o) => store_f16(o.as_mut_ptr().add(i), pv),
                        LowPrecisionOut::F32(o) => store(o.as_mut_ptr().add(i), pv),
                    }
                }
                i += LANES;
            }
            let body_poisoned = poison_any(poison);
            super::super::reference::sweep(c, tail) | body_poisoned
        }

        /// The memory roofline for the sweep: the same vector loads and stores over the
        /// same arrays, with an add in place of the AdamW arithmetic and a truncating
        /// low-precision store in place of the rounding one.
        ///
        /// # Safety
        /// The CPU must support the features named by `is_supported`.
        #[target_feature(enable = $features)]
        unsafe fn roofline_unchecked(s: Sweep<'_>) -> bool {
            let whole = s.len() / LANES * LANES;
            let (body, _tail) = s.split_at(whole);
            let Sweep {
                master,
                exp_avg,
                exp_avg_sq,
                grad,
                mut low,
            } = body;
            let (p, m, v) = (
                master.as_mut_ptr(),
                exp_avg.as_mut_ptr(),
                exp_avg_sq.as_mut_ptr(),
            );
            let mut poison = poison_zero();
            let mut i = 0;
            while i < whole {
                // SAFETY: as in `sweep_unchecked`.
                unsafe {
                    let g = match grad {
                        GradSlice::F32(g) => load(g.as_ptr().add(i)),
                        GradSlice::Bf16(g) => load_bf16(g.as_ptr().add(i)),
                    };
                    poison = poison_accumulate(poison, g);
                    let pv = add(load(p.add(i)), g);
                    store(p.add(i), pv);
                    store(m.add(i), add(load(m.add(i)), g));
                    store(v.add(i), add(load(v.add(i)), g));
                    match &mut low {
                        LowPrecisionOut::None => {}
                        LowPrecisionOut::Bf16(o) | LowPrecisionOut::F16(o) => {
                            store_bf16_truncated(o.as_mut_ptr().add(i), pv)
                        }
                        LowPrecisionOut::F32(o) => store(o.as_mut_ptr().add(i), pv),
                    }
                }
                i += LANES;
            }
            poison_any(poison)
        }
    };
}

pub(super) use simd_kernels;

/// Stand-ins for the x86 kernels on other architectures.
#[cfg(not(target_arch = "x86_64"))]
pub(super) mod unsupported {
    use super::super::{Coefficients, Sweep};

    pub(in super::super) fn is_supported() -> bool {
        false
    }

    pub(in super::super) fn sweep(c: &Coefficients, s: Sweep<'_>) -> bool {
        super::super::reference::sweep(c, s)
    }

    pub(in super::super) fn roofline(_: Sweep<'_>) -> Option<bool> {
        None
    }
}
