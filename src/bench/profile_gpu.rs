//! The GPU's part of `tierzero bench profile`, on a machine where the configs compute on
//! CUDA: every timing ends at a synchronize of the device, so it is the device's time; the
//! copies between host and GPU are `bench h2d`'s (pinned and pageable, CUDA events), the
//! device-memory copy and the matmul peaks are torch's on the GPU, and its memory is the
//! driver's total. The host's rates (memcpy, add, the CPU AdamW) stay the CPU part's.

use super::gpu::h2d_on;
use super::timed;
use crate::plan::simulate::profile::{Copies, Figure};
use crate::torch::shim;
use tch::{Device, Kind, Tensor};

/// Waits for everything queued on `device` (nothing on a CPU).
pub(super) fn sync(device: Device) -> anyhow::Result<()> {
    if let Device::Cuda(d) = device {
        shim::synchronize(d)?;
    }
    Ok(())
}

/// The copies of a GPU profile: host↔device from `bench h2d` over 256 MB, a device copy
/// of 1 GiB (bytes copied, not read plus written), the host's from `host` (the CPU
/// part's measurements).
pub(super) fn copies(ordinal: usize, host: Copies) -> anyhow::Result<Copies> {
    let report = h2d_on(ordinal, 256)?;
    let source = |what: &str| {
        format!(
            "`tierzero bench h2d --size-mb 256` on {} ({what}), by `tierzero bench profile`",
            report.device
        )
    };
    let device = Device::Cuda(ordinal);
    const N: i64 = 1 << 28;
    let a = Tensor::f_ones([N], (Kind::Float, device))?;
    let mut b = Tensor::f_zeros([N], (Kind::Float, device))?;
    let seconds = timed(|| {
        b.f_copy_(&a)?;
        sync(device)
    })?;
    Ok(Copies {
        h2d_pinned: Figure::new(report.pinned.h2d, source("registered host memory")),
        h2d_pageable: Figure::new(report.pageable.h2d, source("pageable host memory")),
        d2h_pinned: Figure::new(report.pinned.d2h, source("registered host memory")),
        d2h_pageable: Figure::new(report.pageable.d2h, source("pageable host memory")),
        device_to_device: Figure::new(
            (4 * N) as f64 / seconds / 1e9,
            "torch copy_ of a 1 GiB fp32 tensor on the GPU, bytes copied (half of those read and written), `tierzero bench profile`",
        ),
        ..host
    })
}

/// The GPU's name and total memory in bytes (the driver's figures).
pub(super) fn memory(ordinal: usize) -> anyhow::Result<(String, f64)> {
    let cuda = crate::device::cuda::Cuda::open(ordinal)?;
    let (_, total) = cuda.memory()?;
    Ok((cuda.name()?, total as f64))
}
