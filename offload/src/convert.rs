//! Scalar conversions between fp32 and the 16-bit formats, as raw `u16` bits.
//!
//! bf16 rounds to nearest even and keeps NaN a (quiet) NaN, as PyTorch's `to(bfloat16)`
//! does; fp16 uses IEEE round-to-nearest-even through the `half` crate. The SIMD kernels
//! implement the same rounding and are tested against these.

/// fp32 → bf16 bits, round to nearest even; NaN stays NaN (quiet bit set).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    // add half an ulp of bf16, plus one more if the kept part is odd (ties to even)
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// bf16 bits → fp32 (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// fp32 → fp16 bits, IEEE round to nearest even.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// fp16 bits → fp32 (exact).
#[inline(always)]
pub fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly half-way between bf16 1.0 and 1.0078125: ties to even (1.0)
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1 + 3·2^-8 is half-way between 1.0078125 (odd) and 1.015625: rounds up
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(f32_to_bf16(-2.0), 0xC000);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        // a signalling NaN whose payload sits only in the low bits must not become inf
        assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0x7F80_0001))).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
    }

    #[test]
    fn bf16_matches_half_crate() {
        for i in 0..100_000u32 {
            let x = f32::from_bits(i.wrapping_mul(2_654_435_761));
            if x.is_nan() {
                continue;
            }
            assert_eq!(f32_to_bf16(x), half::bf16::from_f32(x).to_bits(), "{x:e}");
        }
    }

    #[test]
    fn f16_round_trip() {
        assert_eq!(f16_to_f32(f32_to_f16(0.5)), 0.5);
        assert_eq!(f32_to_f16(65520.0), 0x7C00); // rounds to +inf
    }
}
