//! Learning-rate schedules and fp16 loss scaling, as DeepSpeed computes them.
//!
//! Schedules: `deepspeed/runtime/lr_schedules.py` (WarmupLR, WarmupDecayLR,
//! WarmupCosineLR). DeepSpeed steps a scheduler once at construction, so optimizer step
//! k (0-based) uses the rate of iteration k. Loss scaling: `DynamicLossScaler` in
//! `deepspeed/runtime/fp16/loss_scaler.py` (backoff by 2 after `hysteresis` overflows,
//! growth by 2 after `loss_scale_window` clean steps, floor `min_loss_scale`).

use crate::config::plan::{LossScale, Scheduler, WarmupType};
use serde::{Deserialize, Serialize};

fn warmup_gamma(iteration: u64, warmup_steps: u64, kind: WarmupType) -> f64 {
    match kind {
        WarmupType::Log => (iteration as f64 + 1.0).ln() / (warmup_steps.max(2) as f64).ln(),
        WarmupType::Linear => iteration as f64 / warmup_steps.max(1) as f64,
    }
}

/// The learning rate of optimizer step `iteration` (0-based) for base rate `lr`.
pub fn learning_rate(scheduler: &Scheduler, lr: f64, iteration: u64) -> f64 {
    match *scheduler {
        Scheduler::Constant => lr,
        Scheduler::WarmupLR {
            min_lr,
            max_lr,
            warmup_steps,
            warmup_type,
        } => {
            let gamma = if iteration < warmup_steps {
                warmup_gamma(iteration, warmup_steps, warmup_type)
            } else {
                1.0
            };
            min_lr + (max_lr - min_lr) * gamma
        }
        Scheduler::WarmupDecayLR {
            min_lr,
            max_lr,
            warmup_steps,
            total_steps,
            warmup_type,
        } => {
            let gamma = if iteration < warmup_steps {
                warmup_gamma(iteration, warmup_steps, warmup_type)
            } else {
                (total_steps as f64 - iteration as f64).max(0.0)
                    / (total_steps.saturating_sub(warmup_steps) as f64).max(1.0)
            };
            min_lr + (max_lr - min_lr) * gamma
        }
        Scheduler::WarmupCosineLR {
            warmup_min_ratio,
            cos_min_ratio,
            warmup_steps,
            total_steps,
            warmup_type,
        } => {
            let ratio = if iteration < warmup_steps {
                warmup_min_ratio
                    + warmup_gamma(iteration, warmup_steps, warmup_type) * (1.0 - warmup_min_ratio)
            } else {
                let real_step = (iteration - warmup_steps + 1) as f64;
                let real_total = (total_steps.saturating_sub(warmup_steps)).max(1) as f64;
                let cosine = (1.0 + (std::f64::consts::PI * real_step / real_total).cos()) / 2.0;
                (cos_min_ratio + (1.0 - cos_min_ratio) * cosine).max(0.0)
            };
            lr * ratio
        }
    }
}

/// fp16 loss scaling state (checkpointed with the run).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    dynamic: bool,
    window: u64,
    hysteresis: u32,
    consecutive_hysteresis: bool,
    min_scale: f64,
    current_hysteresis: u32,
    iteration: u64,
    last_overflow: i64,
}

impl LossScaler {
    /// A scaler for fp16 (`Some`) or a fixed scale of 1 (bf16, fp32).
    pub fn new(config: Option<&LossScale>) -> LossScaler {
        let fixed = LossScaler {
            scale: 1.0,
            dynamic: false,
            window: 1,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            current_hysteresis: 1,
            iteration: 0,
            last_overflow: -1,
        };
        match config {
            None => fixed,
            Some(c) if c.static_scale > 0.0 => LossScaler {
                scale: c.static_scale,
                ..fixed
            },
            Some(c) => LossScaler {
                scale: 2f64.powi(c.initial_scale_power as i32),
                dynamic: true,
                window: c.window.max(1),
                hysteresis: c.hysteresis.max(1),
                consecutive_hysteresis: c.consecutive_hysteresis,
                min_scale: c.min_scale,
                current_hysteresis: c.hysteresis.max(1),
                iteration: 0,
                last_overflow: -1,
            },
        }
    }

    /// Records one step's outcome and adjusts the scale.
    /// Continues from a saved scaler's state (scale, hysteresis, window position);
    /// the policy stays this run's config.
    pub fn restore(&mut self, saved: &LossScaler) {
        self.scale = saved.scale;
        self.current_hysteresis = saved.current_hysteresis;
        self.iteration = saved.iteration;
        self.last_overflow = saved.last_overflow;
    }

    pub fn update(&mut self, overflow: bool) {
        if !self.dynamic {
            return;
        }
        if overflow {
            if self.hysteresis == 1 || self.current_hysteresis == 1 {
                self.scale = (self.scale / 2.0).max(self.min_scale);
            } else {
                self.current_hysteresis -= 1;
            }
            self.last_overflow = self.iteration as i64;
        } else {
            if self.consecutive_hysteresis {
                self.current_hysteresis = self.hysteresis;
            }
            if (self.iteration as i64 - self.last_overflow) % self.window as i64 == 0 {
                if !self.consecutive_hysteresis {
                    self.current_hysteresis = self.hysteresis;
                }
                self.scale *= 2.0;
            }
        }
        self.iteration += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_cosine_matches_deepspeed() {
        // values from DeepSpeed's formula evaluated by hand: linear warmup over 10 steps
        // to the base rate, cosine to cos_min_ratio at step 100
        let s = Scheduler::WarmupCosineLR {
            warmup_min_ratio: 0.0,
            cos_min_ratio: 0.1,
            warmup_steps: 10,
            total_steps: 100,
            warmup_type: WarmupType::Linear,
        };
        assert_eq!(learning_rate(&s, 1.0, 0), 0.0);
        assert!((learning_rate(&s, 1.0, 5) - 0.5).abs() < 1e-12);
        // first post-warmup step: real_step 1 of 90
        let expected = 0.1 + 0.9 * (1.0 + (std::f64::consts::PI / 90.0).cos()) / 2.0;
        assert!((learning_rate(&s, 1.0, 10) - expected).abs() < 1e-12);
        assert!((learning_rate(&s, 1.0, 99) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn warmup_decay_and_log_warmup() {
        let s = Scheduler::WarmupDecayLR {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup_steps: 10,
            total_steps: 20,
            warmup_type: WarmupType::Log,
        };
        // log warmup: ln(k+1) / ln(10)
        assert!((learning_rate(&s, 0.0, 4) - 5f64.ln() / 10f64.ln()).abs() < 1e-12);
        assert!((learning_rate(&s, 0.0, 15) - 0.5).abs() < 1e-12);
        assert_eq!(learning_rate(&s, 0.0, 25), 0.0);
    }

    #[test]
    fn dynamic_loss_scale_backs_off_with_hysteresis_and_grows_after_the_window() {
        let config = LossScale {
            static_scale: 0.0,
            initial_scale_power: 4,
            window: 3,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        };
        let mut s = LossScaler::new(Some(&config));
        assert_eq!(s.scale, 16.0);
        s.update(true); // first overflow only uses up hysteresis
        assert_eq!(s.scale, 16.0);
        s.update(true); // second halves
        assert_eq!(s.scale, 8.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale, 8.0);
        s.update(false); // three clean iterations since the overflow at iteration 1... grows at 4
        s.update(false);
        assert_eq!(s.scale, 16.0);
    }
}
