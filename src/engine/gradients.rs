//! The owner of a rank's gradient accumulators: one per unit (the optimizer partition at
//! stages 2–3, the whole padded unit at 0–1), each in host memory, or in the optimizer's
//! swap store on NVMe (stages 2–3 with the optimizer state there, `grad_store.rs`), or
//! lent — to the reduce lane while a reduce-scatter adds into it, or to the optimizer lane
//! while AdamW reads it — and the reduce lane's end on the compute thread.

use super::error::{EngineError, On};
use super::grad_store::{Acc, Fresh, GradStream};
use super::grads::Grads;
use super::reduce::{reduce_into, ChunkBuffers, OnDevice, Reducer, Target};
use super::staging::Squares;
use crate::comm::{Collective, ReduceOp};
use crate::device::sim;
use crate::metrics::timeline::Track;
use crate::plan::partition::Partition;
use crate::plan::rules::REDUCE_DEPTH;
use crate::plan::simulate::costs::Work;
use crate::plan::Wire;
use std::ops::Range;
use tch::Tensor;
use tierzero_offload::arena::Pinning;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pool::BufferPool;

/// Where a unit's accumulator is.
#[derive(Debug)]
pub(super) enum Accumulator {
    Here(Grads),
    /// In host memory holding a finished step's values: logically zeros, made zeros by
    /// the step's first contribution as it writes (`grad_store::Fresh`) or by a reader.
    Stale(Grads),
    /// In the swap store under (unit, rank, [`State::Grad`]).
    Nvme(Stored),
    /// None on the host: the step's sum stays on the device until the optimizer reads it
    /// (`rules::held_gradients`).
    Device,
    /// On a lane (named), coming back with its job.
    Lent(&'static str),
}

impl Accumulator {
    /// The accumulator as a reader must see it: a stale one zeroed (it is zeros).
    fn zeroed(self) -> Accumulator {
        match self {
            Accumulator::Stale(mut g) => {
                g.fill_zero();
                Accumulator::Here(g)
            }
            other => other,
        }
    }
}

/// What the store holds of a unit's gradient this step.
#[derive(Clone, Copy, Debug)]
pub(super) enum Stored {
    /// Nothing yet: the gradient is zero.
    Nothing,
    /// The whole partition, with its Σg².
    Whole { sum_squares: f64 },
}

/// A unit's final gradient as the optimizer lane reads it.
#[derive(Debug)]
pub(super) enum FinalGrad {
    Here(Grads),
    /// The step's sum on the device (`rules::held_gradients`): read there by state on
    /// the device, taken to the host by an update off it.
    Device(Tensor),
    /// `len` elements in the optimizer's swap store, bf16 or fp32.
    Stored {
        len: usize,
        bf16: bool,
    },
}

impl FinalGrad {
    pub(super) fn len(&self) -> usize {
        match self {
            FinalGrad::Here(g) => g.len(),
            FinalGrad::Device(t) => t.numel(),
            FinalGrad::Stored { len, .. } => *len,
        }
    }
}

/// The NVMe tier of gradients: the optimizer's swap store and one chunk buffer per
/// reduction in flight.
struct NvmeGrads<'a> {
    store: &'a SwapStore,
    chunks: BufferPool,
}

pub(super) struct Gradients<'a, C: Collective> {
    accumulators: Vec<Accumulator>,
    /// Which units' accumulators live in the store (`rules::stored_gradients`).
    in_store: Vec<bool>,
    nvme: Option<NvmeGrads<'a>>,
    /// Stage 1: the buffers the optimizer partition is copied into for the optimizer
    /// lane (the replica's accumulator stays here, whole); None while lent.
    copies: Vec<Option<Grads>>,
    parts: Vec<Partition>,
    /// Each unit's optimizer partition within its padded buffer.
    partitions: Vec<Range<usize>>,
    stage: u8,
    rank: usize,
    /// Which units accumulate in bf16 (`plan::rules::bf16_gradients`).
    bf16: Vec<bool>,
    /// The collectives lane of the step in progress, when gradients are reduced there.
    reducer: Option<Reducer<'a, C>>,
    /// Whether the compute thread goes on while a reduction runs (`overlap_comm`).
    overlap: bool,
    /// The chunk buffers of reductions on this thread, reused across units and steps.
    chunk_buffers: ChunkBuffers,
    /// What gradients travel as between ranks.
    wire: Wire,
    /// Gradients in flight on the reduce lane at most (`rules::reduce_depth`).
    depth: usize,
    /// Gradient sums on the device (`plan::rules::device_sums`): the fp32 partition there
    /// of each unit that has one (made at its first use, on the gradient's device),
    /// whether the step has added into it yet, and whether this micro-batch is the step's
    /// last (its contributions flush the sums to the host accumulators, but those of
    /// gradients that stay on the device).
    device: Option<DeviceSums>,
    /// Whether the micro-batch in progress is the step's last.
    last_micro: bool,
    /// Σ g² of each host accumulator, gathered as the step's last contribution was added
    /// (`staging::Squares`; None: a pass over it gives it).
    squares: Vec<Option<f64>>,
}

/// The device accumulators of gradients.
struct DeviceSums {
    sums: Vec<Option<Tensor>>,
    started: Vec<bool>,
    last_micro: bool,
    /// Which units sum on the device (`rules::device_sums`).
    summed: Vec<bool>,
    /// Where the sums are made (the compute device).
    on: tch::Device,
}

impl DeviceSums {
    /// Unit `u`'s sum of `len` elements, made at its first use.
    fn sum(&mut self, u: usize, len: usize) -> Result<Tensor, tch::TchError> {
        if let Some(t) = &self.sums[u] {
            return Ok(t.shallow_clone());
        }
        let t = Tensor::f_empty([len as i64], (tch::Kind::Float, self.on))?;
        self.sums[u] = Some(t.shallow_clone());
        Ok(t)
    }
}

impl<'a, C: Collective + Clone + 'a> Gradients<'a, C> {
    /// Every unit's accumulator, zeroed: the units `stored` marks (stages 2–3) in the
    /// store with a chunk buffer per reduction in flight, the others in an arena of each
    /// kind (`rules::bf16_gradients`; at stage 1 the partition copies in another),
    /// allocated here once for the run.
    pub(super) fn new(
        (stage, rank, bf16): (u8, usize, Vec<bool>),
        (summed, kept, on): (Vec<bool>, Vec<bool>, tch::Device),
        (wire, chunk, depth): (Wire, usize, usize),
        parts: Vec<Partition>,
        partitions: Vec<Range<usize>>,
        pinning: &Pinning,
        (store, stored): (Option<&'a SwapStore>, Vec<bool>),
    ) -> Result<Self, EngineError> {
        let carve_err = |what: &'static str| move |source| EngineError::Arena { rank, what, source };
        let in_store: Vec<bool> = stored.iter().map(|&s| s && stage >= 2).collect();
        let nvme = match (store, in_store.contains(&true)) {
            (Some(store), true) => {
                // one chunk (of the stored element) per reduction in flight: the compute
                // thread waits for the lane's oldest before starting another (`accumulate`)
                // the store's gradients are all of one kind (`rules::stored_bf16`)
                let stored_bf16 = (0..in_store.len()).any(|u| in_store[u] && bf16[u]);
                let elem = if stored_bf16 { 2 } else { 4 };
                let chunks = store
                    .pool(REDUCE_DEPTH, store.chunk_bytes(elem))
                    .map_err(On(rank).alloc())?;
                Some(NvmeGrads { store, chunks })
            }
            (None, true) => {
                return Err(EngineError::Invariant {
                    rank,
                    what: "gradients on nvme without a swap store",
                })
            }
            (_, false) => None,
        };
        // a gradient that stays on the device has no host accumulator (nor a stage-1 copy)
        let on_host = |u: usize| !in_store[u] && !kept[u];
        // an arena for each kind of accumulator that has any, carved in the units' order
        let carve = |low: bool| {
            let lens: Vec<usize> = (0..parts.len())
                .filter(|&u| on_host(u) && bf16[u] == low)
                .map(|u| parts[u].accumulator_len(stage))
                .collect();
            if lens.is_empty() {
                return Ok(Vec::new().into_iter());
            }
            Grads::carve(&lens, low, pinning)
                .map(Vec::into_iter)
                .map_err(carve_err("gradient"))
        };
        let mut carved = [carve(false)?, carve(true)?];
        let accumulators =
            (0..parts.len())
                .map(|u| match (in_store[u], kept[u]) {
                    (true, _) => Ok(Accumulator::Nvme(Stored::Nothing)),
                    (false, true) => Ok(Accumulator::Device),
                    (false, false) => carved[usize::from(bf16[u])].next().map(Accumulator::Here).ok_or(
                        EngineError::Invariant {
                            rank,
                            what: "fewer gradient accumulators carved than units in memory",
                        },
                    ),
                })
                .collect::<Result<Vec<_>, _>>()?;
        let copies = if stage == 1 {
            let lens: Vec<usize> = (0..parts.len())
                .filter(|&u| !kept[u])
                .map(|u| partitions[u].len())
                .collect();
            let mut carved = Grads::carve(&lens, false, pinning)
                .map_err(carve_err("stage-1 gradient copy"))?
                .into_iter();
            (0..parts.len())
                .map(|u| if kept[u] { None } else { carved.next() })
                .collect()
        } else {
            parts.iter().map(|_| None).collect()
        };
        let device = summed.contains(&true).then(|| DeviceSums {
            sums: parts.iter().map(|_| None).collect(),
            started: parts.iter().map(|_| false).collect(),
            last_micro: false,
            summed,
            on,
        });
        Ok(Gradients {
            accumulators,
            in_store,
            nvme,
            copies,
            parts,
            partitions,
            stage,
            rank,
            bf16,
            reducer: None,
            overlap: false,
            chunk_buffers: ChunkBuffers::new(wire.kind(), chunk),
            wire,
            depth,
            device,
            last_micro: true,
            squares: vec![None; stored.len()],
        })
    }

    /// A micro-batch begins: the first of a step starts the device sums afresh; the
    /// contributions of the `last` flush them to the host accumulators.
    pub(super) fn begin_micro_batch(&mut self, first: bool, last: bool) {
        self.last_micro = last;
        if let Some(d) = &mut self.device {
            if first {
                d.started.fill(false);
            }
            d.last_micro = last;
        }
    }

    /// Unit `u`'s device accumulator for a contribution (`more`: another to the same
    /// unit follows in this micro-batch, as the tied head's precedes the embedding's),
    /// and whether it flushes; None where the unit sums on the host.
    fn on_device(&mut self, u: usize, more: bool) -> Result<Option<OnDevice>, EngineError> {
        let (rank, kept) = (self.rank, self.keeps(u));
        let len = self.parts[u].accumulator_len(self.stage);
        let Some(d) = self.device.as_mut().filter(|d| d.summed[u]) else {
            return Ok(None);
        };
        let acc = d
            .sum(u, len)
            .map_err(|source| EngineError::Torch { rank, source })?;
        let first = !std::mem::replace(&mut d.started[u], true);
        Ok(Some(OnDevice {
            acc,
            first,
            flush: d.last_micro && !more && !kept,
        }))
    }

    /// Whether unit `u`'s sum stays on the device until the optimizer reads it
    /// (`rules::held_gradients`): it has no host accumulator.
    fn keeps(&self, u: usize) -> bool {
        matches!(self.accumulators[u], Accumulator::Device)
    }

    /// Unit `u`'s sum of the step's gradient on the device, once the step has added into
    /// it (None where it sums on the host).
    fn device_sum(&self, u: usize) -> Option<Tensor> {
        let d = self.device.as_ref()?;
        d.started[u]
            .then(|| d.sums[u].as_ref().map(Tensor::shallow_clone))
            .flatten()
    }

    fn here(&mut self, u: usize) -> Result<&mut Grads, EngineError> {
        let rank = self.rank;
        let acc = std::mem::replace(&mut self.accumulators[u], Accumulator::Lent("compute"));
        self.accumulators[u] = acc.zeroed();
        match &mut self.accumulators[u] {
            Accumulator::Here(g) => Ok(g),
            Accumulator::Lent(lane) => Err(EngineError::Lent { rank, unit: u, lane }),
            Accumulator::Stale(_) | Accumulator::Nvme(_) => Err(EngineError::Invariant {
                rank,
                what: "a host gradient wanted where the gradients are on NVMe",
            }),
            Accumulator::Device => Err(EngineError::Invariant {
                rank,
                what: "a host gradient wanted where the gradient stays on the device",
            }),
        }
    }

    /// Zeroes every accumulator here for a new step (one lent to the optimizer comes
    /// back zeroed; a stored one starts again from nothing): those in host memory become
    /// stale, zeroed by the step's first contribution without a pass of their own.
    pub(super) fn zero(&mut self) {
        self.squares.fill(None);
        for acc in &mut self.accumulators {
            *acc = match std::mem::replace(acc, Accumulator::Lent("compute")) {
                Accumulator::Here(g) => Accumulator::Stale(g),
                Accumulator::Nvme(_) => Accumulator::Nvme(Stored::Nothing),
                other => other,
            };
        }
    }

    fn key(&self, u: usize) -> TensorKey {
        TensorKey {
            unit: u as u32,
            rank: self.rank as u32,
            state: State::Grad,
        }
    }

    /// Unit `u`'s accumulator for a reduction on `lane`: the buffer itself, or a stream
    /// into the store (reading back what an earlier micro-batch stored). Lent until
    /// [`Self::settle`].
    fn lend(&mut self, u: usize, lane: &'static str) -> Result<Acc<'a>, EngineError> {
        let stored = match std::mem::replace(&mut self.accumulators[u], Accumulator::Lent(lane)) {
            Accumulator::Here(g) => return Ok(Acc::Here(g)),
            Accumulator::Stale(g) => return Ok(Acc::Fresh(Fresh::new(g))),
            Accumulator::Nvme(stored) => stored,
            lent => {
                self.accumulators[u] = lent;
                return Err(self.lent(u));
            }
        };
        let key = self.key(u);
        let buf = self.nvme.as_ref().and_then(|n| n.chunks.try_lease());
        match (&self.nvme, buf) {
            (Some(nvme), Some(buf)) => {
                let fresh = matches!(stored, Stored::Nothing);
                let stream = GradStream::new(On(self.rank), nvme.store, key, self.bf16[u], fresh, buf);
                Ok(Acc::Stream(stream))
            }
            _ => {
                self.accumulators[u] = Accumulator::Nvme(stored);
                Err(EngineError::Invariant {
                    rank: self.rank,
                    what: "more gradient streams than chunk buffers (one per reduction in flight)",
                })
            }
        }
    }

    /// An accumulator back from a reduction (`ok`: it completed).
    fn settle(&mut self, u: usize, acc: Acc<'a>, ok: bool) {
        self.accumulators[u] = match acc {
            Acc::Here(g) => Accumulator::Here(g),
            // a failed reduction's (the run stops) leaves what it wrote as stale
            Acc::Fresh(f) => f
                .into_finished()
                .map_or_else(Accumulator::Stale, Accumulator::Here),
            Acc::Stream(s) if ok => Accumulator::Nvme(Stored::Whole {
                sum_squares: s.sum_squares(),
            }),
            Acc::Stream(_) => Accumulator::Nvme(Stored::Nothing),
        };
    }

    /// Reduces through `reducer` (the collectives lane) until [`Self::stop_reducing`];
    /// without `overlap` each reduction is waited for.
    pub(super) fn reduce_on(&mut self, reducer: Reducer<'a, C>, overlap: bool) {
        self.reducer = Some(reducer);
        self.overlap = overlap;
    }

    /// Takes every accumulator back from the reduce lane and ends it; its chunk buffers
    /// become this thread's.
    pub(super) fn stop_reducing(&mut self) -> Result<(), EngineError> {
        let taken = self.absorb(true);
        if let Some(r) = self.reducer.take() {
            self.chunk_buffers = r.finish();
        }
        taken
    }

    /// Returns the chunk buffers for a reduce lane to use.
    pub(super) fn lend_chunk_buffers(&mut self) -> ChunkBuffers {
        let fresh = self.chunk_buffers.fresh();
        std::mem::replace(&mut self.chunk_buffers, fresh)
    }

    /// Adds a unit's flat gradient (numel elements, the compute kind) into its
    /// accumulator: reduce-scattered at stages 2–3 (on the reduce lane when it runs),
    /// else added to the replica's accumulator.
    pub(super) fn accumulate(
        &mut self,
        u: usize,
        grad: &Tensor,
        (comm, track): (&C, &Track),
        more: bool,
    ) -> Result<(), EngineError> {
        let part = self.parts[u];
        let device = self.on_device(u, more)?;
        // the host accumulator is only touched without device sums, or by their flush
        let to_host = device.as_ref().is_none_or(|d| d.flush);
        // the step's last contribution to a host accumulator of a shard gives its Σ g²
        // as it is added (replicas are all-reduced after the micro-batches)
        let squares = to_host && self.last_micro && !more && self.stage >= 2 && !self.in_store[u];
        if self.stage >= 2 && self.reducer.is_some() {
            // a unit reduced twice in a micro-batch (the tied embedding): its accumulator
            // comes back from the lane first; and at most `depth` are in flight
            while self
                .reducer
                .as_ref()
                .is_some_and(|r| r.holds(u) || r.in_flight() >= self.depth)
            {
                self.take_one(true)?;
            }
            let acc = if to_host {
                Some(self.lend(u, "reduce")?)
            } else {
                None
            };
            if let Some(reducer) = self.reducer.as_mut() {
                reducer.send(u, grad.shallow_clone(), part, (acc, squares), device)?;
            }
            return self.absorb(!self.overlap);
        }
        let target = if self.stage >= 2 {
            Target::Shard
        } else {
            Target::Replica
        };
        let mut acc = if to_host {
            Some(self.lend(u, "compute")?)
        } else {
            None
        };
        let chunk = self.chunk_buffers.chunk();
        if squares {
            self.chunk_buffers.staging().gather_squares();
        }
        let result = reduce_into(
            comm,
            target,
            u,
            grad,
            part,
            acc.as_mut(),
            device.as_ref(),
            &mut self.chunk_buffers,
            track,
            chunk,
        )
        .and_then(|()| acc.as_mut().map_or(Ok(()), |a| a.finish(track)));
        let squares = self.chunk_buffers.staging().take_squares();
        if let Some(acc) = acc {
            self.settle(u, acc, result.is_ok());
            self.keep_squares(u, squares.filter(|_| result.is_ok()));
        }
        result
    }

    /// Keeps unit `u`'s Σ g² gathered by its last contribution, when it covers the whole
    /// accumulator.
    fn keep_squares(&mut self, u: usize, squares: Option<Squares>) {
        let len = self.parts[u].accumulator_len(self.stage);
        self.squares[u] = squares.and_then(|s| s.over(len));
    }

    fn lent(&self, u: usize) -> EngineError {
        let lane = match self.accumulators[u] {
            Accumulator::Lent(lane) => lane,
            Accumulator::Here(_) | Accumulator::Stale(_) | Accumulator::Nvme(_) | Accumulator::Device => {
                "compute"
            }
        };
        EngineError::Lent {
            rank: self.rank,
            unit: u,
            lane,
        }
    }

    /// The oldest accumulator back from the reduce lane (waiting for it with `wait`);
    /// false when none came back.
    fn take_one(&mut self, wait: bool) -> Result<bool, EngineError> {
        let Some(reducer) = self.reducer.as_mut() else {
            return Ok(false);
        };
        match reducer.take(wait)? {
            Some((u, acc, squares)) => {
                if let Some(acc) = acc {
                    self.settle(u, acc, true);
                    self.keep_squares(u, squares);
                }
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Puts the accumulators the reduce lane finished back, in the order they were sent;
    /// with `wait`, every outstanding one.
    pub(super) fn absorb(&mut self, wait: bool) -> Result<(), EngineError> {
        while self.take_one(wait)? {}
        Ok(())
    }

    /// Stages 0–1: every replica's gradient averaged over the ranks (once per step). A
    /// 16-bit communication type is applied by rounding the values to it before and
    /// after the fp32 all-reduce (what travelling in it does, summed in fp32).
    pub(super) fn all_reduce_replicas(&mut self, comm: &C) -> Result<(), EngineError> {
        if self.stage >= 2 {
            return Ok(());
        }
        let (rank, wire, world) = (self.rank, self.wire, comm.world());
        for u in 0..self.accumulators.len() {
            if self.keeps(u) {
                // a replica's gradient that stays on the device, all-reduced there (every
                // rank's is started by the same micro-batches, or none is)
                let Some(sum) = self.kept_sum(u) else {
                    continue;
                };
                if world > 1 {
                    let torch_err = |source| EngineError::Torch { rank, source };
                    round_tensor_through(wire, &sum).map_err(torch_err)?;
                    comm.all_reduce_tensor(&sum, ReduceOp::Avg)?;
                    round_tensor_through(wire, &sum).map_err(torch_err)?;
                    let bytes = 4 * sum.numel() as u64;
                    sim::charge(Work::Collective(bytes));
                    sim::charge(Work::Collective(bytes));
                }
                continue;
            }
            match self.here(u)? {
                Grads::F32(g) => {
                    if world > 1 {
                        round_through(wire, g);
                    }
                    comm.all_reduce(g, ReduceOp::Avg)?;
                    if world > 1 {
                        round_through(wire, g);
                        // a ring all-reduce moves the buffer twice
                        let bytes = 4 * g.len() as u64;
                        sim::charge(Work::Collective(bytes));
                        sim::charge(Work::Collective(bytes));
                    }
                }
                Grads::Bf16(_) => {
                    return Err(EngineError::Invariant {
                        rank,
                        what: "bf16 accumulators exist only at stages 2-3 (plan::rules::bf16_gradients)",
                    })
                }
            }
        }
        Ok(())
    }

    /// The elements of unit `u`'s accumulator its optimizer partition reads.
    fn read_range(&self, u: usize, acc: &Grads) -> Range<usize> {
        if self.stage == 1 {
            self.partitions[u].clone()
        } else {
            0..acc.len()
        }
    }

    /// Unit `u`'s device sum where its gradient stays on the device and the step added
    /// into it (a unit that got nothing this step: [`Self::zero_on_device`]).
    fn kept_sum(&self, u: usize) -> Option<Tensor> {
        self.keeps(u).then(|| self.device_sum(u)).flatten()
    }

    /// A gradient held on the device that got nothing this step: its sum made zeros (made
    /// first where no step has added into it yet) and counted as the step's.
    fn zero_on_device(&mut self, u: usize) -> Result<(), EngineError> {
        let (rank, len) = (self.rank, self.parts[u].accumulator_len(self.stage));
        let Some(d) = self.device.as_mut() else {
            return Err(EngineError::Invariant {
                rank,
                what: "a gradient kept on the device without device sums",
            });
        };
        d.sum(u, len)
            .and_then(|mut sum| sum.f_zero_().map(|_| ()))
            .map_err(|source| EngineError::Torch { rank, source })?;
        d.started[u] = true;
        Ok(())
    }

    /// Zeroes the device sum of every unit held there that got no gradient this step, so
    /// that the optimizer reads it as the step's sum: on compute's stream, before the
    /// optimizer's stream takes its mark.
    pub(super) fn zero_idle_sums(&mut self) -> Result<(), EngineError> {
        for u in 0..self.accumulators.len() {
            if self.keeps(u) && self.device_sum(u).is_none() {
                self.zero_on_device(u)?;
            }
        }
        Ok(())
    }

    /// Of [`Self::kept_sum`], what the optimizer partition reads.
    fn kept_partition(&self, u: usize) -> Result<Option<Tensor>, EngineError> {
        self.kept_sum(u)
            .map(|sum| self.optimizer_view(u, sum))
            .transpose()
    }

    /// What of unit `u`'s device sum its optimizer partition reads: at stage 1 this
    /// rank's slice of the replica's sum, else all of it.
    fn optimizer_view(&self, u: usize, sum: Tensor) -> Result<Tensor, EngineError> {
        if self.stage != 1 {
            return Ok(sum);
        }
        let range = &self.partitions[u];
        sum.f_narrow(0, range.start as i64, range.len() as i64)
            .map_err(|source| EngineError::Torch {
                rank: self.rank,
                source,
            })
    }

    /// Σ g² over this rank's optimizer partitions, in f64.
    pub(super) fn sum_squares(&mut self) -> Result<f64, EngineError> {
        let mut sum = 0.0;
        for u in 0..self.accumulators.len() {
            if let Some(kept) = self.kept_partition(u)? {
                let len = kept.numel() as u64;
                sim::charge(Work::OnDevice(4 * len));
                sum += device_squares(&kept).map_err(|source| EngineError::Torch {
                    rank: self.rank,
                    source,
                })?;
                continue;
            }
            sum += match &self.accumulators[u] {
                Accumulator::Here(acc) => match self.squares[u] {
                    // gathered as its last contribution was added
                    Some(sum) => sum,
                    None => {
                        let range = self.read_range(u, acc);
                        sim::charge(Work::Pass(range.len() as u64));
                        acc.sum_squares(range)
                    }
                },
                Accumulator::Nvme(Stored::Whole { sum_squares }) => *sum_squares,
                // a gradient kept on the device that got nothing this step is zero
                Accumulator::Stale(_) | Accumulator::Nvme(Stored::Nothing) | Accumulator::Device => 0.0,
                Accumulator::Lent(_) => return Err(self.lent(u)),
            };
        }
        Ok(sum)
    }

    /// Stores zeros for every unit that got no gradient this step, so that the optimizer
    /// lane reads a whole gradient of each (before anything is lent to it).
    pub(super) fn store_missing(&mut self, track: &Track) -> Result<(), EngineError> {
        for u in 0..self.accumulators.len() {
            if let Accumulator::Nvme(Stored::Nothing) = self.accumulators[u] {
                let mut zeros = self.lend(u, "compute")?;
                let result = zeros.finish(track);
                self.settle(u, zeros, result.is_ok());
                result?;
            }
        }
        Ok(())
    }

    /// Fails (naming the first) unless every accumulator is here: lending to the
    /// optimizer is all or nothing.
    pub(super) fn all_here(&self) -> Result<(), EngineError> {
        match self
            .accumulators
            .iter()
            .position(|a| matches!(a, Accumulator::Lent(_)))
        {
            Some(u) => Err(self.lent(u)),
            None => Ok(()),
        }
    }

    /// Unit `u`'s final gradient for the optimizer lane: the accumulator itself (lent
    /// until [`Self::take_back`]), or at stage 1 a copy of its partition, or where it
    /// is in the store (after [`Self::store_missing`]; an error before).
    pub(super) fn lend_to_optimizer(&mut self, u: usize) -> Result<FinalGrad, EngineError> {
        if let Some(sum) = self.kept_partition(u)? {
            return Ok(FinalGrad::Device(sum));
        }
        if self.keeps(u) {
            // zeroed before the optimizer's stream took compute's mark, or the zeros
            // would be queued after it
            return Err(EngineError::Invariant {
                rank: self.rank,
                what: "a held gradient sum lent without zero_idle_sums",
            });
        }
        if self.stage == 1 {
            let range = self.partitions[u].clone();
            self.here(u)?;
            let Some(mut copy) = self.copies[u].take() else {
                return Err(EngineError::Lent {
                    rank: self.rank,
                    unit: u,
                    lane: "optimizer",
                });
            };
            if let (Grads::F32(copy), Grads::F32(grad)) = (&mut copy, &*self.here(u)?) {
                copy.copy_from_slice(&grad[range]);
            }
            return Ok(FinalGrad::Here(copy));
        }
        // a stale accumulator is zeroed: no gradient reached it this step
        match std::mem::replace(&mut self.accumulators[u], Accumulator::Lent("optimizer")).zeroed() {
            Accumulator::Here(g) => Ok(FinalGrad::Here(g)),
            Accumulator::Nvme(Stored::Whole { .. }) => Ok(FinalGrad::Stored {
                len: self.partitions[u].len(),
                bf16: self.bf16[u],
            }),
            other => {
                self.accumulators[u] = other;
                Err(self.lent(u))
            }
        }
    }

    /// A gradient back from the optimizer lane: stale for the next step (zeroed by its
    /// first contribution, not here on the compute thread), or (stage 1)
    /// kept as the buffer of the next partition copy, or (stored) nothing this step.
    pub(super) fn take_back(&mut self, u: usize, grad: FinalGrad) {
        self.accumulators[u] = match grad {
            FinalGrad::Here(grad) if self.stage == 1 => {
                self.copies[u] = Some(grad);
                return;
            }
            FinalGrad::Here(grad) => Accumulator::Stale(grad),
            // the host accumulator was not lent
            FinalGrad::Device(_) => return,
            FinalGrad::Stored { .. } => Accumulator::Nvme(Stored::Nothing),
        };
    }

    /// Host bytes of unit `u`'s accumulator, wherever it is now (none when stored or kept
    /// on the device).
    pub(super) fn unit_bytes(&self, u: usize) -> usize {
        if self.in_store[u] || self.keeps(u) {
            return 0;
        }
        let elem = if self.bf16[u] { 2 } else { 4 };
        elem * self.parts[u].accumulator_len(self.stage)
    }

    /// Bytes of unit `u`'s gradient as a device-tier optimizer reads it: its fp32 sum on
    /// the device where it stays there, else its host accumulator's.
    pub(super) fn gradient_bytes(&self, u: usize) -> usize {
        if self.keeps(u) {
            return 4 * self.parts[u].accumulator_len(self.stage);
        }
        self.unit_bytes(u)
    }

    /// Host bytes of the accumulators, wherever they are now, and of the chunk buffers
    /// of stored ones.
    pub(super) fn bytes(&self) -> usize {
        let chunks = self
            .nvme
            .as_ref()
            .map_or(0, |n| n.chunks.count() * n.chunks.buffer_bytes());
        chunks + (0..self.parts.len()).map(|u| self.unit_bytes(u)).sum::<usize>()
    }
}

/// [`round_through`] on an fp32 tensor: in place through a host view on a CPU device (the
/// same conversions), through the wire's kind on a GPU (torch rounds to nearest even and
/// overflows fp16 to infinity alike).
fn round_tensor_through(wire: Wire, t: &Tensor) -> Result<(), tch::TchError> {
    let kind = match wire {
        Wire::Fp32 => return Ok(()),
        Wire::Bf16 => tch::Kind::BFloat16,
        Wire::Fp16 => tch::Kind::Half,
    };
    if t.device() == tch::Device::Cpu {
        // SAFETY: the caller owns the sum for the call (nothing else reads or writes it).
        let values = unsafe { crate::torch::host_slice_mut::<f32>(t, t.numel()) }?;
        round_through(wire, values);
        return Ok(());
    }
    t.shallow_clone().f_copy_(&t.f_to_kind(kind)?)
}

/// Σ g² of a device sum: on a CPU device folded as a host accumulator's pass folds it
/// (the same bits as the host copy a flush would have made); on a GPU in f64 as the host
/// sums, stretch by stretch (a stretch widened to f64 at a time), added there, one value
/// crossing. An fp32 norm of a 262 M-element embedding drifts by ~5e-5 relative.
fn device_squares(sum: &Tensor) -> Result<f64, tch::TchError> {
    if sum.device() == tch::Device::Cpu {
        // SAFETY: the reductions into it are done (the reduce lane is stopped) and
        // nothing writes it before the optimizer reads it, after this.
        let values = unsafe { crate::torch::host_slice::<f32>(sum, sum.numel()) }?;
        return Ok(super::grads::sum_squares_f32(0.0, values));
    }
    widened_squares(sum, 1 << 24)
}

/// Σ x² of an fp32 tensor in f64 on its device, `stretch` elements widened at a time.
fn widened_squares(sum: &Tensor, stretch: i64) -> Result<f64, tch::TchError> {
    let n = sum.numel() as i64;
    let mut total = Tensor::f_zeros([], (tch::Kind::Double, sum.device()))?;
    for start in (0..n).step_by(stretch as usize) {
        let wide = sum
            .f_narrow(0, start, stretch.min(n - start))?
            .f_to_kind(tch::Kind::Double)?;
        total = total.f_add(&wide.f_dot(&wide)?)?;
    }
    total.f_double_value(&[])
}

/// Rounds `values` to `wire`'s precision in place (round to nearest even; fp16 overflows
/// to infinity as it would on the wire).
fn round_through(wire: Wire, values: &mut [f32]) {
    use tierzero_offload::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
    match wire {
        Wire::Fp32 => {}
        Wire::Bf16 => values.iter_mut().for_each(|x| *x = bf16_to_f32(f32_to_bf16(*x))),
        Wire::Fp16 => values.iter_mut().for_each(|x| *x = f16_to_f32(f32_to_f16(*x))),
    }
}

#[cfg(test)]
mod tests {
    /// The GPU's Σ g² (f64, stretch by stretch) is the host pass's up to f64 rounding,
    /// over stretches that do and do not divide the tensor.
    #[test]
    fn widened_squares_are_the_host_pass_to_f64_rounding() {
        let values: Vec<f32> = (0..100_003)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 1e-3)
            .collect();
        let host = super::super::grads::sum_squares_f32(0.0, &values);
        let tensor = tch::Tensor::from_slice(&values);
        for stretch in [1 << 10, 4096, 1 << 20] {
            let device = super::widened_squares(&tensor, stretch).unwrap();
            assert!(
                (device - host).abs() <= 1e-12 * host,
                "{stretch}: {device} against {host}"
            );
        }
    }
}
