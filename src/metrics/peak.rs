//! The compute limit MFU is measured against, taken on this machine in the same run:
//! the matmuls of the model's own shapes (a micro-batch's tokens against the attention,
//! MLP and LM-head weights) on the rank's device, each in the kind it runs in: the
//! blocks' in the training precision, the LM head's in fp32 (`model/head.rs` computes
//! logits in fp32 whatever the weights' kind; on a CPU without bf16 matmul units that is
//! ~17× faster than a bf16 matmul, and a bf16-only peak let `llama-1b` read 404%). Each shape is
//! timed several times and its median kept; the peak is the fastest shape's median, so
//! no layer of the model can run above it and MFU stays a fraction (a single 512² fp32
//! matmul, slower than the model's larger ones, once gave an MFU of 1.096).

use crate::plan::{Accelerator, Plan};
use crate::torch::{compute_kind, shim};
use std::time::Instant;
use tch::{Device, Kind, TchError, Tensor};

/// FLOP/s of an n×n×n matmul of `kind` on `device`: the median of `reps` timings.
pub fn matmul_flops(device: Device, kind: Kind, n: i64, reps: usize) -> Result<f64, TchError> {
    shape_flops(device, kind, (n, n, n), reps)
}

/// FLOP/s of an m×k by k×n matmul of `kind` on `device`: the median of `reps` timings
/// (after one warm-up).
pub fn shape_flops(
    device: Device,
    kind: Kind,
    (m, k, n): (i64, i64, i64),
    reps: usize,
) -> Result<f64, TchError> {
    let a = Tensor::f_ones([m, k], (kind, device))?;
    let b = Tensor::f_ones([k, n], (kind, device))?;
    let sync = || match device {
        Device::Cuda(d) => shim::synchronize(d),
        _ => Ok(()),
    };
    let _ = a.f_matmul(&b)?;
    sync()?;
    let mut rates = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let _ = a.f_matmul(&b)?;
        sync()?;
        rates.push(2.0 * (m * k * n) as f64 / start.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// Model FLOPs utilisation of a run of `ranks` ranks, each with the matmul peak
/// `rank_peak` (FLOP/s), doing `flops_per_s` model FLOP/s in all: the ranks' peaks add
/// up, as the tokens of every rank count in `flops_per_s`. 0 without a peak.
pub fn mfu(flops_per_s: f64, rank_peak: f64, ranks: usize) -> f64 {
    if rank_peak > 0.0 {
        flops_per_s / (rank_peak * ranks.max(1) as f64)
    } else {
        0.0
    }
}

/// The peak one rank of `plan` is measured against (the calling thread's torch threads:
/// set them to a rank's share first, as the trainer does).
pub fn peak_flops(plan: &Plan) -> f64 {
    let device = match plan.train.accelerator {
        Accelerator::Cpu => Device::Cpu,
        Accelerator::Cuda => Device::Cuda(0),
    };
    let config = &plan.model.config;
    let tokens = (plan.batch.micro_batch_per_gpu * plan.data.seq_len).clamp(1, 8192) as i64;
    let hidden = config.hidden_size as i64;
    // the LM head runs in chunks of at most 1024 tokens
    let shapes = [
        (tokens, hidden, hidden),
        (tokens, hidden, config.intermediate_size as i64),
        (tokens.min(1024), hidden, config.vocab_size as i64),
    ];
    // a few milliseconds per timing on the fastest kernel: fewer rows (then columns) for
    // the largest shapes, which run at the same rate
    let budget = match device {
        Device::Cpu => 1e9,
        _ => 1e12,
    };
    let bounded = |(m, k, n): (i64, i64, i64)| {
        let flops = |m: i64, n: i64| 2.0 * (m * k * n) as f64;
        let m = if flops(m, n) > budget {
            ((budget / flops(1, n)) as i64).clamp(64.min(m), m)
        } else {
            m
        };
        let n = if flops(m, n) > budget {
            ((budget / flops(m, 1)) as i64).clamp(64.min(n), n)
        } else {
            n
        };
        (m, k, n)
    };
    let kind = compute_kind(&plan.precision);
    let kinds = [kind, kind, Kind::Float];
    let measured = shapes
        .iter()
        .zip(kinds)
        .map(|(&shape, kind)| shape_flops(device, kind, bounded(shape), 5))
        .try_fold(0f64, |best, rate| rate.map(|r| best.max(r)));
    measured.unwrap_or_else(|e| {
        tracing::warn!("cannot measure the matmul peak ({e}); MFU will read 0");
        f64::INFINITY
    })
}
