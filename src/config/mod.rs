//! Configuration: a DeepSpeed ds_config plus tierzero's `model`, `data` and `train`.
//!
//! Two layers, as ripgrep keeps LowArgs and HiArgs apart: [`DsConfig`] mirrors the JSON
//! as written (after `--set` overrides), and [`Plan`] is the validated form the rest of
//! the program reads. Loading never writes anything; every error names the key or file.
//!
//! - `value.rs`: `5e8` / `"5e8"` / `"auto"` leaves
//! - `ds.rs`: the serde mirror
//! - `keys.rs`: unnamed keys (DeepSpeed-known and accepted, or unknown with a suggestion)
//! - `overrides.rs`: `--set a.b=c`
//! - `plan.rs`: the validated `Plan` types
//! - `resolve.rs`: defaults, `"auto"`, batch math, contradictions
//! - `resolve_zero.rs`: the same for `zero_optimization` and `aio`

mod auto_batch;
pub mod ds;
mod error;
pub mod keys;
pub mod overrides;
pub mod plan;
pub mod report;
mod resolve;
mod resolve_zero;
pub mod value;

pub use ds::DsConfig;
pub use error::ConfigError;
pub use plan::{DeviceFacts, Plan, Tier};
pub use report::plan_table;

use serde_json::Value;
use std::path::Path;

/// Keys this build parses and validates but whose behaviour is not implemented yet.
/// A config that sets one hears about it at start-up.
pub const NOT_YET_ACTED: &[&str] = &[
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_scatter",
    "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.offload_optimizer.fast_init",
    "optimizer.params.torch_adam",
    "optimizer.params.fused",
    "scheduler.params.last_batch_iteration",
];

/// A loaded configuration and what the user should be told about it.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub ds: DsConfig,
    pub plan: Plan,
    /// The resolved JSON (file + overrides), for manifests and `plan --json`.
    pub json: Value,
    /// One line each: DeepSpeed keys accepted but not acted on, deprecated spellings,
    /// keys parsed but not yet implemented.
    pub warnings: Vec<String>,
}

/// Reads `path`, applies `sets` (`key.path=value`), parses and validates.
pub fn load(path: &Path, sets: &[String], facts: DeviceFacts) -> Result<Loaded, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let json: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
        line: e.line(),
        column: e.column(),
    })?;
    from_json(json, sets, facts)
}

/// Parses and validates a JSON config value after applying `sets`.
pub fn from_json(mut json: Value, sets: &[String], facts: DeviceFacts) -> Result<Loaded, ConfigError> {
    if !json.is_object() {
        return Err(ConfigError::Type {
            key: "(top level)".into(),
            message: "a ds_config is a JSON object".into(),
        });
    }
    for arg in sets {
        overrides::apply(&mut json, arg)?;
    }
    let mut unnamed = Vec::new();
    let mut track = serde_path_to_error::Track::new();
    let parsed: Result<DsConfig, _> = serde_ignored::deserialize(
        serde_path_to_error::Deserializer::new(json.clone(), &mut track),
        |path| {
            // serde_ignored writes `?` for each Option level; keys have no such segment
            let key: Vec<String> = path
                .to_string()
                .split('.')
                .filter(|s| *s != "?")
                .map(String::from)
                .collect();
            unnamed.push(key.join("."))
        },
    );
    let ds = parsed.map_err(|e| ConfigError::Type {
        key: track.path().to_string(),
        message: e.to_string(),
    })?;
    let mut accepted = Vec::new();
    for key in unnamed {
        match keys::classify(&key) {
            keys::Unnamed::DeepSpeedUnacted => accepted.push(key),
            keys::Unnamed::Unknown { suggestion } => return Err(ConfigError::UnknownKey { key, suggestion }),
        }
    }
    let mut warnings = Vec::new();
    // monitors that report to a web service: this build has no network client for them
    let (network, accepted): (Vec<String>, Vec<String>) = accepted
        .into_iter()
        .partition(|k| k == "wandb" || k == "comet" || k.starts_with("wandb.") || k.starts_with("comet."));
    let services: std::collections::BTreeSet<&str> =
        network.iter().filter_map(|k| k.split('.').next()).collect();
    if !services.is_empty() {
        warnings.push(format!(
            "{} accepted but not acted on: tierzero does not send metrics to web services; \
             enable \"tensorboard\" or \"csv_monitor\" (written under their output_path) or read metrics.jsonl",
            services.into_iter().collect::<Vec<_>>().join(" and ")
        ));
    }
    if !accepted.is_empty() {
        warnings.push(format!(
            "DeepSpeed keys accepted but not acted on by tierzero: {}",
            accepted.join(", ")
        ));
    }
    let plan = Plan::build(&ds, facts, &mut warnings)?;
    // the mirror re-serialised spells every key canonically, whatever alias was used
    let canonical = serde_json::to_value(&ds).unwrap_or_default();
    let not_yet: Vec<&str> = NOT_YET_ACTED
        .iter()
        .copied()
        .filter(|key| json_has(&canonical, key))
        .collect();
    if !not_yet.is_empty() {
        warnings.push(format!(
            "keys parsed but not yet acted on in this build: {}",
            not_yet.join(", ")
        ));
    }
    Ok(Loaded {
        ds,
        plan,
        json,
        warnings,
    })
}

/// Whether the dotted key is present (and not null) in the JSON.
fn json_has(json: &Value, key: &str) -> bool {
    let mut node = json;
    for segment in key.split('.') {
        match node.get(segment) {
            Some(next) => node = next,
            None => return false,
        }
    }
    !node.is_null()
}
