//! A unit's low-precision parameters as stored, and where they live between uses.

use crate::plan::Precision;
use crate::torch::{pod_bytes, pod_bytes_mut, Shared};
use std::sync::Arc;
use tierzero_offload::adam::LowPrecisionOut;
use tierzero_offload::convert::{f32_to_bf16, f32_to_f16};
use tierzero_offload::nvme::swap::SwapStore;

/// Low-precision parameters as stored: fp32 values or 16-bit float bits.
#[derive(Clone, Debug)]
pub enum LowParams {
    F32(Vec<f32>),
    U16(Vec<u16>),
}

impl Default for LowParams {
    fn default() -> Self {
        LowParams::F32(Vec::new())
    }
}

impl LowParams {
    pub(crate) fn zeros(len: usize, precision: &Precision) -> LowParams {
        match precision {
            Precision::Fp32 => LowParams::F32(vec![0.0; len]),
            _ => LowParams::U16(vec![0; len]),
        }
    }

    /// `values` rounded into `precision` (round to nearest even).
    pub(crate) fn rounded(values: &[f32], precision: &Precision) -> LowParams {
        match precision {
            Precision::Fp32 => LowParams::F32(values.to_vec()),
            Precision::Fp16(_) => LowParams::U16(values.iter().map(|&x| f32_to_f16(x)).collect()),
            Precision::Bf16 => LowParams::U16(values.iter().map(|&x| f32_to_bf16(x)).collect()),
        }
    }

    /// Where AdamW writes this buffer's new values, in `precision`.
    pub(super) fn out_as(&mut self, precision: &Precision) -> LowPrecisionOut<'_> {
        match (self, precision) {
            (LowParams::U16(v), Precision::Fp16(_)) => LowPrecisionOut::F16(v),
            (LowParams::U16(v), _) => LowPrecisionOut::Bf16(v),
            (LowParams::F32(v), _) => LowPrecisionOut::F32(v),
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            LowParams::F32(v) => pod_bytes(v),
            LowParams::U16(v) => pod_bytes(v),
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            LowParams::F32(v) => pod_bytes_mut(v),
            LowParams::U16(v) => pod_bytes_mut(v),
        }
    }

    /// Sets the length to `len` (new elements zero); within the capacity nothing is
    /// allocated, beyond it exactly `len` elements are.
    pub(crate) fn resize(&mut self, len: usize) {
        match self {
            LowParams::F32(v) => {
                v.reserve_exact(len.saturating_sub(v.len()));
                v.resize(len, 0.0)
            }
            LowParams::U16(v) => {
                v.reserve_exact(len.saturating_sub(v.len()));
                v.resize(len, 0)
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            LowParams::F32(v) => v.len(),
            LowParams::U16(v) => v.len(),
        }
    }

    pub(crate) fn elem_bytes(&self) -> usize {
        match self {
            LowParams::F32(_) => 4,
            LowParams::U16(_) => 2,
        }
    }
}

/// Where a unit's stored parameters (this rank's shard at stage 3, else the padded
/// replica) live between uses. Moved only by the parameters' owner (`units.rs`); the
/// lanes read them shared. An update replaces those in host memory (a lane may still
/// hold the old ones) and writes those on the device in place, when no reader is left
/// (`Units::update_target`).
#[derive(Clone)]
pub enum Params<'a> {
    /// On the rank's device (`offload_param: none`): a 1-D tensor of the compute kind —
    /// a CPU tensor on CPU devices, GPU memory on a CUDA rank.
    Device(Shared),
    /// In host memory (`offload_param: cpu`).
    Host(Arc<LowParams>),
    /// In the NVMe parameter store (`offload_param: nvme`), under (unit, rank, `Param`).
    Nvme(&'a SwapStore),
}
