//! AVX2 + FMA + F16C AdamW kernel (8 lanes): the primitives for `simd_kernels!`.
//!
//! bf16 rounding is done in integer lanes (add 0x7FFF plus the kept LSB, ties to even;
//! NaN kept quiet), fp16 through F16C's `vcvtps2ph` with round-to-nearest-even, matching
//! `crate::convert`.

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    pub(super) const LANES: usize = 8;
    type V = __m256;

    pub(in super::super) fn is_supported() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn splat(x: f32) -> V {
        _mm256_set1_ps(x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load(ptr: *const f32) -> V {
        // SAFETY: the caller guarantees LANES readable floats at ptr.
        unsafe { _mm256_loadu_ps(ptr) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store(ptr: *mut f32, x: V) {
        // SAFETY: the caller guarantees LANES writable floats at ptr.
        unsafe { _mm256_storeu_ps(ptr, x) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn fmadd(a: V, b: V, c: V) -> V {
        _mm256_fmadd_ps(a, b, c)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn mul(a: V, b: V) -> V {
        _mm256_mul_ps(a, b)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn add(a: V, b: V) -> V {
        _mm256_add_ps(a, b)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn sqrt(a: V) -> V {
        _mm256_sqrt_ps(a)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn div(a: V, b: V) -> V {
        _mm256_div_ps(a, b)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_bf16(ptr: *const u16) -> V {
        // SAFETY: the caller guarantees LANES readable u16 at ptr.
        let raw = unsafe { _mm_loadu_si128(ptr.cast()) };
        // widen to 32 bits and move the bf16 bits into the high half
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
    }

    /// Packs the low 16 bits of eight 32-bit lanes and stores them.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store_u16x8(ptr: *mut u16, lanes: __m256i) {
        // packus works within 128-bit halves: [a0..a3 a0..a3 | a4..a7 a4..a7]
        let packed = _mm256_packus_epi32(lanes, lanes);
        // keep 64-bit words 0 and 2
        let ordered = _mm256_permute4x64_epi64::<0b00_00_10_00>(packed);
        // SAFETY: the caller guarantees LANES writable u16 at ptr.
        unsafe { _mm_storeu_si128(ptr.cast(), _mm256_castsi256_si128(ordered)) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store_bf16(ptr: *mut u16, x: V) {
        let bits = _mm256_castps_si256(x);
        let upper = _mm256_srli_epi32::<16>(bits);
        // round to nearest even: add 0x7FFF plus the lowest kept bit
        let lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
        // NaN stays NaN: truncate and set the quiet bit
        let quiet = _mm256_or_si256(upper, _mm256_set1_epi32(0x40));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        // SAFETY: forwarded from the caller.
        unsafe { store_u16x8(ptr, _mm256_blendv_epi8(rounded, quiet, nan)) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store_bf16_truncated(ptr: *mut u16, x: V) {
        let upper = _mm256_srli_epi32::<16>(_mm256_castps_si256(x));
        // SAFETY: forwarded from the caller.
        unsafe { store_u16x8(ptr, upper) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store_f16(ptr: *mut u16, x: V) {
        let half = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
        // SAFETY: the caller guarantees LANES writable u16 at ptr.
        unsafe { _mm_storeu_si128(ptr.cast(), half) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn poison_zero() -> V {
        _mm256_setzero_ps()
    }

    /// ORs in `g - g`, whose bits are zero for finite g and NaN otherwise.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn poison_accumulate(acc: V, g: V) -> V {
        _mm256_or_ps(acc, _mm256_sub_ps(g, g))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn poison_any(acc: V) -> bool {
        let bits = _mm256_castps_si256(acc);
        _mm256_testz_si256(bits, bits) == 0
    }

    super::super::simd::simd_kernels!("avx2,fma,f16c");
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) use super::simd::unsupported::{is_supported, roofline, sweep};
#[cfg(target_arch = "x86_64")]
pub(super) use imp::{is_supported, roofline, sweep};
