//! Ranks in several processes: torch's c10d — a `TCPStore` (served by node 0, or by
//! torchrun's agent) and one `ProcessGroupGloo` per communicator — through the C++ bridge
//! `src/torch/c10d.cpp`.
//!
//! Each collective wraps the caller's host slices as CPU tensors (no copy), queues the
//! Gloo operation and waits for its work handle on the calling thread: the engine calls
//! collectives from its lanes, so the waits happen on the gather and reduce lanes.
//! Averages are Gloo sums scaled here, as `Local` scales them (bit-identical between two
//! ranks; Gloo sums three or more in ring order, so they may differ in the last bits).
//! An abort marks this communicator failed and publishes the reason in the store, so a
//! peer whose collective fails (its connection to this process closed) names the cause.

use super::{C10dError, Collective, CommError, Element, ReduceOp};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::{Device, Tensor};
use torch_sys::C_tensor;

const ERR_LEN: usize = 1024;

/// Held while a collective is queued on any group of this process (not while it runs).
/// torch 2.11's flight recorder, a process-wide singleton on by default
/// (`TORCH_FR_BUFFER_SIZE`), records each queued collective and inserts a group's status
/// into its map before taking its own lock (`FlightRecorder::recordWithResetEnabled`):
/// the first collectives of two groups queued at once from two threads (the ranks of one
/// process) corrupted that map and crashed in `_Rb_tree_insert_and_rebalance`, in about
/// one run in seven of `ranks_of_one_process_through_a_loopback_store_train_the_bits_of_local`.
static QUEUEING: Mutex<()> = Mutex::new(());
/// Where an aborting rank leaves its reason.
/// Where a failing rank publishes its cause for every process (Gloo and NCCL alike).
pub(crate) const ABORT_KEY: &str = "tierzero/abort";

extern "C" {
    fn tz_store_new(
        host: *const c_char,
        port: u16,
        is_server: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_store_free(store: *mut c_void);
    fn tz_store_port(store: *mut c_void, out: *mut u16, err: *mut c_char, n: usize) -> c_int;
    fn tz_store_set(
        store: *mut c_void,
        key: *const c_char,
        value: *const u8,
        len: usize,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_store_add(
        store: *mut c_void,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_store_check(
        store: *mut c_void,
        key: *const c_char,
        out: *mut c_int,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_store_get(
        store: *mut c_void,
        key: *const c_char,
        out: *mut u8,
        cap: usize,
        len: *mut usize,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_gloo_new(
        store: *mut c_void,
        prefix: *const c_char,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_gloo_free(group: *mut c_void);
    fn tz_gloo_all_gather(
        group: *mut c_void,
        out: *mut C_tensor,
        input: *mut C_tensor,
        work: *mut *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_gloo_reduce_scatter(
        group: *mut c_void,
        out: *mut C_tensor,
        input: *mut C_tensor,
        op: c_int,
        work: *mut *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_gloo_all_reduce(
        group: *mut c_void,
        data: *mut C_tensor,
        op: c_int,
        work: *mut *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_gloo_broadcast(
        group: *mut c_void,
        data: *mut C_tensor,
        root: c_int,
        work: *mut *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    fn tz_gloo_barrier(group: *mut c_void, work: *mut *mut c_void, err: *mut c_char, n: usize) -> c_int;
    fn tz_work_wait(work: *mut c_void, err: *mut c_char, n: usize) -> c_int;
    fn tz_work_free(work: *mut c_void);
}

/// Runs one bridge call with an error buffer; a non-zero return becomes its message
/// (the first line of torch's exception text).
fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), C10dError> {
    let mut err = [0 as c_char; ERR_LEN];
    if f(err.as_mut_ptr(), ERR_LEN) == 0 {
        return Ok(());
    }
    // SAFETY: the bridge writes a NUL-terminated string of at most ERR_LEN bytes.
    let message = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
    Err(C10dError::Torch(message.lines().next().unwrap_or("").to_string()))
}

fn c_string(s: &str) -> Result<CString, C10dError> {
    CString::new(s).map_err(|_| C10dError::Nul(s.to_string()))
}

/// A c10d `TCPStore`: the server (node 0 without torchrun) or a client of it. Every key
/// lives under the incarnation's scope ([`incarnation_scope`]): torchrun's agent store
/// outlives a restart of its workers, and the new ones must not read what the dead ones
/// published (torch's own process groups scope their keys the same way).
pub struct Store {
    raw: *mut c_void,
    scope: String,
}

/// The key prefix of this incarnation of a torchrun worker group: `restart-N/` under
/// `TORCHELASTIC_RESTART_COUNT` (0 for the first launch, N after the N-th restart),
/// nothing outside torchrun.
pub fn incarnation_scope() -> String {
    std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or_else(String::new, |n| format!("restart-{n}/"))
}

// SAFETY: c10d's TCPStore is safe to use from several threads (its client serialises
// requests under a lock); the handle is only freed on drop.
unsafe impl Send for Store {}
// SAFETY: as for Send: shared use goes through the client's lock.
unsafe impl Sync for Store {}

impl Store {
    /// The store at `host:port`, served here when `serve`; connecting retries until
    /// `timeout`, then fails naming the address.
    pub fn connect(host: &str, port: u16, serve: bool, timeout: Duration) -> Result<Arc<Store>, C10dError> {
        let c_host = c_string(host)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid C string and out-pointer.
        call(|e, n| unsafe {
            tz_store_new(
                c_host.as_ptr(),
                port,
                c_int::from(serve),
                timeout.as_millis() as i64,
                &mut raw,
                e,
                n,
            )
        })
        .map_err(|e| C10dError::Connect {
            role: if serve { "serve" } else { "reach" },
            host: host.to_string(),
            port,
            cause: Box::new(e),
        })?;
        Ok(Arc::new(Store {
            raw,
            scope: incarnation_scope(),
        }))
    }

    /// `key` under this store's scope, as a C string.
    fn key(&self, key: &str) -> Result<CString, C10dError> {
        c_string(&format!("{}{key}", self.scope))
    }

    /// Serves a store on a port of the loopback interface that the system picks (no
    /// window between choosing the port and binding it); [`Store::port`] tells which.
    pub fn serve_loopback(timeout: Duration) -> Result<Arc<Store>, C10dError> {
        Store::connect("127.0.0.1", 0, true, timeout)
    }

    /// The port this store serves or reaches.
    pub fn port(&self) -> Result<u16, C10dError> {
        let mut out = 0u16;
        // SAFETY: valid handle and out-pointer.
        call(|e, n| unsafe { tz_store_port(self.raw, &mut out, e, n) })?;
        Ok(out)
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), C10dError> {
        let key = self.key(key)?;
        // SAFETY: valid handle, C string and byte slice.
        call(|e, n| unsafe { tz_store_set(self.raw, key.as_ptr(), value.as_ptr(), value.len(), e, n) })
    }

    /// Adds `delta` to the counter at `key` (0 when unset) and returns the sum, atomically
    /// across processes.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, C10dError> {
        let c_key = self.key(key)?;
        let mut out = 0i64;
        // SAFETY: valid handle, C string and out-pointer.
        call(|e, n| unsafe { tz_store_add(self.raw, c_key.as_ptr(), delta, &mut out, e, n) })?;
        Ok(out)
    }

    /// The value of `key` if some process set it (no waiting).
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, C10dError> {
        let c_key = self.key(key)?;
        let mut present: c_int = 0;
        // SAFETY: valid handle, C string and out-pointer.
        call(|e, n| unsafe { tz_store_check(self.raw, c_key.as_ptr(), &mut present, e, n) })?;
        if present == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; 4096];
        let mut len = 0usize;
        // SAFETY: `buf` has `buf.len()` bytes of room; `len` receives the full length.
        call(|e, n| unsafe {
            tz_store_get(
                self.raw,
                c_key.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
                e,
                n,
            )
        })?;
        buf.truncate(len.min(4096));
        Ok(Some(buf))
    }

    /// Waits for `key` to be set, polling: its value; `Err` with the text a failing
    /// process left under `stop` meanwhile; `Ok(None)` once `deadline` has passed.
    pub fn wait_for(&self, key: &str, stop: &str, deadline: Instant) -> Result<Option<Vec<u8>>, C10dError> {
        loop {
            if let Some(reason) = self.try_get(stop)? {
                return Err(C10dError::Stopped(String::from_utf8_lossy(&reason).into_owned()));
            }
            if let Some(value) = self.try_get(key)? {
                return Ok(Some(value));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A free TCP port on the loopback interface, for a store this process serves.
pub fn free_loopback_port() -> std::io::Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()
        .map(|a| a.port())
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: created by tz_store_new, freed once.
        unsafe { tz_store_free(self.raw) }
    }
}

/// One rank's Gloo communicator.
pub struct Gloo {
    raw: *mut c_void,
    store: Arc<Store>,
    rank: usize,
    world: usize,
    failed: Mutex<Option<String>>,
}

// SAFETY: ProcessGroupGloo queues work from any thread under its own lock; the handle is
// only freed on drop.
unsafe impl Send for Gloo {}
// SAFETY: as for Send: shared use goes through the process group's lock.
unsafe impl Sync for Gloo {}

/// A host slice seen as a 1-D CPU tensor of its element kind, sharing its memory.
///
/// # Safety
/// The slice must outlive the tensor and every operation on it (the callers wait for the
/// collective before returning).
unsafe fn blob<T: Element>(data: &[T]) -> Tensor {
    // SAFETY: the pointer and length describe `data`, which the caller keeps alive
    unsafe {
        Tensor::from_blob(
            data.as_ptr().cast(),
            &[data.len() as i64],
            &[1],
            T::KIND,
            Device::Cpu,
        )
    }
}

/// As [`blob`], for a slice the collective writes.
///
/// # Safety
/// As [`blob`]; nothing else reads or writes the slice until the collective finished.
unsafe fn blob_mut<T: Element>(data: &mut [T]) -> Tensor {
    let ptr: *mut T = data.as_mut_ptr();
    // SAFETY: the pointer and length describe `data`, which the caller keeps alive and
    // leaves to the collective
    unsafe { Tensor::from_blob(ptr as *const u8, &[data.len() as i64], &[1], T::KIND, Device::Cpu) }
}

impl Gloo {
    /// Rank `rank` of `world` on communicator `name` (its keys under `tierzero/<name>/`
    /// in the store's scope).
    /// Blocks until every rank has joined, at most `timeout`, which also bounds each
    /// collective (a peer that stops answering fails it with the cause).
    pub fn join(
        store: Arc<Store>,
        name: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Gloo, C10dError> {
        let prefix = store.key(&format!("tierzero/{name}"))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid store handle, C string and out-pointer.
        call(|e, n| unsafe {
            tz_gloo_new(
                store.raw,
                prefix.as_ptr(),
                rank as c_int,
                world as c_int,
                timeout.as_millis() as i64,
                &mut raw,
                e,
                n,
            )
        })
        .map_err(|e| C10dError::Join {
            rank,
            name: name.to_string(),
            world,
            cause: Box::new(e),
        })?;
        Ok(Gloo {
            raw,
            store,
            rank,
            world,
            failed: Mutex::new(None),
        })
    }

    fn aborted(&self, reason: String) -> CommError {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        let reason = failed.get_or_insert(reason).clone();
        CommError::Aborted {
            rank: self.rank,
            reason,
        }
    }

    fn check(&self) -> Result<(), CommError> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match failed {
            Some(reason) => Err(self.aborted(reason)),
            None => Ok(()),
        }
    }

    /// Queues one operation with `queue` and waits for it; a failure names a peer's
    /// published reason when there is one.
    fn run(
        &self,
        op: &str,
        queue: impl FnOnce(*mut *mut c_void, *mut c_char, usize) -> c_int,
    ) -> Result<(), CommError> {
        self.check()?;
        let mut work = std::ptr::null_mut();
        let queued = {
            let _one_at_a_time = QUEUEING.lock().unwrap_or_else(|e| e.into_inner());
            call(|e, n| queue(&mut work, e, n))
        };
        let result = queued.and_then(|()| {
            // SAFETY: `work` was created by the queue call above; freed once below.
            let waited = call(|e, n| unsafe { tz_work_wait(work, e, n) });
            // SAFETY: as above; `work` is not used after this
            unsafe { tz_work_free(work) };
            waited
        });
        result.map_err(|e| {
            let cause = match self.store.try_get(ABORT_KEY) {
                Ok(Some(reason)) => format!("{} (after: {e})", String::from_utf8_lossy(&reason)),
                _ => match self.silent_ranks() {
                    Some(silent) => format!("rank {silent} exited or stopped answering ({op}: {e})"),
                    None => format!("{op} failed: {e}"),
                },
            };
            self.aborted(cause)
        })
    }

    /// After a failed collective: every rank that sees the failure says so in the store;
    /// the ranks that have not within a few seconds are the ones that died (a killed
    /// process cannot say anything). None when every rank answered.
    fn silent_ranks(&self) -> Option<String> {
        let _ = self.store.set(&format!("tierzero/failed/{}", self.rank), b"1");
        let start = Instant::now();
        loop {
            let silent: Vec<String> = (0..self.world)
                .filter(|r| !matches!(self.store.try_get(&format!("tierzero/failed/{r}")), Ok(Some(_))))
                .map(|r| r.to_string())
                .collect();
            if silent.is_empty() {
                return None;
            }
            if start.elapsed() > Duration::from_secs(3) {
                return Some(silent.join(", rank "));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn shape(&self, op: &'static str, message: String) -> CommError {
        CommError::Shape {
            rank: self.rank,
            op,
            message,
        }
    }
}

/// Runs `join` for each of `ranks` on a thread of its own and returns their results in
/// order: ranks of one process must join at once, since each join waits for all ranks.
pub fn join_concurrently<T: Send>(
    ranks: std::ops::Range<usize>,
    join: impl Fn(usize) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    let join = &join;
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.map(|rank| s.spawn(move || join(rank))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank panicked while joining".into()))
            })
            .collect()
    })
}

impl Drop for Gloo {
    fn drop(&mut self) {
        // SAFETY: created by tz_gloo_new, freed once.
        unsafe { tz_gloo_free(self.raw) }
    }
}

fn op_code(op: ReduceOp) -> c_int {
    // averages are sums scaled by the caller (Gloo has no average)
    match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
    }
}

fn scale_average<T: Element>(data: &mut [T], op: ReduceOp, world: usize) {
    if op == ReduceOp::Avg {
        let by = 1.0 / world as f64;
        for x in data {
            *x = x.scale(by);
        }
    }
}

impl Collective for Arc<Gloo> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError> {
        if out.len() != shard.len() * self.world {
            return Err(self.shape(
                "all_gather",
                format!("{} elements for {} × {}", out.len(), self.world, shard.len()),
            ));
        }
        // SAFETY: both slices outlive the wait in `run`.
        let (input, mut output) = unsafe { (blob(shard), blob_mut(out)) };
        // SAFETY: a live process group, tensors over slices that outlive the wait in `run`,
        // and the out-pointers `run` gives
        self.run("all_gather", |w, e, n| unsafe {
            tz_gloo_all_gather(
                self.raw,
                output.as_mut_ptr(),
                input.as_ptr() as *mut C_tensor,
                w,
                e,
                n,
            )
        })
    }

    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        if full.len() != out.len() * self.world {
            return Err(self.shape(
                "reduce_scatter",
                format!("{} elements for {} × {}", full.len(), self.world, out.len()),
            ));
        }
        // SAFETY: both slices outlive the wait in `run`.
        let (input, mut output) = unsafe { (blob(full), blob_mut(out)) };
        // SAFETY: a live process group, tensors over slices that outlive the wait in `run`,
        // and the out-pointers `run` gives
        self.run("reduce_scatter", |w, e, n| unsafe {
            tz_gloo_reduce_scatter(
                self.raw,
                output.as_mut_ptr(),
                input.as_ptr() as *mut C_tensor,
                op_code(op),
                w,
                e,
                n,
            )
        })?;
        scale_average(out, op, self.world);
        Ok(())
    }

    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        // SAFETY: the slice outlives the wait in `run`.
        let mut tensor = unsafe { blob_mut(data) };
        // SAFETY: a live process group, tensors over slices that outlive the wait in `run`,
        // and the out-pointers `run` gives
        self.run("all_reduce", |w, e, n| unsafe {
            tz_gloo_all_reduce(self.raw, tensor.as_mut_ptr(), op_code(op), w, e, n)
        })?;
        scale_average(data, op, self.world);
        Ok(())
    }

    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError> {
        // SAFETY: the slice outlives the wait in `run`.
        let mut tensor = unsafe { blob_mut(data) };
        // SAFETY: a live process group, tensors over slices that outlive the wait in `run`,
        // and the out-pointers `run` gives
        self.run("broadcast", |w, e, n| unsafe {
            tz_gloo_broadcast(self.raw, tensor.as_mut_ptr(), root as c_int, w, e, n)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        // SAFETY: a live process group, tensors over slices that outlive the wait in `run`,
        // and the out-pointers `run` gives
        self.run("barrier", |w, e, n| unsafe { tz_gloo_barrier(self.raw, w, e, n) })
    }

    fn abort(&self, reason: &str) {
        let reason = format!("rank {} stopped: {reason}", self.rank);
        let _ = self.aborted(reason.clone());
        let _ = self.store.set(ABORT_KEY, reason.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::Local;

    /// What every collective leaves on each rank.
    type Outcome = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f64>, Vec<u16>);

    fn exercise<C: Collective>(c: &C) -> Outcome {
        let r = c.rank() as f32;
        let world = c.world();
        let mut gathered = vec![0f32; 3 * world];
        c.all_gather(&[r, r + 0.25, r * 3.0], &mut gathered).unwrap();
        let full: Vec<f32> = (0..5 * world).map(|i| (i as f32 * 0.37 + r).sin()).collect();
        let mut mine = vec![0f32; 5];
        c.reduce_scatter(&full, &mut mine, ReduceOp::Avg).unwrap();
        let mut summed = full.clone();
        c.all_reduce(&mut summed, ReduceOp::Sum).unwrap();
        let mut loss = vec![f64::from(r) + 0.1];
        c.all_reduce(&mut loss, ReduceOp::Avg).unwrap();
        let mut bits = vec![c.rank() as u16 + 7; 4];
        c.broadcast(&mut bits, world - 1).unwrap();
        c.barrier().unwrap();
        (gathered, mine, summed, loss, bits)
    }

    /// Two ranks over a real TCPStore and ProcessGroupGloo compute `Local`'s bits.
    #[test]
    fn two_gloo_ranks_compute_the_bits_of_local() {
        let timeout = Duration::from_secs(30);
        // served on a port the system picks; the client reaches it by the port it reports
        let server = Store::serve_loopback(timeout).unwrap();
        let port = server.port().unwrap();
        assert_ne!(port, 0);
        let gloo: Vec<Outcome> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let store = if rank == 0 {
                        server.clone()
                    } else {
                        Store::connect("127.0.0.1", port, false, timeout).unwrap()
                    };
                    s.spawn(move || exercise(&Arc::new(Gloo::join(store, "test", rank, 2, timeout).unwrap())))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let local: Vec<Outcome> = std::thread::scope(|s| {
            let handles: Vec<_> = Local::group(2)
                .into_iter()
                .map(|c| s.spawn(move || exercise(&c)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(gloo, local);
    }

    #[test]
    fn an_abort_fails_later_collectives_with_its_reason_and_publishes_it() {
        let timeout = Duration::from_secs(30);
        let store = Store::serve_loopback(timeout).unwrap();
        let solo = Arc::new(Gloo::join(store.clone(), "solo", 0, 1, timeout).unwrap());
        solo.barrier().unwrap();
        solo.abort("the disk is full");
        let e = solo.barrier().unwrap_err().to_string();
        assert!(e.contains("the disk is full"), "{e}");
        let published = store.try_get(ABORT_KEY).unwrap().unwrap();
        assert!(String::from_utf8_lossy(&published).contains("rank 0 stopped: the disk is full"));
        assert_eq!(store.try_get("tierzero/absent").unwrap(), None);
    }
}
