//! A rank's part of saving a checkpoint (`checkpoint/` has the format).
//!
//! Every rank waits for its pending optimizer updates, then writes the real elements of
//! its own partition slice of every unit (`Partition::real(rank)`, the same slice at
//! every stage, so together the ranks cover each unit exactly once) into each state
//! file: fp32 master and moments from memory or streamed chunk by chunk from the NVMe
//! swap store, and the low-precision parameters. A run's final save takes the NVMe swap
//! files into the checkpoint as they are instead (renamed, where they share the
//! checkpoint's file system: no second copy of the largest state; the manifest records
//! where each slice lies in them). Each slice's crc32c (and placement) is all-gathered;
//! rank 0 writes the manifest and commits. Each phase ends in an agreement (an
//! all-reduce of failures), so a failure on any rank is an error on every rank and the
//! previous checkpoint is untouched.

use super::error::EngineError;
use super::optimizer::Sink;
use super::rank::RankEngine;
use crate::checkpoint::files::{param_dtype, state_files, unit_name, StateFile};
use crate::checkpoint::manifest::{
    self, DataPosition, FileEntry, Manifest, Placed, SchedulerState, UnitEntry,
};
use crate::checkpoint::save::{self, SliceWriter};
use crate::comm::{Collective, ReduceOp};
use crate::model::hf::SaveDtype;
use crate::plan::Precision;
use std::ops::Range;
use std::path::{Path, PathBuf};
use tierzero_offload::nvme::swap::{State, TensorKey};

impl<C: Collective + Clone> RankEngine<'_, C> {
    /// Every rank learns whether every rank succeeded; this rank's own error wins.
    fn agree(&self, outcome: Result<(), EngineError>, what: &'static str) -> Result<(), EngineError> {
        let mut failed = [if outcome.is_err() { 1.0f64 } else { 0.0 }];
        self.comms.main.all_reduce(&mut failed, ReduceOp::Sum)?;
        outcome?;
        if failed[0] > 0.0 {
            return Err(EngineError::Peer {
                rank: self.site.rank,
                what,
            });
        }
        Ok(())
    }

    fn checkpoint_err(&self) -> impl Fn(crate::checkpoint::CheckpointError) -> EngineError {
        let rank = self.site.rank;
        move |source| EngineError::Checkpoint { rank, source }
    }

    /// Saves the state after `step` completed steps under `root` (the checkpoints
    /// directory); `last`: the run's final save (its NVMe swap files become the
    /// checkpoint's, and the swap stores must not be written again). Rank 0 returns the
    /// checkpoint's directory.
    pub fn save_checkpoint(
        &mut self,
        root: &Path,
        (step, last_lr): (u64, f64),
        keep_last: usize,
        last: bool,
    ) -> Result<Option<PathBuf>, EngineError> {
        let saved = self.try_save(root, (step, last_lr), keep_last, last);
        if saved.is_err() && self.site.rank == 0 {
            // every rank learnt of the failure (`agree`) and stopped writing
            save::discard(root, step);
        }
        saved
    }

    fn try_save(
        &mut self,
        root: &Path,
        (step, last_lr): (u64, f64),
        keep_last: usize,
        last: bool,
    ) -> Result<Option<PathBuf>, EngineError> {
        self.install_all()?;
        let files = state_files(&self.model.units, param_dtype(self.plan.precision.name()));
        let staged = if self.site.rank == 0 {
            save::stage(root, step, &files)
                .map(|_| ())
                .map_err(self.checkpoint_err())
        } else {
            Ok(())
        };
        self.agree(staged, "staging the checkpoint")?;
        let written = self.write_slices(root, step, &files, last);
        let (crcs, placed) = match &written {
            Ok(slices) => slices.clone(),
            Err(_) => {
                let n = files.len() * self.units.len();
                (vec![0.0; n], vec![-1.0; n])
            }
        };
        self.agree(written.map(|_| ()), "writing its checkpoint slices")?;
        let world = self.comms.main.world();
        let mut all = vec![0f64; crcs.len() * world];
        self.comms.main.all_gather(&crcs, &mut all)?;
        let mut all_placed = vec![0f64; placed.len() * world];
        self.comms.main.all_gather(&placed, &mut all_placed)?;
        let committed = if self.site.rank == 0 {
            let manifest = self.manifest((step, last_lr), &files, (&all, &all_placed));
            save::commit(root, &manifest, keep_last)
                .map_err(self.checkpoint_err())
                .and_then(|dir| self.save_16bit_model(&dir).map(|()| Some(dir)))
        } else {
            Ok(None)
        };
        let path = committed.as_ref().ok().cloned().flatten();
        self.agree(committed.map(|_| ()), "committing the checkpoint")?;
        Ok(path)
    }

    /// With `stage3_gather_16bit_weights_on_model_save`, the model in its training
    /// precision as a Hugging Face directory inside the checkpoint (`hf/`).
    fn save_16bit_model(&self, dir: &Path) -> Result<(), EngineError> {
        if !self.plan.zero.gather_16bit_weights_on_model_save {
            return Ok(());
        }
        let dtype = match self.plan.precision {
            Precision::Fp32 => SaveDtype::F32,
            Precision::Bf16 => SaveDtype::Bf16,
            Precision::Fp16(_) => SaveDtype::F16,
        };
        crate::checkpoint::export::model_beside(dir, dtype)
            .map(drop)
            .map_err(|source| EngineError::Export {
                rank: self.site.rank,
                source,
            })
    }

    /// Writes this rank's slice of every unit into every file; returns the slices'
    /// crc32c and, for a final save (`last`), where each slice lies in a swap file taken
    /// into the checkpoint (its byte offset; −1: in the state file), both as
    /// `[file][unit]` (f64 so they travel through the collectives exactly).
    fn write_slices(
        &self,
        root: &Path,
        step: u64,
        files: &[StateFile],
        last: bool,
    ) -> Result<(Vec<f64>, Vec<f64>), EngineError> {
        let rank = self.site.rank;
        if last {
            self.discard_gradients();
        }
        let writer = SliceWriter::open(root, step, files).map_err(self.checkpoint_err())?;
        let mut crcs = Vec::with_capacity(files.len() * self.units.len());
        let mut placed = Vec::with_capacity(crcs.capacity());
        let mut taken: Vec<(PathBuf, &'static str)> = Vec::new();
        for (fi, file) in files.iter().enumerate() {
            for u in 0..self.units.len() {
                let real = self.units.part(u).real(rank);
                let store = match file.state {
                    State::Param => self.units.nvme_store(u).map(|s| (s, "params")),
                    _ => self.optimizer.nvme_store(u).map(|s| (s, "optimizer")),
                };
                let take = store.filter(|(s, _)| last && !real.is_empty() && same_file_system(s.dir(), root));
                let mut crc = 0u32;
                let mut offset = -1.0;
                let write = take.is_none();
                if let Some((store, kind)) = take {
                    let key = TensorKey {
                        unit: u as u32,
                        rank: rank as u32,
                        state: file.state,
                    };
                    let (path, at) = store.placement(key).map_err(self.site_io())?;
                    offset = at as f64;
                    if !taken.iter().any(|(p, _)| *p == path) {
                        taken.push((path, kind));
                    }
                }
                let mut sink = |elem: usize, bytes: &[u8]| -> Result<(), EngineError> {
                    crc = crc32c::crc32c_append(crc, bytes);
                    if !write {
                        return Ok(());
                    }
                    writer.write(fi, u, elem, bytes).map_err(self.checkpoint_err())
                };
                if !real.is_empty() {
                    match file.state {
                        State::Param => self.param_slice(u, real.clone(), &mut sink)?,
                        state => self.optimizer.read(state, u, real.clone(), &mut sink)?,
                    }
                }
                crcs.push(f64::from(crc));
                placed.push(offset);
            }
        }
        writer.sync().map_err(self.checkpoint_err())?;
        for (path, kind) in taken {
            save::take_file(root, step, &path, kind).map_err(self.checkpoint_err())?;
        }
        Ok((crcs, placed))
    }

    /// A final save's first act: the last step's gradients on NVMe are dead (every update
    /// is installed), so their swap file gives its room to the checkpoint's files.
    fn discard_gradients(&self) {
        if let Some(store) = self.optimizer.swap_store() {
            // only room is at stake: a file that cannot be truncated stays as it is
            match store.discard(self.site.rank as u32, State::Grad) {
                Ok(0) => {}
                Ok(freed) => tracing::debug!(
                    "rank {}: freed {freed} bytes of dead gradients before the final save",
                    self.site.rank
                ),
                Err(e) => tracing::warn!("rank {}: the dead gradients stay on disk: {e}", self.site.rank),
            }
        }
    }

    fn site_io(&self) -> impl Fn(tierzero_offload::nvme::IoError) -> EngineError {
        super::error::On(self.site.rank).io()
    }

    /// The low-precision parameters of elements `real` of unit `u`.
    fn param_slice(&self, u: usize, real: Range<usize>, sink: &mut Sink<'_>) -> Result<(), EngineError> {
        // stage 3 keeps its shard, the others the replica
        let base = if self.stage() == 3 {
            self.units.part(u).range(self.site.rank).start
        } else {
            0
        };
        self.units.with_stored(u, &self.tracks.compute, |params| {
            let width = params.elem_bytes();
            sink(
                real.start,
                &params.as_bytes()[(real.start - base) * width..(real.end - base) * width],
            )
        })
    }

    fn manifest(
        &self,
        (step, last_lr): (u64, f64),
        files: &[StateFile],
        (crcs, placed): (&[f64], &[f64]),
    ) -> Manifest {
        let plan = self.plan;
        let world = self.comms.main.world();
        let units = self.units.len();
        let per_rank = files.len() * units;
        let entries: Vec<FileEntry> = files
            .iter()
            .enumerate()
            .map(|(fi, f)| FileEntry {
                name: f.file_name(),
                state: f.state.name().into(),
                dtype: f.dtype.into(),
                bytes: f.len(),
                header_crc32c: crc32c::crc32c(&f.header),
                slice_crc32c: (0..units)
                    .map(|u| {
                        (0..world)
                            .map(|r| crcs[r * per_rank + fi * units + u] as u32)
                            .collect()
                    })
                    .collect(),
                placed: (0..units)
                    .flat_map(|u| (0..world).map(move |r| (u, r)))
                    .filter_map(|(u, r)| {
                        let offset = placed[r * per_rank + fi * units + u];
                        let store = if f.state == State::Param {
                            "params"
                        } else {
                            "optimizer"
                        };
                        (offset >= 0.0).then(|| Placed {
                            unit: u,
                            rank: r,
                            file: format!("nvme/{store}/r{r}.{}.swp", f.state.name()),
                            offset: offset as u64,
                        })
                    })
                    .collect(),
            })
            .collect();
        let mut manifest = Manifest {
            format: manifest::FORMAT.into(),
            version: manifest::version_for(&entries),
            step,
            adam_steps: self.optimizer.adam_steps,
            world_size: world,
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            precision: plan.precision.name().into(),
            model: self.model.config.clone(),
            units: self
                .model
                .units
                .iter()
                .map(|u| UnitEntry {
                    name: unit_name(u),
                    numel: u.numel,
                })
                .collect(),
            data: DataPosition {
                seed: plan.train.seed,
                step,
                train_batch_size: plan.batch.train_batch_size,
                seq_len: plan.data.seq_len,
            },
            loss_scaler: self.optimizer.scaler,
            scheduler: SchedulerState {
                iteration: step,
                last_lr,
            },
            config: serde_json::to_value(plan).unwrap_or_default(),
            files: entries,
            checksum: 0,
        };
        manifest.seal();
        manifest
    }
}

/// Whether `a` and `b` (existing paths) are on one file system: a rename between them
/// moves no data.
fn same_file_system(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev(),
        _ => false,
    }
}
