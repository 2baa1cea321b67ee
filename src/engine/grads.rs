//! A unit's gradient accumulator on the host: fp32, or bf16 when the run trains in bf16
//! and its optimizer state lives on NVMe, or where bf16 holds the step's one gradient as
//! exactly as fp32 (`plan::rules::bf16_gradients`); a slab of the rank's gradient arena
//! of its kind (`tierzero_offload::arena`), allocated once at start-up.
//!
//! With the optimizer on NVMe the host must not hold 4 bytes per parameter of gradient
//! (issue "The engine on lanes and arenas", §2): a bf16 run keeps the reduced gradient
//! partition in its training precision, 2 bytes per parameter, and AdamW reads the bf16
//! bits directly (`GradSlice::Bf16`). Each reduced shard is added in fp32 and rounded
//! once (round to nearest even); the engine uses bf16 only with one micro-batch per
//! step, so the accumulator holds exactly the bf16 rounding of the reduced gradient
//! (`plan::rules::bf16_gradients` says why accumulation keeps fp32).

use tierzero_offload::adam::GradSlice;
use tierzero_offload::arena::{self, CarveError, Pinning, Slab};
use tierzero_offload::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16};
use tierzero_offload::crc::{self, Running};
use tierzero_offload::host::{AllocError, Pod};

#[derive(Debug)]
pub enum Grads {
    F32(Slab<f32>),
    Bf16(Slab<u16>),
}

impl Grads {
    /// `len` zeros, in bf16 when `bf16`, in an arena of their own.
    pub fn zeros(len: usize, bf16: bool) -> Result<Grads, AllocError> {
        Ok(if bf16 {
            Grads::Bf16(Slab::zeroed(len)?)
        } else {
            Grads::F32(Slab::zeroed(len)?)
        })
    }

    /// One zeroed accumulator of each length, in one arena (a rank's run-long gradients).
    pub fn carve(lens: &[usize], bf16: bool, pinning: &Pinning) -> Result<Vec<Grads>, CarveError> {
        Ok(if bf16 {
            arena::carve(lens, pinning)?
                .into_iter()
                .map(Grads::Bf16)
                .collect()
        } else {
            arena::carve(lens, pinning)?.into_iter().map(Grads::F32).collect()
        })
    }

    /// fp32 values as an accumulator (tests).
    pub fn from_f32(values: &[f32]) -> Result<Grads, AllocError> {
        let mut slab = Slab::zeroed(values.len())?;
        slab.copy_from_slice(values);
        Ok(Grads::F32(slab))
    }

    pub fn len(&self) -> usize {
        match self {
            Grads::F32(g) => g.len(),
            Grads::Bf16(g) => g.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            Grads::F32(g) => 4 * g.len(),
            Grads::Bf16(g) => 2 * g.len(),
        }
    }

    /// Zeroes every element, on every core for long accumulators.
    pub fn fill_zero(&mut self) {
        let len = self.len();
        self.zero_range(0..len);
    }

    /// Zeroes the elements of `range`, on every core for long stretches.
    pub fn zero_range(&mut self, range: std::ops::Range<usize>) {
        match self {
            Grads::F32(g) => fill(&mut g[range], 0.0),
            Grads::Bf16(g) => fill(&mut g[range], 0),
        }
    }

    /// `self[offset + i] += x[i]` (bf16: added in fp32, rounded once).
    pub fn add(&mut self, offset: usize, x: &[f32]) {
        self.add_values(offset, Values::F32(x));
    }

    /// [`Grads::add`] of any [`Values`].
    pub fn add_values(&mut self, offset: usize, x: Values) {
        match self {
            Grads::F32(g) => add_values_f32(&mut g[offset..offset + x.len()], x),
            Grads::Bf16(g) => add_values_bf16(&mut g[offset..offset + x.len()], x),
        }
    }

    /// `self[offset + i] = 0 + x[i]`: the bits [`Grads::add_values`] leaves in zeros,
    /// without reading them (the step's first contribution to an accumulator).
    pub fn set_values(&mut self, offset: usize, x: Values) {
        match self {
            Grads::F32(g) => set_values_f32(&mut g[offset..offset + x.len()], x),
            Grads::Bf16(g) => set_values_bf16(&mut g[offset..offset + x.len()], x),
        }
    }

    /// [`Grads::add_values`], returning `from` continued with Σ g² of the stretch's sums
    /// as [`Grads::sum_squares`] folds them from `offset` (a block boundary): one pass
    /// where the add and Σ g² took two.
    pub fn add_values_squared(&mut self, offset: usize, x: Values, from: f64) -> f64 {
        self.squared_at((offset, x, from), add_f32_to, add_bf16_to)
    }

    /// [`Grads::set_values`], squared as [`Grads::add_values_squared`].
    pub fn set_values_squared(&mut self, offset: usize, x: Values, from: f64) -> f64 {
        self.squared_at((offset, x, from), set_f32_to, set_bf16_to)
    }

    /// [`squared`] over the stretch at `offset`, with the element operation of the
    /// accumulator's kind.
    fn squared_at(
        &mut self,
        (offset, x, from): (usize, Values, f64),
        op_f32: impl Fn(&mut f32, f32) + Sync,
        op_bf16: impl Fn(&mut u16, f32) + Sync,
    ) -> f64 {
        let at = offset..offset + x.len();
        match self {
            Grads::F32(g) => squared(&mut g[at], x, op_f32, square_f32, from),
            Grads::Bf16(g) => squared(&mut g[at], x, op_bf16, square_bf16, from),
        }
    }

    /// Σ g² over `range`, in f64.
    pub fn sum_squares(&self, range: std::ops::Range<usize>) -> f64 {
        match self {
            Grads::F32(g) => sum_squares_f32(0.0, &g[range]),
            Grads::Bf16(g) => sum_squares_bf16(0.0, &g[range]),
        }
    }

    /// The elements of `range` as the optimizer reads them.
    pub fn slice(&self, range: std::ops::Range<usize>) -> GradSlice<'_> {
        match self {
            Grads::F32(g) => GradSlice::F32(&g[range]),
            Grads::Bf16(g) => GradSlice::Bf16(&g[range]),
        }
    }
}

use crate::plan::rules::{NORM_BLOCK, PARALLEL_CHUNK};

/// Values a reduction adds into an accumulator, as they reached the host: fp32, or the
/// bits of a 16-bit gradient, widened to fp32 as they are added (exact: the same sums
/// as widening them first, without writing and reading an fp32 copy).
#[derive(Clone, Copy, Debug)]
pub enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl<'a> Values<'a> {
    pub fn len(&self) -> usize {
        match self {
            Values::F32(x) => x.len(),
            Values::Bf16(x) | Values::F16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values in `range`.
    pub fn range(&self, range: std::ops::Range<usize>) -> Values<'a> {
        match *self {
            Values::F32(x) => Values::F32(&x[range]),
            Values::Bf16(x) => Values::Bf16(&x[range]),
            Values::F16(x) => Values::F16(&x[range]),
        }
    }
}

/// `g[i] += x[i]`, on every core for long stretches (element-wise: the same bits).
pub fn add_f32(g: &mut [f32], x: &[f32]) {
    add_values_f32(g, Values::F32(x));
}

/// `g[i] += x[i]` on bf16 bits: added in fp32, rounded once (to nearest even); on every
/// core for long stretches.
pub fn add_bf16(g: &mut [u16], x: &[f32]) {
    add_values_bf16(g, Values::F32(x));
}

/// [`add_f32`] of any [`Values`].
pub fn add_values_f32(g: &mut [f32], x: Values) {
    widened(g, x, add_f32_to);
}

/// [`add_bf16`] of any [`Values`].
pub fn add_values_bf16(g: &mut [u16], x: Values) {
    widened(g, x, add_bf16_to);
}

/// [`add_values_f32`] into zeros: `g[i] = 0 + x[i]` (-0.0 becomes +0.0, as added to
/// zero), `g` written and not read.
fn set_values_f32(g: &mut [f32], x: Values) {
    widened(g, x, set_f32_to);
}

/// [`add_values_bf16`] into zeros, `g` written and not read.
fn set_values_bf16(g: &mut [u16], x: Values) {
    widened(g, x, set_bf16_to);
}

#[inline(always)]
fn add_f32_to(g: &mut f32, x: f32) {
    *g += x;
}

#[inline(always)]
fn add_bf16_to(g: &mut u16, x: f32) {
    *g = f32_to_bf16(bf16_to_f32(*g) + x);
}

#[inline(always)]
fn set_f32_to(g: &mut f32, x: f32) {
    *g = 0.0 + x;
}

#[inline(always)]
fn set_bf16_to(g: &mut u16, x: f32) {
    *g = f32_to_bf16(0.0 + x);
}

#[inline(always)]
fn square_f32(x: f32) -> f64 {
    f64::from(x) * f64::from(x)
}

#[inline(always)]
fn square_bf16(b: u16) -> f64 {
    let x = f64::from(bf16_to_f32(b));
    x * x
}

/// `f(g[i], x[i])` for every element as [`widened`] does it, returning `from` + Σ of the
/// results' squares folded as [`blocked`] folds them: blocks of [`NORM_BLOCK`] from g's
/// first element, each by [`block_squares`], the blocks (on every core) added in order.
fn squared<T: Copy + Send + Sync>(
    g: &mut [T],
    x: Values,
    f: impl Fn(&mut T, f32) + Sync,
    square: impl Fn(T) -> f64 + Sync,
    from: f64,
) -> f64 {
    use rayon::prelude::*;
    let block = |g: &mut [T], x: Values| -> f64 {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above)
            return unsafe { add_then_square_avx2(g, x, &f, &square) };
        }
        add_then_square(g, x, &f, &square)
    };
    let at = |i: usize, len: usize| x.range(i * NORM_BLOCK..i * NORM_BLOCK + len);
    if g.len() <= PARALLEL_CHUNK {
        return g
            .chunks_mut(NORM_BLOCK)
            .enumerate()
            .fold(from, |s, (i, g)| s + block(g, at(i, g.len())));
    }
    // each core takes a piece of whole blocks (a task per block costs more than it)
    const PER_PIECE: usize = PARALLEL_CHUNK / NORM_BLOCK;
    let pieces: Vec<Vec<f64>> = g
        .par_chunks_mut(PARALLEL_CHUNK)
        .enumerate()
        .map(|(p, piece)| {
            piece
                .chunks_mut(NORM_BLOCK)
                .enumerate()
                .map(|(i, g)| block(g, at(p * PER_PIECE + i, g.len())))
                .collect()
        })
        .collect();
    pieces.into_iter().flatten().fold(from, |s, b| s + b)
}

/// `f(g[i], x[i])` for every element, each value widened to fp32 as it is read (exact).
fn widened<T: Send>(g: &mut [T], x: Values, f: impl Fn(&mut T, f32) + Sync) {
    match x {
        Values::F32(x) => each(g, x, |g, x| f(g, x)),
        Values::Bf16(x) => each(g, x, |g, b| f(g, bf16_to_f32(b))),
        Values::F16(x) => each(g, x, |g, b| f(g, f16_to_f32(b))),
    }
}

/// `g[i] = value` for every element, on every core for stretches longer than
/// [`PARALLEL_CHUNK`].
fn fill<T: Copy + Send + Sync>(g: &mut [T], value: T) {
    use rayon::prelude::*;
    if g.len() <= PARALLEL_CHUNK {
        return g.fill(value);
    }
    g.par_chunks_mut(PARALLEL_CHUNK).for_each(|g| g.fill(value));
}

/// `f(g[i], x[i])` for every element, on every core for stretches longer than
/// [`PARALLEL_CHUNK`].
fn each<T: Send, X: Copy + Sync>(g: &mut [T], x: &[X], f: impl Fn(&mut T, X) + Sync) {
    use rayon::prelude::*;
    let run = |g: &mut [T], x: &[X]| g.iter_mut().zip(x).for_each(|(g, &x)| f(g, x));
    if g.len() <= PARALLEL_CHUNK {
        return run(g, x);
    }
    g.par_chunks_mut(PARALLEL_CHUNK)
        .zip(x.par_chunks(PARALLEL_CHUNK))
        .for_each(|(g, x)| run(g, x));
}

/// `from` + Σ g² in f64: each block of [`NORM_BLOCK`] elements by [`block_squares`], the
/// blocks (computed on every core) added in order. A sum continued from a stretch that
/// ends on a block boundary is the sum over the whole.
pub fn sum_squares_f32(from: f64, g: &[f32]) -> f64 {
    blocked(from, g, square_f32)
}

/// [`sum_squares_f32`] of bf16 bits.
pub fn sum_squares_bf16(from: f64, g: &[u16]) -> f64 {
    blocked(from, g, square_bf16)
}

/// [`sum_squares_f32`] (or its bf16 twin), with the crc32c of `g`'s bytes taken block by
/// block as the squares pass them in cache: a gradient chunk on its way to the swap
/// store, its checksum without a pass of its own (`SwapStore::write_async_summed`).
pub fn sum_squares_summed(from: f64, g: GradSlice<'_>) -> (f64, Running) {
    match g {
        GradSlice::F32(g) => blocked_summing(from, g, square_f32, true),
        GradSlice::Bf16(g) => blocked_summing(from, g, square_bf16, true),
    }
}

/// Lanes of Σ g² in a block: element i of the block goes to lane i mod [`NORM_LANES`],
/// each lane folded in element order, then the lanes added in order. Independent lanes
/// keep the f64 adds in vector registers (one chain in element order ran at a fifth of
/// a memcpy's speed); every path (a pass, a stream's chunks, an add that squares) sums
/// blocks this way, so their sums are the same bits.
fn block_squares<T: Copy>(b: &[T], square: impl Fn(T) -> f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above)
        return unsafe { block_squares_avx2(b, square) };
    }
    lanes_of_squares(b, square)
}

/// [`lanes_of_squares`] compiled for AVX2 (the same operations in the same order: the
/// same bits, four lanes to a register).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn block_squares_avx2<T: Copy>(b: &[T], square: impl Fn(T) -> f64) -> f64 {
    lanes_of_squares(b, square)
}

#[inline(always)]
fn lanes_of_squares<T: Copy>(b: &[T], square: impl Fn(T) -> f64) -> f64 {
    let mut lanes = [0.0f64; NORM_LANES];
    let mut chunks = b.chunks_exact(NORM_LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += square(x);
        }
    }
    for (l, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += square(x);
    }
    lanes.iter().fold(0.0, |s, &l| s + l)
}

/// A block's adds, then its squares while it is in cache ([`lanes_of_squares`]).
#[inline(always)]
fn add_then_square<T: Copy>(
    g: &mut [T],
    x: Values,
    f: impl Fn(&mut T, f32),
    square: impl Fn(T) -> f64,
) -> f64 {
    match x {
        Values::F32(x) => g.iter_mut().zip(x).for_each(|(g, &x)| f(g, x)),
        Values::Bf16(x) => g.iter_mut().zip(x).for_each(|(g, &b)| f(g, bf16_to_f32(b))),
        Values::F16(x) => g.iter_mut().zip(x).for_each(|(g, &b)| f(g, f16_to_f32(b))),
    }
    lanes_of_squares(g, square)
}

/// [`add_then_square`] compiled for AVX2 (the same operations in the same order).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_then_square_avx2<T: Copy>(
    g: &mut [T],
    x: Values,
    f: impl Fn(&mut T, f32),
    square: impl Fn(T) -> f64,
) -> f64 {
    add_then_square(g, x, f, square)
}

/// Lanes of a block's Σ g² ([`block_squares`]).
const NORM_LANES: usize = 32;

fn blocked<T: Pod>(from: f64, g: &[T], square: impl Fn(T) -> f64 + Sync) -> f64 {
    blocked_summing(from, g, square, false).0
}

/// [`blocked`], and where `summed` the crc32c of `g`'s bytes, each block summed as its
/// squares pass it (an empty sum otherwise): the same squares in the same order either way.
fn blocked_summing<T: Pod>(
    from: f64,
    g: &[T],
    square: impl Fn(T) -> f64 + Sync,
    summed: bool,
) -> (f64, Running) {
    use rayon::prelude::*;
    // a block's squares, its bytes appended to `sum` where summed
    let block = |b: &[T], sum: &mut Running| {
        if summed {
            *sum = sum.append(crc::bytes_of(b));
        }
        block_squares(b, &square)
    };
    if g.len() <= PARALLEL_CHUNK {
        let mut sum = Running::default();
        let squares = g.chunks(NORM_BLOCK).fold(from, |s, b| s + block(b, &mut sum));
        return (squares, sum);
    }
    // each core takes a piece of whole blocks (a task per block costs more than it): its
    // blocks' squares in order, and its bytes' sum
    let pieces: Vec<(Vec<f64>, Running)> = g
        .par_chunks(PARALLEL_CHUNK)
        .map(|p| {
            let mut sum = Running::default();
            (p.chunks(NORM_BLOCK).map(|b| block(b, &mut sum)).collect(), sum)
        })
        .collect();
    pieces
        .into_iter()
        .fold((from, Running::default()), |(s, sum), (squares, piece_sum)| {
            (squares.into_iter().fold(s, |s, b| s + b), sum.then(piece_sum))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squares_summed_are_the_squares_and_the_crc32c_of_the_bytes() {
        for n in [1, NORM_BLOCK + 3, 3 * PARALLEL_CHUNK + 17] {
            let g: Vec<f32> = (0..n).map(|i| (i % 101) as f32 * 1e-3 - 0.05).collect();
            let h: Vec<u16> = g.iter().map(|&x| f32_to_bf16(x)).collect();
            let (squares, sum) = sum_squares_summed(0.5, GradSlice::F32(&g));
            assert_eq!(squares.to_bits(), sum_squares_f32(0.5, &g).to_bits(), "{n}");
            assert_eq!(sum, Running::default().append(crc::bytes_of(&g)), "{n}");
            let (squares, sum) = sum_squares_summed(0.0, GradSlice::Bf16(&h));
            assert_eq!(squares.to_bits(), sum_squares_bf16(0.0, &h).to_bits(), "{n}");
            assert_eq!(sum.crc, crc32c::crc32c(crc::bytes_of(&h)), "{n}");
        }
    }

    #[test]
    fn bf16_accumulation_rounds_each_addition_once() {
        let mut g = Grads::zeros(3, true).unwrap();
        g.add(1, &[1.0 + 1.0 / 512.0, -3.0]);
        // 1 + 2^-9 is halfway between two bf16 values: ties to even (1.0)
        assert_eq!(g.slice(0..3).get(1), 1.0);
        assert_eq!(g.slice(0..3).get(2), -3.0);
        g.add(1, &[1.0]);
        assert_eq!(g.slice(0..3).get(1), 2.0);
        assert_eq!(g.sum_squares(0..3), 4.0 + 9.0);
        let mut f = Grads::zeros(2, false).unwrap();
        f.add(0, &[0.5, 0.25]);
        f.add(0, &[0.5, 0.25]);
        assert_eq!(f.sum_squares(0..2), 1.0 + 0.25);
        assert_eq!((f.bytes(), g.bytes()), (8, 6));
    }

    /// The passes on every core are the one-thread passes' bits: the additions element
    /// by element; Σ g² by blocks, whether over the whole or continued stretch by stretch
    /// from block boundaries (as the swap store's chunks are), in f32 and in bf16.
    #[test]
    fn passes_on_every_core_equal_the_one_thread_definitions() {
        let n = 5 * PARALLEL_CHUNK + 1234;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
        let start: Vec<f32> = (0..n).map(|i| (i % 31) as f32 * 0.37).collect();
        let mut parallel = start.clone();
        add_f32(&mut parallel, &x);
        let serial: Vec<f32> = start.iter().zip(&x).map(|(a, b)| a + b).collect();
        assert_eq!(parallel, serial);
        let bits: Vec<u16> = start.iter().map(|&v| f32_to_bf16(v)).collect();
        let mut parallel16 = bits.clone();
        add_bf16(&mut parallel16, &x);
        let serial16: Vec<u16> = bits
            .iter()
            .zip(&x)
            .map(|(&g, &x)| f32_to_bf16(bf16_to_f32(g) + x))
            .collect();
        assert_eq!(parallel16, serial16);
        // blocks of 4096 from the start, element i of a block in lane i mod 32, each
        // lane in element order, then the lanes, then the blocks, in order
        let definition = |g: &[f32]| {
            g.chunks(NORM_BLOCK)
                .map(|b| {
                    (0..32)
                        .map(|lane| {
                            b.iter()
                                .skip(lane)
                                .step_by(32)
                                .fold(0.0, |s, &x| s + f64::from(x) * f64::from(x))
                        })
                        .fold(0.0, |s, l| s + l)
                })
                .fold(0.0, |s, b| s + b)
        };
        let whole = sum_squares_f32(0.0, &x);
        assert_eq!(whole.to_bits(), definition(&x).to_bits());
        let stretch = 3 * NORM_BLOCK;
        let continued = x.chunks(stretch).fold(0.0, sum_squares_f32);
        assert_eq!(continued.to_bits(), whole.to_bits());
        let widened: Vec<f32> = bits.iter().map(|&b| bf16_to_f32(b)).collect();
        let continued16 = bits.chunks(stretch).fold(0.0, sum_squares_bf16);
        assert_eq!(continued16.to_bits(), definition(&widened).to_bits());
    }

    /// An add that squares as it goes (the step's last contribution, `staging::Squares`)
    /// leaves the bits of the add and the Σ g² of a pass over the result, continued
    /// stretch by stretch on block boundaries (short stretches and ones on every core,
    /// fp32 and bf16 accumulators, fp32 and bf16 values, into zeros and onto values).
    #[test]
    fn an_add_that_squares_is_the_add_and_then_the_pass_bit_for_bit() {
        let n = 3 * PARALLEL_CHUNK + 4 * NORM_BLOCK + 77;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
        let x16: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v * 0.3)).collect();
        let start: Vec<f32> = (0..n).map(|i| (i % 31) as f32 * 0.37 - 4.0).collect();
        for bf16 in [false, true] {
            for stretch in [NORM_BLOCK, 2 * PARALLEL_CHUNK + NORM_BLOCK, n] {
                for (values, onto) in [(0, false), (1, true), (0, true)] {
                    let value = |a: usize, b: usize| match values {
                        0 => Values::F32(&x[a..b]),
                        _ => Values::Bf16(&x16[a..b]),
                    };
                    let begin = || {
                        let mut g = Grads::zeros(n, bf16).unwrap();
                        if onto {
                            g.add(0, &start);
                        }
                        g
                    };
                    let (mut plain, mut fused) = (begin(), begin());
                    let mut sum = 0.0;
                    for a in (0..n).step_by(stretch) {
                        let b = (a + stretch).min(n);
                        plain.add_values(a, value(a, b));
                        sum = if onto {
                            fused.add_values_squared(a, value(a, b), sum)
                        } else {
                            fused.set_values_squared(a, value(a, b), sum)
                        };
                    }
                    let raw = |g: &Grads| -> Vec<u32> {
                        match g {
                            Grads::F32(g) => g.iter().map(|v| v.to_bits()).collect(),
                            Grads::Bf16(g) => g.iter().map(|&v| u32::from(v)).collect(),
                        }
                    };
                    let what = format!("bf16 {bf16}, stretch {stretch}, values {values}, onto {onto}");
                    assert!(raw(&fused) == raw(&plain), "{what}: the sums' bits");
                    assert_eq!(sum.to_bits(), plain.sum_squares(0..n).to_bits(), "{what}: Σ g²");
                }
            }
        }
    }
}
