//! I/O buffers and the bounded pool they are leased from.
//!
//! An [`IoBuf`] is a page-aligned byte buffer that moves into a block-I/O operation and
//! comes back with its completion (tokio-uring's rule), so nothing can touch it while the
//! kernel or a DMA engine does. Buffers leased from a [`BufferPool`] return to it when
//! dropped; `lease` blocks while all `buffer_count` are out, which is what bounds the
//! memory of every pipeline built on it. Pool memory is allocated once, locked in RAM
//! (`mlock`, best effort: locked buffers read ~3× faster with O_DIRECT on these virtual
//! disks) and registered with io_uring as fixed buffers by the `Uring` engine. Pinning
//! for CUDA is a hook ([`HostRegister`]): the CUDA layer registers the existing memory
//! (`cuMemHostRegister`), never allocating write-combined memory the CPU reads slowly.

use crate::host::{AlignedBuf, AllocError, Pod};
use std::sync::{Arc, Condvar, Mutex};

/// Registers host memory with a device runtime (page-locking it for DMA).
pub trait HostRegister: Send + Sync {
    /// Registers `[ptr, ptr + bytes)`.
    fn register(&self, ptr: *mut u8, bytes: usize) -> Result<(), String>;
    /// Undoes `register`; must not panic.
    fn unregister(&self, ptr: *mut u8, bytes: usize);
}

struct Shared {
    free: Mutex<Vec<(u16, AlignedBuf<u8>)>>,
    available: Condvar,
    buffer_bytes: usize,
    count: usize,
    /// Base addresses and lengths, in slot order, for io_uring registration.
    regions: Vec<(usize, usize)>,
    locked: bool,
    pinning: Option<Arc<dyn HostRegister>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        for &(addr, len) in &self.regions {
            if let Some(pin) = &self.pinning {
                pin.unregister(addr as *mut u8, len);
            }
            if self.locked {
                // SAFETY: the region is a live allocation owned by the free list, which
                // is dropped after this body.
                unsafe { libc::munlock(addr as *const libc::c_void, len) };
            }
        }
    }
}

/// A page-aligned byte buffer for block I/O, pooled or not.
pub struct IoBuf {
    buf: Option<AlignedBuf<u8>>,
    home: Option<(Arc<Shared>, u16)>,
}

impl IoBuf {
    /// An unpooled buffer of at least `bytes` (rounded up to whole pages).
    pub fn new(bytes: usize) -> Result<IoBuf, AllocError> {
        Ok(IoBuf {
            buf: Some(AlignedBuf::zeroed(bytes)?),
            home: None,
        })
    }

    fn inner(&self) -> &AlignedBuf<u8> {
        // the Option is only None during Drop
        self.buf
            .as_ref()
            .unwrap_or_else(|| unreachable!("IoBuf used after drop"))
    }

    fn inner_mut(&mut self) -> &mut AlignedBuf<u8> {
        self.buf
            .as_mut()
            .unwrap_or_else(|| unreachable!("IoBuf used after drop"))
    }

    /// Usable bytes: a whole number of pages.
    pub fn capacity(&self) -> usize {
        self.inner().capacity_bytes()
    }

    /// The fixed-buffer index io_uring knows this buffer by, if it came from a pool.
    pub fn registered_index(&self) -> Option<u16> {
        self.home.as_ref().map(|(_, slot)| *slot)
    }

    /// Whether this buffer came from `pool`.
    pub fn is_from(&self, pool: &BufferPool) -> bool {
        self.home
            .as_ref()
            .is_some_and(|(shared, _)| Arc::ptr_eq(shared, &pool.shared))
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.inner().as_bytes()
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.inner_mut().as_bytes_mut()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.inner_mut().as_mut_ptr()
    }

    /// The first `n` elements viewed as `T` (the buffer is page-aligned).
    pub fn typed<T: Pod>(&self, n: usize) -> &[T] {
        let bytes = &self.as_bytes()[..n * std::mem::size_of::<T>()];
        // SAFETY: the buffer is page-aligned (so aligned for T), the range is in bounds
        // (sliced above), and every bit pattern is a valid T (Pod).
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), n) }
    }

    /// The first `n` elements viewed mutably as `T`.
    pub fn typed_mut<T: Pod>(&mut self, n: usize) -> &mut [T] {
        let bytes = &mut self.as_bytes_mut()[..n * std::mem::size_of::<T>()];
        // SAFETY: as in `typed`, with exclusive access.
        unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), n) }
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if let (Some(buf), Some((shared, slot))) = (self.buf.take(), self.home.take()) {
            // a poisoned lock only means another thread panicked while holding it; the
            // Vec itself is intact, so the buffer still goes home
            let mut free = shared.free.lock().unwrap_or_else(|e| e.into_inner());
            free.push((slot, buf));
            shared.available.notify_one();
        }
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoBuf")
            .field("capacity", &self.capacity())
            .field("registered_index", &self.registered_index())
            .finish()
    }
}

/// `buffer_count` buffers of `buffer_bytes`, allocated once.
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<Shared>,
}

impl BufferPool {
    /// Allocates the pool and locks it in memory (best effort).
    pub fn new(count: usize, buffer_bytes: usize) -> Result<BufferPool, AllocError> {
        Self::with_pinning(count, buffer_bytes, None).map_err(|e| match e {
            PoolError::Alloc(a) => a,
            PoolError::Pin(_) => AllocError { bytes: buffer_bytes },
        })
    }

    /// Allocates the pool and registers every buffer through `pinning`.
    pub fn with_pinning(
        count: usize,
        buffer_bytes: usize,
        pinning: Option<Arc<dyn HostRegister>>,
    ) -> Result<BufferPool, PoolError> {
        let count = count.clamp(1, usize::from(u16::MAX));
        let mut free = Vec::with_capacity(count);
        let mut regions = Vec::with_capacity(count);
        let mut locked = true;
        for slot in 0..count {
            let mut buf = AlignedBuf::<u8>::zeroed(buffer_bytes.max(1))?;
            let (addr, len) = (buf.as_mut_ptr() as usize, buf.capacity_bytes());
            // SAFETY: [addr, addr + len) is the allocation just made.
            locked &= unsafe { libc::mlock(addr as *const libc::c_void, len) } == 0;
            regions.push((addr, len));
            free.push((slot as u16, buf));
        }
        if !locked {
            tracing::debug!("could not mlock the {count} × {buffer_bytes}-byte I/O buffers (RLIMIT_MEMLOCK)");
        }
        if let Some(pin) = &pinning {
            for &(addr, len) in &regions {
                pin.register(addr as *mut u8, len).map_err(PoolError::Pin)?;
            }
        }
        // hand out slot 0 first
        free.reverse();
        Ok(BufferPool {
            shared: Arc::new(Shared {
                free: Mutex::new(free),
                available: Condvar::new(),
                buffer_bytes: regions.first().map_or(0, |r| r.1),
                count,
                regions,
                locked,
                pinning,
            }),
        })
    }

    /// Takes a buffer, waiting while all are leased.
    pub fn lease(&self) -> IoBuf {
        let mut free = self.shared.free.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((slot, buf)) = free.pop() {
                return IoBuf {
                    buf: Some(buf),
                    home: Some((self.shared.clone(), slot)),
                };
            }
            free = self
                .shared
                .available
                .wait(free)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Takes a buffer if one is free.
    pub fn try_lease(&self) -> Option<IoBuf> {
        let mut free = self.shared.free.lock().unwrap_or_else(|e| e.into_inner());
        free.pop().map(|(slot, buf)| IoBuf {
            buf: Some(buf),
            home: Some((self.shared.clone(), slot)),
        })
    }

    /// Bytes per buffer (whole pages).
    pub fn buffer_bytes(&self) -> usize {
        self.shared.buffer_bytes
    }

    pub fn count(&self) -> usize {
        self.shared.count
    }

    /// Buffers not leased right now.
    pub fn available(&self) -> usize {
        self.shared.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the buffers are locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.shared.locked
    }

    /// (address, length) of every buffer in slot order, for fixed-buffer registration.
    /// Valid for as long as any clone of this pool or any of its leases lives.
    pub fn regions(&self) -> &[(usize, usize)] {
        &self.shared.regions
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error("cannot register I/O buffers with the device runtime: {0}")]
    Pin(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn leases_return_on_drop_and_lease_blocks_when_empty() {
        let pool = BufferPool::new(2, 10_000).unwrap();
        assert_eq!(pool.buffer_bytes(), 12_288);
        let a = pool.lease();
        let b = pool.lease();
        assert_ne!(a.registered_index(), b.registered_index());
        assert!(pool.try_lease().is_none());
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.lease().registered_index())
        };
        std::thread::sleep(Duration::from_millis(50));
        let index = a.registered_index();
        drop(a);
        assert_eq!(waiter.join().unwrap(), index);
        drop(b);
        assert_eq!(pool.available(), 2);
    }

    #[test]
    fn typed_views_share_the_bytes() {
        let mut buf = IoBuf::new(4096).unwrap();
        buf.typed_mut::<f32>(3).copy_from_slice(&[1.0, 2.0, 3.0]);
        assert_eq!(&buf.as_bytes()[4..8], &2.0f32.to_ne_bytes());
        assert_eq!(buf.typed::<f32>(3), &[1.0, 2.0, 3.0]);
    }

    #[derive(Default)]
    struct CountingPin(std::sync::atomic::AtomicIsize);
    impl HostRegister for CountingPin {
        fn register(&self, _: *mut u8, _: usize) -> Result<(), String> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn unregister(&self, _: *mut u8, _: usize) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn pinning_hook_registers_every_buffer_once_and_unregisters_on_drop() {
        let pin = Arc::new(CountingPin::default());
        let pool = BufferPool::with_pinning(3, 4096, Some(pin.clone())).unwrap();
        assert_eq!(pin.0.load(std::sync::atomic::Ordering::SeqCst), 3);
        let lease = pool.lease();
        drop(pool);
        assert_eq!(
            pin.0.load(std::sync::atomic::Ordering::SeqCst),
            3,
            "a lease keeps the pool alive"
        );
        drop(lease);
        assert_eq!(pin.0.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
