//! Writing a checkpoint: staging, slices, commit.
//!
//! Rank 0 [`stage`]s: removes leftovers of interrupted saves (by name only:
//! `.tmp-step-*`, `.old-step-*`), creates `.tmp-step-N` and every state file at its full
//! length with its header. Every rank then opens the files ([`SliceWriter`]), writes its
//! slices with positional writes and fsyncs. Rank 0 [`commit`]s: writes the manifest,
//! fsyncs it and the directory, renames the directory to `step-N` (exchanges it with
//! the old copy when a resumed run saves a step again), fsyncs the parent, replaces
//! `latest` atomically and prunes to `keep_last`. Every operation goes through [`op`]:
//! a crash point before it (see `crash.rs`). The crash tests check durability from
//! the system calls themselves, traced by strace, not from anything this file reports.

use super::crash;
use super::files::StateFile;
use super::manifest::Manifest;
use super::{io_err, CheckpointError};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// One operation of the save of step `step` on `path`: crash point `point`, then `run`
/// (its error names `path`).
fn op<T>(
    point: &'static str,
    step: u64,
    path: &Path,
    run: impl FnOnce() -> std::io::Result<T>,
) -> Result<T, CheckpointError> {
    crash::point(point, step);
    run().map_err(|source| CheckpointError::Save {
        what: doing(point),
        path: path.to_path_buf(),
        source,
    })
}

/// What the operation at crash point `point` is, for its error.
fn doing(point: &'static str) -> &'static str {
    match point {
        "stage-dir" => "creating the staging directory",
        "stage-file" => "creating the state file",
        "slice-write" => "writing a slice of",
        "slice-sync" => "syncing",
        "manifest-write" => "writing",
        "manifest-sync" | "latest-sync" => "syncing",
        "staging-sync" | "root-sync" | "latest-root-sync" => "syncing the directory",
        "rename" | "aside-rename" | "aside-publish" | "latest-rename" | "prune-rename" => "renaming",
        "exchange" => "exchanging",
        "old-remove" | "prune-remove" => "removing",
        "latest-write" => "writing",
        _ => "saving",
    }
}

/// Removes what a failed save of `step` left: its staging directory and `latest`'s
/// temporary file, so the disk it filled gets its space back and nothing half-written
/// remains. A published `step-N` and `latest` are left as they are.
pub fn discard(root: &Path, step: u64) {
    let staging = staging_dir(root, step);
    if staging.exists() {
        if let Err(e) = std::fs::remove_dir_all(&staging) {
            tracing::warn!("cannot remove {} after a failed save: {e}", staging.display());
        }
    }
    let _ = std::fs::remove_file(root.join(".latest.tmp"));
}

/// Renames `from` to `to` as one operation of the save (crash point `point`).
fn rename(point: &'static str, step: u64, from: &Path, to: &Path) -> Result<(), CheckpointError> {
    op(point, step, from, || std::fs::rename(from, to))
}

/// Writes `text` to a new file `path` and fsyncs it (the manifest, `latest`).
fn write_synced(
    path: &Path,
    text: &[u8],
    step: u64,
    points: [&'static str; 2],
) -> Result<(), CheckpointError> {
    let file = op(points[0], step, path, || {
        let file = File::create(path)?;
        file.write_all_at(text, 0)?;
        Ok(file)
    })?;
    op(points[1], step, path, || file.sync_all())
}

/// Atomically swaps two directory entries (renameat2 RENAME_EXCHANGE); `Ok(false)`
/// where the file system cannot.
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that outlive the call
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

/// `<output_dir>/checkpoints`.
pub fn root(output_dir: &Path) -> PathBuf {
    output_dir.join("checkpoints")
}

/// The prefix of a step moved aside while a step is saved again where the file system
/// cannot exchange two directories.
const ASIDE: &str = ".aside-";

fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

fn staging_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".tmp-{}", step_dir_name(step)))
}

fn sync_dir(dir: &Path, step: u64, point: &'static str) -> Result<(), CheckpointError> {
    op(point, step, dir, || File::open(dir)?.sync_all())
}

/// Takes the NVMe swap file `from` of a run's final save into the checkpoint being staged
/// for `step`, as it is (`nvme/<store>/<its name>`; the run has no further use for it):
/// synced, then renamed — no byte copied — or, where the rename cannot cross (two mounts
/// of one file system), copied; then the directories the entry lands in are synced (the
/// staging directory itself is synced by [`commit`]). Returns its path relative to the
/// checkpoint's directory, which the manifest records.
pub fn take_file(root: &Path, step: u64, from: &Path, store: &str) -> Result<String, CheckpointError> {
    let name = from
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let relative = format!("nvme/{store}/{name}");
    let staging = staging_dir(root, step);
    let to = staging.join(&relative);
    let failed = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Save { what, path, source }
    };
    File::open(from)
        .and_then(|f| f.sync_all())
        .map_err(failed("syncing", from))?;
    let dir = to.parent().unwrap_or(root);
    std::fs::create_dir_all(dir).map_err(failed("creating the directory of", dir))?;
    match std::fs::rename(from, &to) {
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            std::fs::copy(from, &to)
                .and_then(|_| File::open(&to)?.sync_all())
                .map_err(failed("copying the swap file into the checkpoint:", from))?;
        }
        other => other.map_err(failed("taking the swap file into the checkpoint:", from))?,
    }
    for d in [dir, &staging.join("nvme")] {
        File::open(d)
            .and_then(|f| f.sync_all())
            .map_err(failed("syncing the directory", d))?;
    }
    Ok(relative)
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
        let leftover = [".tmp-step-", ".old-step-", ".aside-step-"]
            .iter()
            .any(|p| name.strip_prefix(p).and_then(|s| s.parse::<u64>().ok()).is_some());
        if let Some(step_name) = name.strip_prefix(ASIDE).filter(|n| parse_step(n).is_some()) {
            if !root.join(step_name).exists() {
                // a save that could not exchange died between its two renames: this
                // is the only copy of that step
                let path = entry.path();
                tracing::info!("restoring {} left by an interrupted save", path.display());
                std::fs::rename(&path, root.join(step_name)).map_err(io_err(&path))?;
                continue;
            }
        }
        if leftover {
            let path = entry.path();
            tracing::info!("removing {} left by an interrupted save", path.display());
            std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
    }
    // a 16-bit model export a crash interrupted inside a published checkpoint
    for (_, published) in list(root) {
        let partial = published.join(".hf.tmp");
        if partial.exists() {
            tracing::info!("removing {} left by an interrupted export", partial.display());
            std::fs::remove_dir_all(&partial).map_err(io_err(&partial))?;
        }
    }
    let dir = staging_dir(root, step);
    op("stage-dir", step, &dir, || std::fs::create_dir(&dir))?;
    for f in files {
        let path = dir.join(f.file_name());
        op("stage-file", step, &path, || {
            let file = File::create(&path)?;
            file.set_len(f.len())?;
            file.write_all_at(&f.header, 0)
        })?;
    }
    Ok(dir)
}

/// A rank's handles on the staged files, for writing its slices.
pub struct SliceWriter {
    files: Vec<(StateFile, File, PathBuf)>,
    step: u64,
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
        Ok(SliceWriter { files, step })
    }

    /// Writes `bytes` as elements starting at `elem` of unit `u` in file `file`.
    pub fn write(&self, file: usize, u: usize, elem: usize, bytes: &[u8]) -> Result<(), CheckpointError> {
        let (layout, handle, path) = &self.files[file];
        op("slice-write", self.step, path, || {
            handle.write_all_at(bytes, layout.offset(u, elem))
        })
    }

    /// Makes this rank's writes durable.
    pub fn sync(&self) -> Result<(), CheckpointError> {
        for (_, handle, path) in &self.files {
            op("slice-sync", self.step, path, || handle.sync_data())?;
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
    write_synced(&path, &text, step, ["manifest-write", "manifest-sync"])?;
    sync_dir(&staging, step, "staging-sync")?;
    let target = root.join(step_dir_name(step));
    if !target.exists() {
        rename("rename", step, &staging, &target)?;
        sync_dir(root, step, "root-sync")?;
    } else {
        // saving a step again (a resumed run): swap the new copy in atomically, so
        // `step-N` is whole at every moment, then remove the old one
        crash::point("exchange", step);
        let old = if !crash::no_exchange() && exchange(&staging, &target).map_err(io_err(&target))? {
            staging
        } else {
            // the file system cannot exchange: move the old copy aside first (a
            // crash in between leaves it as `.aside-step-N`, which `stage` and
            // `follow_latest` take back)
            let old = root.join(format!("{ASIDE}{}", step_dir_name(step)));
            rename("aside-rename", step, &target, &old)?;
            rename("aside-publish", step, &staging, &target)?;
            old
        };
        sync_dir(root, step, "root-sync")?;
        op("old-remove", step, &old, || std::fs::remove_dir_all(&old))?;
    }
    let tmp = root.join(".latest.tmp");
    write_synced(
        &tmp,
        format!("{}\n", step_dir_name(step)).as_bytes(),
        step,
        ["latest-write", "latest-sync"],
    )?;
    let latest = root.join("latest");
    rename("latest-rename", step, &tmp, &latest)?;
    sync_dir(root, step, "latest-root-sync")?;
    prune(root, keep_last.max(1), step)?;
    crash::point("committed", step);
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
            rename("prune-rename", current, &path, &doomed)?;
            op("prune-remove", current, &doomed, || {
                std::fs::remove_dir_all(&doomed)
            })?;
        }
    }
    Ok(())
}

/// The directory `--resume` names: a path, `latest` (the one `latest` points at under
/// `<output_dir>/checkpoints`; an error when there is none), or `auto` (the same, or
/// `None` when no checkpoint was saved yet: the same command starts a job and restarts it).
pub fn resolve(resume: &str, output_dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let root = root(output_dir);
    match resume {
        "latest" => follow_latest(&root).map(Some),
        "auto" if !root.join("latest").exists() => Ok(None),
        "auto" => follow_latest(&root).map(Some),
        path => Ok(Some(PathBuf::from(path))),
    }
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
    let dir = root.join(name);
    let aside = root.join(format!("{ASIDE}{name}"));
    if !dir.exists() && aside.exists() {
        return Ok(aside);
    }
    Ok(dir)
}
