//! Learning-rate schedules and fp16 loss scaling, as DeepSpeed computes them.
//!
//! Schedules: `deepspeed/runtime/lr_schedules.py` (WarmupLR, WarmupDecayLR,
//! WarmupCosineLR) as DeepSpeed 0.19.8's engine drives them: a scheduler is created at
//! iteration −1 (WarmupLR and WarmupDecayLR give `warmup_min_lr` there, WarmupCosineLR
//! 0) and stepped after each applied optimizer step, so optimizer step k (0-based,
//! overflow-skipped steps not counted) runs at the rate of iteration k − 1. Warm-up
//! lasts at least 2 iterations (DeepSpeed's `max(2, warmup_num_steps)`) and the cosine
//! stays at its floor past `total_num_steps`. Loss scaling: `DynamicLossScaler` in
//! `deepspeed/runtime/fp16/loss_scaler.py` (backoff by 2 after `hysteresis` overflows,
//! growth by 2 after `loss_scale_window` clean steps, floor `min_loss_scale`).

use super::{LossScale, Scheduler, WarmupType};
use serde::{Deserialize, Serialize};

/// DeepSpeed's warm-up length: at least 2 iterations.
fn warmup_length(warmup_steps: u64) -> u64 {
    warmup_steps.max(2)
}

/// Warm-up progress in [0, 1) at `iteration` (0 ≤ iteration < `warmup`, the length
/// [`warmup_length`] gives).
fn warmup_gamma(iteration: u64, warmup: u64, kind: WarmupType) -> f64 {
    match kind {
        WarmupType::Log => (iteration as f64 + 1.0).ln() / (warmup as f64).ln(),
        WarmupType::Linear => iteration as f64 / warmup as f64,
    }
}

/// The learning rate of applied optimizer step `applied` (0-based) for base rate `lr`:
/// the scheduler's rate at iteration `applied − 1`.
pub fn learning_rate(scheduler: &Scheduler, lr: f64, applied: u64) -> f64 {
    match applied.checked_sub(1) {
        Some(iteration) => rate_at(scheduler, lr, iteration),
        None => match *scheduler {
            Scheduler::Constant => lr,
            Scheduler::WarmupLR { min_lr, .. } | Scheduler::WarmupDecayLR { min_lr, .. } => min_lr,
            Scheduler::WarmupCosineLR { .. } => 0.0,
        },
    }
}

/// The scheduler's rate at `iteration` (≥ 0), DeepSpeed's `get_lr`.
fn rate_at(scheduler: &Scheduler, lr: f64, iteration: u64) -> f64 {
    match *scheduler {
        Scheduler::Constant => lr,
        Scheduler::WarmupLR {
            min_lr,
            max_lr,
            warmup_steps,
            warmup_type,
        } => {
            let warmup = warmup_length(warmup_steps);
            let gamma = if iteration < warmup {
                warmup_gamma(iteration, warmup, warmup_type)
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
            let warmup = warmup_length(warmup_steps);
            let gamma = if iteration < warmup {
                warmup_gamma(iteration, warmup, warmup_type)
            } else {
                ((total_steps as f64 - iteration as f64) / (total_steps as f64 - warmup as f64).max(1.0))
                    .max(0.0)
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
            let warmup = warmup_length(warmup_steps);
            let ratio = if iteration < warmup {
                warmup_min_ratio + warmup_gamma(iteration, warmup, warmup_type) * (1.0 - warmup_min_ratio)
            } else {
                let real_step = (iteration - warmup + 1) as f64;
                let real_total = (total_steps.saturating_sub(warmup)).max(1) as f64;
                let progress = (real_step / real_total).min(1.0);
                let cosine = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
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

    /// The rate each of ten optimizer steps ran at under DeepSpeed 0.19.8's engine
    /// (`deepspeed.initialize` on CPU, base rate 1, `optimizer.param_groups[0]["lr"]`
    /// read before each `engine.step()`, rounded to 4 places), total_num_steps 8.
    #[test]
    fn every_schedule_matches_what_deepspeeds_engine_ran() {
        let (linear, log) = (WarmupType::Linear, WarmupType::Log);
        let warmup = |warmup_steps| Scheduler::WarmupLR {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup_steps,
            warmup_type: linear,
        };
        let cosine = |warmup_steps, warmup_type| Scheduler::WarmupCosineLR {
            warmup_min_ratio: 0.0,
            cos_min_ratio: 0.0001,
            warmup_steps,
            total_steps: 8,
            warmup_type,
        };
        let decay = Scheduler::WarmupDecayLR {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup_steps: 4,
            total_steps: 8,
            warmup_type: log,
        };
        let cases: [(Scheduler, [f64; 10]); 6] = [
            (warmup(4), [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]),
            (warmup(1), [0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
            (
                cosine(4, linear),
                [0.0, 0.0, 0.25, 0.5, 0.75, 0.8536, 0.5, 0.1465, 0.0001, 0.0001],
            ),
            (
                cosine(4, log),
                [0.0, 0.0, 0.5, 0.7925, 1.0, 0.8536, 0.5, 0.1465, 0.0001, 0.0001],
            ),
            (
                cosine(1, linear),
                [0.0, 0.0, 0.5, 0.933, 0.75, 0.5, 0.2501, 0.0671, 0.0001, 0.0001],
            ),
            (decay, [0.0, 0.0, 0.5, 0.7925, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]),
        ];
        for (scheduler, deepspeed) in cases {
            for (k, want) in deepspeed.iter().enumerate() {
                let ours = learning_rate(&scheduler, 1.0, k as u64);
                // DeepSpeed's figures are rounded to 4 places
                assert!(
                    (ours - want).abs() <= 0.5e-4 + 1e-12,
                    "{scheduler:?} step {k}: {ours} vs {want}"
                );
            }
        }
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
