//! The CPU AdamW has PyTorch's semantics: ten steps against libtorch's own
//! `torch::optim::AdamW` (decoupled) and `torch::optim::Adam` with weight decay (L2),
//! driven through tch, agree within 1e-6 relative (plus 1e-7 absolute near zero); and
//! so does torch's fused kernel (`_fused_adamw_` / `_fused_adam_` through the bridge),
//! the update of device-tier optimizer state, master and both moments.

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tierzero_offload::adam::{self, AdamHyper, GradSlice, LowPrecisionOut, Sweep, WeightDecay};

fn pseudo_random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn run(mode: WeightDecay) {
    let n = 4097;
    let hyper = AdamHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        mode,
    };
    let init = pseudo_random(n, 1, 1.0);

    // libtorch's optimizer
    let vs = nn::VarStore::new(Device::Cpu);
    let param = vs.root().var_copy("p", &Tensor::from_slice(&init));
    let mut opt = match mode {
        WeightDecay::Decoupled => nn::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            wd: 0.1,
            eps: 1e-8,
            amsgrad: false,
        }
        .build(&vs, 1e-2)
        .unwrap(),
        WeightDecay::L2 => nn::Adam {
            beta1: 0.9,
            beta2: 0.95,
            wd: 0.1,
            eps: 1e-8,
            amsgrad: false,
        }
        .build(&vs, 1e-2)
        .unwrap(),
    };

    // ours
    let mut master = init.clone();
    let mut exp_avg = vec![0f32; n];
    let mut exp_avg_sq = vec![0f32; n];
    // the device tier's: torch's fused kernel on tensors
    let mut fused = [
        Tensor::from_slice(&init),
        Tensor::zeros([n as i64], (Kind::Float, Device::Cpu)),
        Tensor::zeros([n as i64], (Kind::Float, Device::Cpu)),
    ];

    for step in 1..=10u64 {
        let grad = pseudo_random(n, 100 + step, 0.1);
        // d/dp sum(p * g) = g
        opt.zero_grad();
        let loss = (&param * Tensor::from_slice(&grad)).sum(Kind::Float);
        loss.backward();
        opt.step();

        let sweep = Sweep {
            master: &mut master,
            exp_avg: &mut exp_avg,
            exp_avg_sq: &mut exp_avg_sq,
            grad: GradSlice::F32(&grad),
            low: LowPrecisionOut::None,
        };
        adam::step(&hyper.coefficients(step, 1.0), sweep).unwrap();
        let [p, m, v] = &mut fused;
        tierzero::torch::shim::fused_adam(p, &Tensor::from_slice(&grad), m, v, step, &hyper).unwrap();
    }
    let close = |what: &str, ours: &[f32], theirs: &[f32]| {
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs() + 1e-7,
                "{mode:?} {what}: element {i}: CPU kernel {a} vs fused {b}"
            );
        }
    };
    let [p, m, v] = &fused;
    close("master", &master, &Vec::<f32>::try_from(p).unwrap());
    close("exp_avg", &exp_avg, &Vec::<f32>::try_from(m).unwrap());
    close("exp_avg_sq", &exp_avg_sq, &Vec::<f32>::try_from(v).unwrap());
    let expected: Vec<f32> = Vec::try_from(&param.detach()).unwrap();
    // torch.allclose semantics: |ours − torch| ≤ rtol·|torch| + atol, with rtol 1e-6 and
    // atol 1e-7 (one fp32 ulp near 1) for parameters that pass through zero
    for (i, (a, b)) in master.iter().zip(&expected).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs() + 1e-7,
            "{mode:?}: element {i}: ours {a} vs torch {b}"
        );
    }
}

#[test]
fn decoupled_matches_torch_adamw() {
    run(WeightDecay::Decoupled);
}

#[test]
fn l2_matches_torch_adam_with_weight_decay() {
    run(WeightDecay::L2);
}
