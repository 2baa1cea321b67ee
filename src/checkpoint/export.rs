//! `tierzero export CKPT --hf OUT`: a Hugging Face directory from a checkpoint's fp32
//! master weights, one unit at a time (read, verify, convert, write, release), so the
//! memory it needs is a small multiple of the largest unit, never the model.

use super::{Checkpoint, CheckpointError};
use crate::model::hf::{self, HfError, SaveDtype};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Hf(#[from] HfError),
}

#[derive(Clone, Debug, Serialize)]
pub struct ExportReport {
    pub step: u64,
    pub units: usize,
    pub parameters: usize,
    /// fp32 bytes of the largest unit.
    pub largest_unit_bytes: u64,
    /// Resident memory at the start of the export and the most it grew by (Linux
    /// VmRSS / VmHWM after resetting the peak; None where /proc does not say).
    pub rss_start_bytes: Option<u64>,
    pub rss_growth_bytes: Option<u64>,
}

/// A `/proc/self/status` field in bytes.
fn proc_status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The 16-bit (training precision) model beside a committed checkpoint, as DeepSpeed's
/// `stage3_gather_16bit_weights_on_model_save` does: `<checkpoint>/hf`, written to a
/// temporary directory and renamed, so it is either whole or absent.
pub fn model_beside(checkpoint: &Path, dtype: SaveDtype) -> Result<std::path::PathBuf, ExportError> {
    let tmp = checkpoint.join(".hf.tmp");
    let out = checkpoint.join("hf");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| ExportError::Hf(HfError::Io { path, source: e })
    };
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    export(checkpoint, &tmp, dtype, 5_000_000_000)?;
    // durable before it appears: every file, the directory, then the rename
    for entry in std::fs::read_dir(&tmp).map_err(io(&tmp))?.flatten() {
        let path = entry.path();
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io(&path))?;
    }
    let sync_dir = |dir: &Path| {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))
    };
    sync_dir(&tmp)?;
    std::fs::rename(&tmp, &out).map_err(io(&out))?;
    sync_dir(checkpoint)?;
    Ok(out)
}

pub fn export(
    checkpoint: &Path,
    out: &Path,
    dtype: SaveDtype,
    shard_bytes: usize,
) -> Result<ExportReport, ExportError> {
    // reset the peak so VmHWM measures this export only
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let rss_start = proc_status_bytes("VmRSS:");
    let ckpt = Checkpoint::open(checkpoint)?;
    let units = &ckpt.manifest.units;
    hf::save_streaming(out, &ckpt.manifest.model, dtype, shard_bytes, &mut |u| {
        ckpt.master_unit(u).map_err(|e| HfError::Format {
            path: ckpt.dir.clone(),
            message: e.to_string(),
        })
    })?;
    hf::Companions::from_plan_json(&ckpt.manifest.config).write(out)?;
    let peak = proc_status_bytes("VmHWM:");
    Ok(ExportReport {
        step: ckpt.manifest.step,
        units: units.len(),
        parameters: units.iter().map(|u| u.numel).sum(),
        largest_unit_bytes: units.iter().map(|u| 4 * u.numel as u64).max().unwrap_or(0),
        rss_start_bytes: rss_start,
        rss_growth_bytes: rss_start.zip(peak).map(|(s, p)| p.saturating_sub(s)),
    })
}
