//! `Nccl`: collectives between GPUs over cudarc's raw NCCL API, on torch-owned memory.
//!
//! One communicator per lane of each rank (main, gather, reduce), each bootstrapped
//! through c10d's TCPStore ([`Nccl::join`]: rank 0 of the communicator publishes a fresh
//! unique id under its name, the others read it). Every communicator of a GPU queues on
//! one stream, the GPU's collectives lane stream (`device/cuda.rs`): the collectives of
//! a rank are then one sequence on the device, in the order the rank issued them, which
//! is the same on every rank — two communicators' kernels in flight on two streams
//! could wait for each other across ranks. Called from the collectives lane (whose
//! current stream that is, ordered after compute by the lane), a collective just
//! queues; called from another thread, the stream first waits for that thread's current
//! stream, which then waits for the collective. The [`Collective`] impl serves the
//! engine's host buffers by staging them through device tensors.
//!
//! NCCL neither times out nor tells a rank that a peer died: a [`watchdog`] thread per
//! process aborts its communicators (ncclCommAbort, which unblocks a waiting stream)
//! when any rank publishes a failure in the store, or when one of its own collectives
//! makes no progress for the timeout (on the host, or on the device: an event recorded
//! after each collective tells when its kernel finished), which it then publishes for
//! the others.
//!
//! cudarc looks the library up as `libnccl.so`, which the pip wheel does not ship; the
//! build links `nccl/libnccl.so` next to the binary, and [`library`] repairs that link
//! on a machine where it dangles (from the `libnccl.so.2` torch already loaded).

use super::gloo::{Store, ABORT_KEY};
use super::{rendezvous::ID_BYTES, Collective, CommError, Element, ReduceOp};
use crate::device::cuda::{Cuda, LaneStream};
use crate::torch::shim;
use cudarc::driver::CudaEvent;
use cudarc::nccl::{result, sys};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

mod watchdog;
use watchdog::prune;
pub use watchdog::{watchdog, Watched};

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

/// The lock that serialises NCCL enqueues on GPU `ordinal` across its communicators.
fn device_lock(ordinal: usize) -> std::sync::MutexGuard<'static, ()> {
    static LOCKS: OnceLock<Vec<Mutex<()>>> = OnceLock::new();
    let locks = LOCKS.get_or_init(|| (0..64).map(|_| Mutex::new(())).collect());
    locks[ordinal % locks.len()]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The store key under which communicator `name`'s unique id is published.
fn id_key(name: &str) -> String {
    format!("tierzero/nccl/{name}/id")
}

/// The unique id of communicator `name`: rank 0 makes it with `make` and publishes it in
/// the store; every other rank waits for it, at most `timeout`.
pub fn share_id(
    store: &Store,
    name: &str,
    rank: usize,
    timeout: Duration,
    make: impl FnOnce() -> Result<[u8; ID_BYTES], String>,
) -> Result<[u8; ID_BYTES], String> {
    let key = id_key(name);
    if rank == 0 {
        let id = make()?;
        store.set(&key, &id)?;
        return Ok(id);
    }
    let bytes = store.wait_for(&key, ABORT_KEY, Instant::now() + timeout)?.ok_or_else(|| {
        format!(
            "rank 0 did not publish the {name} communicator's NCCL id within {timeout:?} (train.rendezvous_timeout)"
        )
    })?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| format!("{key} holds {} bytes, not an NCCL id of {ID_BYTES}", b.len()))
}

/// One rank's NCCL communicator on one GPU.
pub struct Nccl {
    comm: Mutex<Comm>,
    rank: usize,
    world: usize,
    cuda: Arc<Cuda>,
    /// The GPU's collectives stream, shared by its communicators.
    stream: LaneStream,
    /// Where failures are published (None for a communicator made without a store).
    store: Option<Arc<Store>>,
    /// The collective in flight on the host's behalf, and since when (for the watchdog).
    busy: Mutex<Option<(Instant, &'static str)>>,
    /// Collectives queued on the device and not known to be done: when each was queued,
    /// and the event recorded after it (so the watchdog sees a kernel that hangs).
    queued: Mutex<VecDeque<(Instant, &'static str, CudaEvent)>>,
    failed: Mutex<Option<String>>,
}

impl Nccl {
    /// Joins communicator `name` through the store as `rank` of `world` (blocks until
    /// every rank joins).
    pub fn join(
        store: Arc<Store>,
        name: &str,
        cuda: Arc<Cuda>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Nccl, CommError> {
        let id = share_id(&store, name, rank, timeout, unique_id)
            .map_err(|reason| CommError::Aborted { rank, reason })?;
        let mut nccl = Nccl::init(cuda, &id, world, rank)?;
        nccl.store = Some(store);
        Ok(nccl)
    }

    /// Eager connect: NCCL sets up the connections each kind of collective uses at its
    /// first call; one of each, at start-up, sets them up before the step's first
    /// collectives, so they are never made beside its kernels and the allocations of
    /// other ranks' threads in the process. Every rank calls it on its communicators
    /// in the same order, once the watchdog runs (`run/comms.rs`): a rank that fails
    /// here stops the others instead of leaving them waiting.
    pub fn connect(&self) -> Result<(), CommError> {
        let world = self.world;
        self.all_reduce(&mut [0f32], ReduceOp::Sum)?;
        self.all_gather(&[0f32], &mut vec![0f32; world])?;
        self.reduce_scatter(&vec![0f32; world], &mut [0f32], ReduceOp::Sum)
    }

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
        let stream = cuda.lane_stream("collectives").map_err(|e| CommError::Aborted {
            rank,
            reason: format!("the collectives stream: {e}"),
        })?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new handle; the id came from ncclGetUniqueId.
        unsafe { result::comm_init_rank(&mut comm, world as i32, uid, rank as i32) }
            .map_err(nccl_err(rank, "ncclCommInitRank"))?;
        Ok(Nccl {
            comm: Mutex::new(Comm(comm)),
            rank,
            world,
            cuda,
            stream,
            store: None,
            busy: Mutex::new(None),
            queued: Mutex::new(VecDeque::new()),
            failed: Mutex::new(None),
        })
    }

    /// Runs `f` (one host-visible collective) marked as busy for the watchdog; after an
    /// abort, fails with the published cause.
    fn watched<T>(&self, op: &'static str, f: impl FnOnce() -> Result<T, CommError>) -> Result<T, CommError> {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), op));
        let out = f();
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match (out, failed) {
            (Ok(v), None) => Ok(v),
            (_, Some(reason)) => Err(CommError::Aborted {
                rank: self.rank,
                reason,
            }),
            (Err(e), None) => Err(e),
        }
    }

    /// Aborts the communicator (in-flight work included) with `reason` as the cause its
    /// calls report from now on.
    fn abort_with(&self, reason: String) {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(reason);
        let mut comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if !comm.0.is_null() {
            // SAFETY: aborting a live communicator, which is then forgotten.
            let _ = unsafe { result::comm_abort(comm.0) };
            comm.0 = std::ptr::null_mut();
        }
    }

    /// Queues `f(comm, stream)` on the collectives stream, ordered after the calling
    /// thread's current stream and before its next work when that is another stream.
    fn run(
        &self,
        op: &'static str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), CommError> {
        let fail = |reason: String| CommError::Aborted {
            rank: self.rank,
            reason,
        };
        // one enqueue at a time per GPU, the stream ordering included: NCCL calls are
        // re-entrant, not thread-safe, and the chain compute → collective → compute must
        // not interleave with another thread's
        let _device = device_lock(self.cuda.ordinal());
        let current = self.cuda.current_stream().map_err(|e| fail(e.to_string()))?;
        // on the collectives lane the stream is already ordered after compute
        let other = !current.same(&self.stream);
        let stream = &self.stream.cuda;
        if other {
            self.cuda
                .order(&current.cuda, stream)
                .map_err(|e| fail(e.to_string()))?;
        }
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.0.is_null() {
            return Err(fail("the communicator was aborted".into()));
        }
        f(comm.0, stream.cu_stream() as sys::cudaStream_t).map_err(nccl_err(self.rank, op))?;
        let done = stream
            .record_event(None)
            .map_err(|e| fail(format!("recording {op}'s event: {e}")))?;
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        prune(&mut queued);
        queued.push_back((Instant::now(), op, done));
        drop(queued);
        if other {
            self.cuda
                .order(stream, &current.cuda)
                .map_err(|e| fail(e.to_string()))?;
        }
        Ok(())
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
    pub fn all_gather_device(&self, shard: &Tensor, out: &mut Tensor) -> Result<(), CommError> {
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
    pub fn reduce_scatter_device(
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

    pub fn all_reduce_device(&self, data: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        let (n, dtype, ptr) = (data.numel(), self.dtype(data)?, self.ptr(data)?);
        // SAFETY: in place on a live contiguous device tensor.
        self.run("all_reduce", |c, s| unsafe {
            result::all_reduce(ptr as _, ptr as _, n, dtype, red_op(op), c, s)
        })
    }

    pub fn broadcast_device(&self, data: &mut Tensor, root: usize) -> Result<(), CommError> {
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
        self.watched("all_gather", || {
            let s = self.stage(shard)?;
            let mut o = self.device_out::<T>(out.len())?;
            self.all_gather_device(&s, &mut o)?;
            self.unstage(&o, out)
        })
    }

    /// Device tensors straight to NCCL on this communicator's stream.
    fn all_gather_tensor(&self, shard: &Tensor, out: &Tensor) -> Result<(), CommError> {
        self.watched("all_gather", || {
            self.all_gather_device(shard, &mut out.shallow_clone())
        })
    }

    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.watched("reduce_scatter", || {
            let f = self.stage(full)?;
            let mut o = self.device_out::<T>(out.len())?;
            self.reduce_scatter_device(&f, &mut o, op)?;
            self.unstage(&o, out)
        })
    }

    fn reduce_scatter_tensor(&self, full: &Tensor, out: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.watched("reduce_scatter", || {
            self.reduce_scatter_device(full, &mut out.shallow_clone(), op)
        })
    }

    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.watched("all_reduce", || {
            let mut d = self.stage(data)?;
            self.all_reduce_device(&mut d, op)?;
            self.unstage(&d, data)
        })
    }

    /// A device tensor straight to NCCL on this communicator's stream.
    fn all_reduce_tensor(&self, data: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.watched("all_reduce", || {
            self.all_reduce_device(&mut data.shallow_clone(), op)
        })
    }

    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError> {
        self.watched("broadcast", || {
            let mut d = self.stage(data)?;
            self.broadcast_device(&mut d, root)?;
            self.unstage(&d, data)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0f32];
        self.all_reduce(&mut one, ReduceOp::Sum)
    }

    /// Aborts this communicator and publishes the cause, so every other process's
    /// watchdog aborts its own with it.
    fn abort(&self, reason: &str) {
        let reason = format!("rank {} stopped: {reason}", self.rank);
        if let Some(store) = &self.store {
            let _ = store.set(ABORT_KEY, reason.as_bytes());
        }
        self.abort_with(reason);
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
    use std::sync::atomic::{AtomicBool, Ordering};

    fn store_pair() -> (Arc<Store>, impl Fn() -> Arc<Store>) {
        let timeout = Duration::from_secs(10);
        let server = Store::serve_loopback(timeout).unwrap();
        let port = server.port().unwrap();
        (server, move || {
            Store::connect("127.0.0.1", port, false, timeout).unwrap()
        })
    }

    /// Three ranks, each with its own store connection, share two communicators' ids:
    /// every rank reads rank 0's id for each name; a rank whose rank 0 never publishes
    /// is told which id and which timeout; a published failure ends the wait with it.
    #[test]
    fn ids_are_shared_per_communicator_through_the_store() {
        let (server, client) = store_pair();
        let ids: Vec<Vec<[u8; ID_BYTES]>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let store = client();
                    s.spawn(move || {
                        ["main", "gather"]
                            .map(|name| {
                                share_id(&store, name, rank, Duration::from_secs(10), unique_id).unwrap()
                            })
                            .to_vec()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.iter().all(|r| *r == ids[0]), "every rank reads rank 0's ids");
        assert_ne!(ids[0][0], ids[0][1], "each communicator has its own id");
        let late = share_id(&client(), "reduce", 1, Duration::from_millis(200), unique_id).unwrap_err();
        assert!(
            late.contains("reduce") && late.contains("train.rendezvous_timeout"),
            "{late}"
        );
        server.set(ABORT_KEY, b"rank 0 stopped: out of memory").unwrap();
        let told = share_id(&client(), "other", 2, Duration::from_secs(10), unique_id).unwrap_err();
        assert_eq!(told, "rank 0 stopped: out of memory");
    }

    struct Fake {
        busy: Option<(Instant, &'static str)>,
        stopped: Mutex<Option<String>>,
    }

    impl Watched for Fake {
        fn busy_since(&self) -> Option<(Instant, &'static str)> {
            self.busy
        }
        fn stop(&self, reason: &str) {
            *self.stopped.lock().unwrap() = Some(reason.to_string());
        }
    }

    fn fake(busy: Option<(Instant, &'static str)>) -> Arc<Fake> {
        Arc::new(Fake {
            busy,
            stopped: Mutex::new(None),
        })
    }

    /// The watchdog (over a real store) stops every communicator with a failure another
    /// process published; publishes and stops on a collective stuck past the timeout,
    /// naming the rank and the collective; and ends once the communicators are dropped.
    #[test]
    fn the_watchdog_aborts_on_a_published_failure_or_a_stuck_collective() {
        let (server, client) = store_pair();
        let weak = |f: &Arc<Fake>| {
            let w: std::sync::Weak<dyn Watched> = Arc::downgrade(f) as _;
            w
        };
        // a stuck all_gather on rank 3
        let (idle, stuck) = (fake(None), fake(Some((Instant::now(), "all_gather"))));
        let dog = watchdog(
            client(),
            vec![(2, weak(&idle)), (3, weak(&stuck))],
            Duration::from_millis(300),
        );
        dog.join().unwrap();
        let published = String::from_utf8(server.try_get(ABORT_KEY).unwrap().unwrap()).unwrap();
        assert!(
            published.starts_with("rank 3: NCCL all_gather made no progress"),
            "{published}"
        );
        for f in [&idle, &stuck] {
            assert_eq!(f.stopped.lock().unwrap().as_deref(), Some(published.as_str()));
        }
        // that failure, as seen by another process's watchdog
        let other = fake(None);
        watchdog(client(), vec![(0, weak(&other))], Duration::from_secs(60))
            .join()
            .unwrap();
        assert_eq!(other.stopped.lock().unwrap().as_deref(), Some(published.as_str()));
        // nothing to watch: the thread ends
        let (_fresh_server, fresh) = store_pair();
        let gone = fake(None);
        let w = weak(&gone);
        drop(gone);
        let ended = Arc::new(AtomicBool::new(false));
        let flag = ended.clone();
        std::thread::spawn(move || {
            watchdog(fresh(), vec![(0, w)], Duration::from_secs(60))
                .join()
                .unwrap();
            flag.store(true, Ordering::SeqCst);
        })
        .join()
        .unwrap();
        assert!(ended.load(Ordering::SeqCst));
    }

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
