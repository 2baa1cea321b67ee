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
    /// (stages 1–2) or kept in memory; parameters on NVMe were written by the optimizer
    /// lane already. The persistent gathered copy is dropped either way. Buffers the unit
    /// no longer needs become its spares for the next optimizer phase.
    pub(super) fn install(&mut self, u: usize, fresh: NewParams) -> Result<(), EngineError> {
        self.units[u].persistent = None;
        let fresh = match fresh {
            NewParams::Written => return Ok(()),
            NewParams::Memory(fresh) => fresh,
        };
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
        let previous = std::mem::replace(&mut self.units[u].params, Params::Memory(Arc::new(params)));
        if let (Params::Memory(old), 3 | 0) = (previous, self.stage()) {
            // a lane may still hold the old shard: then it is dropped, not reused
            self.units[u].spare_params = Arc::try_unwrap(old).ok();
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
                // parameters on NVMe are written from the optimizer lane's one staging
                // buffer: no partition of the whole model waits in memory
                let fresh = match (&unit.params, unit.spare_params.take()) {
                    (Params::Nvme, _) => None,
                    (Params::Memory(_), Some(p)) if p.len() == unit.opt_len => Some(p),
                    (Params::Memory(_), _) => Some(LowParams::zeros(unit.opt_len, &self.plan.precision)),
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
            param_store: self.param_store,
            staging: self.param_staging.clone(),
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
/// buffer the new low-precision partition is written into (None: the parameters live on
/// NVMe and are written there through the staging buffer).
struct OptimizerJob {
    unit: usize,
    state: Option<OptimizerState>,
    grad: Grads,
    fresh: Option<LowParams>,
}

/// A unit's new low-precision partition: in a buffer to install, or already written to
/// the NVMe parameter store by the optimizer lane.
pub(super) enum NewParams {
    Memory(LowParams),
    Written,
}

/// An update ready to install: unit, new low-precision partition, its state and the
/// gradient buffer back.
pub(super) type Update = (usize, NewParams, Option<OptimizerState>, Grads);

/// The optimizer lane's buffers for parameters on NVMe: the new partition (sized to the
/// largest unit once, resized within its capacity) and the bounce buffer of its write.
/// Kept by the engine between steps, so the step allocates nothing for them.
pub(super) struct ParamStaging {
    values: LowParams,
    scratch: IoBuf,
}

pub(super) type SharedStaging = Arc<std::sync::Mutex<Option<ParamStaging>>>;

/// What the optimizer phase needs, without borrowing the engine.
struct OptimizerContext<'a> {
    rank: usize,
    precision: Precision,
    store: Option<&'a SwapStore>,
    param_store: Option<&'a SwapStore>,
    staging: SharedStaging,
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
            state,
            grad,
            fresh,
        } = job;
        match fresh {
            Some(mut fresh) => {
                let state = self.update(unit, state, &grad, &mut fresh)?;
                Ok((unit, NewParams::Memory(fresh), state, grad))
            }
            None => {
                let state = self.update_to_nvme(unit, state, &grad)?;
                Ok((unit, NewParams::Written, state, grad))
            }
        }
    }

    /// AdamW on one partition whose parameters live on NVMe: the new values go into the
    /// staging buffer and from there to the parameter store, before the update is
    /// reported (so the unit's next fetch reads them).
    fn update_to_nvme(
        &self,
        unit: usize,
        state: Option<OptimizerState>,
        grad: &Grads,
    ) -> Result<Option<OptimizerState>, EngineError> {
        let other = |message: String| EngineError::Other {
            rank: self.rank,
            message,
        };
        let Some(store) = self.param_store else {
            return Err(other("parameters on nvme without a swap store".into()));
        };
        let mut slot = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut staging = match slot.take() {
            Some(staging) => staging,
            None => ParamStaging {
                values: LowParams::zeros(0, &self.precision),
                scratch: IoBuf::new(store.chunk_bytes(self.precision.bytes()))
                    .map_err(|e| other(e.to_string()))?,
            },
        };
        staging.values.resize(grad.len());
        let state = self.update(unit, state, grad, &mut staging.values)?;
        let key = TensorKey {
            unit: unit as u32,
            rank: self.rank as u32,
            state: State::Param,
        };
        let bytes = staging.values.as_bytes();
        let start = Instant::now();
        staging.scratch = store
            .write_tensor(key, bytes, staging.scratch)
            .map_err(|source| EngineError::Io {
                rank: self.rank,
                source,
            })?;
        self.tracks.nvme_write.record_between(
            Phase::NvmeWrite,
            false,
            Some(unit),
            start,
            Instant::now(),
            bytes.len() as u64,
        );
        *slot = Some(staging);
        Ok(state)
    }

    /// AdamW on one partition: in memory, or streamed through the NVMe pipeline; the
    /// new low-precision values into `fresh`.
    fn update(
        &self,
        unit: usize,
        mut state: Option<OptimizerState>,
        grad: &Grads,
        fresh: &mut LowParams,
    ) -> Result<Option<OptimizerState>, EngineError> {
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
        Ok(state)
    }
}
