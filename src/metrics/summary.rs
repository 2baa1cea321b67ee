//! `summary.json`: what `train` writes at the end of a run, as a type (its keys in
//! alphabetical order, as the file has always had them): the steady-state breakdown and
//! its rates, memory measured beside memory predicted, losses, throughput and MFU, and the
//! process's host usage.

use super::host::HostUsage;
use super::timeline::Breakdown;
use super::trace::TierBytes;
use crate::plan::host_memory::HostBytes;
use crate::plan::memory::DeviceBytes;
use crate::plan::Accelerator;
use crate::torch::shim::MemoryStats;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Serialize)]
pub struct Summary {
    pub accelerator: Accelerator,
    /// Rank 0's breakdown averaged over the steps after the first.
    #[serde(serialize_with = "Breakdown::serialize_json")]
    pub breakdown: Breakdown,
    /// The CPU allocator's peak bytes in the steps (CPU runs).
    pub cpu_allocator_peak: Option<u64>,
    /// Each rank's peak device bytes, as the engine reserved them.
    pub device_bytes_measured_peak: Vec<u64>,
    pub device_bytes_predicted: DeviceBytes,
    pub first_loss: Option<f64>,
    /// GB/s of each phase of the breakdown that moves bytes.
    pub gb_per_s: BTreeMap<String, f64>,
    /// torch's CUDA allocator statistics of each rank's GPU.
    pub gpu_memory: Vec<MemoryStats>,
    pub host: HostUsage,
    pub host_bytes_predicted: HostBytes,
    pub last_loss: Option<f64>,
    pub loss_floor: Option<f64>,
    /// Bytes per tier after the last step.
    pub memory: Option<TierBytes>,
    /// The last step's MFU.
    pub mfu: Option<f64>,
    pub seconds: f64,
    pub steps: usize,
    /// Mean tokens/s over the kept steps.
    pub tokens_per_s: f64,
}
