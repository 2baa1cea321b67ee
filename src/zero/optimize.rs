//! The optimizer phase of a rank: AdamW on every unit's partition in forward order, on
//! a thread of its own (the next step's forward waits only for its unit's update) or
//! inline, with optimizer state in memory or streamed through the NVMe pipeline; and
//! installing each update where the unit's parameters live (replica all-gather at
//! stages 1–2, NVMe, or in memory).

use super::grads::Grads;
use super::rank::{EngineError, LowParams, OptimizerState, Params, RankEngine, Tracks, UnitState};
use crate::comm::Collective;
use crate::config::plan::Precision;
use crate::metrics::timeline::Phase;
use std::sync::Arc;
use std::time::Instant;
use tierzero_offload::adam::{self, Sweep};
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pipeline::{self, PipelineConfig};
use tierzero_offload::pool::{BufferPool, IoBuf};

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    /// The elements of a unit's gradient accumulator its optimizer partition reads.
    pub(super) fn opt_range(&self, unit: &UnitState) -> std::ops::Range<usize> {
        if self.stage() == 1 {
            unit.opt_start..unit.opt_start + unit.opt_len
        } else {
            0..unit.grad.len()
        }
    }

    /// The new parameters of unit `u` to where they live: all-gathered into the replica
    /// (stages 1–2), written to NVMe, or kept; the persistent gathered copy is dropped.
    /// Buffers the unit no longer needs become its spares for the next optimizer phase.
    pub(super) fn install(&mut self, u: usize, fresh: LowParams) -> Result<(), EngineError> {
        let params = match self.stage() {
            3 | 0 => fresh,
            _ => {
                let padded = self.units[u].part.padded;
                // the old replica (stages 1-2 keep it in memory) is the gather's output
                let previous = match &mut self.units[u].params {
                    Params::Memory(old) => Some(std::mem::take(old)),
                    Params::Nvme => None,
                };
                let mut full = match previous.map(Arc::try_unwrap) {
                    Some(Ok(old)) if old.len() == padded => old,
                    _ => LowParams::zeros(padded, &self.plan.precision),
                };
                self.all_gather_into(&fresh, &mut full)?;
                self.units[u].spare_params = Some(fresh);
                full
            }
        };
        self.units[u].persistent = None;
        if matches!(self.units[u].params, Params::Nvme) {
            let Some(store) = self.param_store else {
                return Err(EngineError::Other {
                    rank: self.rank,
                    message: "parameters on nvme without a swap store".into(),
                });
            };
            let key = TensorKey {
                unit: u as u32,
                rank: self.rank as u32,
                state: State::Param,
            };
            let scratch = match self.param_scratch.take() {
                Some(buf) => buf,
                None => {
                    IoBuf::new(store.chunk_bytes(params.elem_bytes())).map_err(|e| EngineError::Other {
                        rank: self.rank,
                        message: e.to_string(),
                    })?
                }
            };
            let bytes = params.as_bytes().len() as u64;
            let scratch = self
                .tracks
                .compute
                .span(Phase::NvmeWrite, Some(u), bytes, || {
                    store.write_tensor(key, params.as_bytes(), scratch)
                })
                .map_err(self.io_err())?;
            self.param_scratch = Some(scratch);
            if self.stage() == 3 || self.stage() == 0 {
                self.units[u].spare_params = Some(params);
            }
        } else {
            let previous = std::mem::replace(&mut self.units[u].params, Params::Memory(Arc::new(params)));
            if let (Params::Memory(old), 3 | 0) = (previous, self.stage()) {
                // a lane may still hold the old shard: then it is dropped, not reused
                self.units[u].spare_params = Arc::try_unwrap(old).ok();
            }
        }
        Ok(())
    }

    /// A gradient accumulator back from the optimizer phase: zeroed for the next step,
    /// or (stage 1) kept as the buffer of the next partition copy.
    fn take_back_gradient(&mut self, u: usize, mut grad: Grads) {
        if self.stage() == 1 {
            self.units[u].spare_grad = grad;
        } else {
            grad.fill_zero();
            self.units[u].grad = grad;
        }
    }

    /// Installs the optimizer thread's updates for units up to and including `through`
    /// (waiting for them), and takes their optimizer state back.
    pub(super) fn install_through(&mut self, through: usize) -> Result<(), EngineError> {
        while self.next_update <= through {
            let Some(updates) = &self.updates else {
                return Ok(());
            };
            let start = Instant::now();
            let update = updates.recv().map_err(|_| EngineError::Other {
                rank: self.rank,
                message: "the optimizer thread stopped".into(),
            })?;
            self.tracks
                .compute
                .waited(Phase::Optimizer, Some(self.next_update), start);
            let update = update?;
            let (u, fresh, state, grad) = update;
            self.units[u].optimizer = state;
            self.take_back_gradient(u, grad);
            self.install(u, fresh)?;
            self.next_update = u + 1;
            if self.next_update == self.units.len() {
                self.updates = None;
            }
        }
        Ok(())
    }

    /// Waits for every pending update.
    pub fn install_all(&mut self) -> Result<(), EngineError> {
        if self.updates.is_some() {
            self.install_through(self.units.len() - 1)?;
        }
        Ok(())
    }

    /// The optimizer phase: AdamW on every unit's partition in forward order. With a
    /// scope it runs on a thread of its own while the next step's forward proceeds, each
    /// fetch waiting only for its unit's update (the updates arrive in forward order);
    /// without one it runs here. Both compute exactly the same values.
    pub(super) fn optimize<'s, 'e>(
        &mut self,
        c: adam::Coefficients,
        scope: Option<&'s std::thread::Scope<'s, 'e>>,
    ) -> Result<(), EngineError>
    where
        'a: 'e,
    {
        let stage = self.stage();
        let jobs: Vec<OptimizerJob> = (0..self.units.len())
            .map(|u| {
                let unit = &mut self.units[u];
                // the accumulator moves into the job and comes back with the update
                // (stage 1 lends a copy of its partition: the replica stays whole)
                let grad = if stage == 1 {
                    let mut copy = std::mem::take(&mut unit.spare_grad).resized(unit.opt_len, false);
                    if let (Some(copy), Some(grad)) = (copy.as_f32_mut(), unit.grad.as_f32_mut()) {
                        copy.copy_from_slice(&grad[unit.opt_start..unit.opt_start + unit.opt_len]);
                    }
                    copy
                } else {
                    std::mem::take(&mut unit.grad)
                };
                let fresh = match unit.spare_params.take() {
                    Some(p) if p.len() == unit.opt_len => p,
                    _ => LowParams::zeros(unit.opt_len, &self.plan.precision),
                };
                OptimizerJob {
                    unit: u,
                    state: unit.optimizer.take(),
                    grad,
                    fresh,
                }
            })
            .collect();
        let context = OptimizerContext {
            rank: self.rank,
            precision: self.plan.precision,
            store: self.store,
            pool: self.pool.clone(),
            pipeline: PipelineConfig {
                buffer_count: self.plan.zero.offload_optimizer.buffer_count,
                pipeline_read: self.overlap && self.plan.zero.offload_optimizer.pipeline_read,
                pipeline_write: self.overlap && self.plan.zero.offload_optimizer.pipeline_write,
            },
            coefficients: c,
            tracks: self.tracks.clone(),
        };
        match scope {
            Some(scope) => {
                let (tx, rx) = crossbeam_channel::unbounded();
                scope.spawn(move || {
                    for job in jobs {
                        let result = context.run(job);
                        let failed = result.is_err();
                        if tx.send(result).is_err() || failed {
                            return;
                        }
                    }
                });
                self.updates = Some(rx);
                self.next_update = 0;
            }
            None => {
                for job in jobs {
                    let (u, fresh, state, grad) = context.run(job)?;
                    self.units[u].optimizer = state;
                    self.take_back_gradient(u, grad);
                    self.install(u, fresh)?;
                }
            }
        }
        Ok(())
    }
}

/// One unit's optimizer work: its state (None when on NVMe), final gradient, and the
/// buffer the new low-precision partition is written into.
struct OptimizerJob {
    unit: usize,
    state: Option<OptimizerState>,
    grad: Grads,
    fresh: LowParams,
}

/// An update ready to install: unit, new low-precision partition, its state and the
/// gradient buffer back.
pub(super) type Update = (usize, LowParams, Option<OptimizerState>, Grads);

/// What the optimizer phase needs, without borrowing the engine.
struct OptimizerContext<'a> {
    rank: usize,
    precision: Precision,
    store: Option<&'a SwapStore>,
    pool: Option<BufferPool>,
    pipeline: PipelineConfig,
    coefficients: adam::Coefficients,
    tracks: Tracks,
}

impl pipeline::Observer for Tracks {
    fn leg(&self, leg: pipeline::Leg, unit: u32, start: Instant, end: Instant, bytes: u64) {
        let unit = Some(unit as usize);
        match leg {
            pipeline::Leg::Read => {
                self.nvme_read
                    .record_between(Phase::NvmeRead, false, unit, start, end, bytes)
            }
            pipeline::Leg::Write => {
                self.nvme_write
                    .record_between(Phase::NvmeWrite, false, unit, start, end, bytes)
            }
            pipeline::Leg::Update => {
                self.optimizer
                    .record_between(Phase::Optimizer, false, unit, start, end, bytes)
            }
            pipeline::Leg::ReadWait => {
                self.optimizer
                    .record_between(Phase::NvmeRead, true, unit, start, end, 0)
            }
            pipeline::Leg::WriteWait => {
                self.optimizer
                    .record_between(Phase::NvmeWrite, true, unit, start, end, 0)
            }
        }
    }
}

impl OptimizerContext<'_> {
    fn run(&self, job: OptimizerJob) -> Result<Update, EngineError> {
        let OptimizerJob {
            unit,
            mut state,
            grad,
            mut fresh,
        } = job;
        let opt_len = fresh.len();
        let other = |message: String| EngineError::Other {
            rank: self.rank,
            message,
        };
        if let Some(state) = state.as_mut() {
            let sweep = Sweep {
                master: &mut state.master,
                exp_avg: &mut state.exp_avg,
                exp_avg_sq: &mut state.exp_avg_sq,
                grad: grad.slice(0..grad.len()),
                low: fresh.out_as(&self.precision),
            };
            let bytes = 16 * opt_len as u64;
            self.tracks
                .optimizer
                .span(Phase::Optimizer, Some(unit), bytes, || {
                    adam::step(&self.coefficients, sweep)
                })
                .map_err(|e| other(e.to_string()))?;
        } else {
            let (Some(store), Some(pool)) = (self.store, self.pool.as_ref()) else {
                return Err(other("optimizer state has no tier".into()));
            };
            let groups = pipeline::sub_groups(
                unit as u32,
                self.rank as u32,
                store.chunk_elems(),
                grad.slice(0..grad.len()),
                fresh.out_as(&self.precision),
            );
            pipeline::nvme_adam_step_observed(
                store,
                pool,
                groups,
                &self.coefficients,
                self.pipeline,
                &self.tracks,
            )
            .map_err(|source| EngineError::Io {
                rank: self.rank,
                source,
            })?;
        }
        Ok((unit, fresh, state, grad))
    }
}
