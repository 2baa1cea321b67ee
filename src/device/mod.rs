//! Devices: where a rank's "GPU memory" lives.
//!
//! [`cpu::CpuDevice`] is host memory counted against a budget, with current and peak
//! bytes per rank, so the memory a ZeRO stage saves is measurable on any machine and an
//! over-budget request is a clear out-of-memory error. The engine reserves through it
//! every buffer that would sit on a GPU: parameters and gathered units, gradients and
//! optimizer state on the device tier, and the activations kept between forward and
//! backward. The CUDA device plugs in behind the same calls.
//!
//! [`lanes`] are the ordered work queues (h2d, gather, reduce, …) with events that give
//! the step its overlap, and [`pool`] the reusable buffers released only after the event
//! of their last use; both have a checked mode that turns a missing wait into NaN.
//! [`sim`] is the simulated device: streams with virtual clocks that time the engine's
//! own schedule on a profiled machine while its payload runs on the CPU.

pub mod cpu;
pub mod cuda;
pub mod lanes;
pub mod pool;
pub mod sim;

use crate::plan::DeviceFacts;

/// Why a call on a device's streams or marks failed (the Device seam's error).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// The CUDA driver or torch's bridge refused: the operation and its words.
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
    /// A stream was asked to wait for a mark another kind of device made.
    #[error("a mark of another device kind")]
    ForeignMark,
}

/// One process's share of the host memory the kernel says is available for new
/// allocations without swapping (`MemAvailable` of `/proc/meminfo`), bytes: divided among
/// the processes torchrun starts on this machine (`LOCAL_WORLD_SIZE`); None where it
/// cannot be read.
fn available_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    let processes = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1)
        .max(1);
    Some(kib * 1024 / processes)
}

/// Whether this CPU has bf16 matrix units (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo;
/// false where it cannot be read).
pub fn cpu_bf16() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines().filter(|l| l.starts_with("flags")).any(|l| {
            l.split_whitespace()
                .any(|f| f == "avx512_bf16" || f == "amx_bf16")
        })
    })
}

/// What this machine has, for the plan's `"auto"` choices (asks libtorch; no GPU and no
/// driver is simply 0 GPUs).
pub fn facts() -> DeviceFacts {
    let cuda_devices = if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    };
    let cuda_memory = (cuda_devices > 0)
        .then(|| cuda::Cuda::open(0).and_then(|c| c.memory()).ok())
        .flatten()
        .map(|(_, total)| total);
    DeviceFacts {
        cuda_bf16: cuda_devices > 0,
        cpu_bf16: cpu_bf16(),
        cuda_devices,
        cuda_memory,
        host_memory: available_host_memory(),
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("rank {rank}: out of device memory allocating {requested} bytes for {what}: {in_use} of {budget} bytes in use; raise train.device_memory, offload more (offload_param / offload_optimizer), or raise the ZeRO stage")]
pub struct OutOfMemory {
    pub rank: usize,
    pub what: String,
    pub requested: u64,
    pub in_use: u64,
    pub budget: u64,
}
