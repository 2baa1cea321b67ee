//! Built-in synthetic corpora: structured sequences a tiny model learns within a minute
//! on two CPU cores, with a known loss floor, so a first run shows learning without
//! downloading anything.
//!
//! - `addition`: `a+b=c` problems with operands zero-padded to 3 digits and the sum to
//!   4, written least significant digit first (so each answer digit depends on the
//!   digits and carry just seen), packed back to back in 13-token problems. Only answer
//!   digits and the terminating newline are targets. The answer is a function of the
//!   prompt, so the loss floor is 0.
//! - `recall`: eight random key→value pairs, then a query key; the target is its value.
//!   Also floor 0, but it needs attention to retrieve, and takes longer to learn.
//!
//! - `markov` (the default run's): a fixed random first-order Markov chain over 64
//!   tokens, each with 4 possible successors. Every position after the first is a
//!   target; the loss floor is the chain's entropy rate, computed exactly from its
//!   stationary distribution ([`Corpus::loss_floor`]). A tiny model reaches it within a
//!   few hundred steps.
//!
//! Vocabulary: digits 0–9, `+` 10, `=` 11, newline 12, `?` 13, keys 16–47, values 48–79;
//! the Markov chain uses 0–63.

use super::mix;

pub const PLUS: i64 = 10;
pub const EQUALS: i64 = 11;
pub const NEWLINE: i64 = 12;
pub const QUERY: i64 = 13;
const KEYS: i64 = 16;
const VALUES: i64 = 48;
const PAIRS: usize = 8;

const MARKOV_STATES: usize = 64;
const MARKOV_FANOUT: usize = 4;
const MARKOV_SEED: u64 = 0x7131_5eed;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Addition,
    Recall,
    Markov,
}

pub struct Corpus {
    kind: Kind,
    /// Markov successors and their cumulative probabilities, per state.
    chain: Vec<[(i64, f64); MARKOV_FANOUT]>,
}

struct Stream(u64);

impl Stream {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = mix(self.0);
        self.0 % n
    }
}

impl Corpus {
    /// `name` was validated by the plan.
    pub fn new(name: &str) -> Corpus {
        let kind = match name {
            "recall" => Kind::Recall,
            "markov" => Kind::Markov,
            _ => Kind::Addition,
        };
        // the chain is fixed (its own seed), so its floor is a constant of the corpus
        let mut s = Stream(MARKOV_SEED);
        let chain = (0..MARKOV_STATES)
            .map(|_| {
                let weights: Vec<f64> = (0..MARKOV_FANOUT).map(|_| 1.0 + s.below(8) as f64).collect();
                let total: f64 = weights.iter().sum();
                let mut row = [(0i64, 0f64); MARKOV_FANOUT];
                for (i, w) in weights.iter().enumerate() {
                    row[i] = (s.below(MARKOV_STATES as u64) as i64, w / total);
                }
                row
            })
            .collect();
        Corpus { kind, chain }
    }

    pub fn vocab_size(&self) -> usize {
        80
    }

    /// The expected loss of a perfect model, in nats per target token: 0 for `addition`
    /// and `recall` (answers are functions of the prompt); for `markov`, the mean over
    /// positions 1..=seq_len of Σ_s p_t(s)·H(next | s), with p_t the chain's state
    /// distribution t steps after the uniform start the samples use.
    pub fn loss_floor(&self, seq_len: usize) -> f64 {
        if self.kind != Kind::Markov {
            return 0.0;
        }
        let entropy: Vec<f64> = self
            .chain
            .iter()
            .map(|row| merged(row).iter().map(|&(_, p)| -p * p.ln()).sum())
            .collect();
        let mut dist = vec![1.0 / MARKOV_STATES as f64; MARKOV_STATES];
        let mut total = 0.0;
        for _ in 0..seq_len {
            total += dist.iter().zip(&entropy).map(|(p, h)| p * h).sum::<f64>();
            let mut next = vec![0.0; MARKOV_STATES];
            for (state, p) in dist.iter().enumerate() {
                for &(to, q) in &merged(&self.chain[state]) {
                    next[to as usize] += p * q;
                }
            }
            dist = next;
        }
        total / seq_len as f64
    }

    /// The Markov chain's possible successors of `state` (generation tests check
    /// continuations against them).
    pub fn successors(&self, state: i64) -> Vec<i64> {
        self.chain
            .get(state as usize)
            .map_or(Vec::new(), |row| row.iter().map(|&(to, _)| to).collect())
    }

    /// One sample: `seq_len` inputs and the `seq_len` next tokens as targets, with
    /// unpredictable positions marked -1.
    pub fn sample(&self, key: u64, seq_len: usize) -> (Vec<i64>, Vec<i64>) {
        let mut stream = Stream(key);
        let mut tokens = Vec::with_capacity(seq_len + 16);
        let mut scored = Vec::with_capacity(seq_len + 16);
        if self.kind == Kind::Markov {
            let mut state = stream.below(MARKOV_STATES as u64) as i64;
            tokens.push(state);
            scored.push(false);
            while tokens.len() < seq_len + 1 {
                let u = stream.below(1 << 30) as f64 / (1u64 << 30) as f64;
                let row = &self.chain[state as usize];
                let mut acc = 0.0;
                state = row[MARKOV_FANOUT - 1].0;
                for &(to, p) in row {
                    acc += p;
                    if u < acc {
                        state = to;
                        break;
                    }
                }
                tokens.push(state);
                scored.push(true);
            }
        }
        while tokens.len() < seq_len + 1 {
            if self.kind == Kind::Recall {
                recall_problem(&mut stream, &mut tokens, &mut scored);
            } else {
                addition_problem(&mut stream, &mut tokens, &mut scored);
            }
        }
        let inputs = tokens[..seq_len].to_vec();
        let targets = (1..=seq_len)
            .map(|i| if scored[i] { tokens[i] } else { -1 })
            .collect();
        (inputs, targets)
    }
}

/// A row with duplicate successors merged (two slots may draw the same token).
fn merged(row: &[(i64, f64); MARKOV_FANOUT]) -> Vec<(i64, f64)> {
    let mut out: Vec<(i64, f64)> = Vec::new();
    for &(to, p) in row {
        match out.iter_mut().find(|(t, _)| *t == to) {
            Some(entry) => entry.1 += p,
            None => out.push((to, p)),
        }
    }
    out
}

/// The `width` decimal digits of `n`, least significant first.
fn digits(mut n: u64, width: usize) -> Vec<i64> {
    (0..width)
        .map(|_| {
            let d = (n % 10) as i64;
            n /= 10;
            d
        })
        .collect()
}

fn addition_problem(s: &mut Stream, tokens: &mut Vec<i64>, scored: &mut Vec<bool>) {
    let a = s.below(1000);
    let b = s.below(1000);
    let mut push = |t: i64, score: bool| {
        tokens.push(t);
        scored.push(score);
    };
    for d in digits(a, 3).into_iter().rev() {
        push(d, false);
    }
    push(PLUS, false);
    for d in digits(b, 3).into_iter().rev() {
        push(d, false);
    }
    push(EQUALS, false);
    // least significant digit first
    for d in digits(a + b, 4) {
        push(d, true);
    }
    push(NEWLINE, true);
}

fn recall_problem(s: &mut Stream, tokens: &mut Vec<i64>, scored: &mut Vec<bool>) {
    let mut keys: Vec<i64> = Vec::with_capacity(PAIRS);
    while keys.len() < PAIRS {
        let k = KEYS + s.below(32) as i64;
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let values: Vec<i64> = (0..PAIRS).map(|_| VALUES + s.below(32) as i64).collect();
    for (k, v) in keys.iter().zip(&values) {
        tokens.extend([*k, *v]);
        scored.extend([false, false]);
    }
    let q = s.below(PAIRS as u64) as usize;
    tokens.extend([QUERY, keys[q], values[q], NEWLINE]);
    scored.extend([false, false, true, false]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addition_samples_are_correct_sums() {
        let c = Corpus::new("addition");
        let (inputs, targets) = c.sample(99, 64);
        assert_eq!((inputs.len(), targets.len()), (64, 64));
        assert!(targets.iter().any(|&t| t >= 0));
        // decode the first problem: digits, '+', digits, '=', reversed sum
        let plus = inputs.iter().position(|&t| t == PLUS).unwrap();
        let eq = inputs.iter().position(|&t| t == EQUALS).unwrap();
        let number = |ds: &[i64]| ds.iter().fold(0u64, |n, &d| n * 10 + d as u64);
        let (a, b) = (number(&inputs[..plus]), number(&inputs[plus + 1..eq]));
        let answer: Vec<i64> = targets[eq..]
            .iter()
            .take_while(|&&t| t != NEWLINE)
            .copied()
            .collect();
        assert_eq!(answer, digits(a + b, 4));
        assert_eq!(c.sample(99, 64), (inputs, targets), "deterministic per key");
    }

    #[test]
    fn markov_floor_matches_the_empirical_entropy() {
        let c = Corpus::new("markov");
        let floor = c.loss_floor(64);
        assert!(floor > 0.5 && floor < 1.4, "{floor}");
        // the floor is the mean of -ln p(target | previous) over sampled sequences
        let mut total = 0.0;
        let mut count = 0.0;
        for key in 0..2000 {
            let (inputs, targets) = c.sample(key, 64);
            for (prev, next) in inputs.iter().zip(&targets) {
                let p: f64 = merged(&c.chain[*prev as usize])
                    .iter()
                    .filter(|(t, _)| t == next)
                    .map(|(_, p)| p)
                    .sum();
                total -= p.ln();
                count += 1.0;
            }
        }
        assert!(
            (total / count - floor).abs() < 0.02,
            "empirical {} vs floor {floor}",
            total / count
        );
    }

    #[test]
    fn recall_targets_are_the_queried_value() {
        let c = Corpus::new("recall");
        let (inputs, targets) = c.sample(5, 40);
        let q = inputs.iter().position(|&t| t == QUERY).unwrap();
        let key = inputs[q + 1];
        let k = inputs.iter().position(|&t| t == key).unwrap();
        assert_eq!(targets[q + 1], inputs[k + 1]);
    }
}
