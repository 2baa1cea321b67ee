//! `Local`: N ranks as threads of one process, at memory speed.
//!
//! Every collective is one rendezvous in two phases, as an intra-node NCCL ring does
//! with peer pointers instead of bytes on a wire:
//! 1. *publish*: each rank posts the address of its input and waits until every rank has
//!    posted (the last to arrive opens the round for reading);
//! 2. *read*: each rank reads its peers' inputs in place (memcpy for gathers, a
//!    vectorised sum in rank order for reductions) into its own output, then waits until
//!    every rank has finished reading before it returns, so no input changes or is freed
//!    while a peer reads it.
//!
//! Nothing is copied into an intermediate buffer and nothing is allocated, except the
//! result of an in-place `all_reduce`, which must not overwrite its input before the
//! peers have read it. A reduce-scatter of 16-bit tensors reads the posted bits too,
//! widening each element as it sums (`reduce_into`), where the generic path widens every
//! rank's whole input into fp32 first. Sums run in rank order, element by element (`x0 + x1 + …`, then
//! the mean's scale in f64), so results are deterministic, and equal bit for bit to the
//! Gloo communicators' for two ranks (`gloo.rs` tests it).
//!
//! A rank that fails calls `abort`; ranks waiting to publish, or arriving later, get an
//! error naming the reason instead of hanging. A round that is already open for reading
//! finishes (reading never blocks), so no rank returns while a peer reads its buffer.

use super::{tensors, Collective, CommError, Element, ReduceOp};
use std::sync::{Arc, Condvar, Mutex};
use tch::{Device, Kind, Tensor};
use tierzero_offload::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// One rank's posted input: the collective, an address and a length in bytes.
#[derive(Clone, Copy, Default)]
struct Posted {
    op: &'static str,
    address: usize,
    bytes: usize,
}

impl Posted {
    fn of<T>(op: &'static str, data: &[T]) -> Posted {
        Posted {
            op,
            address: data.as_ptr() as usize,
            bytes: std::mem::size_of_val(data),
        }
    }
}

#[derive(Default)]
struct Round {
    posted: Vec<Posted>,
    /// Which ranks have posted in this round.
    filled: Vec<bool>,
    arrived: usize,
    /// All ranks have posted: peers may read (until `finished` reaches the world).
    open: bool,
    finished: usize,
    /// Counts rounds, so a waiter knows its round has closed.
    generation: u64,
    aborted: Option<String>,
}

struct Hub {
    world: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

/// One rank of a local communicator.
#[derive(Clone)]
pub struct Local {
    hub: Arc<Hub>,
    rank: usize,
}

/// Every rank's posted input during the read phase.
struct Peers<'r> {
    posted: &'r [Posted],
}

impl Peers<'_> {
    /// Rank `r`'s input as elements of `T`.
    ///
    /// # Safety
    /// Only between publish and finish of the round that posted it, and `T` must be the
    /// element type every rank posted (checked by length in the callers).
    unsafe fn input<T>(&self, r: usize) -> &[T] {
        let p = self.posted[r];
        // SAFETY: the address came from a live `&[T]`/`&mut [T]` of rank r, which does
        // not touch it until every rank has finished reading (phase 2 of the round).
        unsafe { std::slice::from_raw_parts(p.address as *const T, p.bytes / std::mem::size_of::<T>()) }
    }
}

impl Local {
    /// Handles for ranks 0..world.
    pub fn group(world: usize) -> Vec<Local> {
        let hub = Arc::new(Hub {
            world,
            round: Mutex::new(Round {
                posted: vec![Posted::default(); world],
                filled: vec![false; world],
                ..Round::default()
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| Local {
                hub: hub.clone(),
                rank,
            })
            .collect()
    }

    fn aborted(&self, reason: &str) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            reason: reason.to_string(),
        }
    }

    fn shape(&self, op: &'static str, message: String) -> CommError {
        CommError::Shape {
            rank: self.rank,
            op,
            message,
        }
    }

    /// Runs one round: posts `input`, runs `read` over every rank's posted input once
    /// all have posted, and returns after every rank has read. The caller must not touch
    /// `input`'s memory until this returns (it takes the address, not a borrow, so an
    /// in-place collective can write its own buffer afterwards).
    ///
    /// As NCCL requires, every rank issues the same collectives in the same order, one
    /// at a time per communicator: a round where ranks issued different collectives, or
    /// a rank issuing a second one while its first waits, fails naming them.
    fn round<R>(&self, input: Posted, read: impl FnOnce(&Peers<'_>) -> R) -> Result<R, CommError> {
        let hub = &self.hub;
        let mut round = hub.round.lock().unwrap_or_else(|e| e.into_inner());
        // the previous round must be closed (its readers finish without blocking)
        while round.open {
            round = hub.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(reason) = &round.aborted {
            return Err(self.aborted(reason));
        }
        if round.filled[self.rank] {
            let first = round.posted[self.rank].op;
            return Err(self.shape(
                input.op,
                format!(
                    "rank {} issued it while its {first} waits on the same communicator: a communicator's collectives must come from one thread",
                    self.rank
                ),
            ));
        }
        round.posted[self.rank] = input;
        round.filled[self.rank] = true;
        round.arrived += 1;
        let posted_at = std::time::Instant::now();
        let generation = round.generation;
        if round.arrived == hub.world {
            round.open = true;
            hub.changed.notify_all();
        }
        while !round.open {
            if let Some(reason) = round.aborted.clone() {
                // nobody can read this round: withdraw and fail
                round.arrived -= 1;
                round.posted[self.rank] = Posted::default();
                round.filled[self.rank] = false;
                return Err(self.aborted(&reason));
            }
            round = hub.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
        let posted = round.posted.clone();
        drop(round);
        super::add_peer_wait(posted_at.elapsed());
        let other = posted.iter().position(|p| p.op != input.op);
        let result = match other {
            None => Ok(read(&Peers { posted: &posted })),
            Some(r) => Err(self.shape(
                input.op,
                format!(
                    "rank {r} issued {} where rank {} issued {}: the ranks' collectives are out of order",
                    posted[r].op, self.rank, input.op
                ),
            )),
        };
        let read_at = std::time::Instant::now();
        let mut round = hub.round.lock().unwrap_or_else(|e| e.into_inner());
        round.finished += 1;
        if round.finished == hub.world {
            round.open = false;
            round.arrived = 0;
            round.finished = 0;
            round.filled.iter_mut().for_each(|f| *f = false);
            round.generation += 1;
            hub.changed.notify_all();
        }
        // readers never block, so this wait ends even after an abort
        while round.generation == generation {
            round = hub.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
        drop(round);
        super::add_peer_wait(read_at.elapsed());
        result
    }

    /// A reduce-scatter of two contiguous host tensors of one 16-bit kind, its
    /// elements widened to fp32 and rounded by `convert` ([`reduce_into`]).
    fn reduce_scatter_16(
        &self,
        full: &Tensor,
        out: &Tensor,
        op: ReduceOp,
        convert: (impl Fn(u16) -> f32, impl Fn(f32) -> u16),
    ) -> Result<(), CommError> {
        tensors::check_sizes(self, "reduce_scatter", out, full)?;
        // SAFETY: the input is only read; the output is this collective's (the contract
        // of `tensors::host_views`, as for the generic path).
        let (full, out) = unsafe { tensors::host_views::<u16>(self.rank, "reduce_scatter", full, out) }?;
        let (world, n) = (self.hub.world, out.len());
        self.round(Posted::of("reduce_scatter", full), |peers| {
            self.same_bytes("reduce_scatter", peers, std::mem::size_of_val(full))?;
            reduce_into(peers, (world, self.rank * n), out, op, convert);
            Ok(())
        })?
    }

    /// Fails collective `op` naming the first rank whose posted length differs from
    /// `want` bytes.
    fn same_bytes(&self, op: &'static str, peers: &Peers<'_>, want: usize) -> Result<(), CommError> {
        match self.mismatch(peers, want) {
            Some((r, bytes)) => Err(self.shape(op, format!("rank {r} sent {bytes} bytes, expected {want}"))),
            None => Ok(()),
        }
    }

    /// The rank whose posted length differs from `want` bytes, if any.
    fn mismatch(&self, peers: &Peers<'_>, want: usize) -> Option<(usize, usize)> {
        (0..self.hub.world)
            .map(|r| (r, peers.posted[r].bytes))
            .find(|&(_, bytes)| bytes != want)
    }
}

/// `out[i] = Σ_r inputs[r][offset + i]` in rank order, then scaled for a mean, in
/// cache-sized blocks (each element's additions happen in the same order as a scalar
/// loop, so the result does not depend on the blocking). The sums are in `T`: each
/// posted element widened by `widen` and each sum rounded once into `out` by `round`
/// (identities where the inputs are `T`s; for 16-bit inputs the same bits as widening
/// every rank's input to fp32, reducing the copies and rounding the result, which
/// `tensors::reduce_scatter` does, with a third of the memory traffic).
fn reduce_into<S: Copy, T: Element>(
    peers: &Peers<'_>,
    (world, offset): (usize, usize),
    out: &mut [S],
    op: ReduceOp,
    (widen, round): (impl Fn(S) -> T, impl Fn(T) -> S),
) {
    const BLOCK: usize = 4096;
    let scale = 1.0 / world as f64;
    let mut sums = [T::default(); BLOCK];
    for (b, block) in out.chunks_mut(BLOCK).enumerate() {
        let (start, len) = (offset + b * BLOCK, block.len());
        let sums = &mut sums[..len];
        // SAFETY: called in the read phase with lengths checked against `S`.
        let first: &[S] = unsafe { peers.input(0) };
        for (s, &x) in sums.iter_mut().zip(&first[start..start + len]) {
            *s = widen(x);
        }
        for r in 1..world {
            // SAFETY: as above.
            let peer: &[S] = unsafe { peers.input(r) };
            for (s, &x) in sums.iter_mut().zip(&peer[start..start + len]) {
                *s = s.add(widen(x));
            }
        }
        if op == ReduceOp::Avg {
            for s in sums.iter_mut() {
                *s = s.scale(scale);
            }
        }
        for (o, &s) in block.iter_mut().zip(sums.iter()) {
            *o = round(s);
        }
    }
}

/// [`reduce_into`] of `T`s into `T`s.
fn reduce_same<T: Element>(peers: &Peers<'_>, at: (usize, usize), out: &mut [T], op: ReduceOp) {
    reduce_into(peers, at, out, op, (|x: T| x, |x: T| x));
}

impl Collective for Local {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.hub.world
    }

    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError> {
        let (world, n) = (self.hub.world, shard.len());
        if out.len() != n * world {
            return Err(self.shape("all_gather", format!("output {} != world × shard {n}", out.len())));
        }
        self.round(Posted::of("all_gather", shard), |peers| {
            self.same_bytes("all_gather", peers, std::mem::size_of_val(shard))?;
            for (r, slot) in out.chunks_mut(n.max(1)).enumerate().take(world) {
                // SAFETY: read phase; every rank posted n elements of T (checked above).
                slot.copy_from_slice(unsafe { peers.input::<T>(r) });
            }
            Ok(())
        })?
    }

    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (world, n) = (self.hub.world, out.len());
        if full.len() != n * world {
            return Err(self.shape(
                "reduce_scatter",
                format!("input {} != world × output {n}", full.len()),
            ));
        }
        self.round(Posted::of("reduce_scatter", full), |peers| {
            self.same_bytes("reduce_scatter", peers, std::mem::size_of_val(full))?;
            reduce_same(peers, (world, self.rank * n), out, op);
            Ok(())
        })?
    }

    /// 16-bit tensors in host memory reduce from the posted bits ([`reduce_into`]); any
    /// other through [`tensors::reduce_scatter`].
    fn reduce_scatter_tensor(&self, full: &Tensor, out: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        let in_host = |t: &Tensor| t.device() == Device::Cpu && t.is_contiguous();
        let native = self.hub.world > 1 && in_host(full) && in_host(out) && full.kind() == out.kind();
        match full.kind() {
            Kind::BFloat16 if native => self.reduce_scatter_16(full, out, op, (bf16_to_f32, f32_to_bf16)),
            Kind::Half if native => self.reduce_scatter_16(full, out, op, (f16_to_f32, f32_to_f16)),
            _ => tensors::reduce_scatter(self, full, out, op),
        }
    }

    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let world = self.hub.world;
        let mut result = vec![T::default(); data.len()];
        self.round(Posted::of("all_reduce", data), |peers| {
            self.same_bytes("all_reduce", peers, std::mem::size_of_val(&result[..]))?;
            reduce_same(peers, (world, 0), &mut result, op);
            Ok(())
        })??;
        // every peer has read `data`: now it may change
        data.copy_from_slice(&result);
        Ok(())
    }

    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError> {
        let world = self.hub.world;
        if root >= world {
            return Err(self.shape("broadcast", format!("root {root} is not a rank of {world}")));
        }
        let want = std::mem::size_of_val(data);
        // only the root's input is read; every other rank writes its own buffer
        let rank = self.rank;
        self.round(Posted::of("broadcast", data), |peers| {
            let sent = peers.posted[root].bytes;
            if sent != want {
                return Err(self.shape(
                    "broadcast",
                    format!("root {root} sent {sent} bytes, expected {want}"),
                ));
            }
            if rank != root {
                // SAFETY: read phase; the root posted `want` bytes of T. This rank's own
                // buffer is read by no one (only the root's is), so it may be written.
                data.copy_from_slice(unsafe { peers.input::<T>(root) });
            }
            Ok(())
        })?
    }

    fn barrier(&self) -> Result<(), CommError> {
        let none: &[u8] = &[];
        self.round(Posted::of("barrier", none), |_| ())
    }

    fn abort(&self, reason: &str) {
        let mut round = self.hub.round.lock().unwrap_or_else(|e| e.into_inner());
        round.aborted.get_or_insert_with(|| reason.to_string());
        self.hub.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Collective, ReduceOp};

    fn run<R: Send>(world: usize, body: impl Fn(Local) -> R + Sync) -> Vec<R> {
        let ranks = Local::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(|| body(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A rank early at a collective's rendezvous counts its wait for the late one
    /// (`take_peer_wait`): the engine records it as a wait, not as the collective's work.
    #[test]
    fn a_rank_early_at_a_collective_counts_its_wait_for_the_late_one() {
        let (arriving, arrived) = std::sync::mpsc::sync_channel(1);
        let arrived = std::sync::Mutex::new(arrived);
        let waits = run(2, |c| {
            let _ = crate::comm::take_peer_wait();
            if c.rank() == 0 {
                arriving.send(()).unwrap();
            } else {
                // rank 1 comes 100 ms after rank 0 set off for the collective
                arrived.lock().unwrap().recv().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let mut out = [0f32; 2];
            c.all_gather(&[c.rank() as f32], &mut out).unwrap();
            assert_eq!(out, [0.0, 1.0]);
            // taken once
            (crate::comm::take_peer_wait(), crate::comm::take_peer_wait())
        });
        // the early rank waited for most of the late one's sleep (a lower bound with room
        // for a descheduled thread, not a timing)
        assert!(waits[0].0 >= std::time::Duration::from_millis(20), "{waits:?}");
        assert!(
            waits.iter().all(|w| w.1 == std::time::Duration::ZERO),
            "{waits:?}"
        );
    }

    /// A 16-bit reduce-scatter from the posted bits gives the bits of the generic path
    /// (every rank's input widened to fp32, reduced, rounded once), for bf16 and fp16,
    /// two and three ranks, sum and mean, with the last block shorter than the others.
    #[test]
    fn sixteen_bit_reduce_scatter_equals_the_widened_path_bit_for_bit() {
        for kind in [Kind::BFloat16, Kind::Half] {
            for world in [2, 3] {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let n = 4096 + 1000;
                    let results = run(world, |c| {
                        let _guard = tch::no_grad_guard();
                        tch::manual_seed(17 + c.rank() as i64);
                        // values of mixed scale, so that sums round
                        let full = (Tensor::randn([(n * world) as i64], (Kind::Float, Device::Cpu))
                            * Tensor::randn([(n * world) as i64], (Kind::Float, Device::Cpu)).exp())
                        .to_kind(kind);
                        let native = Tensor::zeros([n as i64], (kind, Device::Cpu));
                        c.reduce_scatter_tensor(&full, &native, op).unwrap();
                        let widened = Tensor::zeros([n as i64], (kind, Device::Cpu));
                        tensors::reduce_scatter(&c, &full, &widened, op).unwrap();
                        (native, widened)
                    });
                    for (rank, (native, widened)) in results.iter().enumerate() {
                        let bits = |t: &Tensor| Vec::<i16>::try_from(t.view_dtype(Kind::Int16)).unwrap();
                        assert_eq!(
                            bits(native),
                            bits(widened),
                            "{kind:?}, {world} ranks, {op:?}, rank {rank}"
                        );
                    }
                }
            }
        }
    }

    /// Ranks that issue different collectives in one round fail, naming both: the
    /// order NCCL needs, checked on every `Local` run.
    #[test]
    fn collectives_out_of_order_fail_naming_both() {
        let errors = run(2, |c| {
            let mut out = [0f32; 2];
            if c.rank() == 0 {
                c.all_gather(&[1f32], &mut out).unwrap_err().to_string()
            } else {
                // the same bytes, another collective
                c.reduce_scatter(&[1f32, 2.0], &mut out[..1], ReduceOp::Sum)
                    .unwrap_err()
                    .to_string()
            }
        });
        for e in errors {
            assert!(
                e.contains("out of order") && e.contains("all_gather") && e.contains("reduce_scatter"),
                "{e}"
            );
        }
    }

    /// A second collective of one rank on a communicator while its first waits (two
    /// threads issuing) fails at once, naming the rule.
    #[test]
    fn two_threads_of_one_rank_on_one_communicator_fail() {
        let ranks = Local::group(2);
        let rank0 = ranks[0].clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            for _ in 0..2 {
                let (c, tx) = (rank0.clone(), tx.clone());
                s.spawn(move || {
                    let _ = tx.send(c.barrier());
                });
            }
            // rank 1 never comes: the first result is the second issuer's error
            let first = rx.recv().unwrap().unwrap_err().to_string();
            assert!(first.contains("one thread"), "{first}");
            rank0.abort("test over");
            let second = rx.recv().unwrap().unwrap_err().to_string();
            assert!(second.contains("test over"), "{second}");
        });
    }

    #[test]
    fn gather_scatter_reduce_broadcast() {
        for world in 1..=4 {
            let results = run(world, |c| {
                let r = c.rank() as f32;
                let mut gathered = vec![0f32; 2 * world];
                c.all_gather(&[r, r + 0.5], &mut gathered).unwrap();
                let full: Vec<f32> = (0..2 * world).map(|i| i as f32 + r).collect();
                let mut mine = vec![0f32; 2];
                c.reduce_scatter(&full, &mut mine, ReduceOp::Sum).unwrap();
                let mut sum = [r as f64];
                c.all_reduce(&mut sum, ReduceOp::Avg).unwrap();
                let mut b = [r * 10.0];
                c.broadcast(&mut b, world - 1).unwrap();
                for _ in 0..50 {
                    c.barrier().unwrap();
                }
                (gathered, mine, sum[0], b[0])
            });
            let w = world as f32;
            let rank_sum: f32 = (0..world).map(|r| r as f32).sum();
            for (rank, (gathered, mine, avg, b)) in results.into_iter().enumerate() {
                let expected: Vec<f32> = (0..world).flat_map(|r| [r as f32, r as f32 + 0.5]).collect();
                assert_eq!(gathered, expected);
                let i0 = (2 * rank) as f32;
                assert_eq!(mine, vec![i0 * w + rank_sum, (i0 + 1.0) * w + rank_sum]);
                assert_eq!(avg, rank_sum as f64 / world as f64);
                assert_eq!(b, (world - 1) as f32 * 10.0);
            }
        }
    }

    /// Rank r's input: values whose sums round differently in another order.
    fn values(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = ((i * 2654435761 + rank * 40503) % 1_000_003) as f32 / 1_000_003.0;
                (x - 0.5) * 10f32.powi((i % 7) as i32 - 3)
            })
            .collect()
    }

    #[test]
    fn reductions_equal_the_scalar_rank_order_reference_bit_for_bit() {
        // lengths that hit the 4096-element blocks' tails
        for world in 1..=4 {
            for shard in [1, 22, 4097, 3 * 4096 + 5] {
                let results = run(world, |c| {
                    let full = values(c.rank(), shard * world);
                    let mut sum = vec![0f32; shard];
                    c.reduce_scatter(&full, &mut sum, ReduceOp::Sum).unwrap();
                    let mut mean = vec![0f32; shard];
                    c.reduce_scatter(&full, &mut mean, ReduceOp::Avg).unwrap();
                    let mut all = full.clone();
                    c.all_reduce(&mut all, ReduceOp::Avg).unwrap();
                    let mut gathered = vec![0f32; shard * world];
                    c.all_gather(&full[..shard], &mut gathered).unwrap();
                    (sum, mean, all, gathered)
                });
                // the reference: a scalar loop, ranks in order, the mean scaled in f64
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, shard * world)).collect();
                let reference = |i: usize, avg: bool| {
                    let mut acc = inputs[0][i];
                    for input in &inputs[1..] {
                        acc += input[i];
                    }
                    if avg {
                        (f64::from(acc) * (1.0 / world as f64)) as f32
                    } else {
                        acc
                    }
                };
                let gathered: Vec<f32> = inputs.iter().flat_map(|v| v[..shard].to_vec()).collect();
                for (rank, (sum, mean, all, got)) in results.into_iter().enumerate() {
                    for i in 0..shard {
                        let j = rank * shard + i;
                        assert_eq!(
                            sum[i].to_bits(),
                            reference(j, false).to_bits(),
                            "world {world} i {j}"
                        );
                        assert_eq!(mean[i].to_bits(), reference(j, true).to_bits());
                    }
                    for (j, &a) in all.iter().enumerate() {
                        assert_eq!(a.to_bits(), reference(j, true).to_bits());
                    }
                    assert_eq!(got, gathered);
                }
            }
        }
    }

    #[test]
    fn a_rank_with_another_shape_is_named() {
        let results = run(2, |c| {
            let shard = vec![1f32; 1 + c.rank()];
            let mut out = vec![0f32; 2 * shard.len()];
            c.all_gather(&shard, &mut out).unwrap_err().to_string()
        });
        assert!(
            results[0].contains("rank 1 sent 8 bytes, expected 4"),
            "{}",
            results[0]
        );
    }

    #[test]
    fn a_failing_rank_makes_every_rank_fail_instead_of_hanging() {
        let results = run(3, |c| {
            if c.rank() == 1 {
                c.abort("rank 1 failed: out of memory");
                return Err(c.rank());
            }
            let mut x = [1.0f32];
            c.all_reduce(&mut x, ReduceOp::Sum).map_err(|e| {
                assert!(e.to_string().contains("rank 1 failed"), "{e}");
                c.rank()
            })
        });
        assert!(results.iter().all(Result::is_err));
    }
}
