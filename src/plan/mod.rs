//! What a config costs before anything runs: the validated [`Plan`] the engine is allowed
//! to read (`types.rs`, built from the config as read by `resolve.rs`,
//! `resolve_zero.rs`, `resolve_data.rs` and `resolve_optimizer.rs`, with `"auto"` batch sizes from `auto_batch.rs` and `"auto"` placements from
//! `auto_tiers.rs`), the partitions of
//! every unit (`partition.rs`), the rules every room asks (`rules.rs`), the stage-3 fetch
//! order (`fetch.rs`), DeepSpeed's learning-rate schedules and loss scaler
//! (`schedule.rs`), device and host memory predictions (`memory.rs`, `host_memory.rs`) and the warning when
//! forced settings overflow the device (`device_fit.rs`),
//! the NVMe path's room (`disk.rs`), the largest model a machine's tiers hold
//! (`capacity.rs`), DeepSpeed's ZeRO-3 estimate (`estimate.rs`), the table `plan` prints (`report.rs`),
//! and the simulated step on a hardware profile (`simulate/`). Below the engine and above
//! the config as written: nothing here runs a step.

mod auto_batch;
mod auto_tiers;
pub mod capacity;
mod device_fit;
pub mod disk;
pub mod estimate;
pub mod fetch;
pub mod host_memory;
pub mod memory;
pub mod partition;
pub mod report;
mod resolve;
mod resolve_data;
mod resolve_optimizer;
mod resolve_zero;
pub mod rules;
pub mod schedule;
pub mod simulate;
mod types;

pub use auto_tiers::HOST_MARGIN;
pub use report::plan_table;
pub use types::*;

use crate::config::{self, ConfigError, DsConfig};
use serde_json::Value;
use std::path::Path;

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
    from_json(config::read_file(path)?, sets, facts)
}

/// Parses and validates a JSON config value after applying `sets`.
pub fn from_json(json: Value, sets: &[String], facts: DeviceFacts) -> Result<Loaded, ConfigError> {
    let read = config::read(json, sets)?;
    let mut warnings = read.warnings;
    let plan = Plan::build(&read.ds, facts, &mut warnings)?;
    warnings.extend(device_fit::device_fit_warning(&read.json, &plan, facts));
    warnings.extend(host_memory::host_fit_warning(&plan));
    warnings.extend(disk::nvme_fit_warning(&plan));
    warnings.extend(read.not_yet);
    Ok(Loaded {
        ds: read.ds,
        plan,
        json: read.json,
        warnings,
    })
}
