//! A unit's low-precision parameters as stored, and where they live between uses.

use crate::plan::Precision;
use crate::torch::{pod_bytes, pod_bytes_mut, Shared};
use std::sync::Arc;
use tierzero_offload::adam::LowPrecisionOut;
use tierzero_offload::arena::{self, CarveError, Pinning, Slab};
use tierzero_offload::convert::{f32_to_bf16, f32_to_f16};
use tierzero_offload::host::Pod;
use tierzero_offload::nvme::swap::SwapStore;

/// Low-precision parameters as stored: fp32 values or 16-bit float bits.
#[derive(Clone, Debug)]
pub enum LowParams {
    F32(HostBuf<f32>),
    U16(HostBuf<u16>),
}

/// A host buffer of parameter values: a `Vec`, or the first elements (the count beside
/// it) of a slab of an arena of its own, locked and registered with the rank's GPU
/// (`offload_param.pin_memory`), which a DMA copy reads in place. A clone is a `Vec`.
pub enum HostBuf<T: Pod> {
    Vec(Vec<T>),
    Pinned(Slab<T>, usize),
}

impl<T: Pod> std::ops::Deref for HostBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Pinned(s, len) => &s[..*len],
        }
    }
}

impl<T: Pod> std::ops::DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Pinned(s, len) => &mut s[..*len],
        }
    }
}

impl<T: Pod> Clone for HostBuf<T> {
    fn clone(&self) -> Self {
        HostBuf::Vec(self.to_vec())
    }
}

impl<T: Pod> std::fmt::Debug for HostBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            HostBuf::Vec(_) => "Vec",
            HostBuf::Pinned(..) => "Pinned",
        };
        write!(f, "HostBuf::{kind}({} elements)", self.len())
    }
}

/// A zero of a plain-old-data type.
fn zero<T: Pod>() -> T {
    // SAFETY: every bit pattern, all zeros included, is a valid value of a Pod type
    unsafe { std::mem::zeroed() }
}

impl<T: Pod> HostBuf<T> {
    /// `len` elements, new ones zero; within a `Vec`'s capacity or the slab nothing is
    /// allocated, beyond it exactly `len` elements are (a slab too short becomes a `Vec`).
    fn resize(&mut self, len: usize) {
        match self {
            HostBuf::Vec(v) => {
                v.reserve_exact(len.saturating_sub(v.len()));
                v.resize(len, zero::<T>());
            }
            HostBuf::Pinned(s, used) if len <= s.len() => {
                if len > *used {
                    s[*used..len].fill(zero::<T>());
                }
                *used = len;
            }
            HostBuf::Pinned(s, used) => {
                let mut v = Vec::with_capacity(len);
                v.extend_from_slice(&s[..*used]);
                v.resize(len, zero::<T>());
                *self = HostBuf::Vec(v);
            }
        }
    }

    /// Elements the buffer holds without allocating.
    fn capacity(&self) -> usize {
        match self {
            HostBuf::Vec(v) => v.capacity(),
            HostBuf::Pinned(s, _) => s.len(),
        }
    }

    /// A copy of `values` in a slab of its own arena, held as `pinning` says.
    fn pinned(values: &[T], pinning: &Pinning) -> Result<HostBuf<T>, CarveError> {
        let mut slab = arena::carve::<T>(&[values.len()], pinning)?
            .pop()
            .unwrap_or_else(|| unreachable!("one length gives one slab"));
        slab.copy_from_slice(values);
        Ok(HostBuf::Pinned(slab, values.len()))
    }

    /// Whether the buffer is registered with a GPU (a DMA copy can read it in place).
    fn is_registered(&self) -> bool {
        matches!(self, HostBuf::Pinned(s, _) if s.arena().is_registered())
    }
}

impl Default for LowParams {
    fn default() -> Self {
        LowParams::F32(HostBuf::Vec(Vec::new()))
    }
}

impl LowParams {
    pub(crate) fn zeros(len: usize, precision: &Precision) -> LowParams {
        match precision {
            Precision::Fp32 => LowParams::F32(HostBuf::Vec(vec![0.0; len])),
            _ => LowParams::U16(HostBuf::Vec(vec![0; len])),
        }
    }

    /// `values` rounded into `precision` (round to nearest even).
    pub(crate) fn rounded(values: &[f32], precision: &Precision) -> LowParams {
        let bits = |f: fn(f32) -> u16| LowParams::U16(HostBuf::Vec(values.iter().map(|&x| f(x)).collect()));
        match precision {
            Precision::Fp32 => LowParams::F32(HostBuf::Vec(values.to_vec())),
            Precision::Fp16(_) => bits(f32_to_f16),
            Precision::Bf16 => bits(f32_to_bf16),
        }
    }

    /// The same values in a locked arena of their own, registered with the rank's GPU
    /// where `pinning` has one (`offload_param.pin_memory`).
    pub(crate) fn pinned(&self, pinning: &Pinning) -> Result<LowParams, CarveError> {
        Ok(match self {
            LowParams::F32(v) => LowParams::F32(HostBuf::pinned(v, pinning)?),
            LowParams::U16(v) => LowParams::U16(HostBuf::pinned(v, pinning)?),
        })
    }

    /// Whether the values are in an arena of their own ([`Self::pinned`]).
    pub(crate) fn is_pinned(&self) -> bool {
        matches!(
            self,
            LowParams::F32(HostBuf::Pinned(..)) | LowParams::U16(HostBuf::Pinned(..))
        )
    }

    /// Whether a GPU's DMA copy reads these values in place.
    pub(crate) fn is_registered(&self) -> bool {
        match self {
            LowParams::F32(v) => v.is_registered(),
            LowParams::U16(v) => v.is_registered(),
        }
    }

    /// Where AdamW writes this buffer's new values, in `precision`.
    pub(super) fn out_as(&mut self, precision: &Precision) -> LowPrecisionOut<'_> {
        match (self, precision) {
            (LowParams::U16(v), Precision::Fp16(_)) => LowPrecisionOut::F16(v),
            (LowParams::U16(v), _) => LowPrecisionOut::Bf16(v),
            (LowParams::F32(v), _) => LowPrecisionOut::F32(v),
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            LowParams::F32(v) => pod_bytes(v),
            LowParams::U16(v) => pod_bytes(v),
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            LowParams::F32(v) => pod_bytes_mut(v),
            LowParams::U16(v) => pod_bytes_mut(v),
        }
    }

    /// Sets the length to `len` (new elements zero); within the capacity nothing is
    /// allocated, beyond it exactly `len` elements are.
    pub(crate) fn resize(&mut self, len: usize) {
        match self {
            LowParams::F32(v) => v.resize(len),
            LowParams::U16(v) => v.resize(len),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            LowParams::F32(v) => v.len(),
            LowParams::U16(v) => v.len(),
        }
    }

    /// Elements [`Self::resize`] reaches without allocating (a pinned buffer's, pinned).
    pub(crate) fn capacity(&self) -> usize {
        match self {
            LowParams::F32(v) => v.capacity(),
            LowParams::U16(v) => v.capacity(),
        }
    }

    pub(crate) fn elem_bytes(&self) -> usize {
        match self {
            LowParams::F32(_) => 4,
            LowParams::U16(_) => 2,
        }
    }
}

/// Where a unit's stored parameters (this rank's shard at stage 3, else the padded
/// replica) live between uses. Moved only by the parameters' owner (`units.rs`); the
/// lanes read them shared. An update replaces those in host memory (a lane may still
/// hold the old ones) and writes those on the device in place, when no reader is left
/// (`Units::update_target`).
#[derive(Clone)]
pub enum Params<'a> {
    /// On the rank's device (`offload_param: none`): a 1-D tensor of the compute kind —
    /// a CPU tensor on CPU devices, GPU memory on a CUDA rank.
    Device(Shared),
    /// In host memory (`offload_param: cpu`).
    Host(Arc<LowParams>),
    /// In the NVMe parameter store (`offload_param: nvme`), under (unit, rank, `Param`).
    Nvme(&'a SwapStore),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_parameters_keep_their_values_within_the_slab_and_a_clone_or_a_longer_length_is_a_vec() {
        let values = LowParams::rounded(&[1.0, -2.5, 3.25], &Precision::Bf16);
        let mut pinned = values.pinned(&Pinning::default()).unwrap();
        assert!(pinned.is_pinned() && !values.is_pinned());
        // no device runtime: locked at most, never registered
        assert!(!pinned.is_registered());
        assert_eq!(pinned.as_bytes(), values.as_bytes());
        assert_eq!(
            pinned.as_bytes().as_ptr() as usize % tierzero_offload::host::ALIGN,
            0
        );
        let copy = pinned.clone();
        assert!(!copy.is_pinned() && copy.as_bytes() == values.as_bytes());
        pinned.resize(3);
        assert!(pinned.is_pinned());
        // shorter, then back within the slab: pinned, the elements shown again zero
        pinned.resize(1);
        assert!(pinned.is_pinned() && pinned.len() == 1 && pinned.capacity() == 3);
        assert_eq!(pinned.as_bytes(), &values.as_bytes()[..2]);
        pinned.resize(3);
        assert!(pinned.is_pinned());
        assert_eq!(&pinned.as_bytes()[2..], &[0, 0, 0, 0]);
        pinned.bytes_mut().copy_from_slice(values.as_bytes());
        pinned.resize(4);
        assert!(!pinned.is_pinned());
        assert_eq!(&pinned.as_bytes()[..6], values.as_bytes());
        assert_eq!(&pinned.as_bytes()[6..], &[0, 0]);
    }
}
