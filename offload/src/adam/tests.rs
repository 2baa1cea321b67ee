//! Kernel tests: every SIMD kernel against the scalar reference, to the bit.

use super::*;
use crate::convert::{f32_to_bf16, f32_to_f16};

/// SplitMix64: a fixed, dependency-free source of test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

#[derive(Clone, PartialEq, Debug)]
struct State {
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    grad: Vec<f32>,
    grad_bf16: Vec<u16>,
    low: Vec<u16>,
    low_f32: Vec<f32>,
}

impl State {
    fn random(n: usize, seed: u64) -> State {
        let mut rng = Rng(seed);
        let grad = rng.vec(n, 0.1);
        State {
            master: rng.vec(n, 1.0),
            exp_avg: rng.vec(n, 0.01),
            exp_avg_sq: rng.vec(n, 1e-3).into_iter().map(f32::abs).collect(),
            grad_bf16: grad.iter().map(|&g| f32_to_bf16(g)).collect(),
            grad,
            low: vec![0; n],
            low_f32: vec![0.0; n],
        }
    }

    fn sweep(&mut self, grad_bf16: bool, low: &str) -> Sweep<'_> {
        Sweep {
            master: &mut self.master,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
            grad: if grad_bf16 {
                GradSlice::Bf16(&self.grad_bf16)
            } else {
                GradSlice::F32(&self.grad)
            },
            low: match low {
                "bf16" => LowPrecisionOut::Bf16(&mut self.low),
                "fp16" => LowPrecisionOut::F16(&mut self.low),
                "fp32" => LowPrecisionOut::F32(&mut self.low_f32),
                _ => LowPrecisionOut::None,
            },
        }
    }
}

const SIZES: [usize; 5] = [1, 7, 22, 4097, (1 << 20) + 3];

fn hypers() -> [AdamHyper; 2] {
    let decoupled = AdamHyper {
        lr: 3e-3,
        weight_decay: 0.1,
        ..AdamHyper::default()
    };
    let l2 = AdamHyper {
        mode: WeightDecay::L2,
        ..decoupled
    };
    [decoupled, l2]
}

/// The kernels this machine runs: every one but AVX-512 where the build script found no
/// `avx512f` (its test is then listed as ignored). AVX2 is required: CI's machines have
/// it, and one that lacks it is worth a red run.
fn kernels_here() -> Vec<Kernel> {
    let kernels: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| cfg!(cpu_has_avx512f) || *k != Kernel::Avx512)
        .collect();
    for k in &kernels {
        assert!(k.is_supported(), "AdamW kernel {k} is not supported by this CPU");
    }
    kernels
}

/// `kernel` against the scalar reference, bit for bit, at sizes that hit every tail.
fn matches_the_reference_bit_for_bit(kernel: Kernel) {
    assert!(
        kernel.is_supported(),
        "AdamW kernel {kernel} is not supported by this CPU"
    );
    for &n in &SIZES {
        for hyper in hypers() {
            for grad_bf16 in [false, true] {
                for low in ["none", "bf16", "fp16", "fp32"] {
                    let mut expected = State::random(n, n as u64);
                    let mut got = expected.clone();
                    let mut flags = (false, false);
                    for step in 1..=3 {
                        let c = hyper.coefficients(step, 0.5);
                        flags.0 |= reference::sweep(&c, expected.sweep(grad_bf16, low));
                        flags.1 |= step_with(kernel, &c, got.sweep(grad_bf16, low))
                            .unwrap()
                            .found_non_finite;
                    }
                    let what = format!("{kernel} n={n} {hyper:?} bf16_grad={grad_bf16} low={low}");
                    assert_eq!(flags, (false, false), "{what}");
                    assert_eq!(bits(&got.master), bits(&expected.master), "master {what}");
                    assert_eq!(bits(&got.exp_avg), bits(&expected.exp_avg), "exp_avg {what}");
                    assert_eq!(
                        bits(&got.exp_avg_sq),
                        bits(&expected.exp_avg_sq),
                        "exp_avg_sq {what}"
                    );
                    assert_eq!(got.low, expected.low, "low {what}");
                    assert_eq!(bits(&got.low_f32), bits(&expected.low_f32), "low fp32 {what}");
                }
            }
        }
    }
}

#[test]
fn scalar_and_avx2_kernels_match_the_reference_bit_for_bit() {
    for kernel in [Kernel::Reference, Kernel::Portable, Kernel::Avx2] {
        matches_the_reference_bit_for_bit(kernel);
    }
}

#[test]
#[cfg_attr(
    not(cpu_has_avx512f),
    ignore = "this CPU has no AVX-512F (offload/build.rs read /proc/cpuinfo)"
)]
fn avx512_kernel_matches_the_reference_bit_for_bit() {
    matches_the_reference_bit_for_bit(Kernel::Avx512);
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn low_precision_copy_is_the_rounded_master() {
    let mut s = State::random(4097, 7);
    let c = AdamHyper::default().coefficients(1, 1.0);
    step(&c, s.sweep(false, "bf16")).unwrap();
    let expected: Vec<u16> = s.master.iter().map(|&p| f32_to_bf16(p)).collect();
    assert_eq!(s.low, expected);
    step(&c, s.sweep(true, "fp16")).unwrap();
    let expected: Vec<u16> = s.master.iter().map(|&p| f32_to_f16(p)).collect();
    assert_eq!(s.low, expected);
}

#[test]
fn non_finite_gradients_are_reported_wherever_they_sit() {
    for kernel in kernels_here() {
        for &n in &[1usize, 22, 4097, 100_003] {
            for position in [0, n / 2, n - 1] {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut s = State::random(n, 3);
                    s.grad[position] = bad;
                    s.grad_bf16[position] = f32_to_bf16(bad);
                    let c = AdamHyper::default().coefficients(1, 1.0);
                    for grad_bf16 in [false, true] {
                        let report = step_with(kernel, &c, s.clone().sweep(grad_bf16, "none")).unwrap();
                        assert!(report.found_non_finite, "{kernel} n={n} at {position}: {bad}");
                    }
                }
            }
        }
    }
}

/// Step 1 from zero moments has a closed form: m̂ = g, v̂ = g², so
/// p₁ = p₀·(1 − lr·wd) − lr·g / (|g| + ε).
#[test]
fn first_step_has_the_closed_form() {
    let hyper = AdamHyper {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamHyper::default()
    };
    let mut s = State::random(1000, 11);
    s.exp_avg.fill(0.0);
    s.exp_avg_sq.fill(0.0);
    let before = s.master.clone();
    step(&hyper.coefficients(1, 1.0), s.sweep(false, "none")).unwrap();
    for ((&p1, &p0), &g) in s.master.iter().zip(&before).zip(&s.grad) {
        let expected = f64::from(p0) * (1.0 - 0.01 * 0.1) - 0.01 * f64::from(g) / (f64::from(g).abs() + 1e-8);
        assert!(
            (f64::from(p1) - expected).abs() <= 1e-6 * expected.abs().max(1e-3),
            "{p1} vs {expected}"
        );
    }
}

#[test]
fn mismatched_lengths_are_an_error_not_a_panic() {
    let mut s = State::random(10, 1);
    s.exp_avg.pop();
    let err = step(&AdamHyper::default().coefficients(1, 1.0), s.sweep(false, "none")).unwrap_err();
    assert_eq!(
        err,
        AdamError::LengthMismatch {
            what: "exp_avg",
            got: 9,
            expected: 10
        }
    );
}

#[test]
fn roofline_runs_on_every_supported_kernel() {
    for kernel in kernels_here() {
        let mut s = State::random(4099, 5);
        let poisoned = roofline_sweep(kernel, s.sweep(true, "bf16")).unwrap();
        assert!(!poisoned, "{kernel}");
    }
}

#[test]
fn a_summed_sweep_updates_as_a_plain_one_and_sums_what_it_read_and_wrote() {
    let bytes = |x: &[f32]| crate::crc::bytes_of(x).to_vec();
    let crc = |x: &[u8]| crate::crc::Running::default().append(x);
    for kernel in kernels_here() {
        for &n in &[1usize, 2047, 2048, 2049, TASK_ELEMENTS * 3 + 5] {
            for grad_bf16 in [false, true] {
                let c = hypers()[0].coefficients(2, 0.5);
                let mut plain = State::random(n, 11 + n as u64);
                let mut summed = plain.clone();
                let before = [&plain.master, &plain.exp_avg, &plain.exp_avg_sq].map(|x| crc(&bytes(x)));
                let grad = if grad_bf16 {
                    crc(crate::crc::bytes_of(&plain.grad_bf16))
                } else {
                    crc(&bytes(&plain.grad))
                };
                step_with(kernel, &c, plain.sweep(grad_bf16, "bf16")).unwrap();
                let (_, sums) = step_summed_with(kernel, &c, summed.sweep(grad_bf16, "bf16"), true).unwrap();
                let what = format!("{kernel} n={n} bf16_grad={grad_bf16}");
                assert_eq!(summed, plain, "{what}");
                let after = [&plain.master, &plain.exp_avg, &plain.exp_avg_sq].map(|x| crc(&bytes(x)));
                assert_eq!(sums.read[..3], before, "{what}");
                assert_eq!(sums.read[3], grad, "{what}");
                assert_eq!(sums.written, after, "{what}");
                let (_, without) =
                    step_summed_with(kernel, &c, summed.sweep(grad_bf16, "none"), false).unwrap();
                assert_eq!(without.read[3], crate::crc::Running::default(), "{what}");
                assert_eq!(without.read[..3], after, "{what}");
            }
        }
    }
}
