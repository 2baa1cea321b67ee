//! Unit-by-unit recompute-backward equals whole-model autograd.
//!
//! The reference builds one autograd graph over every unit's parameters, computes full
//! [tokens, vocab] logits and a plain mean cross-entropy, and calls backward once; the
//! model under test runs each unit forward without autograd, then each unit backward by
//! recompute in reverse, with the chunked head. Gradients must agree to fp32 rounding.

use tch::{Kind, Tensor};
use tierzero::config::model::ModelConfig;
use tierzero::model::Model;
use tierzero::torch::tensor_f32;

fn params(model: &Model, seed: u64) -> Vec<Tensor> {
    model
        .units
        .iter()
        .map(|u| {
            let mut flat = vec![0f32; u.numel];
            u.init(seed, &mut flat);
            tensor_f32(&flat, tch::Device::Cpu).unwrap()
        })
        .collect()
}

fn batch(vocab: i64) -> (Tensor, Tensor) {
    let tokens =
        Tensor::from_slice(&(0..2 * 16).map(|i| (i * 7 + 3) % vocab).collect::<Vec<i64>>()).view([2, 16]);
    let mut targets: Vec<i64> = (0..2 * 16).map(|i| (i * 5 + 1) % vocab).collect();
    targets[3] = -1; // an ignored position
    (tokens, Tensor::from_slice(&targets).view([2, 16]))
}

fn reference_grads(model: &Model, p: &[Tensor], tokens: &Tensor, targets: &Tensor) -> (f64, Vec<Tensor>) {
    let leaves: Vec<Tensor> = p.iter().map(|t| t.detach().set_requires_grad(true)).collect();
    let last = leaves.len() - 1;
    let mut x = tokens.shallow_clone();
    // run every unit through the same blocks, but inside one graph
    for (u, leaf) in leaves.iter().enumerate().take(last) {
        x = model.forward_graph_for_tests(u, leaf, &x);
    }
    let h = model.forward_graph_for_tests(last, &leaves[last], &x);
    let (v, hd) = (model.config.vocab_size as i64, model.config.hidden_size as i64);
    let w = if model.config.tie_word_embeddings {
        leaves[0].narrow(0, 0, v * hd).view([v, hd])
    } else {
        let spec = model.units[last].param("lm_head.weight").unwrap();
        leaves[last]
            .narrow(0, spec.offset as i64, spec.numel as i64)
            .view([v, hd])
    };
    let logits = h.reshape([-1, hd]).matmul(&w.tr());
    let tg = targets.reshape([-1]);
    let valid = tg.ge(0);
    let logp = logits
        .log_softmax(-1, Kind::Float)
        .gather(1, &tg.clamp_min(0).unsqueeze(1), false)
        .squeeze_dim(1);
    let loss = -(logp * valid.to_kind(Kind::Float)).sum(Kind::Float) / valid.sum(Kind::Float);
    let refs: Vec<&Tensor> = leaves.iter().collect();
    let grads = Tensor::run_backward(&[&loss], &refs, false, false);
    (loss.double_value(&[]), grads)
}

fn unit_grads(model: &Model, p: &[Tensor], tokens: &Tensor, targets: &Tensor) -> (f64, Vec<Tensor>) {
    let last = p.len() - 1;
    let mut inputs = vec![tokens.shallow_clone()];
    for (u, params) in p.iter().enumerate().take(last) {
        let y = model.forward_unit(u, params, inputs.last().unwrap()).unwrap();
        inputs.push(y);
    }
    let tied = model.config.tie_word_embeddings.then(|| &p[0]);
    let (loss_sum, count) = model.loss(&p[last], tied, &inputs[last], targets).unwrap();
    let last_unit = model
        .backward_final(&p[last], tied, &inputs[last], targets, 1.0)
        .unwrap();
    assert!((last_unit.loss_sum - loss_sum).abs() < 1e-9 * loss_sum.abs().max(1.0));
    let mut grads: Vec<Option<Tensor>> = (0..p.len()).map(|_| None).collect();
    grads[last] = Some(last_unit.params);
    let mut dx = last_unit.input;
    for u in (0..last).rev() {
        let (g, dinput) = model.backward_unit(u, &p[u], &inputs[u], &dx).unwrap();
        grads[u] = Some(g);
        if let Some(d) = dinput {
            dx = d;
        }
    }
    if let Some(t) = last_unit.tied {
        let g0 = grads[0].take().unwrap();
        let n = t.numel() as i64;
        let _ = g0.narrow(0, 0, n).f_add_(&t.reshape([-1])).unwrap();
        grads[0] = Some(g0);
    }
    (
        loss_sum / count as f64,
        grads.into_iter().map(Option::unwrap).collect(),
    )
}

fn check(preset: &str, tie: Option<bool>) {
    let mut config = ModelConfig::preset(preset).unwrap();
    if let Some(t) = tie {
        config.tie_word_embeddings = t;
    }
    let model = Model::new(config, Kind::Float);
    let p = params(&model, 42);
    let (tokens, targets) = batch(model.config.vocab_size as i64);
    let (loss_ref, g_ref) = reference_grads(&model, &p, &tokens, &targets);
    let (loss, g) = unit_grads(&model, &p, &tokens, &targets);
    assert!(
        (loss - loss_ref).abs() < 1e-5 * loss_ref.abs(),
        "{preset}: loss {loss} vs {loss_ref}"
    );
    // a freshly initialised model predicts nearly uniformly: loss ≈ ln(vocab)
    assert!(
        (loss - (model.config.vocab_size as f64).ln()).abs() < 0.1,
        "{preset}: {loss}"
    );
    for (u, (a, b)) in g.iter().zip(&g_ref).enumerate() {
        let scale = b.abs().max().double_value(&[]).max(1e-12);
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-5 * scale,
            "{preset} tie={tie:?} unit {u}: max |Δ| {diff:e} vs max |g| {scale:e}"
        );
    }
}

#[test]
fn llama_unit_grads_equal_whole_model_autograd() {
    check("llama-tiny", Some(false));
    check("llama-tiny", Some(true));
}

#[test]
fn gpt2_unit_grads_equal_whole_model_autograd() {
    check("gpt2-tiny", None);
}
