//! `tierzero bench adam`: CPU AdamW throughput against its own memory roofline.
//!
//! The limit is measured in the same run, with the same threads and arrays: a sweep that
//! makes exactly the AdamW kernel's memory traffic (read master, exp_avg, exp_avg_sq and
//! the gradient; write master, both moments and the parameters' copy, bf16 or, as an
//! fp32 run's update writes it, fp32) with trivial
//! arithmetic ([`tierzero_offload::adam::roofline_sweep`]). Roofline and AdamW sweeps
//! alternate so that both see the same machine state; medians are reported.

use super::median;
use serde::Serialize;
use std::time::Instant;
use tierzero_offload::adam::{self, AdamHyper, GradSlice, Kernel, LowPrecisionOut, Sweep};
use tierzero_offload::convert::f32_to_bf16;
use tierzero_offload::host::AlignedBuf;

#[derive(Clone, Debug)]
pub struct AdamBenchArgs {
    pub params: usize,
    pub threads: usize,
    pub grad_bf16: bool,
    /// The new parameters' copy in fp32, as an fp32 run's update writes it (else bf16).
    pub copy_fp32: bool,
    pub kernel: Kernel,
    pub repeats: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct AdamBenchReport {
    pub kernel: String,
    pub grad_dtype: String,
    pub copy_dtype: String,
    pub params: usize,
    pub threads: usize,
    pub repeats: usize,
    pub bytes_per_param: usize,
    pub adam_seconds: f64,
    pub roofline_seconds: f64,
    pub params_per_s: f64,
    pub gbps: f64,
    pub roofline_gbps: f64,
    pub ratio_to_roofline: f64,
    /// The NVMe pipeline's sweep: master, moments and gradient summed (crc32c) in cache as
    /// the update passes them ([`adam::step_summed`]).
    pub summed_seconds: f64,
    /// What the same checksums cost as passes of their own, as the store took them before
    /// `step_summed`: one thread's crc32c over the four arrays, the update, then over the
    /// three it wrote.
    pub passes_seconds: f64,
}

struct Arrays {
    master: AlignedBuf<f32>,
    exp_avg: AlignedBuf<f32>,
    exp_avg_sq: AlignedBuf<f32>,
    grad_f32: AlignedBuf<f32>,
    grad_bf16: AlignedBuf<u16>,
    copy: ParamsCopy,
}

/// The new parameters' copy an update writes: bf16, or fp32 as an fp32 run's update
/// writes it (the other buffer empty).
pub(super) struct ParamsCopy {
    bf16: AlignedBuf<u16>,
    f32: AlignedBuf<f32>,
}

impl ParamsCopy {
    pub(super) fn zeroed(n: usize, fp32: bool) -> anyhow::Result<ParamsCopy> {
        Ok(ParamsCopy {
            bf16: AlignedBuf::zeroed(if fp32 { 0 } else { n })?,
            f32: AlignedBuf::zeroed(if fp32 { n } else { 0 })?,
        })
    }

    /// The copy as a sweep writes it.
    pub(super) fn out(&mut self) -> LowPrecisionOut<'_> {
        if self.f32.is_empty() {
            LowPrecisionOut::Bf16(&mut self.bf16)
        } else {
            LowPrecisionOut::F32(&mut self.f32)
        }
    }
}

/// The benches' gradient: small, positive (exp_avg_sq stays positive under the
/// roofline's adds) and varied.
pub(super) fn gradient(i: usize) -> f32 {
    1e-3 + (i % 13) as f32 * 1e-4
}

impl Arrays {
    /// The arrays as the sweep of `args`'s gradient and copy types takes them.
    fn sweep(&mut self, args: &AdamBenchArgs) -> Sweep<'_> {
        Sweep {
            master: &mut self.master,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
            grad: if args.grad_bf16 {
                GradSlice::Bf16(&self.grad_bf16)
            } else {
                GradSlice::F32(&self.grad_f32)
            },
            low: self.copy.out(),
        }
    }
}

/// Runs the benchmark. Errors are allocation or thread-pool failures.
pub fn run(args: &AdamBenchArgs) -> anyhow::Result<AdamBenchReport> {
    anyhow::ensure!(args.params > 0, "--params must be positive");
    anyhow::ensure!(
        args.kernel.is_supported(),
        "kernel {} is not supported by this CPU",
        args.kernel
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.max(1))
        .build()?;
    let n = args.params;
    let (grad_f32_len, grad_bf16_len) = if args.grad_bf16 { (0, n) } else { (n, 0) };
    let mut arrays = Arrays {
        master: AlignedBuf::zeroed(n)?,
        exp_avg: AlignedBuf::zeroed(n)?,
        exp_avg_sq: AlignedBuf::zeroed(n)?,
        grad_f32: AlignedBuf::zeroed(grad_f32_len)?,
        grad_bf16: AlignedBuf::zeroed(grad_bf16_len)?,
        copy: ParamsCopy::zeroed(n, args.copy_fp32)?,
    };
    // first touch from the pool's threads; positive gradients keep exp_avg_sq positive
    // under the roofline's adds
    pool.install(|| {
        use rayon::prelude::*;
        arrays
            .master
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, p)| *p = 1.0 + (i % 97) as f32 * 1e-3);
        arrays.exp_avg.par_iter_mut().for_each(|m| *m = 1e-4);
        arrays.exp_avg_sq.par_iter_mut().for_each(|v| *v = 1e-6);
        arrays
            .grad_f32
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, g)| *g = gradient(i));
        arrays
            .grad_bf16
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, g)| *g = f32_to_bf16(gradient(i)));
    });
    let hyper = AdamHyper::default();
    let mut roofline_times = Vec::new();
    let mut adam_times = Vec::new();
    let (mut summed_times, mut passes_times) = (Vec::new(), Vec::new());
    for step in 0..=args.repeats {
        let start = Instant::now();
        pool.install(|| adam::roofline_sweep(args.kernel, arrays.sweep(args)))?;
        let roofline = start.elapsed().as_secs_f64();
        let coefficients = hyper.coefficients(step as u64 + 1, 1.0);
        let start = Instant::now();
        pool.install(|| adam::step_with(args.kernel, &coefficients, arrays.sweep(args)))?;
        let adam = start.elapsed().as_secs_f64();
        let start = Instant::now();
        pool.install(|| adam::step_summed_with(args.kernel, &coefficients, arrays.sweep(args), true))?;
        let summed = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let sweep = arrays.sweep(args);
        let read: Vec<u32> = sweep
            .state_bytes()
            .into_iter()
            .chain([sweep.grad.bytes()])
            .map(crc32c::crc32c)
            .collect();
        pool.install(|| adam::step_with(args.kernel, &coefficients, sweep))?;
        let written: Vec<u32> = arrays.sweep(args).state_bytes().map(crc32c::crc32c).into();
        std::hint::black_box((read, written));
        let passes = start.elapsed().as_secs_f64();
        // the first round warms caches, page tables and the pool
        if step > 0 {
            roofline_times.push(roofline);
            adam_times.push(adam);
            summed_times.push(summed);
            passes_times.push(passes);
        }
    }
    let copy = if args.copy_fp32 { 4 } else { 2 };
    let bytes_per_param = if args.grad_bf16 {
        4 * 3 + 2 + 4 * 3 + copy
    } else {
        4 * 4 + 4 * 3 + copy
    };
    let adam_seconds = median(adam_times);
    let roofline_seconds = median(roofline_times);
    let traffic = (bytes_per_param * n) as f64;
    Ok(AdamBenchReport {
        kernel: args.kernel.name().into(),
        grad_dtype: if args.grad_bf16 { "bf16" } else { "fp32" }.into(),
        copy_dtype: if args.copy_fp32 { "fp32" } else { "bf16" }.into(),
        params: n,
        threads: args.threads,
        repeats: args.repeats,
        bytes_per_param,
        adam_seconds,
        roofline_seconds,
        params_per_s: n as f64 / adam_seconds,
        gbps: traffic / adam_seconds / 1e9,
        roofline_gbps: traffic / roofline_seconds / 1e9,
        ratio_to_roofline: roofline_seconds / adam_seconds,
        summed_seconds: median(summed_times),
        passes_seconds: median(passes_times),
    })
}

impl AdamBenchReport {
    pub fn human(&self) -> String {
        format!(
            "adam  kernel {:<8} grad {:<4} copy {:<4} params {:>11} threads {:>2}  {:>8.3} Gparams/s  {:>6.2} GB/s  roofline {:>6.2} GB/s  ratio {:.3}",
            self.kernel,
            self.grad_dtype,
            self.copy_dtype,
            self.params,
            self.threads,
            self.params_per_s / 1e9,
            self.gbps,
            self.roofline_gbps,
            self.ratio_to_roofline
        ) + &format!(
            "\nadam  checksummed as the NVMe pipeline sums its state: in the sweep {:>8.3} Gparams/s, in passes of their own {:>8.3} Gparams/s",
            self.params as f64 / self.summed_seconds / 1e9,
            self.params as f64 / self.passes_seconds / 1e9,
        )
    }
}
