//! Resolving `optimizer` and `scheduler`: DeepSpeed's Adam and AdamW with their
//! defaults, and its learning-rate schedules with `"auto"` lengths from `train.steps`.

use super::types::*;
use crate::config::ds::*;
use crate::config::value::{count, number, Num};
use crate::config::ConfigError;

pub(super) fn build_optimizer(o: OptimizerSection) -> Result<Optimizer, ConfigError> {
    let kind = o.kind.clone().unwrap_or_else(|| "AdamW".into());
    let adamw = match kind.to_ascii_lowercase().as_str() {
        "adamw" => true,
        "adam" => o.params.as_ref().and_then(|p| p.adam_w_mode).unwrap_or(true),
        _ => {
            return Err(ConfigError::invalid(
                "optimizer.type",
                format!("{kind:?} is not supported by tierzero's CPU optimizer"),
                "use \"Adam\" or \"AdamW\"",
            ))
        }
    };
    let p = o.params.unwrap_or_default();
    if p.amsgrad == Some(true) {
        return Err(ConfigError::invalid(
            "optimizer.params.amsgrad",
            "AMSGrad is not supported",
            "remove it",
        ));
    }
    if p.bias_correction == Some(false) {
        return Err(ConfigError::invalid(
            "optimizer.params.bias_correction",
            "Adam without bias correction is not supported",
            "remove it (the default is true)",
        ));
    }
    let lr = match p.lr {
        Some(Num::Auto) => {
            return Err(ConfigError::invalid(
                "optimizer.params.lr",
                "\"auto\" has no source outside the Hugging Face Trainer",
                "--set optimizer.params.lr=3e-4",
            ))
        }
        other => number("optimizer.params.lr", other, 1e-3)?,
    };
    let (beta1, beta2) = match p.betas {
        None | Some(BetasOrAuto::Auto(Num::Auto)) => (0.9, 0.999),
        Some(BetasOrAuto::Pair([b1, b2])) => (
            number("optimizer.params.betas[0]", Some(b1), 0.9)?,
            number("optimizer.params.betas[1]", Some(b2), 0.999)?,
        ),
        Some(BetasOrAuto::Auto(Num::Value(_))) => {
            return Err(ConfigError::invalid(
                "optimizer.params.betas",
                "expected two numbers",
                "write \"betas\": [0.9, 0.999]",
            ))
        }
    };
    for (key, beta) in [
        ("optimizer.params.betas[0]", beta1),
        ("optimizer.params.betas[1]", beta2),
    ] {
        if !(0.0..1.0).contains(&beta) {
            return Err(ConfigError::invalid(
                key,
                format!("{beta} is outside [0, 1)"),
                "use e.g. 0.9 and 0.999",
            ));
        }
    }
    let eps = match p.eps {
        Some(Num::Auto) => 1e-8,
        other => number("optimizer.params.eps", other, 1e-8)?,
    };
    let weight_decay = match p.weight_decay {
        Some(Num::Auto) => 0.0,
        other => number("optimizer.params.weight_decay", other, 0.0)?,
    };
    if lr <= 0.0 || eps <= 0.0 || weight_decay < 0.0 {
        let key = if lr <= 0.0 {
            "lr"
        } else if eps <= 0.0 {
            "eps"
        } else {
            "weight_decay"
        };
        return Err(ConfigError::invalid(
            format!("optimizer.params.{key}"),
            "out of range (lr and eps must be positive, weight_decay non-negative)",
            "use e.g. lr 3e-4, eps 1e-8, weight_decay 0.1",
        ));
    }
    Ok(Optimizer {
        lr: lr as f32,
        beta1: beta1 as f32,
        beta2: beta2 as f32,
        eps: eps as f32,
        weight_decay: weight_decay as f32,
        decoupled: adamw,
    })
}

pub(super) fn build_scheduler(
    s: Option<SchedulerSection>,
    opt: &Optimizer,
    steps: u64,
    warnings: &mut Vec<String>,
) -> Result<Scheduler, ConfigError> {
    let Some(s) = s else {
        return Ok(Scheduler::Constant);
    };
    let kind = s.kind.clone().unwrap_or_default();
    let p = s.params.unwrap_or_default();
    let allowed: &[&str] = match kind.as_str() {
        "WarmupLR" => &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "last_batch_iteration",
        ],
        "WarmupDecayLR" => &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "last_batch_iteration",
        ],
        "WarmupCosineLR" => &[
            "warmup_min_ratio",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "cos_min_ratio",
            "last_batch_iteration",
        ],
        _ => {
            return Err(ConfigError::invalid(
                "scheduler.type",
                format!("{kind:?} is not supported"),
                "use \"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\", or remove the scheduler",
            ))
        }
    };
    let set = serde_json::to_value(&p).unwrap_or_default();
    if let Some(object) = set.as_object() {
        for (key, value) in object {
            if !value.is_null() && !allowed.contains(&key.as_str()) {
                return Err(ConfigError::invalid(
                    format!("scheduler.params.{key}"),
                    format!("{kind} takes no parameter {key}"),
                    format!("{kind} takes: {}", allowed.join(", ")),
                ));
            }
        }
    }
    let lr = f64::from(opt.lr);
    let resolved = |key: &str, v: Option<Num>, auto: f64, default: f64| match v {
        Some(Num::Auto) => Ok(auto),
        other => number(&format!("scheduler.params.{key}"), other, default),
    };
    let min_lr = resolved("warmup_min_lr", p.warmup_min_lr, 0.0, 0.0)?;
    let max_lr = resolved("warmup_max_lr", p.warmup_max_lr, lr, 0.001)?;
    let warmup_steps = match p.warmup_num_steps {
        Some(Num::Auto) => 0,
        other => count("scheduler.params.warmup_num_steps", other, 1000)? as u64,
    };
    let total_steps = match p.total_num_steps {
        Some(Num::Auto) | None => steps,
        other => count("scheduler.params.total_num_steps", other, steps as usize)? as u64,
    };
    let warmup_type = match p.warmup_type.as_deref() {
        None | Some("log") => WarmupType::Log,
        Some("linear") => WarmupType::Linear,
        Some(other) => {
            return Err(ConfigError::invalid(
                "scheduler.params.warmup_type",
                format!("unknown warmup type {other:?}"),
                "use \"log\" or \"linear\"",
            ))
        }
    };
    if kind != "WarmupLR" && warmup_steps > total_steps {
        // DeepSpeed warns and runs: the whole run stays in the warm-up
        warnings.push(format!(
            "scheduler.params.warmup_num_steps ({warmup_steps}) exceeds total_num_steps ({total_steps}): \
             the learning rate warms up for the whole run and never decays, as DeepSpeed's {kind} does"
        ));
    }
    Ok(match kind.as_str() {
        "WarmupLR" => Scheduler::WarmupLR {
            min_lr,
            max_lr,
            warmup_steps,
            warmup_type,
        },
        "WarmupDecayLR" => Scheduler::WarmupDecayLR {
            min_lr,
            max_lr,
            warmup_steps,
            total_steps,
            warmup_type,
        },
        _ => Scheduler::WarmupCosineLR {
            warmup_min_ratio: resolved("warmup_min_ratio", p.warmup_min_ratio, 0.0, 0.0)?,
            cos_min_ratio: resolved("cos_min_ratio", p.cos_min_ratio, 0.0001, 0.0001)?,
            warmup_steps,
            total_steps,
            warmup_type,
        },
    })
}
