//! Writing a checkpoint: staging, slices, commit.
//!
//! Rank 0 [`stage`]s: removes leftovers of interrupted saves (by name only:
//! `.tmp-step-*`, `.old-step-*`), creates `.tmp-step-N` and every state file at its full
//! length with its header. Every rank then opens the files ([`SliceWriter`]), writes its
//! slices with positional writes and fsyncs. Rank 0 [`commit`]s: writes the manifest,
//! fsyncs it and the directory, renames the directory to `step-N`, fsyncs the parent,
//! replaces `latest` atomically and prunes to `keep_last`.

use super::files::StateFile;
use super::manifest::Manifest;
use super::{io_err, CheckpointError};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// `<output_dir>/checkpoints`.
pub fn root(output_dir: &Path) -> PathBuf {
    output_dir.join("checkpoints")
}

fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

fn staging_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".tmp-{}", step_dir_name(step)))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// The step of a `step-N` directory name.
pub fn parse_step(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Rank 0: a fresh staging directory for step `step` with every file created.
pub fn stage(root: &Path, step: u64, files: &[StateFile]) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io_err(root))?;
    for entry in std::fs::read_dir(root).map_err(io_err(root))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let leftover = [".tmp-step-", ".old-step-"]
            .iter()
            .any(|p| name.strip_prefix(p).and_then(|s| s.parse::<u64>().ok()).is_some());
        if leftover {
            let path = entry.path();
            tracing::info!("removing {} left by an interrupted save", path.display());
            std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
    }
    let dir = staging_dir(root, step);
    std::fs::create_dir(&dir).map_err(io_err(&dir))?;
    for f in files {
        let path = dir.join(f.file_name());
        let file = File::create(&path).map_err(io_err(&path))?;
        file.set_len(f.len()).map_err(io_err(&path))?;
        file.write_all_at(&f.header, 0).map_err(io_err(&path))?;
    }
    Ok(dir)
}

/// A rank's handles on the staged files, for writing its slices.
pub struct SliceWriter {
    files: Vec<(StateFile, File, PathBuf)>,
}

impl SliceWriter {
    pub fn open(root: &Path, step: u64, files: &[StateFile]) -> Result<SliceWriter, CheckpointError> {
        let dir = staging_dir(root, step);
        let files = files
            .iter()
            .map(|f| {
                let path = dir.join(f.file_name());
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(io_err(&path))?;
                Ok((f.clone(), file, path))
            })
            .collect::<Result<_, CheckpointError>>()?;
        Ok(SliceWriter { files })
    }

    /// Writes `bytes` as elements starting at `elem` of unit `u` in file `file`.
    pub fn write(&self, file: usize, u: usize, elem: usize, bytes: &[u8]) -> Result<(), CheckpointError> {
        let (layout, handle, path) = &self.files[file];
        handle
            .write_all_at(bytes, layout.offset(u, elem))
            .map_err(io_err(path))
    }

    /// Makes this rank's writes durable.
    pub fn sync(&self) -> Result<(), CheckpointError> {
        for (_, handle, path) in &self.files {
            handle.sync_data().map_err(io_err(path))?;
        }
        Ok(())
    }
}

/// Rank 0, after every rank's slices are durable: the manifest, the rename, `latest`,
/// pruning. Returns the checkpoint's directory.
pub fn commit(root: &Path, manifest: &Manifest, keep_last: usize) -> Result<PathBuf, CheckpointError> {
    let step = manifest.step;
    let staging = staging_dir(root, step);
    let path = staging.join("manifest.json");
    let text = serde_json::to_vec_pretty(manifest).map_err(|e| super::corrupt(&path, e.to_string()))?;
    {
        let file = File::create(&path).map_err(io_err(&path))?;
        file.write_all_at(&text, 0).map_err(io_err(&path))?;
        file.sync_all().map_err(io_err(&path))?;
    }
    sync_dir(&staging)?;
    let target = root.join(step_dir_name(step));
    if target.exists() {
        // saving a step again (a resumed run): move the old copy aside first
        let old = root.join(format!(".old-{}", step_dir_name(step)));
        std::fs::rename(&target, &old).map_err(io_err(&target))?;
        std::fs::rename(&staging, &target).map_err(io_err(&staging))?;
        sync_dir(root)?;
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    } else {
        std::fs::rename(&staging, &target).map_err(io_err(&staging))?;
    }
    sync_dir(root)?;
    let latest = root.join("latest");
    let tmp = root.join(".latest.tmp");
    {
        let file = File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all_at(format!("{}\n", step_dir_name(step)).as_bytes(), 0)
            .map_err(io_err(&tmp))?;
        file.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, &latest).map_err(io_err(&latest))?;
    sync_dir(root)?;
    prune(root, keep_last.max(1), step)?;
    Ok(target)
}

/// Every `step-N` checkpoint under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((parse_step(&e.file_name().to_string_lossy())?, e.path())))
        .collect();
    found.sort();
    found
}

/// Keeps the newest `keep` checkpoints (always `current`).
fn prune(root: &Path, keep: usize, current: u64) -> Result<(), CheckpointError> {
    let found = list(root);
    let excess = found.len().saturating_sub(keep);
    for (step, path) in found.into_iter().take(excess) {
        if step != current {
            // rename first: a crash mid-delete leaves a `.old-` leftover (removed at
            // the next save), never a `step-N` with files missing
            let doomed = root.join(format!(".old-{}", step_dir_name(step)));
            std::fs::rename(&path, &doomed).map_err(io_err(&path))?;
            std::fs::remove_dir_all(&doomed).map_err(io_err(&doomed))?;
        }
    }
    Ok(())
}

/// The directory `--resume` names: a path, or `latest` (the one `latest` points at
/// under `<output_dir>/checkpoints`).
pub fn resolve(resume: &str, output_dir: &Path) -> Result<PathBuf, CheckpointError> {
    if resume != "latest" {
        return Ok(PathBuf::from(resume));
    }
    follow_latest(&root(output_dir))
}

/// The checkpoint `root/latest` names.
pub fn follow_latest(root: &Path) -> Result<PathBuf, CheckpointError> {
    let pointer = root.join("latest");
    let name = std::fs::read_to_string(&pointer).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            super::corrupt(
                &pointer,
                "missing: no checkpoint was saved in this output_dir yet (train.save_interval sets how often one is)",
            )
        } else {
            CheckpointError::Io {
                path: pointer.clone(),
                source: e,
            }
        }
    })?;
    let name = name.trim();
    if parse_step(name).is_none() {
        return Err(super::corrupt(
            &pointer,
            format!("names {name:?}, not a step-N directory"),
        ));
    }
    Ok(root.join(name))
}
