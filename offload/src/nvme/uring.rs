//! The io_uring engine: O_DIRECT files, registered fixed buffers, requests split into
//! `block_size` pieces with up to `queue_depth` of them in flight per ring.
//!
//! Each ring has one thread that owns it: it takes operations from a channel, keeps the
//! submission queue full (`single_submit`: one `io_uring_enter` per piece, as DeepSpeed's
//! option of that name; otherwise one per batch), and reaps completions as they arrive
//! (`overlap_events`) or a whole batch at a time. Each ring starts with a sparse table of
//! [`FIXED_SLOTS`] fixed buffers; the pool the engine was built with, and every pool
//! registered later ([`BlockIo::register_pool`], as the trainer makes its pools), fill
//! slots of it, and buffers leased from them go through `READ_FIXED`/`WRITE_FIXED` (pages
//! pinned once, when registered: no page pinning per O_DIRECT request). Other buffers use
//! plain `READ`/`WRITE`. A registered pool is kept (its memory alive) until the engine is
//! dropped. `intra_op_parallelism` rings take operations round-robin. An operation's
//! buffer stays in the ring thread's table until its last piece completes, then goes back
//! to the submitter with the result.

use super::{BlockIo, Direction, Done, EngineConfig, IoError, Op, Pending};
use crate::pool::BufferPool;
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{opcode, types, IoUring};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

/// Fixed-buffer slots of each ring's sparse table.
pub const FIXED_SLOTS: usize = 512;

enum Job {
    Io(Op, Sender<Done>),
    /// Registers buffers at slots from `base` on this ring.
    Register {
        base: u32,
        iovecs: Vec<libc::iovec>,
        reply: Sender<std::io::Result<()>>,
    },
}

// SAFETY: the iovecs describe memory of a pool the registry keeps alive; they are only
// handed to the kernel.
unsafe impl Send for Job {}

/// The pools registered as fixed buffers on every ring, each at its first slot.
#[derive(Default)]
struct Registry {
    pools: RwLock<Vec<(BufferPool, u16)>>,
    /// Serialises registrations (slot allocation across the rings).
    registering: Mutex<()>,
}

impl Registry {
    /// The fixed-buffer index of `buf`, if it came from a registered pool.
    fn index(&self, buf: &crate::pool::IoBuf) -> Option<u16> {
        let slot = buf.registered_index()?;
        let pools = self.pools.read().unwrap_or_else(|e| e.into_inner());
        pools
            .iter()
            .find(|(pool, _)| buf.is_from(pool))
            .map(|(_, base)| base + slot)
    }

    fn next_slot(&self) -> usize {
        let pools = self.pools.read().unwrap_or_else(|e| e.into_inner());
        pools
            .iter()
            .map(|(p, base)| usize::from(*base) + p.count())
            .max()
            .unwrap_or(0)
    }
}

/// `user_data` of the wake-up poll on a ring's eventfd.
const WAKE: u64 = u64::MAX;

/// An eventfd that `submit` writes to, so a ring thread asleep in `io_uring_enter`
/// picks up new work at once instead of at its next unrelated completion.
struct Doorbell(std::os::fd::OwnedFd);

impl Doorbell {
    fn new() -> std::io::Result<Doorbell> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscall; the fd is owned by the returned value.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
        Ok(Doorbell(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    fn ring(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd; EAGAIN (counter full)
        // still leaves the eventfd readable, which is all we need.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn clear(&self) {
        let mut value = 0u64;
        // SAFETY: reads 8 bytes into a live u64; non-blocking.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
    }
}

pub struct Uring {
    rings: Vec<(Sender<Job>, Arc<Doorbell>)>,
    workers: Vec<JoinHandle<()>>,
    next: AtomicUsize,
    direct: bool,
    /// Whether every ring has its sparse fixed-buffer table.
    fixed: bool,
    registry: Arc<Registry>,
}

impl Uring {
    /// Starts `config.parallelism` rings, each with a sparse table of fixed buffers. With
    /// `pool`, its buffers are registered in it.
    pub fn new(config: EngineConfig, direct: bool, pool: Option<&BufferPool>) -> Result<Uring, IoError> {
        let depth = config.queue_depth.clamp(1, 4096);
        let mut rings = Vec::new();
        let mut workers = Vec::new();
        let mut fixed = true;
        let registry = Arc::new(Registry::default());
        for index in 0..config.parallelism.max(1) {
            let ring =
                IoUring::new((depth + 1).next_power_of_two() as u32).map_err(|source| IoError::Os {
                    op: "io_uring_setup",
                    path: "(io_uring)".into(),
                    offset: 0,
                    len: 0,
                    source,
                })?;
            if let Err(e) = ring.submitter().register_buffers_sparse(FIXED_SLOTS as u32) {
                if fixed {
                    tracing::warn!("io_uring: no table of fixed buffers ({e}); using plain reads and writes");
                }
                fixed = false;
            }
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let doorbell = Arc::new(Doorbell::new().map_err(|source| IoError::Os {
                op: "eventfd",
                path: "(io_uring doorbell)".into(),
                offset: 0,
                len: 0,
                source,
            })?);
            let worker = RingWorker {
                ring,
                jobs: rx,
                doorbell: doorbell.clone(),
                armed: false,
                registry: registry.clone(),
                block_size: config.block_size.max(4096),
                depth,
                single_submit: config.single_submit,
                overlap_events: config.overlap_events,
                slots: Vec::new(),
                free_slots: Vec::new(),
                queue: VecDeque::new(),
                in_flight: 0,
            };
            let handle = std::thread::Builder::new()
                .name(format!("tierzero-uring-{index}"))
                .spawn(move || worker.run())
                .map_err(|source| IoError::Os {
                    op: "spawn",
                    path: "(io_uring thread)".into(),
                    offset: 0,
                    len: 0,
                    source,
                })?;
            rings.push((tx, doorbell));
            workers.push(handle);
        }
        let uring = Uring {
            rings,
            workers,
            next: AtomicUsize::new(0),
            direct,
            fixed,
            registry,
        };
        if let Some(pool) = pool {
            if !uring.register(pool) {
                tracing::warn!(
                    "io_uring: cannot register {} fixed buffers; using plain reads and writes",
                    pool.count()
                );
            }
        }
        Ok(uring)
    }

    /// Whether any pool's buffers are registered as fixed buffers on every ring.
    pub fn uses_fixed_buffers(&self) -> bool {
        self.fixed
            && !self
                .registry
                .pools
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
    }

    /// Registers `pool`'s buffers in the next free slots of every ring's table.
    fn register(&self, pool: &BufferPool) -> bool {
        if !self.fixed {
            return false;
        }
        let _one_at_a_time = self
            .registry
            .registering
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let base = self.registry.next_slot();
        if base + pool.count() > FIXED_SLOTS {
            return false;
        }
        let iovecs: Vec<libc::iovec> = pool
            .regions()
            .iter()
            .map(|&(addr, len)| libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        let mut replies = Vec::new();
        for (ring, doorbell) in &self.rings {
            let (reply, answer) = crossbeam_channel::bounded(1);
            let job = Job::Register {
                base: base as u32,
                iovecs: iovecs.clone(),
                reply,
            };
            if ring.send(job).is_err() {
                return false;
            }
            doorbell.ring();
            replies.push(answer);
        }
        let all = replies.iter().all(|answer| match answer.recv() {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!("io_uring: cannot register {} fixed buffers ({e})", iovecs.len());
                false
            }
            Err(_) => false,
        });
        if all {
            // kept until the engine is dropped: the kernel holds the pages until then
            let mut pools = self.registry.pools.write().unwrap_or_else(|e| e.into_inner());
            pools.push((pool.clone(), base as u16));
        }
        all
    }
}

impl BlockIo for Uring {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn submit(&self, op: Op) -> Pending {
        let (reply, pending) = Pending::channel("uring");
        let (ring, doorbell) = &self.rings[self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len()];
        if let Err(crossbeam_channel::SendError(Job::Io(op, _))) = ring.send(Job::Io(op, reply)) {
            return Pending::ready("uring", Done::new(op.buf, Err(IoError::Shutdown("uring"))));
        }
        doorbell.ring();
        pending
    }

    fn register_pool(&self, pool: &BufferPool) -> bool {
        self.register(pool)
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // closing the channels lets each ring drain what is in flight, then exit
        for (ring, doorbell) in self.rings.drain(..) {
            drop(ring);
            doorbell.ring();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// One operation owned by a ring thread.
struct Slot {
    op: Op,
    reply: Sender<Done>,
    pieces: usize,
    submitted: usize,
    completed: usize,
    error: Option<IoError>,
}

struct RingWorker {
    ring: IoUring,
    jobs: Receiver<Job>,
    doorbell: Arc<Doorbell>,
    /// Whether a poll on the doorbell is in the ring.
    armed: bool,
    /// The pools registered on every ring, by their first slot.
    registry: Arc<Registry>,
    block_size: usize,
    depth: usize,
    single_submit: bool,
    overlap_events: bool,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<usize>,
    /// Slots with pieces not yet submitted, oldest first.
    queue: VecDeque<usize>,
    /// Pieces submitted and not yet completed.
    in_flight: usize,
}

impl RingWorker {
    fn run(mut self) {
        let mut open = true;
        loop {
            // take new operations; block only when there is nothing else to do
            if open && self.in_flight == 0 && self.queue.is_empty() {
                match self.jobs.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => open = false,
                }
            }
            while open {
                match self.jobs.try_recv() {
                    Ok(job) => self.accept(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            if !open && self.in_flight == 0 && self.queue.is_empty() {
                return;
            }
            self.fill();
            if self.in_flight == 0 {
                continue;
            }
            if open && !self.armed {
                let poll = opcode::PollAdd::new(types::Fd(self.doorbell.0.as_raw_fd()), libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE);
                // SAFETY: the eventfd outlives the ring (both are owned by this worker).
                self.armed = unsafe { self.ring.submission().push(&poll) }.is_ok();
            }
            let want = if self.overlap_events { 1 } else { self.in_flight };
            if let Err(e) = self.ring.submit_and_wait(want) {
                if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EBUSY) {
                    self.fail_all(e);
                    continue;
                }
            }
            self.reap();
        }
    }

    fn accept(&mut self, job: Job) {
        let (op, reply) = match job {
            Job::Io(op, reply) => (op, reply),
            Job::Register { base, iovecs, reply } => {
                // SAFETY: the iovecs are a pool's allocations, which the registry keeps
                // (with the ring) until the engine is dropped.
                let result = unsafe { self.ring.submitter().register_buffers_update(base, &iovecs, None) };
                let _ = reply.send(result);
                return;
            }
        };
        if let Err(error) = op.validate() {
            let _ = reply.send(Done::new(op.buf, Err(error)));
            return;
        }
        if op.len == 0 {
            let _ = reply.send(Done::new(op.buf, Ok(())));
            return;
        }
        let pieces = op.len.div_ceil(self.block_size);
        let slot = Slot {
            op,
            reply,
            pieces,
            submitted: 0,
            completed: 0,
            error: None,
        };
        let index = match self.free_slots.pop() {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        self.queue.push_back(index);
    }

    /// Pushes pieces until `depth` are in flight or nothing is left to submit.
    fn fill(&mut self) {
        while self.in_flight < self.depth {
            let Some(&index) = self.queue.front() else { break };
            let Some(slot) = self.slots[index].as_mut() else {
                self.queue.pop_front();
                continue;
            };
            let piece = slot.submitted;
            let start = piece * self.block_size;
            let len = self.block_size.min(slot.op.len - start);
            let offset = slot.op.offset + start as u64;
            let fd = types::Fd(slot.op.file.file().as_raw_fd());
            let fixed_index = self.registry.index(&slot.op.buf);
            // SAFETY: start < op.len <= the buffer's capacity (validated in accept).
            let ptr = unsafe { slot.op.buf.as_mut_ptr().add(start) };
            let entry = match (slot.op.direction, fixed_index) {
                (Direction::Read, Some(i)) => opcode::ReadFixed::new(fd, ptr, len as u32, i)
                    .offset(offset)
                    .build(),
                (Direction::Read, None) => opcode::Read::new(fd, ptr, len as u32).offset(offset).build(),
                (Direction::Write, Some(i)) => opcode::WriteFixed::new(fd, ptr, len as u32, i)
                    .offset(offset)
                    .build(),
                (Direction::Write, None) => opcode::Write::new(fd, ptr, len as u32).offset(offset).build(),
            }
            .user_data(((index as u64) << 32) | piece as u64);
            // SAFETY: the buffer and the file stay in this slot until the piece's
            // completion is reaped; the submission queue has room because at most
            // depth <= entries pieces are in flight.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            self.in_flight += 1;
            slot.submitted += 1;
            if slot.submitted == slot.pieces {
                self.queue.pop_front();
            }
            if self.single_submit {
                let _ = self.ring.submit();
            }
        }
    }

    fn reap(&mut self) {
        let completions: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (user_data, result) in completions {
            if user_data == WAKE {
                self.armed = false;
                self.doorbell.clear();
                continue;
            }
            self.in_flight -= 1;
            let index = (user_data >> 32) as usize;
            let piece = (user_data & 0xFFFF_FFFF) as usize;
            let Some(slot) = self.slots[index].as_mut() else {
                continue;
            };
            slot.completed += 1;
            let start = piece * self.block_size;
            let expected = self.block_size.min(slot.op.len - start);
            let offset = slot.op.offset + start as u64;
            let name = slot.op.direction.name();
            if slot.error.is_none() {
                if result < 0 {
                    let source = std::io::Error::from_raw_os_error(-result);
                    slot.error = Some(IoError::from_os(
                        name,
                        slot.op.file.path(),
                        offset,
                        expected,
                        source,
                    ));
                } else if (result as usize) < expected {
                    slot.error = Some(IoError::Short {
                        op: name,
                        path: slot.op.file.path().to_path_buf(),
                        offset,
                        expected,
                        got: result as usize,
                    });
                }
            }
            if slot.completed == slot.pieces {
                self.finish(index);
            }
        }
    }

    fn finish(&mut self, index: usize) {
        if let Some(slot) = self.slots[index].take() {
            let result = slot.error.map_or(Ok(()), Err);
            let _ = slot.reply.send(Done::new(slot.op.buf, result));
            self.free_slots.push(index);
        }
    }

    /// The ring itself failed: wait out what the kernel holds, then fail everything.
    fn fail_all(&mut self, error: std::io::Error) {
        tracing::error!("io_uring_enter failed: {error}");
        while self.in_flight > 0 {
            if self.ring.submit_and_wait(1).is_err() {
                break;
            }
            let n = self.ring.completion().count();
            self.in_flight = self.in_flight.saturating_sub(n);
        }
        self.queue.clear();
        for index in 0..self.slots.len() {
            if let Some(slot) = self.slots[index].as_mut() {
                slot.error.get_or_insert_with(|| IoError::Os {
                    op: slot.op.direction.name(),
                    path: slot.op.file.path().to_path_buf(),
                    offset: slot.op.offset,
                    len: slot.op.len,
                    source: std::io::Error::new(error.kind(), error.to_string()),
                });
                slot.completed = slot.pieces;
                self.finish(index);
            }
        }
    }
}
