//! Pools of reusable buffers whose release waits for the event of their last use.
//!
//! The step takes buffers (gathered units, shard staging, gradient buckets) from pools
//! that grow to the working set in the first step and then stop allocating: a buffer is
//! taken, handed to lanes, and released with the event of its last use; it becomes
//! reusable only once that event has fired (`keep_until`). Sizes are best fit, so units
//! of a few shapes (embedding, blocks, head) settle on a few buffers each.
//!
//! In checked mode ([`Mode::Checked`]) a buffer is NaN-filled the moment it becomes
//! reusable and again when it is handed out, and fresh buffers start as NaN: a release
//! before the last use's event, or a read before the producer's event, feeds NaN (or
//! another unit's data) into the step and fails the equivalence tests instead of passing
//! by luck of timing.

use super::lanes::{Event, Mode};
use tch::{Kind, Tensor};

/// A buffer a pool can hold.
pub trait Buffer: Send {
    /// Elements it can hold.
    fn capacity(&self) -> usize;
    /// Overwrites it with NaN (checked mode).
    fn poison(&mut self);
}

impl Buffer for Tensor {
    fn capacity(&self) -> usize {
        self.numel()
    }

    fn poison(&mut self) {
        // a failed fill leaves the buffer as it was: checked mode only loses its bite
        let _ = self.f_fill_(f64::NAN);
    }
}

impl Buffer for Vec<f32> {
    fn capacity(&self) -> usize {
        self.len()
    }

    fn poison(&mut self) {
        self.fill(f32::NAN);
    }
}

/// Reusable buffers of one kind.
pub struct Pool<B: Buffer> {
    free: Vec<B>,
    /// Released buffers whose last use may still be running.
    pending: Vec<(Event, B)>,
    mode: Mode,
    allocated: usize,
    allocated_elements: usize,
}

impl<B: Buffer> Pool<B> {
    pub fn new(mode: Mode) -> Pool<B> {
        Pool {
            free: Vec::new(),
            pending: Vec::new(),
            mode,
            allocated: 0,
            allocated_elements: 0,
        }
    }

    /// A buffer of at least `len` elements: the smallest free one that fits, else one
    /// made by `make(len)` (NaN-filled in checked mode).
    pub fn take<E>(&mut self, len: usize, make: impl FnOnce(usize) -> Result<B, E>) -> Result<B, E> {
        self.collect();
        if let Some(i) = best_fit(&self.free, len, B::capacity) {
            let mut reused = self.free.swap_remove(i);
            if self.mode.is_checked() {
                // as the next user's writes would: a reader still holding it sees NaN
                reused.poison();
            }
            return Ok(reused);
        }
        let mut fresh = make(len)?;
        self.allocated += 1;
        self.allocated_elements += fresh.capacity();
        if self.mode.is_checked() {
            fresh.poison();
        }
        Ok(fresh)
    }

    /// Returns `buffer`, reusable once `last_use` has fired.
    pub fn release(&mut self, buffer: B, last_use: Event) {
        self.pending.push((last_use, buffer));
        self.collect();
    }

    /// Moves buffers whose last use has finished to the free list (poisoned when checked).
    fn collect(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].0.query() {
                let (_, mut buffer) = self.pending.swap_remove(i);
                if self.mode.is_checked() {
                    buffer.poison();
                }
                self.free.push(buffer);
            } else {
                i += 1;
            }
        }
    }

    /// Buffers made so far and their elements (the pool's footprint).
    pub fn allocated(&self) -> (usize, usize) {
        (self.allocated, self.allocated_elements)
    }
}

impl<B: Buffer> Drop for Pool<B> {
    fn drop(&mut self) {
        for (event, _) in &self.pending {
            let _ = event.synchronize();
        }
    }
}

/// The index of the smallest of `free` with room for `len` elements, among those at
/// most twice that large: a small request does not take a large buffer that a large
/// request would then have to allocate again, so a pool holds the working set of each
/// size (units of a model come in a few sizes: embedding, block, head).
pub fn best_fit<B>(free: &[B], len: usize, capacity: impl Fn(&B) -> usize) -> Option<usize> {
    free.iter()
        .enumerate()
        .filter(|(_, b)| (len..=len.saturating_mul(2).max(1)).contains(&capacity(b)))
        .min_by_key(|(_, b)| capacity(b))
        .map(|(i, _)| i)
}

/// A new tensor buffer of `len` elements of `kind` on `device` (contents unspecified).
pub fn tensor_buffer(len: usize, kind: Kind, device: tch::Device) -> Result<Tensor, tch::TchError> {
    Tensor::f_empty([len as i64], (kind, device))
}

#[cfg(test)]
mod tests {
    use super::super::lanes::Lane;
    use super::*;

    #[test]
    fn buffers_are_reused_best_fit_and_not_before_their_event() {
        std::thread::scope(|s| {
            let lane = Lane::start(s, 0, "gather", Mode::Plain);
            let mut pool: Pool<Vec<f32>> = Pool::new(Mode::Plain);
            let make = |n| Ok::<_, ()>(vec![0f32; n]);
            let big = pool.take(100, make).unwrap();
            let small = pool.take(10, make).unwrap();
            let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(1);
            let busy = lane.submit(move || Ok(gate_rx.recv()?));
            pool.release(big, busy.clone());
            pool.release(small, Event::done());
            // the big one is still in use: a request for 50 allocates
            assert_eq!(pool.take(50, make).unwrap().len(), 50);
            gate_tx.send(()).unwrap();
            busy.synchronize().unwrap();
            // best fit: 10 elements come from the small buffer, 60 from the big one, but
            // 30 do not take a buffer of more than twice their size
            assert_eq!(pool.take(10, make).unwrap().len(), 10);
            assert_eq!(pool.take(30, make).unwrap().len(), 30);
            assert_eq!(pool.take(60, make).unwrap().len(), 100);
            assert_eq!(pool.allocated(), (4, 190));
        });
    }

    /// A lane reads a buffer after a delay; releasing it without the read's event lets
    /// checked mode poison it under the reader.
    fn read_after_release(wait_for_read: bool) -> f32 {
        let mode = Mode::Checked {
            seed: 11,
            max_delay_us: 1,
        };
        let mut pool: Pool<Vec<f32>> = Pool::new(mode);
        let mut buffer = pool.take(4, |n| Ok::<_, ()>(vec![0f32; n])).unwrap();
        buffer.fill(1.0);
        let shared = std::sync::Arc::new(std::sync::Mutex::new(buffer));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(0f32));
        std::thread::scope(|s| {
            let lane = Lane::start(s, 0, "reduce", mode);
            let (reader, out) = (shared.clone(), seen.clone());
            let read = lane.submit(move || {
                std::thread::sleep(std::time::Duration::from_millis(30));
                *out.lock().unwrap() = reader.lock().unwrap().iter().sum();
                Ok(())
            });
            // the pool poisons the buffer in place when it becomes reusable
            let mut pool: Pool<Shared> = Pool::new(mode);
            pool.release(
                Shared(shared.clone()),
                if wait_for_read {
                    read.clone()
                } else {
                    Event::done()
                },
            );
            read.synchronize().unwrap();
        });
        let value = *seen.lock().unwrap();
        value
    }

    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<f32>>>);
    impl Buffer for Shared {
        fn capacity(&self) -> usize {
            self.0.lock().unwrap().len()
        }
        fn poison(&mut self) {
            self.0.lock().unwrap().fill(f32::NAN);
        }
    }

    #[test]
    fn checked_mode_poisons_a_buffer_released_before_its_last_use() {
        assert_eq!(read_after_release(true), 4.0);
        assert!(read_after_release(false).is_nan());
    }
}
