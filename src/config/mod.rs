//! Configuration as written: a DeepSpeed ds_config plus tierzero's `model`, `data` and
//! `train`, read and checked key by key. The floor below the plan: as ripgrep keeps
//! LowArgs and HiArgs apart, [`DsConfig`] mirrors the JSON as written (after `--set`
//! overrides), and `plan::Plan` is the validated form the rest of the program reads
//! (`plan/resolve.rs` builds it from this). Reading never writes anything; every error
//! names the key or file. Imports nothing of the engine.
//!
//! - `value.rs`: `5e8` / `"5e8"` / `"auto"` leaves
//! - `ds.rs`: the serde mirror
//! - `keys.rs`: unnamed keys (DeepSpeed-known and accepted, or unknown with a suggestion)
//! - `overrides.rs`: `--set a.b=c`
//! - `model.rs`: model shapes and presets
//! - `hf_model.rs`: model shapes from a Hugging Face `config.json`

pub mod ds;
mod error;
mod hf_model;
pub mod keys;
pub mod model;
pub mod overrides;
pub mod value;

pub use ds::DsConfig;
pub use error::ConfigError;

use serde_json::Value;
use std::path::Path;

/// Keys this build parses and validates but whose behaviour is not implemented yet.
/// A config that sets one hears about it at start-up.
pub const NOT_YET_ACTED: &[&str] = &[
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_scatter",
    "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.offload_optimizer.fast_init",
    "optimizer.params.torch_adam",
    "optimizer.params.fused",
    "scheduler.params.last_batch_iteration",
];

/// A config as read: the mirror, the JSON it came from, and what the user should be told.
#[derive(Debug, Clone)]
pub struct Read {
    pub ds: DsConfig,
    /// The JSON (file + overrides), for manifests and `plan --json`.
    pub json: Value,
    /// One line each: DeepSpeed keys accepted but not acted on, monitors of web services.
    pub warnings: Vec<String>,
    /// The keys parsed but not yet acted on in this build, as one line.
    pub not_yet: Option<String>,
}

/// The JSON of the config file at `path`.
pub fn read_file(path: &Path) -> Result<Value, ConfigError> {
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
    Ok(json)
}

/// Applies `sets` (`key.path=value`) to a JSON config value and parses it, key by key.
pub fn read(mut json: Value, sets: &[String]) -> Result<Read, ConfigError> {
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
    // the mirror re-serialised spells every key canonically, whatever alias was used
    let canonical = serde_json::to_value(&ds).unwrap_or_default();
    let not_yet: Vec<&str> = NOT_YET_ACTED
        .iter()
        .copied()
        .filter(|key| json_has(&canonical, key))
        .collect();
    let not_yet = (!not_yet.is_empty()).then(|| {
        format!(
            "keys parsed but not yet acted on in this build: {}",
            not_yet.join(", ")
        )
    });
    Ok(Read {
        ds,
        json,
        warnings,
        not_yet,
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
