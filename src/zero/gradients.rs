//! The owner of a rank's gradient accumulators: one per unit (the optimizer partition at
//! stages 2–3, the whole padded unit at 0–1), each either here or lent — to the reduce
//! lane while a reduce-scatter adds into it, or to the optimizer lane while AdamW reads
//! it — and the reduce lane's end on the compute thread.

use super::error::EngineError;
use super::grads::Grads;
use super::partition::Partition;
use super::reduce::{reduce_into, ChunkBuffers, Reducer, Target, CHUNK_LIMIT};
use crate::comm::{Collective, ReduceOp};
use crate::metrics::timeline::Track;
use std::ops::Range;
use tch::Tensor;
use tierzero_offload::arena::Pinning;

/// Where a unit's accumulator is.
#[derive(Debug)]
pub(super) enum Accumulator {
    Here(Grads),
    /// On a lane (named), coming back with its job.
    Lent(&'static str),
}

pub(super) struct Gradients<'a, C: Collective> {
    accumulators: Vec<Accumulator>,
    /// Stage 1: the buffers the optimizer partition is copied into for the optimizer
    /// lane (the replica's accumulator stays here, whole); None while lent.
    copies: Vec<Option<Grads>>,
    parts: Vec<Partition>,
    /// Each unit's optimizer partition within its padded buffer.
    partitions: Vec<Range<usize>>,
    stage: u8,
    rank: usize,
    /// Accumulate in bf16 (see `rank::bf16_gradients`).
    bf16: bool,
    /// The reduce lane of the step in progress, when gradients are reduced off-thread.
    reducer: Option<Reducer<'a, C>>,
    /// The chunk buffers of reductions on this thread, reused across units and steps.
    chunk_buffers: ChunkBuffers,
}

impl<'a, C: Collective + Clone + 'a> Gradients<'a, C> {
    /// Every unit's accumulator, zeroed, in one arena (and at stage 1 the partition
    /// copies in another), allocated here once for the run.
    pub(super) fn new(
        (stage, rank, bf16): (u8, usize, bool),
        parts: Vec<Partition>,
        partitions: Vec<Range<usize>>,
        pinning: &Pinning,
    ) -> Result<Self, EngineError> {
        let carve_err = |what: &'static str| move |source| EngineError::Arena { rank, what, source };
        let lens: Vec<usize> = parts
            .iter()
            .zip(&partitions)
            .map(|(p, r)| accumulator_len(stage, p, r))
            .collect();
        let accumulators = Grads::carve(&lens, bf16, pinning)
            .map_err(carve_err("gradient"))?
            .into_iter()
            .map(Accumulator::Here)
            .collect();
        let copies = if stage == 1 {
            let lens: Vec<usize> = partitions.iter().map(|r| r.len()).collect();
            Grads::carve(&lens, false, pinning)
                .map_err(carve_err("stage-1 gradient copy"))?
                .into_iter()
                .map(Some)
                .collect()
        } else {
            parts.iter().map(|_| None).collect()
        };
        Ok(Gradients {
            accumulators,
            copies,
            parts,
            partitions,
            stage,
            rank,
            bf16,
            reducer: None,
            chunk_buffers: ChunkBuffers::default(),
        })
    }

    fn here(&mut self, u: usize) -> Result<&mut Grads, EngineError> {
        match &mut self.accumulators[u] {
            Accumulator::Here(g) => Ok(g),
            Accumulator::Lent(lane) => Err(EngineError::Lent {
                rank: self.rank,
                unit: u,
                lane,
            }),
        }
    }

    /// Zeroes every accumulator here for a new step (one lent to the optimizer comes
    /// back zeroed).
    pub(super) fn zero(&mut self) {
        for acc in &mut self.accumulators {
            if let Accumulator::Here(g) = acc {
                g.fill_zero();
            }
        }
    }

    /// Reduces through `reducer` (the reduce lane) until [`Self::stop_reducing`].
    pub(super) fn reduce_on(&mut self, reducer: Reducer<'a, C>) {
        self.reducer = Some(reducer);
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
        std::mem::take(&mut self.chunk_buffers)
    }

    /// Adds a unit's flat gradient (numel elements, the compute kind) into its
    /// accumulator: reduce-scattered at stages 2–3 (on the reduce lane when it runs),
    /// else added to the replica's accumulator.
    pub(super) fn accumulate(
        &mut self,
        u: usize,
        grad: &Tensor,
        comm: &C,
        track: &Track,
    ) -> Result<(), EngineError> {
        let part = self.parts[u];
        if self.stage >= 2 && self.reducer.is_some() {
            // a unit reduced twice in a micro-batch (the tied embedding): its accumulator
            // comes back from the lane first
            while self.reducer.as_ref().is_some_and(|r| r.holds(u)) {
                self.take_one(true)?;
            }
            let acc = std::mem::replace(&mut self.accumulators[u], Accumulator::Lent("reduce"));
            let Accumulator::Here(acc) = acc else {
                self.accumulators[u] = acc;
                return Err(self.lent(u));
            };
            if let Some(reducer) = self.reducer.as_mut() {
                if let Some((v, back)) = reducer.send(u, grad.shallow_clone(), part, acc)? {
                    self.accumulators[v] = Accumulator::Here(back);
                }
            }
            return self.absorb(false);
        }
        let target = if self.stage >= 2 {
            Target::Shard
        } else {
            Target::Replica
        };
        let Accumulator::Here(acc) = &mut self.accumulators[u] else {
            return Err(self.lent(u));
        };
        reduce_into(
            comm,
            target,
            u,
            grad,
            part,
            acc,
            &mut self.chunk_buffers,
            track,
            CHUNK_LIMIT,
        )
    }

    fn lent(&self, u: usize) -> EngineError {
        let lane = match self.accumulators[u] {
            Accumulator::Lent(lane) => lane,
            Accumulator::Here(_) => "compute",
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
            Some((u, acc)) => {
                self.accumulators[u] = Accumulator::Here(acc);
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

    /// Stages 0–1: every replica's gradient averaged over the ranks (once per step).
    pub(super) fn all_reduce_replicas(&mut self, comm: &C) -> Result<(), EngineError> {
        if self.stage >= 2 {
            return Ok(());
        }
        let rank = self.rank;
        for u in 0..self.accumulators.len() {
            match self.here(u)? {
                Grads::F32(g) => comm.all_reduce(g, ReduceOp::Avg)?,
                Grads::Bf16(_) => {
                    return Err(EngineError::Invariant {
                        rank,
                        what: "bf16 accumulators exist only at stages 2-3 (rank::bf16_gradients)",
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

    /// Σ g² over this rank's optimizer partitions, in f64.
    pub(super) fn sum_squares(&mut self) -> Result<f64, EngineError> {
        let mut sum = 0.0;
        for u in 0..self.accumulators.len() {
            let Accumulator::Here(acc) = &self.accumulators[u] else {
                return Err(self.lent(u));
            };
            sum += acc.sum_squares(self.read_range(u, acc));
        }
        Ok(sum)
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
    /// until [`Self::take_back`]), or at stage 1 a copy of its partition.
    pub(super) fn lend_to_optimizer(&mut self, u: usize) -> Result<Grads, EngineError> {
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
            return Ok(copy);
        }
        match std::mem::replace(&mut self.accumulators[u], Accumulator::Lent("optimizer")) {
            Accumulator::Here(g) => Ok(g),
            lent => {
                self.accumulators[u] = lent;
                Err(self.lent(u))
            }
        }
    }

    /// A gradient back from the optimizer lane: zeroed for the next step, or (stage 1)
    /// kept as the buffer of the next partition copy.
    pub(super) fn take_back(&mut self, u: usize, mut grad: Grads) {
        if self.stage == 1 {
            self.copies[u] = Some(grad);
        } else {
            grad.fill_zero();
            self.accumulators[u] = Accumulator::Here(grad);
        }
    }

    /// Bytes of unit `u`'s accumulator, wherever it is now.
    pub(super) fn unit_bytes(&self, u: usize) -> usize {
        let elem = if self.bf16 { 2 } else { 4 };
        elem * accumulator_len(self.stage, &self.parts[u], &self.partitions[u])
    }

    /// Host bytes of the accumulators, wherever they are now.
    pub(super) fn bytes(&self) -> usize {
        (0..self.parts.len()).map(|u| self.unit_bytes(u)).sum()
    }
}

/// Elements of a unit's accumulator: its optimizer partition at stages 2–3 (gradients
/// are reduce-scattered into it), the whole padded unit at 0–1.
fn accumulator_len(stage: u8, part: &Partition, partition: &Range<usize>) -> usize {
    if stage >= 2 {
        partition.len()
    } else {
        part.padded
    }
}
