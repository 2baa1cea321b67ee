//! Collectives from one primitive: every rank deposits bytes and receives every rank's
//! bytes, in rank order. `Local` (threads) and `Tcp` (processes) provide the primitive;
//! the collectives are computed here, on every rank from the same bytes in rank order,
//! so both give identical, deterministic results.

use super::{Collective, CommError, Element, ReduceOp};
use std::sync::Arc;

pub type Contribution = Arc<Vec<u8>>;

/// The all-to-all byte exchange under [`Local`](super::local::Local) and
/// [`Tcp`](super::tcp::Tcp).
pub trait Exchange: Send + Sync {
    /// This member's rank.
    fn index(&self) -> usize;
    /// Number of members.
    fn size(&self) -> usize;
    /// Deposits `data`; returns every rank's deposit of this round, in rank order.
    fn exchange(&self, data: Vec<u8>) -> Result<Arc<Vec<Contribution>>, CommError>;
    /// Makes every rank's pending and future exchanges fail with `reason`.
    fn cancel(&self, reason: &str);
}

fn to_bytes<T: Element>(data: &[T]) -> Vec<u8> {
    // SAFETY: Pod elements have no padding.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }.to_vec()
}

/// Reads element `i` of a contribution (contributions are not aligned for T).
fn element<T: Element>(bytes: &[u8], i: usize) -> T {
    let size = std::mem::size_of::<T>();
    // SAFETY: the range is in bounds (checked by the caller's length checks) and any
    // bit pattern is a valid T; read_unaligned needs no alignment.
    unsafe { std::ptr::read_unaligned(bytes[i * size..(i + 1) * size].as_ptr().cast::<T>()) }
}

fn shape_error(rank: usize, op: &'static str, message: String) -> CommError {
    CommError::Shape { rank, op, message }
}

/// Every contribution must be `len` bytes (a rank that sent another shape is named).
fn check_lengths(rank: usize, op: &'static str, all: &[Contribution], len: usize) -> Result<(), CommError> {
    match all.iter().position(|b| b.len() != len) {
        Some(r) => Err(shape_error(
            rank,
            op,
            format!("rank {r} sent {} bytes, expected {len}", all[r].len()),
        )),
        None => Ok(()),
    }
}

/// Element `i` reduced over every contribution, in rank order.
fn reduce<T: Element>(all: &[Contribution], i: usize, op: ReduceOp) -> T {
    let mut acc: T = element(&all[0], i);
    for bytes in all.iter().skip(1) {
        acc = acc.add(element(bytes, i));
    }
    if op == ReduceOp::Avg {
        acc.scale(1.0 / all.len() as f64)
    } else {
        acc
    }
}

impl<E: Exchange + 'static> Collective for E {
    fn rank(&self) -> usize {
        self.index()
    }

    fn world(&self) -> usize {
        self.size()
    }

    fn all_gather<T: Element>(&self, shard: &[T], out: &mut [T]) -> Result<(), CommError> {
        let rank = self.index();
        if out.len() != shard.len() * self.size() {
            return Err(shape_error(
                rank,
                "all_gather",
                format!("output {} != world × shard {}", out.len(), shard.len()),
            ));
        }
        let all = self.exchange(to_bytes(shard))?;
        check_lengths(rank, "all_gather", &all, std::mem::size_of_val(shard))?;
        for (r, bytes) in all.iter().enumerate() {
            for (i, o) in out[r * shard.len()..(r + 1) * shard.len()].iter_mut().enumerate() {
                *o = element(bytes, i);
            }
        }
        Ok(())
    }

    fn reduce_scatter<T: Element>(&self, full: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (rank, n) = (self.index(), out.len());
        if full.len() != n * self.size() {
            return Err(shape_error(
                rank,
                "reduce_scatter",
                format!("input {} != world × output {n}", full.len()),
            ));
        }
        let all = self.exchange(to_bytes(full))?;
        check_lengths(rank, "reduce_scatter", &all, std::mem::size_of_val(full))?;
        for (i, o) in out.iter_mut().enumerate() {
            *o = reduce(&all, rank * n + i, op);
        }
        Ok(())
    }

    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let all = self.exchange(to_bytes(data))?;
        check_lengths(self.index(), "all_reduce", &all, std::mem::size_of_val(data))?;
        for (i, o) in data.iter_mut().enumerate() {
            *o = reduce(&all, i, op);
        }
        Ok(())
    }

    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<(), CommError> {
        let rank = self.index();
        let all = self.exchange(if rank == root { to_bytes(data) } else { Vec::new() })?;
        let sent = all.get(root).map_or(0, |b| b.len());
        if sent != std::mem::size_of_val(data) {
            return Err(shape_error(
                rank,
                "broadcast",
                format!(
                    "root {root} sent {sent} bytes, expected {}",
                    std::mem::size_of_val(data)
                ),
            ));
        }
        for (i, o) in data.iter_mut().enumerate() {
            *o = element(&all[root], i);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.exchange(Vec::new()).map(drop)
    }

    fn abort(&self, reason: &str) {
        self.cancel(reason)
    }
}
