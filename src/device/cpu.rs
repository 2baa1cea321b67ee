//! `CpuDevice`: host memory standing in for a GPU, counted against a budget.

use super::OutOfMemory;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug)]
pub struct CpuDevice {
    rank: usize,
    budget: u64,
    current: AtomicU64,
    peak: AtomicU64,
    window_peak: AtomicU64,
}

/// Bytes held on a device; released when dropped.
#[derive(Debug)]
pub struct Reservation {
    device: Arc<CpuDevice>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.device.current.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

impl CpuDevice {
    /// A device for `rank` with `budget` bytes (`u64::MAX` for no limit).
    pub fn new(rank: usize, budget: u64) -> Arc<CpuDevice> {
        Arc::new(CpuDevice {
            rank,
            budget,
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            window_peak: AtomicU64::new(0),
        })
    }

    /// Reserves `bytes` for `what`, or fails without reserving anything.
    pub fn reserve(self: &Arc<Self>, bytes: u64, what: &str) -> Result<Reservation, OutOfMemory> {
        let mut current = self.current.load(Ordering::SeqCst);
        loop {
            let next = current.saturating_add(bytes);
            if next > self.budget {
                return Err(OutOfMemory {
                    rank: self.rank,
                    what: what.to_string(),
                    requested: bytes,
                    in_use: current,
                    budget: self.budget,
                });
            }
            match self
                .current
                .compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::SeqCst);
                    self.window_peak.fetch_max(next, Ordering::SeqCst);
                    return Ok(Reservation {
                        device: self.clone(),
                        bytes,
                    });
                }
                Err(actual) => current = actual,
            }
        }
    }

    pub fn current(&self) -> u64 {
        self.current.load(Ordering::SeqCst)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// The peak since the last call (per-step memory in the breakdown).
    pub fn take_window_peak(&self) -> u64 {
        self.window_peak.swap(self.current(), Ordering::SeqCst)
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_current_and_peak_and_refuses_over_budget() {
        let d = CpuDevice::new(3, 1000);
        let a = d.reserve(600, "params").unwrap();
        let e = d.reserve(500, "gather buffer").unwrap_err();
        assert_eq!(e.to_string().split(':').next().unwrap(), "rank 3");
        assert!(
            e.to_string().contains("500 bytes for gather buffer") && e.to_string().contains("600 of 1000")
        );
        drop(a);
        let _b = d.reserve(900, "grads").unwrap();
        assert_eq!((d.current(), d.peak()), (900, 900));
    }
}
