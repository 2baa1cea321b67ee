//! Host arenas: a rank's run-long host state of one kind (gradient accumulators, fp32
//! master and moments) in one page-aligned allocation made at start-up, carved into
//! disjoint slabs that are updated in place and never freed or regrown on the step's
//! path. With `pin_memory` the arena is locked in RAM (`mlock`, best effort: the limit
//! is RLIMIT_MEMLOCK) and, where a device runtime is given, registered with it once
//! (`cuMemHostRegister`), so copies from it are truly asynchronous.
//!
//! A [`Slab`] owns its range exclusively (like a `Vec`): it can move to another thread
//! (a lane) and back, and the arena lives as long as any of its slabs.

use crate::host::{AlignedBuf, AllocError, Pod, ALIGN};
use crate::pool::HostRegister;
use std::ptr::NonNull;
use std::sync::Arc;

/// How an arena is held in memory.
#[derive(Clone, Default)]
pub struct Pinning {
    /// Lock the pages in RAM (`pin_memory: true`).
    pub lock: bool,
    /// Register the range with a device runtime (CUDA ranks).
    pub register: Option<Arc<dyn HostRegister>>,
}

/// One allocation shared by its slabs.
pub struct Arena {
    buf: AlignedBuf<u8>,
    /// The whole pages the slabs occupy (locked and registered).
    region: (usize, usize),
    locked: bool,
    register: Option<Arc<dyn HostRegister>>,
}

impl Arena {
    /// Bytes of the slabs' pages.
    pub fn bytes(&self) -> usize {
        self.region.1
    }

    /// Bytes allocated (the pages, and up to a page of alignment slack).
    pub fn allocated(&self) -> usize {
        self.buf.capacity_bytes()
    }

    /// Whether its pages are locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Whether its pages are registered with a device runtime (a GPU's DMA reads them).
    pub fn is_registered(&self) -> bool {
        self.register.is_some()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let (addr, len) = (self.region.0 as *mut u8, self.region.1);
        if let Some(register) = &self.register {
            register.unregister(addr, len);
        }
        if self.locked {
            // SAFETY: the range is this arena's allocation, locked in `carve`.
            unsafe { libc::munlock(addr as *const libc::c_void, len) };
        }
    }
}

/// `len` elements of `T` in an arena, owned exclusively.
pub struct Slab<T: Pod> {
    arena: Arc<Arena>,
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: a slab's range is disjoint from every other slab's and reachable only through
// it (as a Vec's buffer is); the arena it keeps alive is never written through otherwise.
unsafe impl<T: Pod> Send for Slab<T> {}
// SAFETY: shared access hands out only &[T].
unsafe impl<T: Pod> Sync for Slab<T> {}

impl<T: Pod> Slab<T> {
    /// A zeroed slab in an arena of its own (tests, and buffers outside the run-long state).
    pub fn zeroed(len: usize) -> Result<Slab<T>, AllocError> {
        let mut slabs = carve::<T>(&[len], &Pinning::default()).map_err(|e| match e {
            CarveError::Alloc(a) => a,
            CarveError::Register(_) => AllocError {
                bytes: len * std::mem::size_of::<T>(),
            },
        })?;
        Ok(slabs
            .pop()
            .unwrap_or_else(|| unreachable!("one length gives one slab")))
    }

    /// The arena this slab lives in.
    pub fn arena(&self) -> &Arena {
        &self.arena
    }
}

impl<T: Pod> std::ops::Deref for Slab<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised (zeroed, Pod) elements while the arena
        // lives, and this slab is the only way to reach them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Pod> std::ops::DerefMut for Slab<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in Deref, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for Slab<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slab").field("len", &self.len).finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CarveError {
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error("cannot register a host arena with the device runtime: {0}")]
    Register(String),
}

/// One arena holding a zeroed slab of each length in `lens`, in order; every slab starts
/// on a page boundary (so O_DIRECT and DMA can use any of them).
pub fn carve<T: Pod>(lens: &[usize], pinning: &Pinning) -> Result<Vec<Slab<T>>, CarveError> {
    let elem = std::mem::size_of::<T>();
    // slabs start on page boundaries: the kernel's page where it is larger than ALIGN, so
    // locking or unlocking one arena never touches a page of another
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).map_or(ALIGN, |p| p.max(ALIGN));
    let pages = |len: usize| (len * elem).div_ceil(page) * page;
    let total: usize = lens.iter().map(|&l| pages(l)).sum();
    let mut buf = AlignedBuf::<u8>::zeroed(total.max(page) + page - ALIGN)?;
    let start = buf.as_mut_ptr();
    // the first page boundary at or after the allocation's start; [base, base + bytes) is
    // whole pages inside the allocation, the only range locked and registered
    let base = start.wrapping_add(start.align_offset(page).min(page - ALIGN));
    let bytes = total.max(page);
    let locked = pinning.lock
        // SAFETY: [base, base + bytes) lies inside the allocation just made.
        && unsafe { libc::mlock(base as *const libc::c_void, bytes) } == 0;
    // each warning once a process: a run carves an arena per unit of parameters
    static LOCK_WARNED: std::sync::Once = std::sync::Once::new();
    static REGISTER_WARNED: std::sync::Once = std::sync::Once::new();
    if pinning.lock && !locked {
        LOCK_WARNED.call_once(|| {
            tracing::warn!(
                "pin_memory: cannot lock {bytes} bytes of host state in RAM (RLIMIT_MEMLOCK, `ulimit -l`); it stays pageable (said once)"
            )
        });
    }
    // registration is best effort too: without it copies from the arena are staged
    let register = pinning
        .register
        .as_ref()
        .and_then(|r| match r.register(base, bytes) {
            Ok(()) => Some(r.clone()),
            Err(e) => {
                REGISTER_WARNED
                    .call_once(|| tracing::warn!("pin_memory: {} (said once)", CarveError::Register(e)));
                None
            }
        });
    let arena = Arc::new(Arena {
        buf,
        region: (base as usize, bytes),
        locked,
        register,
    });
    let mut offset = 0;
    let mut slabs = Vec::with_capacity(lens.len());
    for &len in lens {
        // SAFETY: base + offset + len * elem ≤ start + bytes, and base + offset is
        // page-aligned, which satisfies T's alignment; the slabs' ranges do not overlap.
        let ptr = unsafe { NonNull::new_unchecked(base.add(offset).cast::<T>()) };
        slabs.push(Slab {
            arena: arena.clone(),
            ptr,
            len,
        });
        offset += pages(len);
    }
    Ok(slabs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_size() -> usize {
        // SAFETY: sysconf has no preconditions.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
    }

    #[test]
    fn slabs_are_disjoint_page_aligned_and_outlive_their_arena_handle() {
        let mut slabs = carve::<f32>(&[3, 0, 1025, 7], &Pinning::default()).unwrap();
        for (i, slab) in slabs.iter_mut().enumerate() {
            assert_eq!(slab.as_ptr() as usize % ALIGN, 0);
            assert!(slab.iter().all(|&x| x == 0.0));
            slab.fill(i as f32);
        }
        // moved to another thread and back, each keeps its own values
        let back = std::thread::spawn(move || slabs).join().unwrap();
        for (i, slab) in back.iter().enumerate() {
            assert!(slab.iter().all(|&x| x == i as f32));
        }
        assert_eq!(back[2].len(), 1025);
        // a page each, none for the empty slab, two for 1025 floats
        if page_size() == ALIGN {
            assert_eq!(back[0].arena().bytes(), 4 * 4096);
        }
        let single = Slab::<u16>::zeroed(5).unwrap();
        assert_eq!(&single[..], &[0; 5]);
    }

    #[test]
    fn a_locked_arena_reports_whether_the_lock_held() {
        let slabs = carve::<u8>(
            &[4096],
            &Pinning {
                lock: true,
                register: None,
            },
        )
        .unwrap();
        // the lock is best effort (RLIMIT_MEMLOCK); either way the memory is usable
        let _ = slabs[0].arena().is_locked();
        assert_eq!(slabs[0].len(), 4096);
    }
}
