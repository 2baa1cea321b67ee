//! `Cuda`: one GPU through cudarc's driver API, loaded at run time.
//!
//! The binary starts on machines with no driver: every entry first checks that
//! `libcuda` can be loaded ([`driver`]) and returns [`CudaError::NoDriver`] otherwise,
//! because cudarc panics when it cannot find the library. Compute runs on torch's
//! current stream (borrowed through the bridge); the lanes (host→device copies,
//! collectives) run on streams of torch's pool, ordered against compute by events.
//! cudarc retains the primary context, the one torch uses, so pointers are shared.
//!
//! Lane streams are one per lane name and GPU in the process ([`Cuda::lane_stream`],
//! whichever handle asks): the collectives lane's stream is also the
//! one each NCCL communicator of that GPU queues on, so a rank's collectives are one
//! sequence on the device. [`CudaStreams`] gives them to the lanes (`lanes.rs`) with
//! cudarc events as their marks.
//!
//! Host memory the copy engines read is allocated by the offload crate (page-aligned)
//! and registered here ([`Pinner`], `cuMemHostRegister`), never allocated write-combined:
//! the CPU optimizer reads the same memory at full speed.

use super::lanes::{DeviceMark, Mark, Stream, Streams};
use super::DeviceError;
use crate::torch::shim::{self, TorchStream};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
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
    /// A failed call through torch's bridge.
    pub fn torch(op: &str) -> impl FnOnce(tch::TchError) -> CudaError + '_ {
        move |e| CudaError::Driver {
            op: op.to_string(),
            message: e.to_string(),
        }
    }

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

/// One GPU: its context, and two streams of its own for the copy benchmarks (`bench
/// gpu`); the lanes' streams come from [`Cuda::lane_stream`].
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

    /// The process's handle on GPU `ordinal`, opened once: every user (a rank's lanes,
    /// its NCCL communicators, the pinned-memory registration) gets the same streams.
    pub fn shared(ordinal: usize) -> Result<Arc<Cuda>, CudaError> {
        static OPENED: Mutex<Vec<(usize, Arc<Cuda>)>> = Mutex::new(Vec::new());
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, cuda)) = opened.iter().find(|(o, _)| *o == ordinal) {
            return Ok(cuda.clone());
        }
        let cuda = Arc::new(Cuda::open(ordinal)?);
        opened.push((ordinal, cuda.clone()));
        Ok(cuda)
    }

    /// The stream lane `name` runs on: one of torch's pool streams (non-blocking: ordered
    /// against compute only by events), the same one for this GPU and name at every call
    /// in the process, whichever handle asks.
    pub fn lane_stream(&self, name: &'static str) -> Result<LaneStream, CudaError> {
        static LANES: Mutex<Vec<((usize, &'static str), TorchStream)>> = Mutex::new(Vec::new());
        let mut lanes = LANES.lock().unwrap_or_else(|e| e.into_inner());
        let key = (self.ordinal(), name);
        if let Some((_, torch)) = lanes.iter().find(|(k, _)| *k == key) {
            return Ok(self.wrap(*torch));
        }
        // the collectives a step waits on go first when both are ready
        let high = name == "collectives";
        let torch =
            shim::stream_from_pool(self.ordinal(), high).map_err(CudaError::torch("torch pool stream"))?;
        lanes.push((key, torch));
        Ok(self.wrap(torch))
    }

    /// Torch's current stream of the calling thread.
    pub fn current_stream(&self) -> Result<LaneStream, CudaError> {
        let torch = shim::current_stream(self.ordinal()).map_err(CudaError::torch("torch current stream"))?;
        Ok(self.wrap(torch))
    }

    fn wrap(&self, torch: TorchStream) -> LaneStream {
        // SAFETY: torch's streams belong to the primary context, which `ctx` retains, and
        // torch keeps them for the whole process.
        let cuda = unsafe { self.ctx.wrap_borrowed_stream(torch.raw as sys::CUstream) };
        LaneStream {
            ordinal: self.ordinal(),
            torch,
            cuda,
        }
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
        // SAFETY: the caller's contract above: `dst` has room and `src` outlives the copy
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(CudaError::driver("host→device copy"))
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
        // SAFETY: the caller's contract above: `src` is readable and `dst` outlives the copy
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
            .map_err(CudaError::driver("device→host copy"))
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

/// A stream of torch's on one GPU, as torch and as cudarc see it.
pub struct LaneStream {
    ordinal: usize,
    torch: TorchStream,
    pub cuda: Arc<CudaStream>,
}

impl LaneStream {
    /// Whether both name the same stream.
    pub fn same(&self, other: &LaneStream) -> bool {
        self.torch.raw == other.torch.raw
    }
}

impl Stream for LaneStream {
    fn enter(&self) -> Result<(), DeviceError> {
        shim::set_current_stream(self.ordinal, self.torch).map_err(CudaError::torch("set current stream"))?;
        // the driver calls of this thread (events, NCCL) go to the same context
        self.cuda
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        Ok(())
    }

    fn mark(&self) -> Result<Mark, DeviceError> {
        let event = self
            .cuda
            .record_event(None)
            .map_err(CudaError::driver("cuEventRecord"))?;
        Ok(Arc::new(CudaMark(event)))
    }

    fn timed_mark(&self) -> Result<Mark, DeviceError> {
        let event = self
            .cuda
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("cuEventRecord"))?;
        Ok(Arc::new(CudaMark(event)))
    }

    fn wait(&self, mark: &Mark) -> Result<(), DeviceError> {
        let Some(CudaMark(event)) = mark.as_any().downcast_ref::<CudaMark>() else {
            return Err(DeviceError::ForeignMark);
        };
        self.cuda
            .wait(event)
            .map_err(CudaError::driver("cuStreamWaitEvent"))?;
        Ok(())
    }

    /// A spinning kernel (torch's `at::cuda::sleep`) on the thread's current stream of
    /// this GPU, which is this one on its lane's worker; ~1.5 GHz clocks assumed.
    fn delay(&self, micros: u64) -> Result<(), DeviceError> {
        shim::device_sleep(self.ordinal, micros.saturating_mul(1500))
            .map_err(CudaError::torch("device sleep"))?;
        Ok(())
    }
}

/// A lane mark: a cudarc event (timing disabled).
pub struct CudaMark(CudaEvent);

impl DeviceMark for CudaMark {
    fn query(&self) -> bool {
        // an error is not done: the host wait reports it
        let _ = self.0.context().bind_to_thread();
        self.0.try_is_complete().unwrap_or(false)
    }

    /// Polls rather than spins (an event's host wait spins a core otherwise, which the
    /// CPU optimizer needs).
    fn synchronize(&self) -> Result<(), DeviceError> {
        let _ = self.0.context().bind_to_thread();
        let mut pause = Duration::from_micros(5);
        while !self
            .0
            .try_is_complete()
            .map_err(CudaError::driver("waiting for the GPU"))?
        {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(200));
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Both marks timed (`timed_mark`); None otherwise, or on an error of the device's.
    fn seconds_since(&self, earlier: &Mark) -> Option<f64> {
        let earlier = earlier.as_any().downcast_ref::<CudaMark>()?;
        elapsed(&earlier.0, &self.0).ok()
    }
}

/// A rank's streams on one GPU, for its lanes.
pub struct CudaStreams(pub Arc<Cuda>);

impl Streams for CudaStreams {
    fn current(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        Ok(Arc::new(self.0.current_stream()?))
    }

    fn lane(&self, name: &'static str) -> Result<Arc<dyn Stream>, DeviceError> {
        Ok(Arc::new(self.0.lane_stream(name)?))
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
