//! The bridge between tierzero's flat host buffers and tch tensors.
//!
//! Every conversion between raw memory and a `Tensor` lives here, so the rest of the
//! crate never handles pointers. This build copies (`from_data_size`, `copy_data_u8`):
//! on CPU devices the copy is a memcpy of one unit, small next to its compute. The CUDA
//! side adds zero-copy `from_blob` views and the stream shim in this module.

pub mod shim;

use crate::config::plan::Precision;
use tch::{Device, Kind, TchError, Tensor};

/// The element type of parameters and activations for a precision.
pub fn compute_kind(precision: &Precision) -> Kind {
    match precision {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16(_) => Kind::Half,
    }
}

pub fn pod_bytes<T: tierzero_offload::host::Pod>(data: &[T]) -> &[u8] {
    // SAFETY: Pod types have no padding and any byte view of them is valid.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

pub fn pod_bytes_mut<T: tierzero_offload::host::Pod>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: Pod types accept any byte pattern.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}

/// `t` on `device` (itself when it is already there).
fn onto(t: Tensor, device: Device) -> Result<Tensor, TchError> {
    if t.device() == device {
        Ok(t)
    } else {
        t.f_to(device)
    }
}

/// A tensor of `kind` and `shape` on `device` holding a copy of host `data`: an owned
/// host tensor on CPU, a direct host→GPU copy otherwise.
fn tensor_of<T: tierzero_offload::host::Pod>(
    data: &[T],
    shape: &[i64],
    kind: Kind,
    device: Device,
) -> Result<Tensor, TchError> {
    match device {
        Device::Cpu => Tensor::f_from_data_size(pod_bytes(data), shape, kind),
        gpu => shim::to_gpu(data, shape, kind, gpu),
    }
}

/// A 1-D tensor on `device` holding a copy of fp32 `data`.
pub fn tensor_f32(data: &[f32], device: Device) -> Result<Tensor, TchError> {
    tensor_of(data, &[data.len() as i64], Kind::Float, device)
}

/// A 1-D tensor of `kind` (BFloat16 or Half) on `device` holding the raw 16-bit `bits`.
pub fn tensor_u16(bits: &[u16], kind: Kind, device: Device) -> Result<Tensor, TchError> {
    tensor_of(bits, &[bits.len() as i64], kind, device)
}

/// An int64 tensor of token ids on `device`.
pub fn tensor_tokens(tokens: &[i64], shape: &[i64], device: Device) -> Result<Tensor, TchError> {
    tensor_of(tokens, shape, Kind::Int64, device)
}

/// Copies a tensor (any float kind, any shape) into `out` as fp32.
pub fn copy_to_f32(t: &Tensor, out: &mut [f32]) -> Result<(), TchError> {
    let t = onto(t.f_to_kind(Kind::Float)?, Device::Cpu)?.f_contiguous()?;
    let numel = t.numel();
    if numel != out.len() {
        return Err(TchError::Shape(format!(
            "tensor has {numel} elements, buffer {}",
            out.len()
        )));
    }
    t.f_copy_data_u8(pod_bytes_mut(out), numel)
}

/// Adds a tensor (any float kind) into `out` as fp32.
pub fn add_to_f32(t: &Tensor, out: &mut [f32]) -> Result<(), TchError> {
    let mut tmp = vec![0f32; out.len()];
    copy_to_f32(t, &mut tmp)?;
    for (o, x) in out.iter_mut().zip(tmp) {
        *o += x;
    }
    Ok(())
}
