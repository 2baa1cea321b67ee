//! AVX-512F AdamW kernel (16 lanes): the primitives for `simd_kernels!`.
//!
//! Same rounding as the AVX2 kernel: bf16 in integer lanes (ties to even, NaN kept
//! quiet) narrowed with `vpmovdw`; fp16 with `vcvtps2ph` round-to-nearest-even.

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    pub(super) const LANES: usize = 16;
    type V = __m512;

    pub(in super::super) fn is_supported() -> bool {
        is_x86_feature_detected!("avx512f")
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn splat(x: f32) -> V {
        _mm512_set1_ps(x)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load(ptr: *const f32) -> V {
        // SAFETY: the caller guarantees LANES readable floats at ptr.
        unsafe { _mm512_loadu_ps(ptr) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store(ptr: *mut f32, x: V) {
        // SAFETY: the caller guarantees LANES writable floats at ptr.
        unsafe { _mm512_storeu_ps(ptr, x) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn fmadd(a: V, b: V, c: V) -> V {
        _mm512_fmadd_ps(a, b, c)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn mul(a: V, b: V) -> V {
        _mm512_mul_ps(a, b)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn add(a: V, b: V) -> V {
        _mm512_add_ps(a, b)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn sqrt(a: V) -> V {
        _mm512_sqrt_ps(a)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn div(a: V, b: V) -> V {
        _mm512_div_ps(a, b)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_bf16(ptr: *const u16) -> V {
        // SAFETY: the caller guarantees LANES readable u16 at ptr.
        let raw = unsafe { _mm256_loadu_si256(ptr.cast()) };
        // widen to 32 bits and move the bf16 bits into the high half
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_bf16(ptr: *mut u16, x: V) {
        let bits = _mm512_castps_si512(x);
        let upper = _mm512_srli_epi32::<16>(bits);
        // round to nearest even: add 0x7FFF plus the lowest kept bit
        let lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
        // NaN stays NaN: truncate and set the quiet bit
        let quiet = _mm512_or_si512(upper, _mm512_set1_epi32(0x40));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let lanes = _mm512_mask_blend_epi32(nan, rounded, quiet);
        // SAFETY: the caller guarantees LANES writable u16 at ptr.
        unsafe { _mm256_storeu_si256(ptr.cast(), _mm512_cvtepi32_epi16(lanes)) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_bf16_truncated(ptr: *mut u16, x: V) {
        let upper = _mm512_srli_epi32::<16>(_mm512_castps_si512(x));
        // SAFETY: the caller guarantees LANES writable u16 at ptr.
        unsafe { _mm256_storeu_si256(ptr.cast(), _mm512_cvtepi32_epi16(upper)) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_f16(ptr: *mut u16, x: V) {
        let half = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
        // SAFETY: the caller guarantees LANES writable u16 at ptr.
        unsafe { _mm256_storeu_si256(ptr.cast(), half) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn poison_zero() -> __m512i {
        _mm512_setzero_si512()
    }

    /// ORs in `g - g`, whose bits are zero for finite g and NaN otherwise.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn poison_accumulate(acc: __m512i, g: V) -> __m512i {
        _mm512_or_si512(acc, _mm512_castps_si512(_mm512_sub_ps(g, g)))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn poison_any(acc: __m512i) -> bool {
        _mm512_test_epi32_mask(acc, acc) != 0
    }

    super::super::simd::simd_kernels!("avx512f");
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) use super::simd::unsupported::{is_supported, roofline, sweep};
#[cfg(target_arch = "x86_64")]
pub(super) use imp::{is_supported, roofline, sweep};
