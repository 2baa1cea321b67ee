//! The C++ bridge (`shim.cpp`) and every raw-pointer use of tch tensors.
//!
//! tch has no stream API, no non-blocking `copy_`, no `autograd::grad` with incoming
//! gradients and no fused Adam; the bridge adds them, plus the caching allocator's
//! memory statistics and a counting CPU allocator.
//! Each call returns torch's exception text as an error. Device pointers for NCCL and
//! CUDA copies come from [`device_ptr`], the only `data_ptr` use in the crate.

use std::ffi::{c_char, c_int, c_void, CStr};
use tch::{TchError, Tensor};
use torch_sys::C_tensor;

const ERR_LEN: usize = 1024;

extern "C" {
    fn tz_current_stream(
        device: c_int,
        out: *mut *mut c_void,
        id: *mut i64,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_stream_from_pool(
        device: c_int,
        high_priority: c_int,
        out: *mut *mut c_void,
        id: *mut i64,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_set_current_stream(device: c_int, id: i64, err: *mut c_char, n: usize) -> c_int;
    fn tz_pinned_bytes(bytes: i64, out: *mut *mut C_tensor, err: *mut c_char, n: usize) -> c_int;
    fn tz_device_sleep(device: c_int, cycles: i64, err: *mut c_char, n: usize) -> c_int;
    fn tz_synchronize(device: c_int, err: *mut c_char, n: usize) -> c_int;
    fn tz_copy(
        dst: *mut C_tensor,
        src: *const C_tensor,
        non_blocking: c_int,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_grad(
        outputs: *const *mut C_tensor,
        grad_outputs: *const *mut C_tensor,
        n_out: c_int,
        inputs: *const *mut C_tensor,
        n_in: c_int,
        keep_graph: c_int,
        result: *mut *mut C_tensor,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_memory_stats(device: c_int, out4: *mut i64, err: *mut c_char, n: usize) -> c_int;
    fn tz_reset_peak(device: c_int, err: *mut c_char, n: usize) -> c_int;
    fn tz_count_cpu_allocations(err: *mut c_char, n: usize) -> c_int;
    fn tz_fused_adam(
        param: *mut C_tensor,
        grad: *mut C_tensor,
        exp_avg: *mut C_tensor,
        exp_avg_sq: *mut C_tensor,
        step: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: c_int,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_cpu_memory_stats(out2: *mut i64, err: *mut c_char, n: usize) -> c_int;
    fn tz_cpu_reset_peak(err: *mut c_char, n: usize) -> c_int;
}

/// Runs one bridge call with an error buffer; a non-zero return becomes its message.
fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), TchError> {
    let mut err = [0 as c_char; ERR_LEN];
    if f(err.as_mut_ptr(), ERR_LEN) == 0 {
        return Ok(());
    }
    // SAFETY: the bridge writes a NUL-terminated string of at most ERR_LEN bytes.
    let message = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
    let first = message.lines().next().unwrap_or("").to_string();
    Err(TchError::Torch(first))
}

/// A stream of torch's: its raw handle (a `cudaStream_t` on CUDA; null is the legacy
/// default stream) and torch's id for it (to make it current on a thread).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TorchStream {
    pub raw: *mut c_void,
    pub id: i64,
}

// SAFETY: a stream handle names a queue of the driver's, usable from any thread.
unsafe impl Send for TorchStream {}
// SAFETY: as for Send: the handle is only read.
unsafe impl Sync for TorchStream {}

/// Torch's current stream on accelerator `device` for the calling thread. An error where
/// there is no accelerator.
pub fn current_stream(device: usize) -> Result<TorchStream, TchError> {
    let (mut raw, mut id) = (std::ptr::null_mut(), 0i64);
    // SAFETY: `raw` and `id` are valid places for one value each.
    call(|e, n| unsafe { tz_current_stream(device as c_int, &mut raw, &mut id, e, n) })?;
    Ok(TorchStream { raw, id })
}

/// A stream from torch's pool on accelerator `device` (torch keeps it for the process).
pub fn stream_from_pool(device: usize, high_priority: bool) -> Result<TorchStream, TchError> {
    let (mut raw, mut id) = (std::ptr::null_mut(), 0i64);
    // SAFETY: as in `current_stream`.
    call(|e, n| unsafe {
        tz_stream_from_pool(device as c_int, high_priority as c_int, &mut raw, &mut id, e, n)
    })?;
    Ok(TorchStream { raw, id })
}

/// Makes `stream` the calling thread's current stream on accelerator `device`: torch
/// queues this thread's work for that device there from now on.
pub fn set_current_stream(device: usize, stream: TorchStream) -> Result<(), TchError> {
    // SAFETY: plain call; torch checks the id.
    call(|e, n| unsafe { tz_set_current_stream(device as c_int, stream.id, e, n) })
}

/// `bytes` uninitialised bytes of pinned host memory, as a byte tensor (an error where
/// there is no accelerator).
pub fn pinned_bytes(bytes: usize) -> Result<Tensor, TchError> {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` receives one new tensor handle on success, which the Tensor owns.
    call(|e, n| unsafe { tz_pinned_bytes(bytes as i64, &mut out, e, n) })?;
    // SAFETY: a fresh handle from the bridge.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Queues a kernel that spins for `cycles` GPU clock cycles on the calling thread's
/// current stream on CUDA device `device` (checked mode's device delays); an error
/// without CUDA torch.
pub fn device_sleep(device: usize, cycles: u64) -> Result<(), TchError> {
    let cycles = cycles.min(i64::MAX as u64) as i64;
    // SAFETY: plain call.
    call(|e, n| unsafe { tz_device_sleep(device as c_int, cycles, e, n) })
}

/// Waits for every queued operation on accelerator `device`.
pub fn synchronize(device: usize) -> Result<(), TchError> {
    // SAFETY: plain call.
    call(|e, n| unsafe { tz_synchronize(device as c_int, e, n) })
}

/// `dst.copy_(src, non_blocking)`: with pinned host memory and `non_blocking`, the copy
/// is queued on torch's current stream and returns at once.
pub fn copy_(dst: &mut Tensor, src: &Tensor, non_blocking: bool) -> Result<(), TchError> {
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    // SAFETY: both handles are live tensors owned by the caller.
    call(|e, n| unsafe { tz_copy(d, s, non_blocking as c_int, e, n) })
}

/// `torch::autograd::grad(outputs, inputs, grad_outputs)`: the vector-Jacobian product
/// with incoming gradients. `None` for an input the outputs do not depend on.
pub fn grad(
    outputs: &[&Tensor],
    grad_outputs: &[&Tensor],
    inputs: &[&Tensor],
    keep_graph: bool,
) -> Result<Vec<Option<Tensor>>, TchError> {
    if outputs.len() != grad_outputs.len() {
        return Err(TchError::Shape(format!(
            "{} outputs but {} incoming gradients",
            outputs.len(),
            grad_outputs.len()
        )));
    }
    let handles = |ts: &[&Tensor]| ts.iter().map(|t| t.as_ptr() as *mut C_tensor).collect::<Vec<_>>();
    let (outs, grads, ins) = (handles(outputs), handles(grad_outputs), handles(inputs));
    let mut result = vec![std::ptr::null_mut::<C_tensor>(); inputs.len()];
    // SAFETY: the handle arrays have the stated lengths and point at live tensors; the
    // bridge fills `result` with fresh tensors only on success.
    call(|e, n| unsafe {
        tz_grad(
            outs.as_ptr(),
            grads.as_ptr(),
            outs.len() as c_int,
            ins.as_ptr(),
            ins.len() as c_int,
            keep_graph as c_int,
            result.as_mut_ptr(),
            e,
            n,
        )
    })?;
    Ok(result
        .into_iter()
        .map(|p| {
            // SAFETY: each pointer is a fresh heap tensor the bridge handed over to us.
            let t = unsafe { Tensor::from_ptr(p) };
            t.defined().then_some(t)
        })
        .collect())
}

/// The caching allocator's view of one accelerator, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    pub allocated: u64,
    pub peak_allocated: u64,
    pub reserved: u64,
    pub peak_reserved: u64,
}

/// Memory statistics of accelerator `device` (peaks since the last [`reset_peak`]).
pub fn memory_stats(device: usize) -> Result<MemoryStats, TchError> {
    let mut out = [0i64; 4];
    // SAFETY: `out` has the four slots the bridge writes.
    call(|e, n| unsafe { tz_memory_stats(device as c_int, out.as_mut_ptr(), e, n) })?;
    let b = |v: i64| v.max(0) as u64;
    Ok(MemoryStats {
        allocated: b(out[0]),
        peak_allocated: b(out[1]),
        reserved: b(out[2]),
        peak_reserved: b(out[3]),
    })
}

pub fn reset_peak(device: usize) -> Result<(), TchError> {
    // SAFETY: plain call.
    call(|e, n| unsafe { tz_reset_peak(device as c_int, e, n) })
}

/// torch's fused Adam (`_fused_adamw_`, or `_fused_adam_` for L2 decay) on one fp32
/// partition on its device, in place; `step` is the 1-based step this update makes.
pub fn fused_adam(
    param: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: u64,
    hyper: &tierzero_offload::adam::AdamHyper,
) -> Result<(), TchError> {
    let decoupled = hyper.mode == tierzero_offload::adam::WeightDecay::Decoupled;
    let (p, g, m, v) = (
        param.as_mut_ptr(),
        grad.as_ptr() as *mut C_tensor,
        exp_avg.as_mut_ptr(),
        exp_avg_sq.as_mut_ptr(),
    );
    // SAFETY: four live tensors owned by the caller; the kernel writes p, m and v only.
    call(|e, n| unsafe {
        tz_fused_adam(
            p,
            g,
            m,
            v,
            step as i64,
            f64::from(hyper.lr),
            f64::from(hyper.beta1),
            f64::from(hyper.beta2),
            f64::from(hyper.weight_decay),
            f64::from(hyper.eps),
            decoupled as c_int,
            e,
            n,
        )
    })
}

/// Routes libtorch's CPU allocations through the bridge's counting allocator from now
/// on (once per process): the CPU counterpart of the caching allocator's statistics,
/// measured where tensors are made, not from the engine's own reservations.
/// Call it before any tensor exists and before other threads use torch (the binary does
/// at start-up): the allocator is swapped without a lock.
pub fn count_cpu_allocations() -> Result<(), TchError> {
    // SAFETY: plain call.
    call(|e, n| unsafe { tz_count_cpu_allocations(e, n) })?;
    COUNTING.store(true, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

static COUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`count_cpu_allocations`] has run in this process.
pub fn counting_cpu_allocations() -> bool {
    COUNTING.load(std::sync::atomic::Ordering::SeqCst)
}

/// Bytes libtorch's CPU tensors hold: `(now, peak since the last reset)`, counted from
/// [`count_cpu_allocations`] on (this process, all its ranks).
pub fn cpu_memory() -> (u64, u64) {
    let mut out = [0i64; 2];
    // SAFETY: `out` has the two slots the bridge writes; the call cannot fail.
    let _ = call(|e, n| unsafe { tz_cpu_memory_stats(out.as_mut_ptr(), e, n) });
    (out[0].max(0) as u64, out[1].max(0) as u64)
}

/// Starts a new peak of [`cpu_memory`] at the bytes held now.
pub fn reset_cpu_peak() {
    // SAFETY: plain call; it cannot fail.
    let _ = call(|e, n| unsafe { tz_cpu_reset_peak(e, n) });
}

/// The address of a contiguous tensor's first element, for CUDA copies and NCCL; the
/// tensor must stay alive (and unmoved by torch) while the address is in use.
pub fn device_ptr(t: &Tensor) -> Result<u64, TchError> {
    if !t.is_contiguous() {
        return Err(TchError::Shape("raw access needs a contiguous tensor".into()));
    }
    Ok(t.data_ptr() as u64)
}

/// A copy of host elements `data` (raw bits of `kind`) on GPU `device`, copied straight
/// from `data` through a borrowed view (no intermediate host tensor). The copy is
/// blocking, so `data` is free again when this returns.
pub fn to_gpu<T: tierzero_offload::host::Pod>(
    data: &[T],
    shape: &[i64],
    kind: tch::Kind,
    device: tch::Device,
) -> Result<Tensor, TchError> {
    let numel: i64 = shape.iter().product();
    if numel as usize * kind.elt_size_in_bytes() != std::mem::size_of_val(data) {
        return Err(TchError::Shape(format!(
            "{} bytes of host data for {shape:?} of {kind:?}",
            std::mem::size_of_val(data)
        )));
    }
    // SAFETY: the view covers exactly `data`'s bytes (checked above), lives only inside
    // this call, and the blocking copy finishes reading it before we return.
    let view = unsafe { Tensor::f_from_blob(data.as_ptr().cast(), shape, &[], kind, tch::Device::Cpu)? };
    view.f_to_device_(device, kind, false, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn grad_with_incoming_gradients_matches_the_seeded_backward() {
        let x = Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let w = Tensor::randn([4, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = x.matmul(&w).tanh();
        let dy = Tensor::randn([3, 5], (Kind::Float, Device::Cpu));
        let got = grad(&[&y], &[&dy], &[&x, &w], true).unwrap();
        let want = Tensor::run_backward(&[(&y * &dy).sum(Kind::Float)], &[&x, &w], false, false);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.as_ref().unwrap(), w);
        }
        let unused = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = x.sum(Kind::Float);
        let got = grad(&[&y], &[&Tensor::from(1f32)], &[&unused], false).unwrap();
        assert!(got[0].is_none());
        let e = grad(&[&y], &[], &[&x], false).unwrap_err();
        assert!(e.to_string().contains("1 outputs but 0 incoming"), "{e}");
    }

    #[test]
    fn a_gpu_copy_checks_its_shape_and_needs_a_gpu() {
        let data = [1u16, 2, 3];
        let e = to_gpu(&data, &[4], Kind::BFloat16, Device::Cuda(0)).unwrap_err();
        assert!(e.to_string().contains("6 bytes of host data for [4]"), "{e}");
        if !tch::Cuda::is_available() {
            assert!(to_gpu(&data, &[3], Kind::BFloat16, Device::Cuda(0)).is_err());
        } else {
            let t = to_gpu(&data, &[3], Kind::BFloat16, Device::Cuda(0)).unwrap();
            let back =
                Tensor::f_from_data_size(crate::torch::pod_bytes(&data), &[3], Kind::BFloat16).unwrap();
            assert_eq!(t.to(Device::Cpu), back);
        }
    }

    #[test]
    fn copy_and_accelerator_calls_report_errors_instead_of_throwing() {
        let src = Tensor::arange(6, (Kind::Float, Device::Cpu));
        let mut dst = Tensor::zeros([6], (Kind::Float, Device::Cpu));
        copy_(&mut dst, &src, true).unwrap();
        assert_eq!(dst, src);
        let mut wrong = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        assert!(copy_(&mut wrong, &src, false).is_err());
        if !tch::Cuda::is_available() {
            for e in [
                current_stream(0).map(|_| ()).unwrap_err(),
                stream_from_pool(0, false).map(|_| ()).unwrap_err(),
                set_current_stream(
                    0,
                    TorchStream {
                        raw: std::ptr::null_mut(),
                        id: 0,
                    },
                )
                .unwrap_err(),
                pinned_bytes(16).map(|_| ()).unwrap_err(),
                device_sleep(0, 1000).unwrap_err(),
                synchronize(0).unwrap_err(),
                memory_stats(0).map(|_| ()).unwrap_err(),
            ] {
                assert!(!e.to_string().is_empty());
            }
        }
    }
}
