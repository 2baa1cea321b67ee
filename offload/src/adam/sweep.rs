//! The arrays one AdamW sweep touches, and how they are split across threads.
//!
//! A [`Sweep`] borrows master, both moments, the gradient and the optional
//! low-precision output for the same element range. Splitting it yields two sweeps over
//! disjoint ranges, so rayon can hand halves to threads with no unsafe code.

use super::AdamError;

/// The gradient, fp32 or bf16 (bf16 as raw `u16` bits, read without a conversion pass).
#[derive(Clone, Copy, Debug)]
pub enum GradSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> GradSlice<'a> {
    pub fn len(&self) -> usize {
        match self {
            GradSlice::F32(g) => g.len(),
            GradSlice::Bf16(g) => g.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            GradSlice::F32(g) => {
                let (a, b) = g.split_at(mid);
                (GradSlice::F32(a), GradSlice::F32(b))
            }
            GradSlice::Bf16(g) => {
                let (a, b) = g.split_at(mid);
                (GradSlice::Bf16(a), GradSlice::Bf16(b))
            }
        }
    }

    /// Element `i` as fp32.
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            GradSlice::F32(g) => g[i],
            GradSlice::Bf16(g) => crate::convert::bf16_to_f32(g[i]),
        }
    }

    /// Its bytes, as the swap store holds them.
    pub fn bytes(&self) -> &'a [u8] {
        match self {
            GradSlice::F32(g) => crate::crc::bytes_of(g),
            GradSlice::Bf16(g) => crate::crc::bytes_of(g),
        }
    }

    pub fn dtype_name(&self) -> &'static str {
        match self {
            GradSlice::F32(_) => "fp32",
            GradSlice::Bf16(_) => "bf16",
        }
    }
}

/// Where the updated parameter is also written: in low precision (raw `u16` bits), or
/// as an fp32 copy (fp32 training keeps its parameters apart from the master).
#[derive(Debug)]
pub enum LowPrecisionOut<'a> {
    None,
    Bf16(&'a mut [u16]),
    F16(&'a mut [u16]),
    F32(&'a mut [f32]),
}

impl<'a> LowPrecisionOut<'a> {
    fn len(&self) -> Option<usize> {
        match self {
            LowPrecisionOut::None => None,
            LowPrecisionOut::Bf16(o) | LowPrecisionOut::F16(o) => Some(o.len()),
            LowPrecisionOut::F32(o) => Some(o.len()),
        }
    }

    /// The same output, borrowed again.
    pub fn reborrow(&mut self) -> LowPrecisionOut<'_> {
        match self {
            LowPrecisionOut::None => LowPrecisionOut::None,
            LowPrecisionOut::Bf16(o) => LowPrecisionOut::Bf16(o),
            LowPrecisionOut::F16(o) => LowPrecisionOut::F16(o),
            LowPrecisionOut::F32(o) => LowPrecisionOut::F32(o),
        }
    }

    /// Two outputs over `[0, mid)` and `[mid, len)`.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            LowPrecisionOut::None => (LowPrecisionOut::None, LowPrecisionOut::None),
            LowPrecisionOut::Bf16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (LowPrecisionOut::Bf16(a), LowPrecisionOut::Bf16(b))
            }
            LowPrecisionOut::F16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (LowPrecisionOut::F16(a), LowPrecisionOut::F16(b))
            }
            LowPrecisionOut::F32(o) => {
                let (a, b) = o.split_at_mut(mid);
                (LowPrecisionOut::F32(a), LowPrecisionOut::F32(b))
            }
        }
    }
}

/// Everything one AdamW sweep reads and writes, for one contiguous element range.
#[derive(Debug)]
pub struct Sweep<'a> {
    pub master: &'a mut [f32],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    pub grad: GradSlice<'a>,
    pub low: LowPrecisionOut<'a>,
}

impl<'a> Sweep<'a> {
    pub fn len(&self) -> usize {
        self.master.len()
    }

    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// Every array covers the same number of elements.
    pub fn check(&self) -> Result<(), AdamError> {
        let expected = self.master.len();
        let lengths = [
            ("exp_avg", Some(self.exp_avg.len())),
            ("exp_avg_sq", Some(self.exp_avg_sq.len())),
            ("grad", Some(self.grad.len())),
            ("low-precision output", self.low.len()),
        ];
        for (what, got) in lengths {
            if let Some(got) = got {
                if got != expected {
                    return Err(AdamError::LengthMismatch { what, got, expected });
                }
            }
        }
        Ok(())
    }

    /// Two sweeps over `[0, mid)` and `[mid, len)`.
    pub fn split_at(self, mid: usize) -> (Sweep<'a>, Sweep<'a>) {
        let (m0, m1) = self.master.split_at_mut(mid);
        let (a0, a1) = self.exp_avg.split_at_mut(mid);
        let (s0, s1) = self.exp_avg_sq.split_at_mut(mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (l0, l1) = self.low.split_at(mid);
        (
            Sweep {
                master: m0,
                exp_avg: a0,
                exp_avg_sq: s0,
                grad: g0,
                low: l0,
            },
            Sweep {
                master: m1,
                exp_avg: a1,
                exp_avg_sq: s1,
                grad: g1,
                low: l1,
            },
        )
    }

    /// Splits in halves (at multiples of `task`) until pieces are at most `task`
    /// elements, runs `work` on each piece in the current rayon pool, and ORs the flags.
    pub fn par_fold(self, task: usize, work: &(dyn Fn(Sweep<'_>) -> bool + Sync)) -> bool {
        self.par_reduce(task, work, &|a, b| a | b)
    }

    /// Splits as [`Self::par_fold`] does, runs `work` on each piece, and joins the
    /// results of adjacent pieces in element order (`join(left, right)`).
    pub fn par_reduce<T: Send>(
        self,
        task: usize,
        work: &(dyn Fn(Sweep<'_>) -> T + Sync),
        join: &(dyn Fn(T, T) -> T + Sync),
    ) -> T {
        let len = self.len();
        if len <= task {
            return work(self);
        }
        let mid = (len / task).div_ceil(2) * task;
        let (left, right) = self.split_at(mid);
        let (a, b) = rayon::join(
            || left.par_reduce(task, work, join),
            || right.par_reduce(task, work, join),
        );
        join(a, b)
    }

    /// The bytes of master, exp_avg and exp_avg_sq, as the swap store holds them.
    pub fn state_bytes(&self) -> [&[u8]; 3] {
        let bytes = crate::crc::bytes_of::<f32>;
        [bytes(self.master), bytes(self.exp_avg), bytes(self.exp_avg_sq)]
    }

    /// The same arrays, borrowed again for a kernel that takes a sweep by value.
    pub fn reborrow(&mut self) -> Sweep<'_> {
        Sweep {
            master: self.master,
            exp_avg: self.exp_avg,
            exp_avg_sq: self.exp_avg_sq,
            grad: self.grad,
            low: self.low.reborrow(),
        }
    }
}
