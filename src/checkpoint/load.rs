//! Reading a checkpoint: open, verify, read element ranges of any unit.
//!
//! [`Checkpoint::open`] reads the manifest (self-checked), then checks that every
//! state file exists, has the recorded length and the recorded header, and that every
//! file holding slices outside them (swap files a final save took as they were) exists.
//! Reads take an element range of one unit: they read the save-time slices that cover
//! it, each from its state file or its placed file, verify each slice's crc32c, and
//! return the range. A rank loading with a different world size
//! than the save reads at most its own range plus the two partial slices at its ends.

use super::files::{param_dtype, state_files, StateFile};
use super::manifest::Manifest;
use super::{corrupt, io_err, CheckpointError};
use crate::model::layout::units;
use crate::plan::partition::Partition;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use tierzero_offload::nvme::swap::State;

pub struct Checkpoint {
    pub dir: PathBuf,
    pub manifest: Manifest,
    files: Vec<(StateFile, File, PathBuf)>,
}

impl Checkpoint {
    /// Opens `path`: a checkpoint directory, or a `latest` file or the checkpoints
    /// directory holding one (then the checkpoint it names).
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let pointer = if path.is_dir() {
            path.join("latest")
        } else {
            path.to_path_buf()
        };
        let followed;
        let dir = if pointer.is_file() && !path.join("manifest.json").exists() {
            followed = super::save::follow_latest(pointer.parent().unwrap_or(Path::new(".")))?;
            followed.as_path()
        } else {
            path
        };
        if !dir.is_dir() {
            return Err(corrupt(dir, "no such checkpoint directory"));
        }
        let manifest = Manifest::read(dir)?;
        let layouts = units(&manifest.model);
        let mut files = Vec::new();
        for layout in state_files(&layouts, param_dtype(&manifest.precision)) {
            let path = dir.join(layout.file_name());
            let Some(entry) = manifest.files.iter().find(|f| f.name == layout.file_name()) else {
                return Err(corrupt(
                    &dir.join("manifest.json"),
                    format!("lists no {}", layout.file_name()),
                ));
            };
            let file = File::open(&path).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    corrupt(&path, "missing from the checkpoint")
                } else {
                    CheckpointError::Io {
                        path: path.clone(),
                        source: e,
                    }
                }
            })?;
            let len = file.metadata().map_err(io_err(&path))?.len();
            if len != entry.bytes || layout.len() != entry.bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "{len} bytes, the manifest records {} (truncated or replaced)",
                        entry.bytes
                    ),
                ));
            }
            let mut header = vec![0u8; layout.header.len()];
            file.read_exact_at(&mut header, 0).map_err(io_err(&path))?;
            if crc32c::crc32c(&header) != entry.header_crc32c || header != layout.header {
                return Err(corrupt(&path, "header (bytes 0..data start) fails its checksum"));
            }
            if entry.slice_crc32c.len() != layouts.len()
                || entry.slice_crc32c.iter().any(|s| s.len() != manifest.world_size)
            {
                return Err(corrupt(
                    &path,
                    "the manifest's slice checksums do not match the model",
                ));
            }
            for placed in &entry.placed {
                let at = dir.join(&placed.file);
                // inside the checkpoint only: no absolute path, no `..`
                let inside = Path::new(&placed.file)
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)));
                if !inside
                    || placed.unit >= layouts.len()
                    || placed.rank >= manifest.world_size
                    || !at.is_file()
                {
                    return Err(corrupt(
                        &at,
                        format!(
                            "holds {}'s unit {} slice of rank {} by the manifest, and is missing or out of range",
                            layout.file_name(),
                            placed.unit,
                            placed.rank
                        ),
                    ));
                }
            }
            files.push((layout, file, path));
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            manifest,
            files,
        })
    }

    fn file(&self, state: State) -> (usize, &(StateFile, File, PathBuf)) {
        let i = State::ALL.iter().position(|&s| s == state).unwrap_or(0);
        (i, &self.files[i])
    }

    /// The stored parameter dtype (`F32`, `BF16`, `F16`).
    pub fn param_dtype(&self) -> &'static str {
        self.file(State::Param).1 .0.dtype
    }

    /// Whether the stored parameters are in `precision` (else they are rounded from the
    /// master weights).
    pub fn params_match(&self, precision: &crate::plan::Precision) -> bool {
        self.param_dtype() == param_dtype(precision.name())
    }

    /// Bytes of elements `range` (real elements only) of unit `u` of `state`, every
    /// covering slice verified.
    pub fn read(&self, state: State, u: usize, range: Range<usize>) -> Result<Vec<u8>, CheckpointError> {
        let (index, (layout, file, path)) = self.file(state);
        let numel = self.manifest.units[u].numel;
        if range.end > numel || range.start > range.end {
            return Err(corrupt(
                path,
                format!("elements {range:?} of unit {u} are outside its {numel}"),
            ));
        }
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let part = Partition::new(numel, self.manifest.world_size);
        let first = range.start / part.shard;
        let last = (range.end - 1) / part.shard;
        let span = part.real(first).start..part.real(last).end;
        let width = layout.elem_bytes();
        let entry = &self.manifest.files[index];
        let mut bytes = vec![0u8; span.len() * width];
        for rank in first..=last {
            let real = part.real(rank);
            let piece = &mut bytes[(real.start - span.start) * width..(real.end - span.start) * width];
            let placed = entry.placed.iter().find(|p| p.unit == u && p.rank == rank);
            let (at, offset) = match placed {
                Some(p) => (self.dir.join(&p.file), p.offset),
                None => (path.clone(), layout.offset(u, real.start)),
            };
            let read = match placed {
                Some(_) => File::open(&at).and_then(|f| f.read_exact_at(piece, offset)),
                None => file.read_exact_at(piece, offset),
            };
            read.map_err(io_err(&at))?;
            if crc32c::crc32c(piece) != entry.slice_crc32c[u][rank] {
                return Err(corrupt(
                    &at,
                    format!(
                        "unit {} elements {real:?} (bytes {}..{}) fail their checksum: the file is damaged; use an earlier checkpoint",
                        self.manifest.units[u].name,
                        offset,
                        offset + (real.len() * width) as u64
                    ),
                ));
            }
        }
        Ok(bytes[(range.start - span.start) * width..(range.end - span.start) * width].to_vec())
    }

    /// fp32 elements `range` of unit `u` of an fp32 state into `out`.
    pub fn read_f32(
        &self,
        state: State,
        u: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let bytes = self.read(state, u, range)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }

    /// Unit `u`'s whole fp32 master weights.
    pub fn master_unit(&self, u: usize) -> Result<Vec<f32>, CheckpointError> {
        let numel = self.manifest.units[u].numel;
        let mut values = vec![0f32; numel];
        self.read_f32(State::Master, u, 0..numel, &mut values)?;
        Ok(values)
    }

    /// Reads every byte once and checks every checksum (`tierzero inspect --verify`,
    /// tests).
    pub fn verify(&self) -> Result<(), CheckpointError> {
        for &state in &State::ALL {
            for (u, unit) in self.manifest.units.iter().enumerate() {
                self.read(state, u, 0..unit.numel)?;
            }
        }
        Ok(())
    }
}
