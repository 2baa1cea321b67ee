//! Gradient partitions on NVMe, beside the optimizer state (DeepSpeed's optimizer swapper
//! keeps them there too): with the optimizer state on NVMe at stages 2–3 the host holds no
//! gradient accumulator, only one swap chunk per reduction in flight (issue "The engine on
//! lanes and arenas", §2).
//!
//! A reduction adds its reduced stretches into a [`GradStream`] in element order. The
//! stream holds one chunk of the unit's stored gradient in a pool buffer — zeros on the
//! step's first contribution, else the chunk read back from the store — and writes it
//! (checksummed, O_DIRECT) as soon as the stretches move past it. Additions are
//! [`Grads::add`]'s (fp32, or bf16 rounded once) and Σg² folds over the elements in order
//! as [`Grads::sum_squares`] does, so the stored gradient, its norm and the update are the
//! bits an in-memory accumulator gives. The optimizer pipeline reads each chunk back beside
//! the state it updates (`pipeline::GradIn::Stored`).

use super::error::{EngineError, On};
use super::grads::{add_values_bf16, add_values_f32, sum_squares_summed, Grads, Values};
use crate::device::sim;
use crate::metrics::timeline::{Phase, Track};
use crate::plan::simulate::costs::Work;
use std::time::Instant;
use tierzero_offload::adam::GradSlice;
use tierzero_offload::nvme::swap::{SwapStore, TensorKey};
use tierzero_offload::pool::IoBuf;

/// Where a reduction adds: `offset` is the element of the accumulator `x[0]` goes to;
/// I/O it does is recorded on `track` (the thread's).
pub trait Accumulate {
    fn add(&mut self, offset: usize, x: Values, track: &Track) -> Result<(), EngineError>;

    /// [`Self::add`], returning `from` continued with Σ g² of the stretch's elements after
    /// the add, folded as `Grads::sum_squares` folds them from `offset` (a block
    /// boundary); None where this accumulator does not square as it adds (a stream to
    /// NVMe keeps its own sum), the stretch added all the same.
    fn add_squared(
        &mut self,
        offset: usize,
        x: Values,
        from: f64,
        track: &Track,
    ) -> Result<Option<f64>, EngineError> {
        let _ = from;
        self.add(offset, x, track).map(|()| None)
    }
}

impl Accumulate for Grads {
    fn add(&mut self, offset: usize, x: Values, _: &Track) -> Result<(), EngineError> {
        Grads::add_values(self, offset, x);
        Ok(())
    }

    fn add_squared(
        &mut self,
        offset: usize,
        x: Values,
        from: f64,
        _: &Track,
    ) -> Result<Option<f64>, EngineError> {
        Ok(Some(self.add_values_squared(offset, x, from)))
    }
}

/// One unit's gradient on its way into the store.
pub struct GradStream<'s> {
    on: On,
    store: &'s SwapStore,
    key: TensorKey,
    bf16: bool,
    /// Nothing was stored this step: chunks start at zero instead of being read back.
    fresh: bool,
    /// The chunk buffer (None only after a failed I/O took it).
    buf: Option<IoBuf>,
    /// The chunk `buf` holds.
    held: Option<usize>,
    /// Chunks written so far, in order.
    written: usize,
    sum_squares: f64,
}

impl<'s> GradStream<'s> {
    /// A stream into `key` (a [`State::Grad`](tierzero_offload::nvme::swap::State) tensor)
    /// through `buf` (one chunk of fp32).
    pub fn new(on: On, store: &'s SwapStore, key: TensorKey, bf16: bool, fresh: bool, buf: IoBuf) -> Self {
        GradStream {
            on,
            store,
            key,
            bf16,
            fresh,
            buf: Some(buf),
            held: None,
            written: 0,
            sum_squares: 0.0,
        }
    }

    /// Σg² of the gradient as written (complete after [`Self::finish`]).
    pub fn sum_squares(&self) -> f64 {
        self.sum_squares
    }

    /// Writes the chunk in hand and every chunk not reached, so that the store holds the
    /// whole gradient (chunks nothing was added to keep their old or zero values).
    pub fn finish(&mut self, track: &Track) -> Result<(), EngineError> {
        let chunks = self.store.chunks(self.key).map_err(self.on.io())?;
        if chunks > 0 {
            self.hold(chunks - 1, track)?;
            self.flush(track)?;
        }
        Ok(())
    }

    fn unit(&self) -> Option<usize> {
        Some(self.key.unit as usize)
    }

    fn buffer(&mut self) -> Result<&mut IoBuf, EngineError> {
        let rank = self.on.0;
        self.buf.as_mut().ok_or(EngineError::Invariant {
            rank,
            what: "a gradient stream used after a failed write",
        })
    }

    /// Makes chunk `c` the one in hand, writing the chunks before it first.
    fn hold(&mut self, c: usize, track: &Track) -> Result<(), EngineError> {
        while self.held != Some(c) {
            if self.held.is_some() {
                self.flush(track)?;
            }
            if self.written > c {
                return Err(EngineError::Invariant {
                    rank: self.on.0,
                    what: "a gradient stream went back to a chunk it had written",
                });
            }
            self.load(self.written, track)?;
        }
        Ok(())
    }

    fn load(&mut self, c: usize, track: &Track) -> Result<(), EngineError> {
        let (store, key, io) = (self.store, self.key, self.on.io());
        if self.fresh {
            self.buffer()?.as_bytes_mut().fill(0);
        } else {
            let Some(buf) = self.buf.take() else {
                return self.buffer().map(drop);
            };
            let bytes = store.chunk_io_bytes(key, c).map_err(&io)? as u64;
            let start = Instant::now();
            let read = store.read_async(key, c, buf).map_err(|(e, _)| io(e))?;
            let buf = read.wait().map_err(&io)?;
            track.record(Phase::NvmeRead, self.unit(), start, bytes);
            sim::charge(Work::NvmeRead(bytes));
            self.buf = Some(buf);
        }
        self.held = Some(c);
        Ok(())
    }

    fn flush(&mut self, track: &Track) -> Result<(), EngineError> {
        let Some(c) = self.held.take() else {
            return Ok(());
        };
        let (store, key, io) = (self.store, self.key, self.on.io());
        let n = store.chunk_numel(key, c).map_err(&io)?;
        let Some(buf) = self.buf.take() else {
            return self.buffer().map(drop);
        };
        // Σ g² and the chunk's checksum in one pass over it
        let g = if self.bf16 {
            GradSlice::Bf16(buf.typed::<u16>(n))
        } else {
            GradSlice::F32(buf.typed::<f32>(n))
        };
        let (sum_squares, summed) = sum_squares_summed(self.sum_squares, g);
        self.sum_squares = sum_squares;
        let bytes = store.chunk_io_bytes(key, c).map_err(&io)? as u64;
        let start = Instant::now();
        let write = store
            .write_async_summed(key, c, buf, summed)
            .map_err(|(e, _)| io(e))?;
        let buf = write.wait().map_err(&io)?;
        track.record(Phase::NvmeWrite, self.unit(), start, bytes);
        sim::charge(Work::NvmeWrite(bytes));
        self.buf = Some(buf);
        self.written = c + 1;
        Ok(())
    }
}

impl Accumulate for GradStream<'_> {
    fn add(&mut self, offset: usize, x: Values, track: &Track) -> Result<(), EngineError> {
        let chunk = self.store.chunk_elems();
        let (mut offset, mut x) = (offset, x);
        while !x.is_empty() {
            let c = offset / chunk;
            self.hold(c, track)?;
            let within = offset - c * chunk;
            let n = x.len().min(chunk - within);
            let bf16 = self.bf16;
            let buf = self.buffer()?;
            if bf16 {
                add_values_bf16(&mut buf.typed_mut::<u16>(within + n)[within..], x.range(0..n));
            } else {
                add_values_f32(&mut buf.typed_mut::<f32>(within + n)[within..], x.range(0..n));
            }
            offset += n;
            x = x.range(n..x.len());
        }
        Ok(())
    }
}

/// A unit's accumulator as a reduction holds it: in host memory, in host memory at the
/// step's first contribution, or streaming to NVMe.
pub enum Acc<'s> {
    Here(Grads),
    Fresh(Fresh),
    Stream(GradStream<'s>),
}

impl Acc<'_> {
    /// Completes what the reduction wrote (a stream's last chunks reach the store; a
    /// fresh accumulator's elements no contribution reached become zeros).
    pub fn finish(&mut self, track: &Track) -> Result<(), EngineError> {
        match self {
            Acc::Here(_) => Ok(()),
            Acc::Fresh(f) => {
                f.finish();
                Ok(())
            }
            Acc::Stream(s) => s.finish(track),
        }
    }
}

impl Accumulate for Acc<'_> {
    fn add(&mut self, offset: usize, x: Values, track: &Track) -> Result<(), EngineError> {
        match self {
            Acc::Here(g) => Accumulate::add(g, offset, x, track),
            Acc::Fresh(f) => {
                f.add(offset, x);
                Ok(())
            }
            Acc::Stream(s) => s.add(offset, x, track),
        }
    }

    fn add_squared(
        &mut self,
        offset: usize,
        x: Values,
        from: f64,
        track: &Track,
    ) -> Result<Option<f64>, EngineError> {
        match self {
            Acc::Here(g) => g.add_squared(offset, x, from, track),
            Acc::Fresh(f) => Ok(f.add_squared(offset, x, from)),
            Acc::Stream(s) => s.add_squared(offset, x, from, track),
        }
    }
}

/// A host accumulator that holds a finished step's values (logically zeros) taking the
/// step's first contribution: below `valid` its elements are this step's, above they are
/// stale. An addition past `valid` writes `0 + x` without reading the stale value (and
/// zeroes a gap it skips), one below adds, so the accumulator ends with the bits that
/// zeroing it first and adding give, without the zeroing pass or the read.
pub struct Fresh {
    grads: Grads,
    valid: usize,
}

impl Fresh {
    pub fn new(grads: Grads) -> Self {
        Fresh { grads, valid: 0 }
    }

    fn add(&mut self, offset: usize, x: Values) {
        let end = offset + x.len();
        if end <= self.valid {
            return self.grads.add_values(offset, x);
        }
        let split = self.valid.max(offset);
        if offset < split {
            self.grads.add_values(offset, x.range(0..split - offset));
        } else {
            self.grads.zero_range(self.valid..offset);
        }
        self.grads.set_values(split, x.range(split - offset..x.len()));
        self.valid = end;
    }

    /// [`Self::add`], squared as [`Grads::add_values_squared`] where the stretch lies
    /// wholly below or from `valid` on (None, the stretch added, where it straddles it or
    /// leaves a gap).
    fn add_squared(&mut self, offset: usize, x: Values, from: f64) -> Option<f64> {
        let end = offset + x.len();
        if end <= self.valid {
            return Some(self.grads.add_values_squared(offset, x, from));
        }
        if offset != self.valid {
            self.add(offset, x);
            return None;
        }
        self.valid = end;
        Some(self.grads.set_values_squared(offset, x, from))
    }

    /// The elements no contribution reached become zeros.
    fn finish(&mut self) {
        let len = self.grads.len();
        self.grads.zero_range(self.valid.min(len)..len);
        self.valid = len;
    }

    /// The accumulator, if every element is this step's (after [`Acc::finish`]).
    pub fn into_finished(self) -> Result<Grads, Grads> {
        if self.valid >= self.grads.len() {
            Ok(self.grads)
        } else {
            Err(self.grads)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierzero_offload::nvme::swap::{State, TensorSpec};
    use tierzero_offload::nvme::{open_engine, EngineChoice, EngineConfig};

    /// A stale accumulator taking a step's contributions — stretches in order, out of
    /// order, overlapping, with gaps, covering part of it, negative zeros, in 16 bits
    /// and fp32, then a second micro-batch — ends with the bits of zeroing it first and
    /// adding the same stretches; nothing reads the stale values (NaN here).
    #[test]
    fn a_fresh_accumulator_is_zeroing_and_adding_bit_for_bit() {
        let n = 3 * crate::plan::rules::PARALLEL_CHUNK + 77;
        let x: Vec<f32> = (0..n)
            .map(|i| {
                if i % 13 == 0 {
                    -0.0
                } else {
                    ((i * 7919) % 1013) as f32 / 97.0 - 5.0
                }
            })
            .collect();
        let bits: Vec<u16> = x
            .iter()
            .map(|&v| tierzero_offload::convert::f32_to_bf16(v))
            .collect();
        let stretches: [&[(usize, usize)]; 5] = [
            &[(0, n)],
            &[(0, 100), (100, 5000), (5000, n)],
            &[(10, 90), (40, 60_000), (0, 30)],
            &[(70_000, 80_000), (5, 6)],
            &[],
        ];
        for bf16 in [false, true] {
            for stretches in stretches {
                let track = Track::disabled();
                let mut expected = Grads::zeros(n, bf16).unwrap();
                let mut stale = Grads::zeros(n, bf16).unwrap();
                match &mut stale {
                    Grads::F32(g) => g.fill(f32::NAN),
                    Grads::Bf16(g) => g.fill(0x7fc0),
                }
                let mut acc = Acc::Fresh(Fresh::new(stale));
                for micro in 0..2 {
                    for &(a, b) in stretches {
                        let values = if micro == 0 {
                            Values::F32(&x[a..b])
                        } else {
                            Values::Bf16(&bits[a..b])
                        };
                        expected.add_values(a, values);
                        acc.add(a, values, &track).unwrap();
                    }
                    acc.finish(&track).unwrap();
                }
                let Acc::Fresh(fresh) = acc else { unreachable!() };
                let got = fresh.into_finished().unwrap();
                let raw = |g: &Grads| -> Vec<u32> {
                    match g {
                        Grads::F32(g) => g.iter().map(|v| v.to_bits()).collect(),
                        Grads::Bf16(g) => g.iter().map(|&v| u32::from(v)).collect(),
                    }
                };
                assert_eq!(raw(&got), raw(&expected), "bf16 {bf16}, stretches {stretches:?}");
            }
        }
    }

    /// Two micro-batches added in stretches that straddle chunk boundaries, through the
    /// store (the second reading back the first), against the same additions into an
    /// in-memory accumulator: the same bits stored and the same Σg², fp32 and bf16; a
    /// gradient nothing was added to is stored as zeros.
    #[test]
    fn a_stored_gradient_is_the_in_memory_accumulator_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, _) = open_engine(dir.path(), EngineConfig::default(), None, EngineChoice::Auto).unwrap();
        let numel = 10_000;
        let key = |unit| TensorKey {
            unit,
            rank: 0,
            state: State::Grad,
        };
        let specs = [(0, 4), (1, 2), (2, 4)].map(|(unit, elem_bytes)| TensorSpec {
            key: key(unit),
            numel,
            elem_bytes,
        });
        let store = SwapStore::create(dir.path(), "grads", engine, &specs, 4096).unwrap();
        assert_eq!(store.chunks(key(0)).unwrap(), 3, "a ragged last chunk");
        let values = |seed: usize| -> Vec<f32> {
            (0..numel)
                .map(|i| ((i * 7919 + seed * 104_729) % 1999) as f32 / 997.0 - 1.0)
                .collect()
        };
        let (on, track) = (On(0), Track::disabled());
        for (unit, bf16) in [(0u32, false), (1, true)] {
            let mut memory = Grads::zeros(numel, bf16).unwrap();
            let mut sum = 0.0;
            for (micro, stretch) in [(0, 700), (1, 4097)] {
                let x = values(micro);
                let buf = IoBuf::new(store.chunk_bytes(4)).unwrap();
                let mut stream = GradStream::new(on, &store, key(unit), bf16, micro == 0, buf);
                for start in (0..numel).step_by(stretch) {
                    let end = (start + stretch).min(numel);
                    stream.add(start, Values::F32(&x[start..end]), &track).unwrap();
                    memory.add(start, &x[start..end]);
                }
                stream.finish(&track).unwrap();
                sum = stream.sum_squares();
            }
            assert_eq!(
                sum.to_bits(),
                memory.sum_squares(0..numel).to_bits(),
                "bf16 {bf16}"
            );
            let elem = if bf16 { 2 } else { 4 };
            let mut stored = vec![0u8; elem * numel];
            store
                .read_tensor(key(unit), &mut stored, IoBuf::new(store.chunk_bytes(4)).unwrap())
                .unwrap();
            let expected: Vec<u8> = match &memory {
                Grads::F32(g) => g.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Grads::Bf16(g) => g.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            assert!(stored == expected, "bf16 {bf16}: the stored gradient differs");
        }
        let buf = IoBuf::new(store.chunk_bytes(4)).unwrap();
        let mut untouched = GradStream::new(on, &store, key(2), false, true, buf);
        untouched.finish(&track).unwrap();
        let mut stored = vec![1u8; 4 * numel];
        store
            .read_tensor(key(2), &mut stored, IoBuf::new(store.chunk_bytes(4)).unwrap())
            .unwrap();
        assert!(stored.iter().all(|&b| b == 0));
        assert_eq!(untouched.sum_squares(), 0.0);
    }
}
