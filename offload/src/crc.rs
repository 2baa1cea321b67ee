//! crc32c summed in pieces: the checksums of the pieces of a buffer, computed apart (on
//! several threads, each as its piece passes through a kernel), joined into the checksum
//! of the whole, as one pass in order would give it.
//!
//! A CRC is the message, as a polynomial over GF(2), times x³² modulo the generator. For
//! a message A followed by B (`len_b` bytes), crc(AB) = crc(A)·x^(8·len_b) ⊕ crc(B): the
//! initial and final inversions of crc32c cancel in it, as in zlib's `crc32_combine`.
//! The product is one multiplication modulo the generator with x^(8·len_b) taken from a
//! table of x^(2^k): 64 shifts at most a join, where the `crc32c` crate's
//! `crc32c_combine` squares 32×32 matrices for each bit of the length (it is the
//! reference of the tests below).

use crate::host::Pod;

/// The Castagnoli generator, bit-reflected (bit 31 holds x⁰).
const GENERATOR: u32 = 0x82F6_3B78;

/// a·b modulo the generator, both bit-reflected.
const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 1u32 << 31; // x⁰ of a, then x¹, …
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        // b·x: a right shift in the reflected order, reduced where x³² appears
        b = if b & 1 != 0 { (b >> 1) ^ GENERATOR } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// x^(2^k) modulo the generator, k = 0..64.
const POWERS: [u32; 64] = {
    let mut table = [0u32; 64];
    table[0] = 1 << 30; // x¹
    let mut k = 1;
    while k < 64 {
        table[k] = multiply(table[k - 1], table[k - 1]);
        k += 1;
    }
    table
};

/// x^(8·bytes) modulo the generator.
fn shift_by(bytes: usize) -> u32 {
    let bits = (bytes as u128) * 8;
    let mut power = 1u32 << 31; // x⁰
    for (k, &x) in POWERS.iter().enumerate() {
        if bits >> k & 1 != 0 {
            power = multiply(power, x);
        }
    }
    power
}

/// The crc32c of A followed by B, from crc(A), crc(B) and B's length in bytes.
pub fn join(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    multiply(shift_by(len_b), crc_a) ^ crc_b
}

/// The bytes of a slice of plain-old-data elements, as the swap files hold them.
pub fn bytes_of<T: Pod>(elements: &[T]) -> &[u8] {
    // SAFETY: `Pod` types have no padding and every byte of them is initialised; the
    // view covers exactly the slice's memory and borrows it for as long.
    unsafe { std::slice::from_raw_parts(elements.as_ptr().cast::<u8>(), std::mem::size_of_val(elements)) }
}

/// Bytes a copy moves before it sums them, while they are in cache.
const COPY_STRETCH: usize = 32 << 10;

/// Copies `from` into `to` (of the same length) a stretch at a time, summing each stretch
/// as it lands: the crc32c of the bytes without a pass of its own over memory.
pub fn copy_summed(to: &mut [u8], from: &[u8]) -> Running {
    assert_eq!(to.len(), from.len(), "copy_summed: lengths differ");
    let mut sum = Running::default();
    for (to, from) in to.chunks_mut(COPY_STRETCH).zip(from.chunks(COPY_STRETCH)) {
        to.copy_from_slice(from);
        sum = sum.append(to);
    }
    sum
}

/// A checksum under way over consecutive bytes: appended piece by piece, or two running
/// sums of adjacent stretches joined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Running {
    pub crc: u32,
    pub len: usize,
}

impl Running {
    /// This sum with `bytes` appended.
    pub fn append(self, bytes: &[u8]) -> Running {
        Running {
            crc: crc32c::crc32c_append(self.crc, bytes),
            len: self.len + bytes.len(),
        }
    }

    /// This stretch followed by `next`.
    pub fn then(self, next: Running) -> Running {
        Running {
            crc: join(self.crc, next.crc, next.len),
            len: self.len + next.len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn joined_pieces_equal_one_pass_over_the_whole() {
        let data = bytes(1 << 16, 7);
        for cut in [0, 1, 3, 64, 4095, 4096, 30_000, data.len() - 1, data.len()] {
            let (a, b) = data.split_at(cut);
            let whole = crc32c::crc32c(&data);
            assert_eq!(
                join(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                whole,
                "cut {cut}"
            );
            assert_eq!(
                crc32c::crc32c_combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                whole,
                "the crate's combine, cut {cut}"
            );
        }
    }

    #[test]
    fn join_equals_the_crates_combine_for_any_length() {
        for (i, len) in [
            1usize,
            2,
            7,
            8,
            255,
            1 << 20,
            (1 << 26) + 12345,
            1 << 40,
            usize::MAX / 16,
        ]
        .into_iter()
        .enumerate()
        {
            let (a, b) = (
                0x1234_5678u32.wrapping_mul(i as u32 + 1),
                0x9abc_def0u32 ^ i as u32,
            );
            assert_eq!(join(a, b, len), crc32c::crc32c_combine(a, b, len), "length {len}");
        }
    }

    #[test]
    fn running_sums_of_adjacent_stretches_join_in_order() {
        let data = bytes(10_000, 3);
        let pieces: Vec<Running> = data.chunks(999).map(|c| Running::default().append(c)).collect();
        let joined = pieces.into_iter().reduce(Running::then).unwrap_or_default();
        assert_eq!(joined, Running::default().append(&data));
        assert_eq!(joined.crc, crc32c::crc32c(&data));
        let mut copy = vec![0u8; data.len()];
        assert_eq!(copy_summed(&mut copy, &data), joined);
        assert_eq!(copy, data);
        let floats = [1.5f32, -2.0, 3.25];
        assert_eq!(bytes_of(&floats).len(), 12);
        assert_eq!(&bytes_of(&floats)[..4], &1.5f32.to_ne_bytes());
    }
}
