//! `Cuda`: one GPU through cudarc's driver API, loaded at run time.
//!
//! The binary starts on machines with no driver: every entry first checks that
//! `libcuda` can be loaded ([`driver`]) and returns [`CudaError::NoDriver`] otherwise,
//! because cudarc panics when it cannot find the library. Compute runs on torch's
//! current stream (borrowed through the bridge); host→device, device→host and
//! collectives get their own non-blocking streams, ordered against compute by events.
//! cudarc retains the primary context, the one torch uses, so pointers are shared.
//!
//! Host memory the copy engines read is allocated by the offload crate (page-aligned)
//! and registered here ([`Pinner`], `cuMemHostRegister`), never allocated write-combined:
//! the CPU optimizer reads the same memory at full speed.

use crate::torch::shim;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use std::sync::{Arc, OnceLock};
use tierzero_offload::pool::HostRegister;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda.so.1 cannot be loaded on this machine; run on CPU devices (`--devices N`) or install the NVIDIA driver")]
    NoDriver,
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA {op} failed: {message}")]
    Driver { op: String, message: String },
}

impl CudaError {
    pub fn driver(op: &str) -> impl FnOnce(DriverError) -> CudaError + '_ {
        move |e| CudaError::Driver {
            op: op.to_string(),
            message: format!("{e}"),
        }
    }
}

/// Ok when the CUDA driver library loads (checked once per process).
pub fn driver() -> Result<(), CudaError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the driver library by its usual names.
    let present = *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

/// GPUs the driver sees (an error without a driver).
pub fn device_count() -> Result<usize, CudaError> {
    driver()?;
    result::init().map_err(CudaError::driver("cuInit"))?;
    let n = CudaContext::device_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// One GPU: its context and the streams tierzero queues copies on (each NCCL
/// communicator has a stream of its own, `comm/nccl.rs`).
pub struct Cuda {
    ctx: Arc<CudaContext>,
    pub h2d: Arc<CudaStream>,
    pub d2h: Arc<CudaStream>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cuda({})", self.ordinal())
    }
}

impl Cuda {
    /// Opens GPU `ordinal` (the primary context, shared with torch).
    pub fn open(ordinal: usize) -> Result<Cuda, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("context creation"))?;
        let stream = || ctx.new_stream().map_err(CudaError::driver("stream creation"));
        Ok(Cuda {
            h2d: stream()?,
            d2h: stream()?,
            ctx: ctx.clone(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn name(&self) -> Result<String, CudaError> {
        self.ctx.name().map_err(CudaError::driver("cuDeviceGetName"))
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(u64, u64), CudaError> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(CudaError::driver("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }

    pub fn compute_capability(&self) -> Result<(i32, i32), CudaError> {
        self.ctx
            .compute_capability()
            .map_err(CudaError::driver("compute capability"))
    }

    /// Torch's current stream on this device, where compute runs (borrowed, not owned).
    pub fn compute_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        let raw = shim::current_stream(self.ordinal()).map_err(|e| CudaError::Driver {
            op: "torch current stream".into(),
            message: e.to_string(),
        })?;
        // SAFETY: torch's stream belongs to the primary context, which `ctx` retains;
        // torch keeps its streams alive for the whole process.
        Ok(unsafe { self.ctx.wrap_borrowed_stream(raw as sys::CUstream) })
    }

    /// An event that records timing (for the step breakdown).
    pub fn timed_event(&self) -> Result<CudaEvent, CudaError> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("event creation"))
    }

    /// Makes `waiter` wait for everything queued on `on` so far (no host blocking).
    pub fn order(&self, on: &CudaStream, waiter: &CudaStream) -> Result<(), CudaError> {
        waiter.join(on).map_err(CudaError::driver("stream ordering"))
    }

    /// Registers host memory for DMA with this context.
    pub fn pinner(&self) -> Pinner {
        Pinner {
            ctx: self.ctx.clone(),
        }
    }

    /// Queues a host→device copy of `src` to device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` must address at least `src.len()` writable device bytes, and `src` must stay
    /// alive and unchanged until `stream` has executed the copy.
    pub unsafe fn copy_h2d(&self, dst: u64, src: &[u8], stream: &CudaStream) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        result::memcpy_htod_async(dst, src, stream.cu_stream()).map_err(CudaError::driver("host→device copy"))
    }

    /// Queues a device→host copy from device address `src` into `dst` on `stream`.
    ///
    /// # Safety
    /// `src` must address at least `dst.len()` readable device bytes, and `dst` must stay
    /// alive and untouched until `stream` has executed the copy.
    pub unsafe fn copy_d2h(&self, dst: &mut [u8], src: u64, stream: &CudaStream) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        result::memcpy_dtoh_async(dst, src, stream.cu_stream()).map_err(CudaError::driver("device→host copy"))
    }

    /// Device memory of `bytes` bytes owned by cudarc (for benchmarks and staging).
    pub fn alloc(
        &self,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<cudarc::driver::CudaSlice<u8>, CudaError> {
        stream
            .alloc_zeros::<u8>(bytes)
            .map_err(CudaError::driver("device allocation"))
    }
}

/// Seconds between two recorded events (waits for both).
pub fn elapsed(start: &CudaEvent, end: &CudaEvent) -> Result<f64, CudaError> {
    let ms = start.elapsed_ms(end).map_err(CudaError::driver("event timing"))?;
    Ok(f64::from(ms) / 1e3)
}

/// Pins existing host memory with `cuMemHostRegister` (portable, not write-combined):
/// the CUDA layer's implementation of the offload pool's [`HostRegister`] hook.
pub struct Pinner {
    ctx: Arc<CudaContext>,
}

impl HostRegister for Pinner {
    fn register(&self, ptr: *mut u8, bytes: usize) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("bind context: {e}"))?;
        // SAFETY: the pool hands over a live allocation of `bytes` bytes that it keeps
        // until it calls `unregister`.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(|e| format!("cuMemHostRegister of {bytes} bytes: {e}"))
    }

    fn unregister(&self, ptr: *mut u8, _bytes: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `register` above.
            let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_every_entry_is_an_error_not_a_panic() {
        if driver().is_ok() {
            // a GPU machine: the entries work instead
            assert!(device_count().unwrap() > 0);
            assert!(Cuda::open(0).is_ok());
            return;
        }
        assert_eq!(device_count().unwrap_err(), CudaError::NoDriver);
        let e = Cuda::open(0).unwrap_err();
        assert!(
            e.to_string().contains("no CUDA driver") && e.to_string().contains("--devices"),
            "{e}"
        );
    }
}
