//! The optimizer step over NVMe-resident state: read sub-group i+1 | update i | write i−1.
//!
//! DeepSpeed's `PipelinedOptimizerSwapper` (`runtime/swap_tensor/`) in three stages joined
//! by bounded crossbeam channels:
//!
//! 1. the reader leases a buffer set (master, exp_avg, exp_avg_sq, and the gradient when
//!    it is stored beside them, as DeepSpeed's optimizer swapper keeps it) and submits
//!    the chunk reads of the next sub-group;
//! 2. the updater waits for them, runs the SIMD AdamW on the sub-group with its
//!    gradient (from host memory or the store) and low-precision output in host memory,
//!    summing the state and a stored gradient as the sweep passes them in cache (the
//!    reads' checksums verified from those sums, the writes' taken from them: no pass
//!    of its own over memory), and submits the three state writes (a gradient is read
//!    only);
//! 3. the completer waits for the writes (checksums recorded) and returns the set.
//!
//! At most `sets` buffer sets exist, so memory is bounded and the reader runs at most
//! that far ahead. DeepSpeed's `offload_optimizer.buffer_count` counts buffers, not sets
//! (its docs: at least one per state, Adam's four being parameter, gradient, momentum and
//! variance): [`sets_for`] turns it into sets. `pipeline_read: false` makes the reader wait for each update before
//! reading the next sub-group; `pipeline_write: false` makes the updater wait for its
//! writes. Without either the stages would only take turns, so they run in turn on the
//! calling thread instead (`serial`: the same legs, no thread started). Results are
//! bit-identical to the same AdamW on in-memory state: the kernel is elementwise and sees
//! exactly the same inputs.

use crate::adam::{self, Coefficients, GradSlice, LowPrecisionOut, Sweep};
use crate::nvme::swap::{State, StoreRead, StoreWrite, SwapStore, TensorKey, Unverified};
use crate::nvme::IoError;
use crate::pool::{BufferPool, IoBuf};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One sub-group to update: chunk `chunk` of the (unit, rank) optimizer state, with its
/// gradient and low-precision output in host memory.
#[derive(Debug)]
pub struct SubGroup<'a> {
    pub unit: u32,
    pub rank: u32,
    pub chunk: usize,
    pub grad: GradIn<'a>,
    pub low: LowPrecisionOut<'a>,
}

/// Where a sub-group's gradient is.
#[derive(Clone, Copy, Debug)]
pub enum GradIn<'a> {
    Host(GradSlice<'a>),
    /// `len` elements in the store under (unit, rank, [`State::Grad`]), chunked as the
    /// optimizer state is, in bf16 or fp32: read beside the state.
    Stored {
        len: usize,
        bf16: bool,
    },
}

impl<'a> GradIn<'a> {
    pub fn len(&self) -> usize {
        match self {
            GradIn::Host(g) => g.len(),
            GradIn::Stored { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            GradIn::Host(g) => {
                let (a, b) = g.split_at(mid);
                (GradIn::Host(a), GradIn::Host(b))
            }
            GradIn::Stored { len, bf16 } => (
                GradIn::Stored { len: mid, bf16 },
                GradIn::Stored { len: len - mid, bf16 },
            ),
        }
    }

    fn stored(&self) -> bool {
        matches!(self, GradIn::Stored { .. })
    }
}

impl SubGroup<'_> {
    fn key(&self, state: State) -> TensorKey {
        TensorKey {
            unit: self.unit,
            rank: self.rank,
            state,
        }
    }
}

/// Bytes the disk moves for a sub-group's states (three reads or three writes) and, when
/// `grad`, its stored gradient: each chunk's elements padded to the O_DIRECT alignment,
/// as the store reads and writes them (a chunk the store does not have counts nothing;
/// its read or write reports the error).
fn moved_bytes(store: &SwapStore, (unit, rank, chunk): (u32, u32, usize), grad: bool) -> (u64, u64) {
    let bytes = |state| {
        store
            .chunk_io_bytes(TensorKey { unit, rank, state }, chunk)
            .map_or(0, |b| b as u64)
    };
    let states = State::OPTIMIZER.into_iter().map(bytes).sum();
    (states, if grad { bytes(State::Grad) } else { 0 })
}

/// A sub-group as the pipeline's threads see it: its (unit, rank, chunk), whether its
/// gradient is read beside its state, and the bytes of its state and gradient on the disk
/// ([`moved_bytes`]), worked out once before the threads start.
#[derive(Clone, Copy)]
struct Planned {
    group: (u32, u32, usize),
    grad: bool,
    moved: (u64, u64),
}

/// Cuts one (unit, rank) partition into its sub-groups: chunk i covers elements
/// [i·chunk_elems, (i+1)·chunk_elems) of the gradient and the low-precision output.
pub fn sub_groups<'a>(
    unit: u32,
    rank: u32,
    chunk_elems: usize,
    grad: GradIn<'a>,
    low: LowPrecisionOut<'a>,
) -> Vec<SubGroup<'a>> {
    let mut groups = Vec::with_capacity(grad.len().div_ceil(chunk_elems.max(1)));
    let (mut grad, mut low) = (grad, low);
    while !grad.is_empty() {
        let n = chunk_elems.max(1).min(grad.len());
        let (g, g_rest) = grad.split_at(n);
        let (l, l_rest) = low.split_at(n);
        groups.push(SubGroup {
            unit,
            rank,
            chunk: groups.len(),
            grad: g,
            low: l,
        });
        grad = g_rest;
        low = l_rest;
    }
    groups
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineConfig {
    /// Buffer sets in flight ([`sets_for`] DeepSpeed's `offload_optimizer.buffer_count`).
    pub sets: usize,
    pub pipeline_read: bool,
    pub pipeline_write: bool,
}

/// What a pipelined step did and where its time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PipelineReport {
    pub found_non_finite: bool,
    pub sub_groups: usize,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Time the updater waited for reads.
    pub read_wait: Duration,
    /// Time in the AdamW kernel.
    pub update: Duration,
    /// Time waiting for writes (in the completer, or the updater without pipeline_write).
    pub write_wait: Duration,
    pub total: Duration,
}

/// Buffers one sub-group needs: its three fp32 states, and its gradient when stored.
fn per_set(stored_gradients: bool) -> usize {
    3 + usize::from(stored_gradients)
}

/// Buffer sets in DeepSpeed's `buffer_count` buffers (at least one).
pub fn sets_for(buffer_count: usize, stored_gradients: bool) -> usize {
    (buffer_count / per_set(stored_gradients)).max(1)
}

/// A pool big enough for `sets` sets of one chunk of each optimizer state, and of the
/// gradient when `stored_gradients`, registered with the store's engine ([`SwapStore::pool`]).
pub fn buffer_pool_for(
    store: &SwapStore,
    sets: usize,
    stored_gradients: bool,
) -> Result<BufferPool, IoError> {
    let bytes = store.chunk_bytes(4);
    store
        .pool(per_set(stored_gradients) * sets.max(1), bytes)
        .map_err(|e| IoError::Store {
            path: store.dir().to_path_buf(),
            message: e.to_string(),
        })
}

type Reads = Vec<StoreRead>;
/// A chunk read in, its checksum verified where the update passes its bytes.
type Arrived = (IoBuf, Unverified);
type Writes<'s> = Vec<StoreWrite<'s>>;

/// Records the first error; later ones are consequences of it.
struct FirstError(Mutex<Option<IoError>>);

impl FirstError {
    fn set(&self, e: IoError) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
    }
    fn is_set(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }
    fn take(self) -> Option<IoError> {
        self.0.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// The reads of one sub-group's optimizer state, and of its gradient when `grad`.
fn submit_reads(
    store: &SwapStore,
    pool: &BufferPool,
    group: (u32, u32, usize),
    grad: bool,
) -> Result<Reads, IoError> {
    let (unit, rank, chunk) = group;
    let gradient = grad.then_some(State::Grad);
    State::OPTIMIZER
        .iter()
        .chain(gradient.iter())
        .map(|&state| {
            let key = TensorKey { unit, rank, state };
            store.read_async(key, chunk, pool.lease()).map_err(|(e, _)| e)
        })
        .collect()
}

/// Waits for every read (so every buffer returns to the pool after an error): their
/// buffers in order, each with its checksum still to verify, or the first error, and when
/// the engine had the last of those that completed.
fn wait_all_reads(reads: Reads) -> (Result<Vec<Arrived>, IoError>, Option<Instant>) {
    let mut buffers = Vec::with_capacity(reads.len());
    let (mut first, mut done) = (None, None);
    for read in reads {
        match read.wait_unverified() {
            Ok((buf, at, check)) => {
                buffers.push((buf, check));
                done = done.max(Some(at));
            }
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    (first.map_or(Ok(buffers), Err), done)
}

fn wait_all_writes(writes: Writes<'_>) -> Result<(), IoError> {
    let mut first = None;
    for write in writes {
        if let Err(e) = write.wait() {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// The optimizer-state reads of one of a step's first sub-groups, submitted before the
/// step's update can start ([`read_ahead`]): they do not depend on the gradient norm,
/// and the pipeline's buffers are idle while the backward runs. With its gradient read,
/// submitted when the update starts, they serve that sub-group in place of its reads
/// ([`nvme_adam_step_then`]); dropped unused, their buffers return to the pool once the
/// reads complete.
pub struct ReadAhead {
    group: (u32, u32, usize),
    submit: Instant,
    reads: Reads,
    bytes: u64,
    /// When the span of the last sub-group of its batch waited for ended (its read-ahead's
    /// and the rest of its reads', [`read_ahead_after`]): this one's leg starts no earlier.
    chain: Chain,
}

/// When the spans of the sub-groups of one batch of read-aheads waited for so far ended.
type Chain = std::sync::Arc<Mutex<Option<Instant>>>;

impl ReadAhead {
    /// The bytes its reads move (each state's chunk padded as the store pads it).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The sub-group it reads.
    pub fn group(&self) -> Group {
        self.group
    }
}

/// Submits the three optimizer-state reads of sub-group `group` (unit, rank, chunk)
/// into buffers of `pool`. The state must not be written before the reads are used.
pub fn read_ahead(
    store: &SwapStore,
    pool: &BufferPool,
    group: (u32, u32, usize),
) -> Result<ReadAhead, IoError> {
    read_ahead_chained(store, pool, group, Chain::default())
}

/// [`read_ahead`] of the sub-group after `previous`'s, submitted with it: the disk serves
/// them in turn, so its leg starts once `previous`'s reads are in.
pub fn read_ahead_after(
    store: &SwapStore,
    pool: &BufferPool,
    group: (u32, u32, usize),
    previous: &ReadAhead,
) -> Result<ReadAhead, IoError> {
    read_ahead_chained(store, pool, group, previous.chain.clone())
}

fn read_ahead_chained(
    store: &SwapStore,
    pool: &BufferPool,
    group: (u32, u32, usize),
    chain: Chain,
) -> Result<ReadAhead, IoError> {
    Ok(ReadAhead {
        group,
        submit: Instant::now(),
        reads: submit_reads(store, pool, group, false)?,
        bytes: moved_bytes(store, group, false).0,
        chain,
    })
}

/// A sub-group's reads as submitted: a read-ahead's of its state, when one read it,
/// then the rest.
struct Submitted {
    unit: u32,
    /// The read-ahead's: when it was submitted, its reads and their bytes, and its chain.
    ahead: Option<(Instant, Reads, u64, Chain)>,
    /// When the rest were submitted, and their bytes.
    submit: Instant,
    reads: Reads,
    bytes: u64,
}

/// The reads of sub-group `planned`: its state's from the first of `ahead` when that
/// read this sub-group (only its gradient's read submitted now), else all submitted now.
fn reads_for(
    store: &SwapStore,
    pool: &BufferPool,
    planned: &Planned,
    ahead: &mut VecDeque<ReadAhead>,
) -> Result<Submitted, IoError> {
    let (unit, rank, chunk) = planned.group;
    let (states, grad) = planned.moved;
    let early = match ahead.pop_front() {
        Some(early) if early.group == planned.group => early,
        other => {
            // read-aheads of other sub-groups go first: their buffers return to the
            // pool as their reads complete, and these reads may need them
            drop(other);
            ahead.clear();
            return Ok(Submitted {
                unit,
                ahead: None,
                submit: Instant::now(),
                reads: submit_reads(store, pool, planned.group, planned.grad)?,
                bytes: states + grad,
            });
        }
    };
    let mut reads = Vec::new();
    if planned.grad {
        let key = TensorKey {
            unit,
            rank,
            state: State::Grad,
        };
        reads.push(store.read_async(key, chunk, pool.lease()).map_err(|(e, _)| e)?);
    }
    Ok(Submitted {
        unit,
        ahead: Some((early.submit, early.reads, states, early.chain)),
        submit: Instant::now(),
        reads,
        bytes: grad,
    })
}

/// Splits the read-aheads a run is given into those it uses, the leading ones that read
/// its first sub-groups in order, and those it keeps for the runs after it: kept only
/// where this run reads no state of its own (every sub-group of it was read ahead, so
/// its buffers come back as its writes complete, whatever the others hold) and they go
/// on from the next run's first sub-group `next`. Any other is dropped here, before the
/// run leases buffers, so that its buffers come back to the pool.
fn split_aheads(
    aheads: Vec<ReadAhead>,
    order: &[Planned],
    next: Option<Group>,
) -> (VecDeque<ReadAhead>, Vec<ReadAhead>) {
    let mut aheads = aheads.into_iter().peekable();
    let mut mine = VecDeque::new();
    for planned in order {
        match aheads.next_if(|a| a.group == planned.group) {
            Some(a) => mine.push_back(a),
            None => break,
        }
    }
    let later: Vec<ReadAhead> = aheads.collect();
    let keep = mine.len() == order.len() && later.first().map(|a| a.group) == next && next.is_some();
    (mine, if keep { later } else { Vec::new() })
}

/// Waits for a sub-group's reads, every one of them (so every buffer returns to the
/// pool after an error), and reports them: a read-ahead's as [`Leg::ReadAhead`], from
/// its submission to when the disk had the last of them, the rest as [`Leg::Read`], from
/// `last_end` at the earliest. Returns the buffers in the reads' order and the end.
fn wait_submitted(
    submitted: Submitted,
    last_end: Instant,
    observer: &dyn Observer,
) -> (Result<Vec<Arrived>, IoError>, Instant) {
    let Submitted {
        unit,
        ahead,
        submit,
        reads,
        bytes,
    } = submitted;
    let mut buffers = Ok(Vec::new());
    let mut from = submit.max(last_end);
    let mut chained = None;
    if let Some((early, reads, bytes, chain)) = ahead {
        let (result, done) = wait_all_reads(reads);
        // from its submission, or the span before it in its batch ending
        let before = *chain.lock().unwrap_or_else(|p| p.into_inner());
        let start = before.map_or(early, |b| b.max(early));
        let end = done.map_or(start, |d| d.max(start));
        observer.leg(Leg::ReadAhead, unit, start, end, bytes);
        buffers = result;
        // the rest's span follows it, and the batch's next read-ahead's follows both: one
        // lane's spans in turn, however late the read-aheads come in
        from = from.max(end);
        chained = Some(chain);
    }
    let (rest, _) = wait_all_reads(reads);
    let end = Instant::now().max(from);
    observer.leg(Leg::Read, unit, from, end, bytes);
    if let Some(chain) = chained {
        *chain.lock().unwrap_or_else(|p| p.into_inner()) = Some(end);
    }
    let result = buffers.and_then(|mut buffers| {
        buffers.extend(rest?);
        Ok(buffers)
    });
    (result, end)
}

/// What the stages share: the report, the first error, the observer.
type Shared<'r> = (&'r Mutex<PipelineReport>, &'r FirstError, &'r dyn Observer);

/// The updater's work on one sub-group whose reads are in (`buffers`: master, exp_avg,
/// exp_avg_sq, then a stored gradient's): AdamW, summing the state and a stored gradient
/// as it passes them, their reads verified from those sums, then its three state writes
/// submitted with the sums of what it wrote. A chunk that fails its checksum is an error
/// before anything computed from it is written. Returns when the writes were submitted
/// and the writes, or None once an error is recorded.
fn update_and_submit<'s>(
    store: &'s SwapStore,
    coefficients: &Coefficients,
    (group, (state_bytes, grad_bytes)): (SubGroup<'_>, (u64, u64)),
    (buffers, read_wait): (Vec<Arrived>, Duration),
    (report, error, observer): Shared<'_>,
) -> Option<(Instant, Writes<'s>)> {
    let t = Instant::now();
    let n = group.grad.len();
    let (keys, chunk) = (State::OPTIMIZER.map(|state| group.key(state)), group.chunk);
    let (mut buffers, checks): (Vec<IoBuf>, Vec<Unverified>) = buffers.into_iter().unzip();
    // a stored gradient's buffer goes back to the pool after the update
    let stored = (buffers.len() > 3).then(|| buffers.remove(3));
    let Ok([mut master, mut exp_avg, mut exp_avg_sq]) = <[IoBuf; 3]>::try_from(buffers) else {
        return None;
    };
    let grad = match (group.grad, &stored) {
        (GradIn::Host(g), _) => g,
        (GradIn::Stored { bf16: true, .. }, Some(b)) => GradSlice::Bf16(b.typed::<u16>(n)),
        (GradIn::Stored { bf16: false, .. }, Some(b)) => GradSlice::F32(b.typed::<f32>(n)),
        (GradIn::Stored { .. }, None) => {
            error.set(IoError::Store {
                path: store.dir().to_path_buf(),
                message: format!("unit {} chunk {chunk}: its gradient was not read", group.unit),
            });
            return None;
        }
    };
    let sweep = Sweep {
        master: master.typed_mut::<f32>(n),
        exp_avg: exp_avg.typed_mut::<f32>(n),
        exp_avg_sq: exp_avg_sq.typed_mut::<f32>(n),
        grad,
        low: group.low,
    };
    let (found, sums) = match adam::step_summed(coefficients, sweep, stored.is_some()) {
        Ok((r, sums)) => (r.found_non_finite, sums),
        Err(e) => {
            error.set(IoError::Store {
                path: store.dir().to_path_buf(),
                message: e.to_string(),
            });
            return None;
        }
    };
    // one check per buffer read, in the order of the sums
    let read: [&IoBuf; 3] = [&master, &exp_avg, &exp_avg_sq];
    let verified = read
        .into_iter()
        .chain(stored.as_ref())
        .zip(sums.read)
        .zip(checks)
        .try_for_each(|((buf, sum), check)| check.verify(buf, sum));
    if let Err(e) = verified {
        error.set(e);
        return None;
    }
    let update = t.elapsed();
    // the bytes of state it reads and writes, as an in-memory update counts them
    observer.leg(Leg::Update, group.unit, t, Instant::now(), 16 * n as u64);
    let submit = Instant::now();
    let mut writes = Vec::with_capacity(3);
    let written = [master, exp_avg, exp_avg_sq];
    for ((key, buf), sum) in keys.into_iter().zip(written).zip(sums.written) {
        match store.write_async_summed(key, chunk, buf, sum) {
            Ok(w) => writes.push(w),
            Err((e, _)) => error.set(e),
        }
    }
    let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
    r.found_non_finite |= found;
    r.read_wait += read_wait;
    r.update += update;
    r.bytes_read += state_bytes + grad_bytes;
    r.bytes_written += state_bytes;
    Some((submit, writes))
}

/// A sub-group's reads as the updater takes them: the buffers and how long taking them
/// took (the `ReadWait` leg), or None once the error is recorded.
fn reads_in(
    unit: u32,
    reads: Result<Vec<Arrived>, IoError>,
    (_, error, observer): Shared<'_>,
) -> Option<(Vec<Arrived>, Duration)> {
    let t = Instant::now();
    let buffers = reads.map_err(|e| error.set(e)).ok()?;
    let read_wait = t.elapsed();
    observer.leg(Leg::ReadWait, unit, t, Instant::now(), 0);
    Some((buffers, read_wait))
}

/// Waits for one sub-group's writes on the updater's thread (without `pipeline_write`);
/// false once an error is recorded.
fn wait_writes_here(
    unit: u32,
    (submit, writes): (Instant, Writes<'_>),
    state_bytes: u64,
    (report, error, observer): Shared<'_>,
) -> bool {
    let t = Instant::now();
    let result = wait_all_writes(writes);
    let end = Instant::now();
    report.lock().unwrap_or_else(|p| p.into_inner()).write_wait += end - t;
    observer.leg(Leg::Write, unit, submit, end, state_bytes);
    observer.leg(Leg::WriteWait, unit, t, end, 0);
    match result {
        Ok(()) => true,
        Err(e) => {
            error.set(e);
            false
        }
    }
}

/// Without `pipeline_read` and `pipeline_write` the stages take turns: each sub-group is
/// read, updated and written before the next one's read is submitted. So they run here,
/// in that order, with the same legs reported and no thread started (three a unit
/// otherwise: on a machine whose cores compute, a new thread waits for a time slice).
fn serial(
    store: &SwapStore,
    pool: &BufferPool,
    (groups, mut ahead): (Vec<SubGroup<'_>>, VecDeque<ReadAhead>),
    order: &[Planned],
    coefficients: &Coefficients,
    shared: Shared<'_>,
) {
    let (_, error, observer) = shared;
    for (group, planned) in groups.into_iter().zip(order) {
        if error.is_set() {
            break;
        }
        let submitted = match reads_for(store, pool, planned, &mut ahead) {
            Ok(submitted) => submitted,
            Err(e) => {
                error.set(e);
                break;
            }
        };
        let from = submitted.submit;
        let (result, _) = wait_submitted(submitted, from, observer);
        let (unit, moved) = (group.unit, planned.moved);
        let Some(read) = reads_in(unit, result, shared) else {
            break;
        };
        let Some(submitted) = update_and_submit(store, coefficients, (group, moved), read, shared) else {
            break;
        };
        if !wait_writes_here(unit, submitted, moved.0, shared) {
            break;
        }
    }
}

/// A leg of the pipeline, as reported to an [`Observer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leg {
    /// A sub-group's reads, from when the disk could start them (submitted and the
    /// previous read done) to completion: the three of its state and its gradient's, or
    /// the gradient's alone after a read-ahead (its bytes: 0 without a stored gradient).
    Read,
    /// A sub-group's state reads of a [`ReadAhead`], from their submission (or the one
    /// before it in its batch being in) to when the disk had the last of them; reported
    /// with that sub-group's `Read`, before it.
    ReadAhead,
    /// AdamW on a sub-group (its bytes: 16 per element, master and moments read and
    /// written).
    Update,
    /// A sub-group's three writes, likewise.
    Write,
    /// The updater waiting for a read.
    ReadWait,
    /// The updater waiting for writes (without `pipeline_write`).
    WriteWait,
}

/// Receives each leg's span (the step breakdown and trace; see tierzero's
/// `metrics/timeline.rs`).
pub trait Observer: Sync {
    fn leg(&self, leg: Leg, unit: u32, start: Instant, end: Instant, bytes: u64);
}

struct Unobserved;

impl Observer for Unobserved {
    fn leg(&self, _: Leg, _: u32, _: Instant, _: Instant, _: u64) {}
}

/// Runs AdamW over every sub-group, streaming the optimizer state (and stored gradients)
/// through `pool`. The pool's buffers must hold one chunk of fp32 ([`buffer_pool_for`]).
pub fn nvme_adam_step(
    store: &SwapStore,
    pool: &BufferPool,
    groups: Vec<SubGroup<'_>>,
    coefficients: &Coefficients,
    config: PipelineConfig,
) -> Result<PipelineReport, IoError> {
    nvme_adam_step_observed(store, pool, groups, coefficients, config, &Unobserved)
}

/// [`nvme_adam_step`], reporting every leg to `observer`. Reads are waited for in
/// order on a thread of their own, so completion times are the disk's, not the
/// updater's.
pub fn nvme_adam_step_observed(
    store: &SwapStore,
    pool: &BufferPool,
    groups: Vec<SubGroup<'_>>,
    coefficients: &Coefficients,
    config: PipelineConfig,
    observer: &dyn Observer,
) -> Result<PipelineReport, IoError> {
    nvme_adam_step_from(store, pool, (groups, None), coefficients, config, observer)
}

/// [`nvme_adam_step_observed`], the first sub-group's state read by `ahead` where it
/// read that sub-group ([`read_ahead`]; otherwise it is dropped). The same values: only
/// when the reads were submitted differs.
pub fn nvme_adam_step_from(
    store: &SwapStore,
    pool: &BufferPool,
    (groups, ahead): (Vec<SubGroup<'_>>, Option<ReadAhead>),
    coefficients: &Coefficients,
    config: PipelineConfig,
    observer: &dyn Observer,
) -> Result<PipelineReport, IoError> {
    let ahead = ahead.into_iter().collect();
    nvme_adam_step_then(store, pool, (groups, ahead, None), coefficients, config, observer)
        .map(|(report, _)| report)
}

/// A sub-group's (unit, rank, chunk).
pub type Group = (u32, u32, usize);

/// [`nvme_adam_step_from`] with read-aheads in sub-group order (those of this run's
/// first sub-groups used, those of the runs after it kept: [`split_aheads`]), then the
/// state of sub-group `next` (the next run's first) read ahead as soon as this run's
/// reads are submitted and a buffer set is free, so its reads overlap this run's updates
/// and writes: DeepSpeed's swapper reads sub-group i+1 while it writes i, across the
/// runs of a step as within one. Returns, for the next run, the read-aheads kept, or
/// else that one ([`read_ahead`]'s); none where the reads do not run on threads of their
/// own (without `pipeline_read`), after an error, or where the submission failed (the
/// next run reads the same chunks and reports it).
pub fn nvme_adam_step_then(
    store: &SwapStore,
    pool: &BufferPool,
    (groups, ahead, next): (Vec<SubGroup<'_>>, Vec<ReadAhead>, Option<Group>),
    coefficients: &Coefficients,
    config: PipelineConfig,
    observer: &dyn Observer,
) -> Result<(PipelineReport, Vec<ReadAhead>), IoError> {
    let start = Instant::now();
    let sets = config.sets.max(1);
    let order: Vec<Planned> = groups
        .iter()
        .map(|g| {
            let (group, grad) = ((g.unit, g.rank, g.chunk), g.grad.stored());
            Planned {
                group,
                grad,
                moved: moved_bytes(store, group, grad),
            }
        })
        .collect();
    let error = FirstError(Mutex::new(None));
    let report = Mutex::new(PipelineReport {
        sub_groups: groups.len(),
        ..PipelineReport::default()
    });
    let shared = (&report, &error, observer);
    let (mut ahead, later) = split_aheads(ahead, &order, next);
    let mut next_ahead = Vec::new();
    if !config.pipeline_read && !config.pipeline_write {
        serial(store, pool, (groups, ahead), &order, coefficients, shared);
    } else {
        let (to_wait, submitted) = crossbeam_channel::bounded::<Submitted>(sets);
        let (to_update, updates) = crossbeam_channel::bounded::<Result<Vec<Arrived>, IoError>>(sets);
        let (to_complete, completions) = crossbeam_channel::bounded::<(u32, Instant, Writes<'_>, u64)>(sets);
        // without pipeline_read the reader waits for this after each sub-group
        let (updated, updated_rx) = crossbeam_channel::bounded::<()>(sets);

        std::thread::scope(|scope| {
            // stage 3: wait for writes, then the buffers go back to the pool
            let completer = scope.spawn(|| {
                let mut last_end = start;
                for (unit, submit, writes, bytes) in completions {
                    let t = Instant::now();
                    let result = wait_all_writes(writes);
                    let end = Instant::now();
                    report.lock().unwrap_or_else(|p| p.into_inner()).write_wait += end - t;
                    observer.leg(Leg::Write, unit, submit.max(last_end), end, bytes);
                    last_end = end;
                    if let Err(e) = result {
                        error.set(e);
                    }
                }
            });

            // stage 1b: wait for reads in order, timing them; keeps waiting after an error
            // so every buffer comes back
            let read_waiter = scope.spawn(|| {
                let to_update = to_update; // closes the updater's channel when done
                let mut last_end = start;
                for reads in submitted {
                    let (result, end) = wait_submitted(reads, last_end, observer);
                    last_end = end;
                    if to_update.send(result).is_err() {
                        error.set(IoError::Store {
                            path: store.dir().to_path_buf(),
                            message: "the updater stopped".into(),
                        });
                    }
                }
            });

            // stage 2: update
            let updater = scope.spawn(|| {
                let mut groups = groups.into_iter().zip(order.iter().map(|p| p.moved));
                for reads in updates.iter() {
                    let Some((group, moved)) = groups.next() else {
                        break;
                    };
                    if error.is_set() {
                        break;
                    }
                    let unit = group.unit;
                    let Some(read) = reads_in(unit, reads, shared) else {
                        break;
                    };
                    let Some((submit, writes)) =
                        update_and_submit(store, coefficients, (group, moved), read, shared)
                    else {
                        break;
                    };
                    if config.pipeline_write {
                        if to_complete.send((unit, submit, writes, moved.0)).is_err() {
                            break;
                        }
                    } else if !wait_writes_here(unit, (submit, writes), moved.0, shared) {
                        break;
                    }
                    if !config.pipeline_read && updated.send(()).is_err() {
                        break;
                    }
                }
                drop(to_complete);
                drop(updated);
                // after an error the reader may still be queueing: drain, so that the
                // buffers of queued reads return to the pool and it can finish
                for reads in updates.iter() {
                    drop(reads);
                }
            });

            // stage 1 (this thread): read ahead
            for (i, planned) in order.iter().enumerate() {
                if error.is_set() {
                    break;
                }
                if !config.pipeline_read && i > 0 && updated_rx.recv().is_err() {
                    break;
                }
                match reads_for(store, pool, planned, &mut ahead) {
                    Ok(submitted) => {
                        if to_wait.send(submitted).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        error.set(e);
                        break;
                    }
                }
            }
            drop(to_wait);
            drop(updated_rx);
            // a read-ahead this run did not use gives its buffers back first
            ahead.clear();
            // the next run's first state, unless read ahead already: its buffers come
            // back as this run's writes complete (the completer does not wait for
            // this thread)
            if config.pipeline_read && !error.is_set() && later.is_empty() {
                next_ahead.extend(next.and_then(|group| read_ahead(store, pool, group).ok()));
            }
            let _ = read_waiter.join();
            let _ = updater.join();
            let _ = completer.join();
        });
    }
    if let Some(e) = error.take() {
        return Err(e);
    }
    let mut report = report.into_inner().unwrap_or_else(|p| p.into_inner());
    report.total = start.elapsed();
    Ok((report, if later.is_empty() { next_ahead } else { later }))
}

/// Submits one batch per sub-group on this thread, at most `sets` batches ahead, and
/// waits for them in order on a second thread, which keeps waiting after an error so that
/// every buffer returns to its pool before the error is reported.
fn stream<T: Send>(
    sets: usize,
    groups: &[(u32, u32, usize)],
    mut submit: impl FnMut((u32, u32, usize)) -> Result<T, IoError>,
    wait: impl Fn(T) -> Result<(), IoError> + Send,
) -> Result<Duration, IoError> {
    let start = Instant::now();
    let (tx, rx) = crossbeam_channel::bounded::<T>(sets.max(1));
    std::thread::scope(|scope| {
        let waiter = scope.spawn(move || {
            let mut result = Ok(());
            for batch in rx {
                result = result.and(wait(batch));
            }
            result
        });
        let mut submitted = Ok(());
        for &group in groups {
            match submit(group) {
                Ok(batch) => {
                    if tx.send(batch).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    submitted = Err(e);
                    break;
                }
            }
        }
        drop(tx);
        let waited = waiter.join().unwrap_or(Ok(()));
        submitted.and(waited)
    })?;
    Ok(start.elapsed())
}

/// Reads every chunk of the optimizer states of `groups` and discards the data: the read
/// leg of the pipeline alone, for `bench swap`.
pub fn read_only(
    store: &SwapStore,
    pool: &BufferPool,
    groups: &[(u32, u32, usize)],
) -> Result<Duration, IoError> {
    stream(
        pool.count() / 3,
        groups,
        |group| submit_reads(store, pool, group, false),
        |reads| {
            let arrived = wait_all_reads(reads).0?;
            arrived
                .into_iter()
                .try_for_each(|(buf, check)| check.verify_here(&buf))
        },
    )
}

/// Writes every chunk of the optimizer states of `groups` from pool buffers as they are:
/// the write leg alone, for `bench swap`.
pub fn write_only(
    store: &SwapStore,
    pool: &BufferPool,
    groups: &[(u32, u32, usize)],
) -> Result<Duration, IoError> {
    let submit = |(unit, rank, chunk): (u32, u32, usize)| -> Result<Writes<'_>, IoError> {
        State::OPTIMIZER
            .into_iter()
            .map(|state| {
                store
                    .write_async(TensorKey { unit, rank, state }, chunk, pool.lease())
                    .map_err(|(e, _)| e)
            })
            .collect()
    };
    stream(pool.count() / 3, groups, submit, wait_all_writes)
}
