//! The bridge between tierzero's flat host buffers and tch tensors.
//!
//! Every conversion between raw memory and a `Tensor` lives here, so the rest of the
//! crate never handles pointers. This build copies (`from_data_size`, `copy_data_u8`):
//! on CPU devices the copy is a memcpy of one unit, small next to its compute. The CUDA
//! side adds zero-copy `from_blob` views and the stream shim in this module.

pub mod shim;

use crate::plan::Precision;
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

thread_local! {
    /// The lane whose job this thread runs in checked mode (`device::lanes` says so through
    /// [`in_checked_lane`]): a blocking copy between host and device fails there.
    static CHECKED_LANE: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` as a job of lane `lane` in checked mode: the blocking copies between host and
/// a GPU that this module makes fail inside it. A lane queues its copies asynchronously
/// on its stream; a blocking one stalls the lane's thread, and beside the NCCL kernels of
/// several GPUs in one process (and allocations on other threads) it can deadlock, as
/// TensorFlow and JAX have seen.
pub fn in_checked_lane<R>(lane: &'static str, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<&'static str>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CHECKED_LANE.set(self.0);
        }
    }
    let _restore = Restore(CHECKED_LANE.replace(Some(lane)));
    f()
}

/// A blocking copy `what` between host and a device other than the CPU: an error in a
/// checked lane's job ([`in_checked_lane`]).
fn blocking_device_copy(what: &str, device: Device) -> Result<(), TchError> {
    match (device, CHECKED_LANE.get()) {
        (Device::Cpu, _) | (_, None) => Ok(()),
        (_, Some(lane)) => Err(TchError::Torch(format!(
            "a blocking {what} on the {lane} lane: checked lanes refuse it (a lane queues its copies asynchronously on its stream)"
        ))),
    }
}

/// `t` on `device` (itself when it is already there).
fn onto(t: Tensor, device: Device) -> Result<Tensor, TchError> {
    if t.device() == device {
        Ok(t)
    } else {
        let gpu = if device == Device::Cpu { t.device() } else { device };
        blocking_device_copy("copy between host and device", gpu)?;
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
        gpu => {
            blocking_device_copy("host→device copy", gpu)?;
            shim::to_gpu(data, shape, kind, gpu)
        }
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

/// Copies a 1-D tensor into `out` as fp32 like [`copy_to_f32`], widening a contiguous
/// 16-bit CPU tensor in place of a temporary fp32 tensor.
pub fn widen_to_f32(t: &Tensor, out: &mut [f32]) -> Result<(), TchError> {
    use tierzero_offload::convert::{bf16_to_f32, f16_to_f32};
    let widen: fn(u16) -> f32 = match t.f_kind()? {
        Kind::BFloat16 => bf16_to_f32,
        Kind::Half => f16_to_f32,
        _ => return copy_to_f32(t, out),
    };
    if t.device() != Device::Cpu || !t.is_contiguous() || t.numel() != out.len() {
        return copy_to_f32(t, out);
    }
    // SAFETY: a contiguous CPU tensor of 2-byte elements, only read; the caller does not
    // write it meanwhile.
    let bits = unsafe { host_slice::<u16>(t, out.len()) }?;
    for (o, &b) in out.iter_mut().zip(bits) {
        *o = widen(b);
    }
    Ok(())
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

/// The first `len` elements of a contiguous CPU tensor as a mutable slice of `T`.
///
/// # Safety
/// - `T` must be the tensor's element type (or one of the same size read as raw bits,
///   as 16-bit floats are read as `u16`);
/// - for the slice's lifetime nothing else may access those elements (the caller owns
///   the buffer, or a lane holds it between events), and the tensor's storage must
///   stay alive (the caller keeps a handle on it).
// A tensor handle shares its storage (every shallow clone writes the same memory), so a
// mutable view comes from a shared handle; the exclusivity is the caller's contract.
#[allow(clippy::mut_from_ref)]
pub unsafe fn host_slice_mut<T: tierzero_offload::host::Pod>(
    t: &Tensor,
    len: usize,
) -> Result<&mut [T], TchError> {
    let size = t.f_kind()?.elt_size_in_bytes();
    if t.device() != Device::Cpu || !t.is_contiguous() || size != std::mem::size_of::<T>() || t.numel() < len
    {
        return Err(TchError::Shape(format!(
            "a {len}-element host view needs a contiguous CPU tensor of {}-byte elements; got {:?} {:?} of {} elements",
            std::mem::size_of::<T>(),
            t.device(),
            t.f_kind()?,
            t.numel()
        )));
    }
    // SAFETY: the tensor is contiguous on the host with at least `len` elements of
    // T's size; exclusivity and lifetime are the caller's contract above.
    Ok(unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<T>(), len) })
}

/// The first `bytes` bytes of a contiguous CPU tensor, whatever its element type.
///
/// # Safety
/// As [`host_slice_mut`]: nothing else may access those bytes for the slice's lifetime,
/// and the tensor's storage must stay alive.
#[allow(clippy::mut_from_ref)]
pub unsafe fn host_bytes_mut(t: &Tensor, bytes: usize) -> Result<&mut [u8], TchError> {
    let size = t.f_kind()?.elt_size_in_bytes();
    if t.device() != Device::Cpu || !t.is_contiguous() || t.numel() * size < bytes {
        return Err(TchError::Shape(format!(
            "a {bytes}-byte host view needs a contiguous CPU tensor that large; got {:?} of {} bytes",
            t.device(),
            t.numel() * size
        )));
    }
    // SAFETY: contiguous host memory of at least `bytes` bytes; the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<u8>(), bytes) })
}

/// The first `len` elements of a contiguous CPU tensor as a shared slice of `T`.
///
/// # Safety
/// As [`host_slice_mut`], except that other readers may share the elements; nothing may
/// write them for the slice's lifetime.
pub unsafe fn host_slice<T: tierzero_offload::host::Pod>(t: &Tensor, len: usize) -> Result<&[T], TchError> {
    // SAFETY: the caller's contract; the slice is only read.
    unsafe { host_slice_mut(t, len) }.map(|s| &*s)
}

/// Copies host `bytes` into the first elements of `dst`, a contiguous tensor on any
/// device whose elements the caller owns for the call (from pageable memory the copy to
/// a GPU is synchronous, so `bytes` is free again on return).
pub fn copy_from_host(dst: &Tensor, bytes: &[u8]) -> Result<(), TchError> {
    let kind = dst.f_kind()?;
    let n = bytes.len() / kind.elt_size_in_bytes();
    if dst.device() == Device::Cpu {
        // SAFETY: the caller owns these elements of `dst` for the call.
        unsafe { host_bytes_mut(dst, bytes.len()) }?.copy_from_slice(bytes);
        return Ok(());
    }
    blocking_device_copy("host→device copy", dst.device())?;
    // SAFETY: the view of `bytes` lives only within this call, while they are borrowed,
    // and is only read.
    let src = unsafe { Tensor::f_from_blob(bytes.as_ptr(), &[n as i64], &[1], kind, Device::Cpu) }?;
    dst.f_narrow(0, 0, n as i64)?.f_copy_(&src)
}

/// Copies the first `out.len()` bytes' worth of elements of `t` (any device) into `out`:
/// one copy straight into it (no host tensor between; from a GPU into pageable memory the
/// driver stages it).
pub fn copy_to_host(t: &Tensor, out: &mut [u8]) -> Result<(), TchError> {
    let kind = t.f_kind()?;
    let n = (out.len() / kind.elt_size_in_bytes()) as i64;
    blocking_device_copy("device→host copy", t.device())?;
    // SAFETY: the view of `out` lives only within this call, while it is borrowed mutably
    // here; the copy into it is synchronous.
    let mut dst = unsafe { Tensor::f_from_blob(out.as_mut_ptr(), &[n], &[1], kind, Device::Cpu) }?;
    dst.f_copy_(&t.f_narrow(0, 0, n)?)
}

/// A tensor several threads hold at once (a stored parameter shard the lanes gather
/// from): cloning gives another handle on the same storage, which its owner writes only
/// while no other thread reads it (`Units::update_target` says when).
pub struct Shared(Tensor);

impl Clone for Shared {
    fn clone(&self) -> Shared {
        Shared(self.0.shallow_clone())
    }
}

impl Shared {
    pub fn new(t: Tensor) -> Shared {
        Shared(t)
    }

    /// A handle for reading (a shallow clone: the same storage).
    pub fn tensor(&self) -> Tensor {
        self.0.shallow_clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checked_lanes_job_refuses_blocking_copies_to_a_gpu_and_only_inside_it() {
        let gpu = Device::Cuda(0);
        assert!(blocking_device_copy("host→device copy", gpu).is_ok());
        let inside = in_checked_lane("collectives", || {
            // host memory is no device copy: CPU tensors are copied as ever
            let t = Tensor::zeros([2], (Kind::Float, Device::Cpu));
            copy_from_host(&t, pod_bytes(&[1.0f32, 2.0])).unwrap();
            assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![1.0, 2.0]);
            blocking_device_copy("host→device copy", gpu)
        });
        let message = inside.unwrap_err().to_string();
        assert!(
            message.contains("blocking host→device copy on the collectives lane"),
            "{message}"
        );
        // the lane's mark is gone with its job, also after a panic inside it
        assert!(blocking_device_copy("host→device copy", gpu).is_ok());
        let _ = std::panic::catch_unwind(|| in_checked_lane("h2d", || panic!("a job panics")));
        assert!(blocking_device_copy("host→device copy", gpu).is_ok());
    }
}
