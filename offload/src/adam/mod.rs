//! CPU AdamW: the optimizer step that runs on fp32 master weights in host memory.
//!
//! Semantics are PyTorch's `torch.optim.AdamW` / DeepSpeed's `DeepSpeedCPUAdam`
//! (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019; Kingma & Ba,
//! "Adam", 2015): bias-corrected moments, `eps` added after the square root, weight
//! decay either decoupled (AdamW) or folded into the gradient (L2, classic Adam). The
//! step number is an argument, never hidden state, so a sub-group can be updated in any
//! order and a resumed run computes the same coefficients.
//!
//! One sweep reads master, exp_avg, exp_avg_sq and the gradient (fp32 or bf16), applies a
//! fused gradient scale (1/loss_scale × clip coefficient), writes master and moments in
//! place plus an optional low-precision (bf16/fp16) copy of the parameter, and reports
//! whether any gradient element was non-finite.
//!
//! Every kernel evaluates the same per-element formula with fused multiply-adds in the
//! same places (see [`reference::update_one`]), so the SIMD kernels agree with the scalar
//! reference to the bit; the tests hold them to that.

mod avx2;
mod avx512;
mod portable;
pub mod reference;
mod roofline;
mod simd;
mod sweep;

pub use roofline::roofline_sweep;
pub use sweep::{GradSlice, LowPrecisionOut, Sweep};

use crate::crc::Running;
use std::fmt;

/// How weight decay enters the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum WeightDecay {
    /// AdamW: `p -= lr * wd * p`, independent of the gradient.
    Decoupled,
    /// Classic Adam with L2 regularisation: `g += wd * p` before the moments.
    L2,
}

/// Hyper-parameters of one AdamW parameter group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub mode: WeightDecay,
}

impl Default for AdamHyper {
    /// PyTorch's AdamW defaults.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            mode: WeightDecay::Decoupled,
        }
    }
}

/// Per-step scalars, computed once per call and broadcast into every kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Coefficients {
    /// Multiplies every gradient element: 1/loss_scale × clip coefficient.
    pub grad_scale: f32,
    /// L2 mode: weight decay added to the gradient; 0 in decoupled mode.
    pub l2: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `1 / sqrt(1 - beta2^step)`.
    pub inv_sqrt_bias2: f32,
    pub eps: f32,
    /// Decoupled mode: `1 - lr * wd`; 1 in L2 mode.
    pub decay: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
}

impl AdamHyper {
    /// Coefficients for optimizer step `step` (1-based, as in PyTorch).
    pub fn coefficients(&self, step: u64, grad_scale: f32) -> Coefficients {
        let step = step.max(1);
        // bias corrections in f64, as PyTorch computes them on the host
        let exponent = step.min(i32::MAX as u64) as i32;
        let bias1 = 1.0 - f64::from(self.beta1).powi(exponent);
        let bias2 = 1.0 - f64::from(self.beta2).powi(exponent);
        let (l2, decay) = match self.mode {
            WeightDecay::Decoupled => (0.0, 1.0 - self.lr * self.weight_decay),
            WeightDecay::L2 => (self.weight_decay, 1.0),
        };
        Coefficients {
            grad_scale,
            l2,
            beta1: self.beta1,
            one_minus_beta1: 1.0 - self.beta1,
            beta2: self.beta2,
            one_minus_beta2: 1.0 - self.beta2,
            inv_sqrt_bias2: (1.0 / bias2.sqrt()) as f32,
            eps: self.eps,
            decay,
            neg_step_size: (-f64::from(self.lr) / bias1) as f32,
        }
    }
}

/// Which implementation of the sweep runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// The scalar oracle: one element at a time, written for reading.
    Reference,
    /// Fixed-width blocks the compiler vectorises on any target (NEON on aarch64).
    Portable,
    /// AVX2 + FMA + F16C, 8 lanes.
    Avx2,
    /// AVX-512F, 16 lanes.
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Kernel {
        if Kernel::Avx512.is_supported() {
            Kernel::Avx512
        } else if Kernel::Avx2.is_supported() {
            Kernel::Avx2
        } else {
            Kernel::Portable
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_supported(self) -> bool {
        match self {
            Kernel::Reference | Kernel::Portable => true,
            Kernel::Avx2 => avx2::is_supported(),
            Kernel::Avx512 => avx512::is_supported(),
        }
    }

    /// Every kernel, fastest last.
    pub const ALL: [Kernel; 4] = [Kernel::Reference, Kernel::Portable, Kernel::Avx2, Kernel::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Reference => "reference",
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
        }
    }

    /// Runs the kernel on one contiguous piece, on the calling thread.
    fn run_serial(self, c: &Coefficients, sweep: Sweep<'_>) -> bool {
        match self {
            Kernel::Reference => reference::sweep(c, sweep),
            Kernel::Portable => portable::sweep(c, sweep),
            Kernel::Avx2 => avx2::sweep(c, sweep),
            Kernel::Avx512 => avx512::sweep(c, sweep),
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of the optimizer step: only misuse by the caller, never numerics.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdamError {
    #[error("AdamW sweep: {what} has {got} elements, master has {expected}")]
    LengthMismatch {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("AdamW kernel {0} is not supported by this CPU")]
    Unsupported(Kernel),
}

/// Elements per rayon task: large enough to amortise scheduling, small enough to
/// balance two to a few hundred threads. A multiple of every kernel's lane count.
pub const TASK_ELEMENTS: usize = 1 << 15;

/// The result of one sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SweepReport {
    /// Some gradient element was NaN or ±inf (the parameters then hold NaN too;
    /// callers check the global gradient norm before stepping, as DeepSpeed does).
    pub found_non_finite: bool,
}

/// One AdamW step over `sweep` with the fastest kernel, split across the current
/// rayon pool.
pub fn step(c: &Coefficients, sweep: Sweep<'_>) -> Result<SweepReport, AdamError> {
    step_with(Kernel::detect(), c, sweep)
}

/// One AdamW step with a chosen kernel, split across the current rayon pool.
pub fn step_with(kernel: Kernel, c: &Coefficients, sweep: Sweep<'_>) -> Result<SweepReport, AdamError> {
    if !kernel.is_supported() {
        return Err(AdamError::Unsupported(kernel));
    }
    sweep.check()?;
    let found_non_finite = sweep.par_fold(TASK_ELEMENTS, &|piece| kernel.run_serial(c, piece));
    Ok(SweepReport { found_non_finite })
}

/// Elements of each stretch a summed sweep checksums, updates and checksums again while
/// it is in the core's cache (8 KiB of each fp32 array).
const SUMMED_BLOCK: usize = 8192;

/// The crc32c of what a summed sweep read and wrote, each array's bytes in element order:
/// master, exp_avg and exp_avg_sq before the update (and the gradient, where asked for),
/// then the three after it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sums {
    /// Master, exp_avg, exp_avg_sq and the gradient as the sweep read them (the
    /// gradient's zero-length where it was not asked for).
    pub read: [Running; 4],
    /// Master, exp_avg and exp_avg_sq as it wrote them.
    pub written: [Running; 3],
}

impl Sums {
    /// These sums followed by those of the next stretch of elements.
    fn then(self, next: Sums) -> Sums {
        Sums {
            read: std::array::from_fn(|i| self.read[i].then(next.read[i])),
            written: std::array::from_fn(|i| self.written[i].then(next.written[i])),
        }
    }
}

/// [`step`], checksumming the state as it passes through the cores: each stretch of
/// [`SUMMED_BLOCK`] elements is summed, updated and summed again while it is in cache,
/// the stretches' sums joined in order ([`crate::crc`]). The same update to the bit; the
/// sums equal crc32c passes over the arrays before and after a plain [`step`] (the
/// gradient's only where `grad`), without those passes' trips through memory: how the
/// NVMe pipeline verifies the state it read and sums what it writes.
pub fn step_summed(c: &Coefficients, sweep: Sweep<'_>, grad: bool) -> Result<(SweepReport, Sums), AdamError> {
    step_summed_with(Kernel::detect(), c, sweep, grad)
}

/// [`step_summed`] with a chosen kernel.
pub fn step_summed_with(
    kernel: Kernel,
    c: &Coefficients,
    sweep: Sweep<'_>,
    grad: bool,
) -> Result<(SweepReport, Sums), AdamError> {
    if !kernel.is_supported() {
        return Err(AdamError::Unsupported(kernel));
    }
    sweep.check()?;
    let (found_non_finite, sums) = sweep.par_reduce(
        TASK_ELEMENTS,
        &|piece| kernel.run_summed(c, piece, grad),
        &|(a, left), (b, right)| (a | b, left.then(right)),
    );
    Ok((SweepReport { found_non_finite }, sums))
}

impl Kernel {
    /// [`Kernel::run_serial`] over `sweep` a block at a time, each block's state summed
    /// before and after its update.
    fn run_summed(self, c: &Coefficients, mut sweep: Sweep<'_>, grad: bool) -> (bool, Sums) {
        let mut sums = Sums::default();
        let mut found = false;
        while !sweep.is_empty() {
            let len = sweep.len();
            let (mut block, rest) = sweep.split_at(SUMMED_BLOCK.min(len));
            for (sum, bytes) in sums.read.iter_mut().zip(block.state_bytes()) {
                *sum = sum.append(bytes);
            }
            if grad {
                sums.read[3] = sums.read[3].append(block.grad.bytes());
            }
            found |= self.run_serial(c, block.reborrow());
            for (sum, bytes) in sums.written.iter_mut().zip(block.state_bytes()) {
                *sum = sum.append(bytes);
            }
            sweep = rest;
        }
        (found, sums)
    }
}

#[cfg(test)]
mod tests;
