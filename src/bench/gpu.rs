//! `bench h2d` and `bench gpu`: what the GPU and its links offer, measured here.
//!
//! `h2d` times host→device and device→host copies with CUDA events on tierzero's copy
//! streams, from registered (pinned) and pageable host memory, one direction at a time
//! and both at once; beside them, in the same run, torch's own pinned `copy_`
//! (non-blocking, on its current stream), the rate the copy engines reach for torch.
//! `gpu` is the smoke check of a GPU machine: device, memory, a bf16 matmul, the bridge's
//! current stream, a pinned copy round trip, NCCL's version and a one-rank all-gather.

use crate::comm::nccl::{self, Nccl};
use crate::device::cuda::{self, Cuda, CudaError};
use crate::metrics::peak::matmul_flops;
use crate::torch::shim;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use tch::{Device, Kind, Tensor};
use tierzero_offload::host::AlignedBuf;
use tierzero_offload::pool::HostRegister;

#[derive(Debug, thiserror::Error)]
pub enum GpuBenchError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Other(String),
}

/// GB/s of one kind of copy.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Rates {
    pub h2d: f64,
    pub d2h: f64,
    /// Both directions at once: bytes moved in both ÷ wall time.
    pub duplex: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct H2dReport {
    pub device: String,
    pub size_mb: usize,
    pub pinned: Rates,
    pub pageable: Rates,
    /// torch's pinned non-blocking copy_ on the same machine (the copy-engine rate).
    pub torch_pinned: Rates,
    /// Why the torch baseline could not be measured, if it could not.
    pub torch_error: Option<String>,
    pub ratio_h2d: f64,
    pub ratio_d2h: f64,
}

impl H2dReport {
    pub fn human(&self) -> String {
        let row =
            |name: &str, r: &Rates| format!("{name:<16}{:>10.2}{:>10.2}{:>10.2}\n", r.h2d, r.d2h, r.duplex);
        let mut s = format!("{} · {} MB per copy · GB/s\n", self.device, self.size_mb);
        s += &format!("{:<16}{:>10}{:>10}{:>10}\n", "host memory", "H2D", "D2H", "both");
        s += &row("pinned", &self.pinned);
        s += &row("pageable", &self.pageable);
        s += &row("torch pinned", &self.torch_pinned);
        s += &format!(
            "ratio to torch: H2D {:.3}, D2H {:.3} (target ≥ 0.9)\n",
            self.ratio_h2d, self.ratio_d2h
        );
        if let Some(e) = &self.torch_error {
            s += &format!("torch baseline failed: {e}\n");
        }
        s
    }
}

/// Host memory registered with CUDA for as long as it lives.
struct Pinned<'a> {
    buf: AlignedBuf<u8>,
    pinner: cuda::Pinner,
    _cuda: &'a Cuda,
}

impl<'a> Pinned<'a> {
    fn new(cuda: &'a Cuda, bytes: usize) -> Result<Pinned<'a>, GpuBenchError> {
        let mut buf = AlignedBuf::<u8>::zeroed(bytes).map_err(|e| GpuBenchError::Other(e.to_string()))?;
        let pinner = cuda.pinner();
        let cap = buf.capacity_bytes();
        pinner
            .register(buf.as_mut_ptr(), cap)
            .map_err(GpuBenchError::Other)?;
        Ok(Pinned {
            buf,
            pinner,
            _cuda: cuda,
        })
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        let cap = self.buf.capacity_bytes();
        self.pinner.unregister(self.buf.as_mut_ptr(), cap);
    }
}

const REPS: usize = 10;

/// Seconds for `REPS` copies queued by `queue` on `stream`, timed by events.
fn timed(
    cuda: &Cuda,
    stream: &CudaStream,
    mut queue: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, GpuBenchError> {
    queue()?; // warm-up
    let (start, end) = (cuda.timed_event()?, cuda.timed_event()?);
    start.record(stream).map_err(CudaError::driver("event record"))?;
    for _ in 0..REPS {
        queue()?;
    }
    end.record(stream).map_err(CudaError::driver("event record"))?;
    Ok(cuda::elapsed(&start, &end)?)
}

fn device_addr(slice: &CudaSlice<u8>, stream: &Arc<CudaStream>) -> u64 {
    let (ptr, _sync) = slice.device_ptr(stream);
    ptr
}

/// Copy rates between `host` and the GPU on tierzero's streams.
fn rates(cuda: &Cuda, host: &mut [u8], other: &mut [u8], bytes: usize) -> Result<Rates, GpuBenchError> {
    let dev_a = cuda.alloc(bytes, &cuda.h2d)?;
    let dev_b = cuda.alloc(bytes, &cuda.d2h)?;
    cuda.h2d.synchronize().map_err(CudaError::driver("synchronize"))?;
    cuda.d2h.synchronize().map_err(CudaError::driver("synchronize"))?;
    let (a, b) = (device_addr(&dev_a, &cuda.h2d), device_addr(&dev_b, &cuda.d2h));
    let gb = (REPS * bytes) as f64 / 1e9;
    // the device buffers hold `bytes` bytes, the host slices outlive the copies, and each
    // timing waits for its stream before returning
    // SAFETY: as said above
    let h2d = timed(cuda, &cuda.h2d, || unsafe {
        cuda.copy_h2d(a, &host[..bytes], &cuda.h2d)
    })?;
    // SAFETY: as for h2d
    let d2h = timed(cuda, &cuda.d2h, || unsafe {
        cuda.copy_d2h(&mut other[..bytes], b, &cuda.d2h)
    })?;
    // both at once: one start event both streams wait for, one end event per stream
    let start = cuda.timed_event()?;
    start
        .record(&cuda.h2d)
        .map_err(CudaError::driver("event record"))?;
    cuda.d2h.wait(&start).map_err(CudaError::driver("stream wait"))?;
    for _ in 0..REPS {
        // SAFETY: as for h2d; the end events below wait for both streams
        unsafe {
            cuda.copy_h2d(a, &host[..bytes], &cuda.h2d)?;
            cuda.copy_d2h(&mut other[..bytes], b, &cuda.d2h)?;
        }
    }
    let (end_a, end_b) = (cuda.timed_event()?, cuda.timed_event()?);
    end_a
        .record(&cuda.h2d)
        .map_err(CudaError::driver("event record"))?;
    end_b
        .record(&cuda.d2h)
        .map_err(CudaError::driver("event record"))?;
    let both = cuda::elapsed(&start, &end_a)?.max(cuda::elapsed(&start, &end_b)?);
    Ok(Rates {
        h2d: gb / h2d,
        d2h: gb / d2h,
        duplex: 2.0 * gb / both,
    })
}

/// torch's pinned non-blocking copies, timed around a device synchronize.
fn torch_rates(ordinal: usize, bytes: usize) -> Result<Rates, GpuBenchError> {
    let n = bytes as i64;
    let host = Tensor::f_zeros([n], (Kind::Uint8, Device::Cpu))?.f_pin_memory(Device::Cuda(ordinal))?;
    let mut host_out =
        Tensor::f_zeros([n], (Kind::Uint8, Device::Cpu))?.f_pin_memory(Device::Cuda(ordinal))?;
    let mut dev = Tensor::f_zeros([n], (Kind::Uint8, Device::Cuda(ordinal)))?;
    let dev_src = Tensor::f_zeros([n], (Kind::Uint8, Device::Cuda(ordinal)))?;
    let gb = (REPS * bytes) as f64 / 1e9;
    let time = |f: &mut dyn FnMut() -> Result<(), tch::TchError>| -> Result<f64, GpuBenchError> {
        f()?;
        shim::synchronize(ordinal)?;
        let start = Instant::now();
        for _ in 0..REPS {
            f()?;
        }
        shim::synchronize(ordinal)?;
        Ok(start.elapsed().as_secs_f64())
    };
    let h2d = time(&mut || shim::copy_(&mut dev, &host, true))?;
    let d2h = time(&mut || shim::copy_(&mut host_out, &dev_src, true))?;
    Ok(Rates {
        h2d: gb / h2d,
        d2h: gb / d2h,
        duplex: 0.0,
    })
}

/// `tierzero bench h2d`.
pub fn h2d(size_mb: usize) -> Result<H2dReport, GpuBenchError> {
    h2d_on(0, size_mb)
}

/// [`h2d`] on the GPU of `ordinal`.
pub fn h2d_on(ordinal: usize, size_mb: usize) -> Result<H2dReport, GpuBenchError> {
    let cuda = Cuda::open(ordinal)?;
    let bytes = size_mb.max(1) << 20;
    let device = cuda.name()?;
    let pinned = {
        let mut a = Pinned::new(&cuda, bytes)?;
        let mut b = Pinned::new(&cuda, bytes)?;
        rates(&cuda, &mut a.buf, &mut b.buf, bytes)?
    };
    let pageable = {
        let mut a = vec![1u8; bytes];
        let mut b = vec![1u8; bytes];
        rates(&cuda, &mut a, &mut b, bytes)?
    };
    let (torch_pinned, torch_error) = match torch_rates(cuda.ordinal(), bytes) {
        Ok(r) => (r, None),
        Err(e) => (
            Rates {
                h2d: f64::NAN,
                d2h: f64::NAN,
                duplex: f64::NAN,
            },
            Some(e.to_string()),
        ),
    };
    Ok(H2dReport {
        device,
        size_mb,
        torch_error,
        ratio_h2d: pinned.h2d / torch_pinned.h2d,
        ratio_d2h: pinned.d2h / torch_pinned.d2h,
        pinned,
        pageable,
        torch_pinned,
    })
}

#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    pub device: String,
    pub compute_capability: (i32, i32),
    pub memory_total_gb: f64,
    pub memory_free_gb: f64,
    pub torch_cuda_available: bool,
    pub bf16_matmul_tflops: f64,
    pub current_stream: String,
    pub pinned_h2d_gb_s: f64,
    pub pinned_d2h_gb_s: f64,
    pub pinned_round_trip_ok: bool,
    pub nccl_version: String,
    pub nccl_one_rank_all_gather_ok: bool,
}

impl GpuReport {
    pub fn human(&self) -> String {
        format!(
            "device            {} (sm {}.{})\nmemory            {:.1} GB total, {:.1} GB free\ntorch CUDA        {}\nbf16 matmul       {:.1} TFLOP/s (8192³)\ncurrent stream    {}\npinned H2D / D2H  {:.2} / {:.2} GB/s (round trip {})\nNCCL              {} (one-rank all-gather {})\n",
            self.device,
            self.compute_capability.0,
            self.compute_capability.1,
            self.memory_total_gb,
            self.memory_free_gb,
            self.torch_cuda_available,
            self.bf16_matmul_tflops,
            self.current_stream,
            self.pinned_h2d_gb_s,
            self.pinned_d2h_gb_s,
            if self.pinned_round_trip_ok { "ok" } else { "WRONG" },
            self.nccl_version,
            if self.nccl_one_rank_all_gather_ok { "ok" } else { "WRONG" },
        )
    }
}

/// `tierzero bench gpu`.
pub fn gpu() -> Result<GpuReport, GpuBenchError> {
    let cuda = Arc::new(Cuda::open(0)?);
    let (free, total) = cuda.memory()?;
    let torch_cuda_available = tch::Cuda::is_available();
    let bf16 = matmul_flops(Device::Cuda(0), Kind::BFloat16, 8192, 20)?;
    let stream = shim::current_stream(0)?;
    // pinned round trip through the GPU on tierzero's streams
    let bytes = 64 << 20;
    let mut src = Pinned::new(&cuda, bytes)?;
    for (i, b) in src.buf.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut back = Pinned::new(&cuda, bytes)?;
    let r = rates(&cuda, &mut src.buf, &mut back.buf, bytes)?;
    let dev = cuda.alloc(bytes, &cuda.h2d)?;
    let addr = device_addr(&dev, &cuda.h2d);
    // SAFETY: `dev` holds `bytes` bytes; both host buffers outlive the synchronize below.
    unsafe {
        cuda.copy_h2d(addr, &src.buf[..bytes], &cuda.h2d)?;
        cuda.order(&cuda.h2d, &cuda.d2h)?;
        cuda.copy_d2h(&mut back.buf[..bytes], addr, &cuda.d2h)?;
    }
    cuda.d2h.synchronize().map_err(CudaError::driver("synchronize"))?;
    let pinned_round_trip_ok = src.buf[..bytes] == back.buf[..bytes];
    let (nccl_version, nccl_ok) = match nccl::version() {
        Ok((a, b, c)) => {
            let id = nccl::unique_id().map_err(GpuBenchError::Other)?;
            let comm =
                Nccl::init(cuda.clone(), &id, 1, 0).map_err(|e| GpuBenchError::Other(e.to_string()))?;
            let shard = Tensor::f_arange(1024, (Kind::BFloat16, Device::Cuda(0)))?;
            let mut out = Tensor::f_zeros([1024], (Kind::BFloat16, Device::Cuda(0)))?;
            comm.all_gather_device(&shard, &mut out)
                .map_err(|e| GpuBenchError::Other(e.to_string()))?;
            shim::synchronize(0)?;
            (format!("{a}.{b}.{c}"), out == shard)
        }
        Err(e) => (format!("unavailable: {e}"), false),
    };
    Ok(GpuReport {
        device: cuda.name()?,
        compute_capability: cuda.compute_capability()?,
        memory_total_gb: total as f64 / 1e9,
        memory_free_gb: free as f64 / 1e9,
        torch_cuda_available,
        bf16_matmul_tflops: bf16 / 1e12,
        current_stream: format!("{:p}", stream.raw),
        pinned_h2d_gb_s: r.h2d,
        pinned_d2h_gb_s: r.d2h,
        pinned_round_trip_ok,
        nccl_version,
        nccl_one_rank_all_gather_ok: nccl_ok,
    })
}
