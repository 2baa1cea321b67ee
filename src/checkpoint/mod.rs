//! Checkpoints: topology-free, crash-safe, resumable on any world size.
//!
//! A checkpoint is a directory `<output_dir>/checkpoints/step-N` holding
//! `manifest.json` and one safetensors file per state (`master`, `exp_avg`,
//! `exp_avg_sq`: fp32; `param`: the training precision). Each file stores every unit as
//! one flat tensor of its real (unpadded) length, so nothing in it depends on the world
//! size; each rank writes its own slice at its offset, in parallel, and reads back the
//! slice its own partition needs, whatever world size saved it.
//!
//! - `files.rs`: the layout of the state files (header, offsets), shared by save and load
//! - `manifest.rs`: what the manifest records, its checksum, compatibility checks, the
//!   human form `tierzero inspect` prints
//! - `save.rs`: staging directory, parallel slice writes, fsync, rename, `latest`,
//!   `keep_last`
//! - `crash.rs`: crash points (`TIERZERO_CRASH_AT`) and a record of a save's
//!   file-system operations, for the tests that kill a save at each of its steps
//! - `load.rs`: opening, verifying (per-slice crc32c) and reading element ranges
//! - `export.rs`: a Hugging Face directory from a checkpoint, one unit at a time
//!
//! Crash safety: a save writes into `.tmp-step-N`, fsyncs every file and the directory,
//! writes the manifest last, renames the directory into place and only then replaces
//! `latest` (write, fsync, rename). A crash at any moment leaves every earlier
//! checkpoint and `latest` as they were; stale staging directories are removed by name
//! at the next save. Saving a step that exists (a run resumed from an older checkpoint)
//! exchanges the two directories atomically (`renameat2(RENAME_EXCHANGE)`), so `step-N`
//! is whole at every moment.

pub mod crash;
pub mod export;
pub mod files;
pub mod load;
pub mod manifest;
pub mod save;
pub mod space;

use std::path::PathBuf;

pub use load::Checkpoint;
pub use manifest::Manifest;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// One operation of a save (`save.rs`), named.
    #[error("{what} {path}: {source}")]
    Save {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("checkpoint {path} cannot be used: {message}")]
    Incompatible { path: PathBuf, message: String },
}

pub(crate) fn io_err(path: &std::path::Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn corrupt(path: &std::path::Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.to_path_buf(),
        message: message.into(),
    }
}
