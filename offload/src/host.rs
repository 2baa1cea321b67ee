//! Aligned host buffers.
//!
//! O_DIRECT needs buffers aligned to the device's DMA alignment (4096 covers every disk
//! here), and the CUDA layer registers (pins) existing host memory rather than allocating
//! write-combined memory the CPU reads slowly. `AlignedBuf` is that memory: zeroed,
//! 4096-aligned, freed on drop. Pinning is a hook: the owner of a CUDA context registers
//! the buffer's range and unregisters it before the buffer drops.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every host buffer: a page, which satisfies O_DIRECT and DMA.
pub const ALIGN: usize = 4096;

/// Plain-old-data element types a buffer may hold (any bit pattern is valid).
///
/// # Safety
/// Implementors must be valid for every bit pattern, including all zeros.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}
// SAFETY: every bit pattern is a valid value of these types.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for i64 {}
// SAFETY: as above.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for f64 {}

/// A zeroed, page-aligned, fixed-length host buffer of `T`.
pub struct AlignedBuf<T: Pod> {
    ptr: NonNull<T>,
    len: usize,
    /// Allocation size in bytes, rounded up to a whole page (at least one).
    capacity_bytes: usize,
}

// SAFETY: the buffer owns its memory exclusively, like a Vec<T>.
unsafe impl<T: Pod> Send for AlignedBuf<T> {}
// SAFETY: shared access only hands out &[T].
unsafe impl<T: Pod> Sync for AlignedBuf<T> {}

#[derive(Debug, thiserror::Error)]
#[error("cannot allocate a {bytes}-byte aligned host buffer")]
pub struct AllocError {
    pub bytes: usize,
}

impl<T: Pod> AlignedBuf<T> {
    /// A zeroed buffer of `len` elements.
    pub fn zeroed(len: usize) -> Result<Self, AllocError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(AllocError { bytes: usize::MAX })?;
        let capacity_bytes = bytes.div_ceil(ALIGN).max(1) * ALIGN;
        let layout = Layout::from_size_align(capacity_bytes, ALIGN).map_err(|_| AllocError { bytes })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw.cast::<T>()).ok_or(AllocError { bytes })?;
        Ok(Self {
            ptr,
            len,
            capacity_bytes,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the allocation (a whole number of pages), for O_DIRECT transfers.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// The whole allocation as bytes, including the zeroed page tail past `len`.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the allocation is capacity_bytes long, initialised (zeroed), and u8
        // has no alignment or validity requirements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>(), self.capacity_bytes) }
    }

    /// The whole allocation as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u8>(), self.capacity_bytes) }
    }
}

impl<T: Pod> std::ops::Deref for AlignedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised (zeroed, Pod) elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Pod> std::ops::DerefMut for AlignedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in Deref, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Pod> Drop for AlignedBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout (validated there).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr().cast::<u8>(),
                Layout::from_size_align_unchecked(self.capacity_bytes, ALIGN),
            )
        }
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for AlignedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

/// `dst.copy_from_slice(src)`, on every core for stretches longer than a MiB (the fill of
/// a pinned staging buffer from a host shard: one thread's memcpy ran at a tenth of a
/// GPU link's rate).
pub fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    if dst.len() <= CHUNK {
        return dst.copy_from_slice(src);
    }
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_whole_pages() {
        for len in [0usize, 1, 1023, 1024, 1025, 100_000] {
            let mut b = AlignedBuf::<f32>::zeroed(len).unwrap();
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            assert_eq!(b.capacity_bytes() % ALIGN, 0);
            assert!(b.capacity_bytes() >= len * 4);
            assert!(b.iter().all(|&x| x == 0.0));
            b.iter_mut().for_each(|x| *x = 1.5);
            assert_eq!(b.iter().sum::<f32>(), 1.5 * len as f32);
        }
    }
}
