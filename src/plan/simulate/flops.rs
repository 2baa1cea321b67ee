//! The FLOPs of each piece of a step's compute, counted one way for both the profile's
//! rates (`tierzero bench profile` divides by these) and the simulation (which divides
//! these by the rates), so a rate measured at a config's shapes predicts it exactly.
//!
//! A block's forward is 2 FLOPs per weight per token plus attention's 4·T·S·H (scores
//! and values, PaLM appendix B's count); its backward by recompute is the forward again
//! and twice the forward. The final unit's work is the LM head's 6·T·H·V (forward and
//! backward). The embedding is a gather: no FLOPs, only its fixed overhead (and, in
//! backward, a dense gradient of the table: bytes, costed as device memory traffic).

use crate::config::model::ModelConfig;

/// FLOPs of one forward of a block over `tokens` tokens in sequences of `seq_len`.
pub fn block_forward(config: &ModelConfig, block_numel: usize, tokens: usize, seq_len: usize) -> f64 {
    2.0 * (block_numel * tokens) as f64 + 4.0 * (tokens * seq_len * config.hidden_size) as f64
}

/// FLOPs of a block's backward by recompute (forward, then backward at twice forward).
pub fn block_backward(config: &ModelConfig, block_numel: usize, tokens: usize, seq_len: usize) -> f64 {
    3.0 * block_forward(config, block_numel, tokens, seq_len)
}

/// FLOPs of a block's backward through its kept activations (twice the forward).
pub fn block_backward_kept(config: &ModelConfig, block_numel: usize, tokens: usize, seq_len: usize) -> f64 {
    2.0 * block_forward(config, block_numel, tokens, seq_len)
}

/// FLOPs of the LM head's forward and backward over `tokens` tokens.
pub fn head(config: &ModelConfig, tokens: usize) -> f64 {
    6.0 * (tokens * config.hidden_size * config.vocab_size) as f64
}
