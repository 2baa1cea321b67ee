//! `manifest.json`: what a checkpoint holds and how to check it.
//!
//! Written last, inside the staging directory, so a checkpoint with a manifest is
//! complete. It records the format version, the step (which is also the data position:
//! a batch is a pure function of (seed, step, micro-batch), so no sampler state exists
//! beyond it), optimizer steps taken, the loss-scaler and scheduler state, the resolved
//! config, the world size at save, the model and its units, and per file the length,
//! a crc32c of the header and a crc32c of every rank's slice of every unit (slices of
//! the save-time partition, so a loading rank verifies just what it reads). The
//! manifest checksums itself: `checksum` is the crc32c of its own JSON with
//! `checksum` set to 0.

use super::files::unit_name;
use super::{corrupt, CheckpointError};
use crate::config::model::ModelConfig;
use crate::model::layout::units;
use crate::plan::schedule::LossScaler;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const FORMAT: &str = "tierzero-checkpoint";
pub const VERSION: u32 = 2;

/// The version a manifest is written with: 1 unless slices are placed outside their
/// state files (`Placed`, version 2), so checkpoints without them stay readable by
/// builds that read version 1.
pub fn version_for(files: &[FileEntry]) -> u32 {
    if files.iter().any(|f| !f.placed.is_empty()) {
        2
    } else {
        1
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitEntry {
    pub name: String,
    pub numel: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub state: String,
    pub dtype: String,
    pub bytes: u64,
    pub header_crc32c: u32,
    /// `[unit][save rank]`: crc32c of that rank's real elements of the unit.
    pub slice_crc32c: Vec<Vec<u32>>,
    /// Slices stored outside the state file: NVMe swap files a run's final save took
    /// into the checkpoint as they were (no second copy); the state file leaves their
    /// bytes unwritten (a hole).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placed: Vec<Placed>,
}

/// Where one save rank's slice of a unit is when not in its state file: `file`, relative
/// to the checkpoint's directory, from byte `offset` on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placed {
    pub unit: usize,
    pub rank: usize,
    pub file: String,
    pub offset: u64,
}

/// Where the data stream is: the next step's batches follow from these alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    pub seed: u64,
    pub step: u64,
    pub train_batch_size: usize,
    pub seq_len: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerState {
    /// Iterations the scheduler has seen (the next step's index).
    pub iteration: u64,
    /// The learning rate of the last step taken.
    pub last_lr: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Steps completed.
    pub step: u64,
    /// AdamW steps applied (overflow-skipped steps do not count).
    pub adam_steps: u64,
    pub world_size: usize,
    pub created_unix_s: u64,
    pub precision: String,
    pub model: ModelConfig,
    pub units: Vec<UnitEntry>,
    pub data: DataPosition,
    pub loss_scaler: LossScaler,
    pub scheduler: SchedulerState,
    /// The resolved plan the run trained with.
    pub config: serde_json::Value,
    pub files: Vec<FileEntry>,
    pub checksum: u32,
}

impl Manifest {
    fn own_checksum(&self) -> u32 {
        let mut copy = self.clone();
        copy.checksum = 0;
        crc32c::crc32c(&serde_json::to_vec(&copy).unwrap_or_default())
    }

    /// Sets `checksum`; call after every other field is final.
    pub fn seal(&mut self) {
        self.checksum = self.own_checksum();
    }

    /// Reads and checks `dir/manifest.json`: format, version, self-checksum.
    pub fn read(dir: &Path) -> Result<Manifest, CheckpointError> {
        let path = dir.join("manifest.json");
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(corrupt(
                    &path,
                    "missing: not a complete checkpoint (the manifest is written last, so a save that was interrupted has none); use an earlier checkpoint",
                ))
            }
            Err(source) => return Err(CheckpointError::Io { path, source }),
        };
        let value: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| corrupt(&path, format!("not JSON ({e}): the file is damaged")))?;
        if value["format"] != FORMAT {
            return Err(CheckpointError::Incompatible {
                path: dir.to_path_buf(),
                message: format!(
                    "manifest.json has format {}, expected \"{FORMAT}\"",
                    value["format"]
                ),
            });
        }
        let version = value["version"].as_u64().unwrap_or(0);
        if version > u64::from(VERSION) {
            return Err(CheckpointError::Incompatible {
                path: dir.to_path_buf(),
                message: format!(
                    "format version {version} is newer than this tierzero reads ({VERSION}); use a newer tierzero"
                ),
            });
        }
        let manifest: Manifest = serde_json::from_value(value).map_err(|e| {
            corrupt(
                &path,
                format!("does not match the version {VERSION} manifest: {e}"),
            )
        })?;
        if manifest.checksum != manifest.own_checksum() {
            return Err(corrupt(
                &path,
                "checksum mismatch: the manifest was modified or damaged after it was written",
            ));
        }
        Ok(manifest)
    }

    /// Refuses a model other than the one the checkpoint holds, naming the difference.
    pub fn check_model(&self, dir: &Path, config: &ModelConfig) -> Result<(), CheckpointError> {
        let incompatible = |message: String| CheckpointError::Incompatible {
            path: dir.to_path_buf(),
            message,
        };
        let expected: Vec<UnitEntry> = units(config)
            .iter()
            .map(|u| UnitEntry {
                name: unit_name(u),
                numel: u.numel,
            })
            .collect();
        if expected == self.units && self.model.architecture == config.architecture {
            return Ok(());
        }
        // name the first model field that differs, else the first unit
        let saved = serde_json::to_value(&self.model).unwrap_or_default();
        let wanted = serde_json::to_value(config).unwrap_or_default();
        let field = saved.as_object().and_then(|s| {
            s.iter()
                .find(|(k, v)| wanted.get(k.as_str()) != Some(v))
                .map(|(k, v)| {
                    format!(
                        "{k} is {v} in the checkpoint, {} in the config",
                        wanted[k.as_str()]
                    )
                })
        });
        let detail = field.unwrap_or_else(|| {
            format!(
                "units differ: the checkpoint has {} units, the config's model {}",
                self.units.len(),
                expected.len()
            )
        });
        Err(incompatible(format!(
            "it holds a different model ({detail}); point the config's model at the checkpoint's model"
        )))
    }

    /// The manifest for people (`tierzero inspect`).
    pub fn human(&self) -> String {
        let params: usize = self.units.iter().map(|u| u.numel).sum();
        let mut out = String::new();
        let mut line = |k: &str, v: String| out.push_str(&format!("{k:<20}  {v}\n"));
        line("format", format!("{} v{}", self.format, self.version));
        line("step", self.step.to_string());
        line("optimizer steps", self.adam_steps.to_string());
        line("world size at save", self.world_size.to_string());
        line("created (unix s)", self.created_unix_s.to_string());
        line(
            "model",
            format!(
                "{:?}, {} layers, hidden {}, vocab {}, {:.2}M parameters",
                self.model.architecture,
                self.model.num_hidden_layers,
                self.model.hidden_size,
                self.model.vocab_size,
                params as f64 / 1e6
            ),
        );
        line("precision", self.precision.clone());
        line(
            "data position",
            format!(
                "seed {}, step {}, {} sequences × {} tokens per step",
                self.data.seed, self.data.step, self.data.train_batch_size, self.data.seq_len
            ),
        );
        line(
            "scheduler",
            format!(
                "next iteration {}, last lr {:.3e}",
                self.scheduler.iteration, self.scheduler.last_lr
            ),
        );
        line("loss scale", format!("{}", self.loss_scaler.scale));
        line(
            "units",
            format!(
                "{} ({} … {})",
                self.units.len(),
                self.units.first().map_or("", |u| &u.name),
                self.units.last().map_or("", |u| &u.name)
            ),
        );
        for f in &self.files {
            line(
                "file",
                format!(
                    "{:<24}{:<5} {:>10.2} MiB, {} slice checksums",
                    f.name,
                    f.dtype,
                    f.bytes as f64 / (1 << 20) as f64,
                    f.slice_crc32c.iter().map(Vec::len).sum::<usize>()
                ),
            );
        }
        out
    }
}
