//! `Nccl`: collectives between GPUs over cudarc's raw NCCL API, on torch-owned memory.
//!
//! One communicator per device thread, created from the id the rendezvous shares. The
//! tensor calls ([`Nccl::all_gather_tensor`] …) run on the device's collective stream,
//! which first waits for torch's compute stream and which compute then waits for, so
//! results are ordered without blocking the host. The [`Collective`] impl serves the
//! engine's host buffers by staging them through device tensors.
//!
//! cudarc looks the library up as `libnccl.so`, which the pip wheel does not ship; the
//! build links `nccl/libnccl.so` next to the binary, and [`library`] repairs that link
//! on a machine where it dangles (from the `libnccl.so.2` torch already loaded).

use super::{rendezvous::ID_BYTES, Collective, CommError, Element, ReduceOp};
use crate::device::cuda::Cuda;
use crate::torch::shim;
use cudarc::nccl::{result, sys};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

/// Ok when NCCL can be loaded; otherwise the reason and the fix.
pub fn library() -> Result<(), String> {
    static FOUND: OnceLock<Result<(), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the library by name.
            if unsafe { sys::is_culib_present() } {
                return Ok(());
            }
            let repaired = repair_link();
            // SAFETY: as above.
            if unsafe { sys::is_culib_present() } {
                return Ok(());
            }
            Err(format!(
                "NCCL cannot be loaded as libnccl.so ({}); link torch's nvidia/nccl/lib/libnccl.so.2 as nccl/libnccl.so next to the tierzero binary",
                repaired
                    .err()
                    .unwrap_or_else(|| "the link beside the binary was created now; it is found from the next start".into())
            ))
        })
        .clone()
}

/// Points `<binary dir>/nccl/libnccl.so` at a `libnccl.so.2` this process can see.
fn repair_link() -> Result<(), String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mapped = |name: &str| {
        maps.lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.ends_with(name))
            .map(PathBuf::from)
    };
    let source = mapped("/libnccl.so.2")
        .or_else(|| {
            mapped("/libtorch_cpu.so").and_then(|t| {
                t.parent()
                    .map(|lib| lib.join("../../nvidia/nccl/lib/libnccl.so.2"))
            })
        })
        .filter(|p| p.exists())
        .ok_or("no libnccl.so.2 is loaded or beside torch")?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = exe.parent().ok_or("the binary has no directory")?.join("nccl");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&source, &link).map_err(|e| format!("{}: {e}", link.display()))
}

fn nccl_err(rank: usize, op: &'static str) -> impl FnOnce(result::NcclError) -> CommError {
    move |e| CommError::Shape {
        rank,
        op,
        message: format!("NCCL error {e:?}"),
    }
}

/// NCCL's version as (major, minor, patch).
pub fn version() -> Result<(i32, i32, i32), String> {
    library()?;
    let v = result::get_nccl_version().map_err(|e| format!("ncclGetVersion: {e:?}"))?;
    Ok((v / 10000, (v / 100) % 100, v % 100))
}

/// A fresh NCCL unique id (works without a GPU once the library loads).
pub fn unique_id() -> Result<[u8; ID_BYTES], String> {
    library()?;
    let id = result::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
    Ok(id.internal.map(|c| c as u8))
}

struct Comm(sys::ncclComm_t);
// SAFETY: the handle is only used under the Mutex in `Nccl`, one call at a time.
unsafe impl Send for Comm {}

/// One rank's NCCL communicator on one GPU.
pub struct Nccl {
    comm: Mutex<Comm>,
    rank: usize,
    world: usize,
    cuda: Arc<Cuda>,
}

impl Nccl {
    /// Joins the communicator `id` as `rank` of `world` (blocks until all ranks join).
    pub fn init(cuda: Arc<Cuda>, id: &[u8; ID_BYTES], world: usize, rank: usize) -> Result<Nccl, CommError> {
        library().map_err(|reason| CommError::Aborted { rank, reason })?;
        cuda.context().bind_to_thread().map_err(|e| CommError::Aborted {
            rank,
            reason: format!("bind CUDA context: {e}"),
        })?;
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new handle; the id came from ncclGetUniqueId.
        unsafe { result::comm_init_rank(&mut comm, world as i32, uid, rank as i32) }
            .map_err(nccl_err(rank, "ncclCommInitRank"))?;
        Ok(Nccl {
            comm: Mutex::new(Comm(comm)),
            rank,
            world,
            cuda,
        })
    }

    /// Queues `f(comm, stream)` on the collective stream, ordered after compute and
    /// before compute's next work.
    fn run(
        &self,
        op: &'static str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), CommError> {
        let fail = |reason: String| CommError::Aborted {
            rank: self.rank,
            reason,
        };
        let compute = self.cuda.compute_stream().map_err(|e| fail(e.to_string()))?;
        let stream = &self.cuda.comm;
        self.cuda
            .order(&compute, stream)
            .map_err(|e| fail(e.to_string()))?;
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.0.is_null() {
            return Err(fail("the communicator was aborted".into()));
        }
        f(comm.0, stream.cu_stream() as sys::cudaStream_t).map_err(nccl_err(self.rank, op))?;
        self.cuda.order(stream, &compute).map_err(|e| fail(e.to_string()))
    }

    fn check(&self, op: &'static str, ok: bool, message: String) -> Result<(), CommError> {
        if ok {
            Ok(())
        } else {
            Err(CommError::Shape {
                rank: self.rank,
                op,
                message,
            })
        }
    }

    /// `out` (world × shard) receives every rank's `shard` in rank order.
    pub fn all_gather_tensor(&self, shard: &Tensor, out: &mut Tensor) -> Result<(), CommError> {
        let n = shard.numel();
        self.check(
            "all_gather",
            out.numel() == n * self.world && out.kind() == shard.kind(),
            format!("shard of {n}, output of {}", out.numel()),
        )?;
        let (dtype, send, recv) = (self.dtype(shard)?, self.ptr(shard)?, self.ptr(out)?);
        // SAFETY: both buffers are live contiguous device tensors of the checked sizes.
        self.run("all_gather", |c, s| unsafe {
            result::all_gather(send as _, recv as _, n, dtype, c, s)
        })
    }

    /// Reduces `full` (world × out) across ranks; this rank keeps its slice in `out`.
    pub fn reduce_scatter_tensor(
        &self,
        full: &Tensor,
        out: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let n = out.numel();
        self.check(
            "reduce_scatter",
            full.numel() == n * self.world && out.kind() == full.kind(),
            format!("input of {}, output of {n}", full.numel()),
        )?;
        let (dtype, send, recv) = (self.dtype(full)?, self.ptr(full)?, self.ptr(out)?);
        // SAFETY: as in all_gather.
        self.run("reduce_scatter", |c, s| unsafe {
            result::reduce_scatter(send as _, recv as _, n, dtype, red_op(op), c, s)
        })
    }

    pub fn all_reduce_tensor(&self, data: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        let (n, dtype, ptr) = (data.numel(), self.dtype(data)?, self.ptr(data)?);
        // SAFETY: in place on a live contiguous device tensor.
        self.run("all_reduce", |c, s| unsafe {
            result::all_reduce(ptr as _, ptr as _, n, dtype, red_op(op), c, s)
        })
    }

    pub fn broadcast_tensor(&self, data: &mut Tensor, root: usize) -> Result<(), CommError> {
        let (n, dtype, ptr) = (data.numel(), self.dtype(data)?, self.ptr(data)?);
        // SAFETY: in place on a live contiguous device tensor.
        self.run("broadcast", |c, s| unsafe {
            result::broadcast(ptr as _, ptr as _, n, dtype, root as i32, c, s)
        })
    }

    fn ptr(&self, t: &Tensor) -> Result<u64, CommError> {
        let on_device = t.device() == Device::Cuda(self.cuda.ordinal());
        self.check(
            "collective",
            on_device,
            format!(
                "tensor on {:?}, communicator on cuda:{}",
                t.device(),
                self.cuda.ordinal()
            ),
        )?;
        shim::device_ptr(t).map_err(|e| CommError::Shape {
            rank: self.rank,
            op: "collective",
            message: e.to_string(),
        })
    }

    fn dtype(&self, t: &Tensor) -> Result<sys::ncclDataType_t, CommError> {
        use sys::ncclDataType_t::*;
        Ok(match t.kind() {
            Kind::Float => ncclFloat32,
            Kind::Double => ncclFloat64,
            Kind::BFloat16 => ncclBfloat16,
            Kind::Half => ncclFloat16,
            Kind::Int64 => ncclInt64,
            other => {
                return Err(CommError::Shape {
                    rank: self.rank,
                    op: "collective",
                    message: format!("NCCL does not move {other:?} here"),
                })
            }
        })
    }

    /// Host slice → a device tensor of the element's kind.
    fn stage<T: Element>(&self, data: &[T]) -> Result<Tensor, CommError> {
        let bytes = crate::torch::pod_bytes(data);
        Tensor::f_from_data_size(bytes, &[data.len() as i64], T::KIND)
            .and_then(|t| t.f_to(Device::Cuda(self.cuda.ordinal())))
            .map_err(|e| CommError::Aborted {
                rank: self.rank,
                reason: format!("staging to the GPU: {e}"),
            })
    }

    /// A zeroed device tensor for `len` elements of `T` (an output needs no upload).
    fn device_out<T: Element>(&self, len: usize) -> Result<Tensor, CommError> {
        Tensor::f_zeros([len as i64], (T::KIND, Device::Cuda(self.cuda.ordinal()))).map_err(|e| {
            CommError::Aborted {
                rank: self.rank,
                reason: format!("allocating on the GPU: {e}"),
            }
        })
    }

    fn unstage<T: Element>(&self, t: &Tensor, out: &mut [T]) -> Result<(), CommError> {
        let host = t.f_to(Device::Cpu).map_err(|e| CommError::Aborted {
            rank: self.rank,
            reason: format!("staging from the GPU: {e}"),
        })?;
        let n = out.len();
        host.f_copy_data_u8(crate::torch::pod_bytes_mut(out), n)
            .map_err(|e| CommError::Aborted {
                rank: self.rank,
                reason: format!("staging from the GPU: {e}"),
            })
    }
}

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError> {
        let s = self.stage(shard)?;
        let mut o = self.device_out::<T>(out.len())?;
        self.all_gather_tensor(&s, &mut o)?;
        self.unstage(&o, out)
    }

    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let f = self.stage(full)?;
        let mut o = self.device_out::<T>(out.len())?;
        self.reduce_scatter_tensor(&f, &mut o, op)?;
        self.unstage(&o, out)
    }

    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let mut d = self.stage(data)?;
        self.all_reduce_tensor(&mut d, op)?;
        self.unstage(&d, data)
    }

    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError> {
        let mut d = self.stage(data)?;
        self.broadcast_tensor(&mut d, root)?;
        self.unstage(&d, data)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0f32];
        self.all_reduce(&mut one, ReduceOp::Sum)
    }

    fn abort(&self, _reason: &str) {
        let mut comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if !comm.0.is_null() {
            // SAFETY: aborting a live communicator, which is then forgotten.
            let _ = unsafe { result::comm_abort(comm.0) };
            comm.0 = std::ptr::null_mut();
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        let comm = self.comm.get_mut().unwrap_or_else(|e| e.into_inner());
        if !comm.0.is_null() {
            // SAFETY: the communicator is ours and no call is in flight (we hold &mut).
            let _ = unsafe { result::comm_destroy(comm.0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_loads_and_makes_ids_without_a_gpu() {
        // NCCL comes with the pip torch wheel `make setup` installs; the id needs no GPU.
        library().unwrap();
        let (major, minor, _) = version().unwrap();
        assert!(major >= 2 && minor > 0, "{major}.{minor}");
        let (a, b) = (unique_id().unwrap(), unique_id().unwrap());
        assert_ne!(a, b);
        assert!(a.iter().any(|&x| x != 0));
    }
}
