//! Text generation with the training model's own units on one device: the prompt in
//! one pass, then one token at a time against a cache of every block's keys and values
//! ([`Model::decode`]), so each position is computed once.
//!
//! The next token is the most likely one (greedy, `temperature` 0) or drawn from the
//! softmax of the logits divided by `temperature`, restricted to the `top_k` most likely
//! tokens and then to the smallest set whose probability reaches `top_p`, in the order
//! transformers applies its warpers. Draws come from a seeded SplitMix64 stream, so a
//! seed gives the same text every time.

use super::{Cache, Model};
use tch::{Kind, TchError, Tensor};

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f64,
    /// 0: no limit.
    pub top_k: usize,
    /// 1: no limit.
    pub top_p: f64,
    pub seed: u64,
}

impl Sampling {
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Up to `max_new` tokens after `prompt`, stopping after any of `stop` (which is kept).
/// `params` are the units' full parameters on the device the model runs on.
pub fn generate(
    model: &Model,
    params: &[Tensor],
    prompt: &[i64],
    max_new: usize,
    stop: &[i64],
    sampling: &Sampling,
) -> Result<Vec<i64>, TchError> {
    let device = params.first().map_or(tch::Device::Cpu, Tensor::device);
    let mut cache = Cache::default();
    let mut state = sampling.seed;
    let mut out = Vec::new();
    let mut next = Tensor::f_from_slice(prompt)?.f_view([1, -1])?.f_to(device)?;
    for _ in 0..max_new {
        let logits = model.decode(params, &next, &mut cache)?;
        let logits: Vec<f32> = Vec::<f32>::try_from(logits.f_to_kind(Kind::Float)?.f_to(tch::Device::Cpu)?)?;
        let token = choose(&logits, sampling, &mut state);
        out.push(token);
        if stop.contains(&token) {
            break;
        }
        next = Tensor::f_from_slice(&[token])?.f_view([1, 1])?.f_to(device)?;
    }
    Ok(out)
}

/// The next token from `logits` (module docs).
pub fn choose(logits: &[f32], sampling: &Sampling, state: &mut u64) -> i64 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |best, (i, &l)| if l > best.1 { (i, l) } else { best },
            )
            .0 as i64
    };
    if sampling.temperature <= 0.0 {
        return argmax();
    }
    let mut ranked: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, f64::from(l) / sampling.temperature))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    if sampling.top_k > 0 {
        ranked.truncate(sampling.top_k);
    }
    let top = ranked[0].1;
    let weights: Vec<f64> = ranked.iter().map(|&(_, l)| (l - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    // the smallest prefix whose probability reaches top_p (at least one token)
    let mut kept = ranked.len();
    if sampling.top_p < 1.0 {
        let mut sum = 0.0;
        for (k, w) in weights.iter().enumerate() {
            sum += w / total;
            if sum >= sampling.top_p {
                kept = k + 1;
                break;
            }
        }
    }
    let total: f64 = weights[..kept].iter().sum();
    *state = super::layout::splitmix(*state);
    let mut draw = (*state >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (k, w) in weights[..kept].iter().enumerate() {
        if draw < *w {
            return ranked[k].0 as i64;
        }
        draw -= w;
    }
    ranked[kept - 1].0 as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_keeps_to_top_k_and_top_p_and_follows_the_seed() {
        let logits = [0.0f32, 3.0, 2.9, -1.0, 1.0];
        assert_eq!(choose(&logits, &Sampling::greedy(), &mut 0), 1);
        let draws = |s: Sampling| {
            let mut state = s.seed;
            (0..400)
                .map(|_| choose(&logits, &s, &mut state))
                .collect::<Vec<_>>()
        };
        let top2 = draws(Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 7,
        });
        assert!(top2.iter().all(|&t| t == 1 || t == 2) && top2.contains(&1) && top2.contains(&2));
        // p(1) ≈ 0.47, p(2) ≈ 0.43 of the whole softmax: top_p 0.5 keeps both, 0.4 one
        let nucleus = draws(Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.4,
            seed: 7,
        });
        assert!(nucleus.iter().all(|&t| t == 1));
        let all = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 3,
        };
        assert_eq!(draws(all.clone()), draws(all.clone()));
        assert!(draws(all).contains(&4));
    }
}
