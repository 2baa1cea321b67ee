//! The compute limit MFU is measured against, taken on this machine in the same run:
//! a square matmul of the training precision on the rank's device (fp32 on CPU, where
//! bf16 matmuls are emulated).

use crate::config::plan::{Accelerator, Plan};
use crate::torch::{compute_kind, shim};
use std::time::Instant;
use tch::{Device, Kind, TchError, Tensor};

/// FLOP/s of `reps` n×n×n matmuls of `kind` on `device` (after one warm-up).
pub fn matmul_flops(device: Device, kind: Kind, n: i64, reps: usize) -> Result<f64, TchError> {
    let a = Tensor::f_ones([n, n], (kind, device))?;
    let sync = || match device {
        Device::Cuda(d) => shim::synchronize(d),
        _ => Ok(()),
    };
    let _ = a.f_matmul(&a)?;
    sync()?;
    let start = Instant::now();
    for _ in 0..reps {
        let _ = a.f_matmul(&a)?;
    }
    sync()?;
    Ok(2.0 * (n * n * n) as f64 * reps as f64 / start.elapsed().as_secs_f64())
}

/// The peak one rank of `plan` is measured against.
pub fn peak_flops(plan: &Plan) -> f64 {
    let measured = match plan.train.accelerator {
        Accelerator::Cpu => matmul_flops(Device::Cpu, Kind::Float, 512, 20),
        Accelerator::Cuda => matmul_flops(Device::Cuda(0), compute_kind(&plan.precision), 8192, 50),
    };
    measured.unwrap_or_else(|e| {
        tracing::warn!("cannot measure the matmul peak ({e}); MFU will read 0");
        f64::INFINITY
    })
}
