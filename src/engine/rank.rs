//! One rank of the ZeRO engine: its state, split between three owners, and the training
//! step that moves state between them.
//!
//! Stages are residency rules over the same code (ZeRO paper, §5):
//! - stage 0: parameters, gradients and optimizer state replicated; gradients all-reduced;
//! - stage 1: optimizer state sharded; gradients all-reduced, each rank updates its shard
//!   and the updated shards are all-gathered into every replica;
//! - stage 2: as 1, with gradients reduce-scattered straight into the shard;
//! - stage 3: as 2, with parameters sharded too: a unit is all-gathered only while it
//!   computes, then released (units below `stage3_param_persistence_threshold` stay).
//!
//! The owners, each with private fields and its residency as a type:
//! - `units.rs` ([`Units`]): the low-precision parameters, `Memory | Nvme` per unit;
//! - `gradients.rs` ([`Gradients`]): the accumulators, `Here | Lent` (to the reduce or
//!   optimizer lane), and the reduce lane's end;
//! - `optimizer.rs` ([`Optimizer`]): master and moments, `Memory | Nvme | Lent`.
//!
//! The step (DESIGN.md, "One training step"), as [`RankEngine::step`] reads: every
//! micro-batch's forward unit by unit under no_grad keeping each unit's input, the final
//! unit's loss and backward, backward in reverse by recompute with each flat gradient
//! reduced into its accumulator; the replicas' all-reduce (stages 0–1); the global
//! gradient norm, clipping and fp16 overflow skipping; AdamW unit by unit in forward order
//! (`optimize.rs`), overlapping the next step's forward. Stage-3 fetches come from the
//! prefetch lanes (`prefetch.rs`), reduce-scatters from the reduce lane (`reduce.rs`)
//! with `overlap_comm`.

use super::context::{Comms, LaneOptions, RankContext, StepReport, Tracks};
use super::error::{EngineError, On};
use super::gradients::Gradients;
use super::optimizer::{NvmeTier, Optimizer};
use super::prefetch::{FetchLanes, Fetcher, Prefetcher};
use super::reduce::Reducer;
use super::setup::{device_reservations, device_streams, host_pinning, unit_start};
use super::units::{Home, Units};
use crate::comm::{Collective, ReduceOp};
use crate::data::{Batch, Dataset};
use crate::device::cpu::{CpuDevice, Reservation};
use crate::device::lanes::{Lane, Streams};
use crate::metrics::timeline::Phase;
use crate::metrics::trace::TierBytes;
use crate::model::head::Weight;
use crate::model::layout::UnitKind;
use crate::model::{Graph, Model, Segments};
use crate::plan::memory::kept_graph_bytes;
use crate::plan::partition::Partition;
use crate::plan::rules::{bf16_gradients, keeps_activations, nvme_gradients, pipeline_sets};
use crate::plan::schedule::LossScaler;
use crate::plan::{Plan, Precision, Tier};
use crate::torch;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, TchError, Tensor};
use tierzero_offload::nvme::swap::SwapStore;
use tierzero_offload::pipeline;

pub struct RankEngine<'a, C: Collective> {
    /// The compute thread's communicator.
    pub(super) comm: C,
    /// The gather lane's (stage-3 all-gathers ahead of compute).
    gather_comm: C,
    /// The reduce lane's (`overlap_comm`).
    reduce_comm: C,
    pub(super) plan: &'a Plan,
    pub(super) model: &'a Model,
    dataset: &'a Dataset,
    pub(super) units: Units<'a>,
    pub(super) grads: Gradients<'a, C>,
    pub(super) optimizer: Optimizer<'a>,
    pub(super) rank: usize,
    device: Arc<CpuDevice>,
    /// Device memory of the state that lives for the whole run.
    _held: Vec<Reservation>,
    /// The swap stores, for their disk bytes.
    stores: [Option<&'a SwapStore>; 2],
    pub(super) tracks: Tracks,
    pub(super) overlap: bool,
    lanes: LaneOptions,
    /// The step's collectives lane while micro-batches run (stages 2–3): the one thread
    /// that issues this rank's gathers and reduce-scatters, in the order the compute
    /// thread submits them, which is the same on every rank.
    collectives: Option<Arc<Lane<'a>>>,
    /// Where this rank computes (CPU, or its GPU).
    compute: tch::Device,
    /// Its GPU's streams for the lanes (None on CPU, where lane work is done when its job
    /// returns).
    streams: Option<Arc<dyn Streams>>,
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    fn torch_err(&self) -> impl Fn(TchError) -> EngineError {
        On(self.rank).torch()
    }

    /// Waits for the compute stream's queued work, so a compute span ends when the
    /// kernels did (torch launches asynchronously); the lanes' streams go on. Nothing to
    /// wait for on CPU.
    fn settle(&self) -> Result<(), TchError> {
        match &self.streams {
            Some(streams) => streams
                .current()
                .and_then(|compute| compute.mark())
                .and_then(|mark| mark.synchronize())
                .map_err(|e| TchError::Torch(e.to_string())),
            None => Ok(()),
        }
    }

    pub(super) fn stage(&self) -> u8 {
        self.plan.zero.stage
    }

    /// Builds this rank's state: each unit initialised (a pure function of the seed),
    /// sliced to what this rank keeps, and handed to its owners on their tiers.
    pub fn new(
        comms: Comms<C>,
        context: RankContext<'a>,
        device: Arc<CpuDevice>,
    ) -> Result<Self, EngineError> {
        let Comms {
            main: comm,
            gather: gather_comm,
            reduce: reduce_comm,
        } = comms;
        let RankContext {
            plan,
            model,
            dataset,
            optimizer_store,
            param_store,
            start,
            timeline,
            overlap,
            lanes,
        } = context;
        let (rank, world, stage) = (comm.rank(), comm.world(), plan.zero.stage);
        let on = On(rank);
        let missing = |what| EngineError::Invariant { rank, what };
        let optimizer_nvme = match (plan.zero.offload_optimizer.tier, optimizer_store) {
            (Tier::Nvme, Some(store)) => Some(NvmeTier {
                store,
                pool: pipeline::buffer_pool_for(store, pipeline_sets(plan), nvme_gradients(plan))
                    .map_err(on.io())?,
            }),
            (Tier::Nvme, None) => return Err(missing("optimizer on nvme without a swap store")),
            _ => None,
        };
        let param_home = match (plan.zero.offload_param.tier, param_store) {
            (Tier::Nvme, Some(store)) => Home::Nvme(store),
            (Tier::Nvme, None) => return Err(missing("parameters on nvme without a swap store")),
            (Tier::Cpu, _) => Home::Host,
            (Tier::Device, _) => Home::Device,
        };
        let compute = plan.train.compute_device(rank);
        let mut units = Units::new(
            rank,
            stage,
            plan.precision,
            (model.kind, compute),
            plan.zero.param_persistence_threshold,
            (param_home, lanes.mode),
        );
        let parts: Vec<Partition> = model
            .units
            .iter()
            .map(|l| Partition::new(l.numel, world))
            .collect();
        // each unit's optimizer partition: the whole unit at stage 0, else this rank's slice
        let partitions: Vec<_> = parts
            .iter()
            .map(|p| if stage == 0 { 0..p.padded } else { p.range(rank) })
            .collect();
        // the run-long host state, allocated once: gradients and in-memory optimizer
        // state in arenas, locked (and registered with a GPU's context) with pin_memory
        let pinning = host_pinning(plan, compute, rank)?;
        let bf16_grads = bf16_gradients(plan);
        let grads = Gradients::new(
            (
                stage,
                rank,
                bf16_grads,
                crate::plan::rules::device_accumulation(plan),
            ),
            (plan.communication, crate::plan::rules::chunk_elements(plan)),
            parts.clone(),
            partitions.clone(),
            &pinning,
            optimizer_store.filter(|_| nvme_gradients(plan)),
        )?;
        let adam_steps = start.checkpoint().map_or(0, |c| c.manifest.adam_steps);
        let mut scaler = LossScaler::new(match &plan.precision {
            Precision::Fp16(s) => Some(s),
            _ => None,
        });
        if let Some(checkpoint) = start.checkpoint() {
            scaler.restore(&checkpoint.manifest.loss_scaler);
        }
        // `offload_optimizer: none`: the state is tensors on the rank's device
        let optimizer_device = (plan.zero.offload_optimizer.tier == Tier::Device).then_some(compute);
        let mut optimizer = Optimizer::new(
            rank,
            (optimizer_nvme, optimizer_device),
            (adam_steps, scaler),
            partitions.clone(),
            &pinning,
        )?;
        let mut held = Vec::new();
        for (u, (layout, part)) in model.units.iter().zip(&parts).enumerate() {
            let (part, partition) = (*part, partitions[u].clone());
            let state = unit_start(start, plan, (u, layout), part, partition.clone(), rank)?;
            optimizer.init(u, &state.master, &state.exp_avg, &state.exp_avg_sq)?;
            held.extend(device_reservations(
                plan,
                &device,
                u,
                (state.params.len(), part),
                (partition.len(), grads.unit_bytes(u)),
            )?);
            units.push(part, state.params)?;
        }
        Ok(RankEngine {
            comm,
            gather_comm,
            reduce_comm,
            plan,
            model,
            dataset,
            units,
            grads,
            optimizer,
            rank,
            device,
            _held: held,
            stores: [optimizer_store, param_store],
            tracks: Tracks::new(timeline, rank),
            overlap,
            lanes,
            collectives: None,
            compute,
            streams: device_streams(compute, rank)?,
        })
    }

    /// Checks that every rank starts at `first_step` (each process resolves its own
    /// checkpoint): a rank whose start differs from the ranks' mean stops the run, naming
    /// both, instead of training a different step count from the others.
    pub fn check_same_start(&self, first_step: u64) -> Result<(), EngineError> {
        let mut start = [first_step as f64];
        self.comm.all_reduce(&mut start, ReduceOp::Avg)?;
        if start[0] != first_step as f64 {
            return Err(EngineError::StartDiffers {
                rank: self.rank,
                mine: first_step,
                mean: start[0],
            });
        }
        Ok(())
    }

    /// One optimizer step: every micro-batch of this rank, the gradients' reduction and
    /// norm, then the update, which runs on a thread of `scope` when one is given (see
    /// [`Self::optimize`]). `stop` says this rank's process was asked to stop; the
    /// report's `preempted` says whether any rank's was.
    pub fn step<'s, 'e>(
        &mut self,
        step: u64,
        scope: Option<&'s std::thread::Scope<'s, 'e>>,
        stop: bool,
    ) -> Result<StepReport, EngineError>
    where
        'a: 'e,
    {
        let plan = self.plan;
        self.grads.zero();
        let loss_scale = self.optimizer.scaler.scale;
        let loss = self.micro_batches(step, loss_scale)?;
        let reduce_start = Instant::now();
        self.grads.all_reduce_replicas(&self.comm)?;
        // each rank's preemption flag travels with its loss: any rank asked, all stop
        let mut losses = [loss, f64::from(u8::from(stop))];
        self.comm.all_reduce(&mut losses, ReduceOp::Avg)?;
        // the global gradient norm (of the unscaled gradients)
        let mut sum_sq = [self.grads.sum_squares()?];
        if self.stage() >= 1 {
            self.comm.all_reduce(&mut sum_sq, ReduceOp::Sum)?;
        }
        self.tracks.compute.record(Phase::Reduce, None, reduce_start, 0);
        let grad_norm = sum_sq[0].sqrt() / loss_scale;
        let lr = self.optimizer.learning_rate(plan);
        let mut report = StepReport {
            loss: losses[0],
            grad_norm,
            lr,
            loss_scale,
            skipped: false,
            preempted: losses[1] > 0.0,
        };
        let Some(adam_step) = self.optimizer.next_update(plan, grad_norm, lr) else {
            report.skipped = true;
            return Ok(report);
        };
        self.install_all()?;
        self.optimize(adam_step, scope)?;
        Ok(report)
    }

    /// Every micro-batch of the step. At stages 2–3 one collectives lane issues every
    /// all-gather (stage 3) and reduce-scatter of the step in the order the compute
    /// thread submits them — the schedule's, identical on every rank, which is what
    /// keeps NCCL's communicators from deadlocking each other; with `overlap_comm` off
    /// the compute thread waits for each reduction. Returns the loss.
    ///
    /// The compute thread's own collectives come before (stages 1–2 gathering an
    /// installed update: every unit is installed in the first micro-batch's forward,
    /// before any reduction of the step) or after the lane (the step's all-reduces).
    fn micro_batches(&mut self, step: u64, loss_scale: f64) -> Result<f64, EngineError> {
        let plan = self.plan;
        let world = self.comm.world();
        let run = |engine: &mut Self| -> Result<f64, EngineError> {
            let mut loss = 0.0;
            let micro_batches = plan.batch.gradient_accumulation_steps;
            for micro in 0..micro_batches {
                let global_micro = (micro * world + engine.rank) as u64;
                engine
                    .grads
                    .begin_micro_batch(micro == 0, micro + 1 == micro_batches);
                loss += engine.with_prefetch(|engine, prefetch| {
                    engine.micro_batch(prefetch, step, global_micro, loss_scale)
                })?;
            }
            engine.grads.absorb(true)?;
            Ok(loss)
        };
        if self.stage() < 2 || !self.overlap {
            return run(self);
        }
        let aborts = [self.reduce_comm.clone(), self.gather_comm.clone()];
        let (rank, mode, streams) = (self.rank, self.lanes.mode, self.streams.clone());
        std::thread::scope(|scope| {
            let lane = Arc::new(Lane::start_on(scope, rank, "collectives", mode, streams));
            let buffers = self.grads.lend_chunk_buffers();
            self.grads.reduce_on(
                Reducer::new(
                    lane.clone(),
                    self.reduce_comm.clone(),
                    self.tracks.reduce.clone(),
                    buffers,
                ),
                plan.zero.overlap_comm,
            );
            self.collectives = Some(lane);
            // a panic must not leave a handle on the lane: the scope would wait for its
            // thread forever instead of letting the panic reach the trainer
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(self)));
            let failure = match &result {
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("rank {rank} panicked")),
                Ok(Ok(_)) => None,
            };
            if let Some(reason) = failure {
                for comm in &aborts {
                    comm.abort(&reason);
                }
            }
            // every handle on the lane goes before the scope joins its thread
            self.collectives = None;
            let stopped = self.grads.stop_reducing();
            let loss = result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            stopped.map(|()| loss)
        })
    }

    /// The full parameters of unit `u` as a tensor of the compute kind, with the device
    /// memory its gathered form holds (stage 3) until dropped. At stage 3 the gather
    /// comes from the prefetcher's lanes when they run, else it happens here.
    fn fetch(
        &mut self,
        prefetch: Option<&mut Prefetcher<'a, C>>,
        u: usize,
    ) -> Result<(Tensor, Option<Reservation>), EngineError> {
        self.install_through(u)?;
        if let Some(tensor) = self.units.persistent(u) {
            return Ok((tensor, None));
        }
        if self.stage() < 3 {
            // the replica is already whole
            return Ok((self.units.replica(u, &self.tracks.compute)?, None));
        }
        let (tensor, hold) = match prefetch {
            // a unit is requested only once its pending update is installed
            Some(prefetch) => prefetch.next(u, &mut |v| {
                self.install_through(v)?;
                Ok(self.units.source(v))
            })?,
            None => {
                let bytes = (self.units.part(u).padded * self.plan.precision.bytes()) as u64;
                let hold = self.device.reserve(bytes, &format!("gathered unit {u}"))?;
                (self.units.gather_now(u, &self.comm, &self.tracks.compute)?, hold)
            }
        };
        Ok(self.units.keep_if_small(u, tensor, Some(hold)))
    }

    /// Runs `body` with the prefetcher's lanes at stage 3 (none below). On any error the
    /// gather communicator is aborted, so no rank's gather lane waits forever.
    fn with_prefetch<T>(
        &mut self,
        body: impl FnOnce(&mut Self, Option<&mut Prefetcher<'a, C>>) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if self.stage() != 3 || !self.overlap {
            return body(self, None);
        }
        let tied = self.model.config.tie_word_embeddings;
        let threshold = self.plan.zero.param_persistence_threshold;
        let parts = self.units.parts();
        let mut order = crate::plan::fetch::schedule(parts.len(), tied, |u| parts[u].numel <= threshold);
        // a pending update invalidates every cached unit before its use, so while one is
        // pending every unit is fetched
        let pending = self.optimizer.any_pending();
        order.retain(|&(u, _)| pending || self.units.persistent(u).is_none());
        let fetcher = Fetcher {
            comm: self.gather_comm.clone(),
            rank: self.rank,
            precision: self.plan.precision,
            kind: self.model.kind,
            compute: self.compute,
            parts,
            gather_track: self.tracks.prefetch.clone(),
            h2d_track: self.tracks.h2d.clone(),
            dropped: self.lanes.dropped,
            streams: self.streams.clone(),
        };
        let limits = crate::plan::fetch::Limits {
            bucket: self.plan.zero.prefetch_bucket_size,
            max_live: self.plan.zero.max_live_parameters,
            persistence_threshold: threshold,
        };
        let buffers = self.units.lend_gather_buffers(self.lanes.mode);
        let comms = [self.gather_comm.clone(), self.reduce_comm.clone()];
        let (mode, rank) = (self.lanes.mode, self.rank);
        // the step's collectives lane (`micro_batches`): a lane of their own would issue
        // gathers from a second thread
        let Some(collectives) = self.collectives.clone() else {
            return Err(EngineError::Invariant {
                rank,
                what: "stage-3 prefetch outside the step's collectives lane",
            });
        };
        std::thread::scope(|scope| {
            let lanes = FetchLanes {
                h2d: Lane::start_on(scope, rank, "h2d", mode, self.streams.clone()),
                gather: collectives,
            };
            let mut prefetcher = Prefetcher::new(
                order,
                self.plan.precision.bytes(),
                limits,
                self.device.clone(),
                self.tracks.compute.clone(),
                buffers,
                lanes,
                fetcher,
            );
            let result = body(self, Some(&mut prefetcher));
            if let Err(e) = &result {
                // the lane may hold reductions too: no job on it may wait forever
                for comm in &comms {
                    comm.abort(&e.to_string());
                }
            }
            self.units.return_gather_buffers(prefetcher.finish());
            result
        })
    }

    /// One micro-batch: forward, the final unit's loss and backward, backward through
    /// the kept graphs of units whose parameters stay on the device
    /// (`rules::keeps_activations`) and by recompute for the others. Returns this
    /// micro-batch's share of the step loss.
    fn micro_batch(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        step: u64,
        global_micro: u64,
        loss_scale: f64,
    ) -> Result<f64, EngineError> {
        let plan = self.plan;
        let accumulation = plan.batch.gradient_accumulation_steps;
        let last = self.units.len() - 1;
        let (rows, seq) = (plan.batch.micro_batch_per_gpu, plan.data.seq_len);
        let data_start = Instant::now();
        let batch = self
            .dataset
            .batch(plan.train.seed, 0, step, global_micro, rows, seq);
        let shape = [rows as i64, seq as i64];
        let tokens = torch::tensor_tokens(&batch.inputs, &shape, self.compute).map_err(self.torch_err())?;
        let targets = torch::tensor_tokens(&batch.targets, &shape, self.compute).map_err(self.torch_err())?;
        let segments = self.segments(&batch)?;
        // the loss is the mean over the global batch's counted tokens: known in advance
        // where samples count different numbers of tokens, so each micro-batch weighs its
        // tokens by it (the reduction averages over ranks, hence the world size)
        let weight = match self.dataset.counted(step) {
            Some(total) => Weight::PerToken(loss_scale * self.comm.world() as f64 / total.max(1) as f64),
            None => Weight::Mean(loss_scale / accumulation as f64),
        };
        self.tracks.compute.record(Phase::Forward, None, data_start, 0);
        // forward, keeping each unit's input (activation checkpoints on the device)
        let mut kept = vec![self.device.reserve(8 * (rows * seq) as u64, "token ids")?];
        if let Some(s) = &segments {
            // the mask ([B, 1, T, T] bools) and positions of packed rows
            let bytes = (s.mask.numel() + 8 * s.positions.numel()) as u64;
            kept.push(self.device.reserve(bytes, "packed rows' attention mask")?);
        }
        let mut inputs = vec![tokens];
        // units whose parameters stay on the device keep their graphs for backward
        let mut graphs: Vec<Option<Graph>> = (0..last).map(|_| None).collect();
        for u in 0..last {
            let (params, _gathered) = self.fetch(prefetch.as_deref_mut(), u)?;
            let keep = keeps_activations(plan, u);
            let (y, graph) = self
                .tracks
                .compute
                .span(Phase::Forward, Some(u), 0, || {
                    let out = if keep {
                        let (y, graph) =
                            self.model
                                .forward_keep(u, &params, &inputs[u], segments.as_ref())?;
                        (y, Some(graph))
                    } else {
                        (
                            self.model
                                .forward_unit(u, &params, &inputs[u], segments.as_ref())?,
                            None,
                        )
                    };
                    self.settle().map(|()| out)
                })
                .map_err(self.torch_err())?;
            if graph.is_some() {
                let bytes = kept_graph_bytes(plan);
                kept.push(
                    self.device
                        .reserve(bytes, &format!("kept activations of unit {u}"))?,
                );
            }
            graphs[u] = graph;
            let bytes = (y.numel() * self.plan.precision.bytes()) as u64;
            kept.push(
                self.device
                    .reserve(bytes, &format!("activation checkpoint of unit {}", u + 1))?,
            );
            inputs.push(y);
        }
        // loss and the final unit's backward
        let (params, gathered) = self.fetch(prefetch.as_deref_mut(), last)?;
        let tied = if self.model.config.tie_word_embeddings {
            Some(self.fetch(prefetch.as_deref_mut(), 0)?)
        } else {
            None
        };
        let final_start = Instant::now();
        let last_unit = self
            .model
            .backward_final(
                &params,
                tied.as_ref().map(|t| &t.0),
                &inputs[last],
                &targets,
                weight,
            )
            .map_err(self.torch_err())?;
        self.settle().map_err(self.torch_err())?;
        self.tracks
            .compute
            .record(Phase::Backward, Some(last), final_start, 0);
        drop((params, gathered, tied));
        let loss = match weight {
            Weight::PerToken(w) => last_unit.loss_sum * w / loss_scale,
            Weight::Mean(_) => last_unit.loss_sum / last_unit.count.max(1) as f64 / accumulation as f64,
        };
        self.grads
            .accumulate(last, &last_unit.params, (&self.comm, &self.tracks.compute), false)?;
        if let Some(t) = &last_unit.tied {
            // the embedding's own gradient follows in backward
            self.grads
                .accumulate(0, &t.reshape([-1]), (&self.comm, &self.tracks.compute), true)?;
        }
        // backward in reverse: through kept graphs, else by recompute
        let mut grad_out = last_unit.input;
        for u in (0..last).rev() {
            let graph = graphs[u].take();
            let (params, _gathered) = match graph {
                Some(_) => (Tensor::new(), None),
                None => self.fetch(prefetch.as_deref_mut(), u)?,
            };
            let (g, grad_in) = self
                .tracks
                .compute
                .span(Phase::Backward, Some(u), 0, || {
                    let grads = match graph {
                        Some(graph) => self.model.backward_kept(graph, &grad_out)?,
                        None => {
                            self.model
                                .backward_unit(u, &params, &inputs[u], &grad_out, segments.as_ref())?
                        }
                    };
                    self.settle().map(|()| grads)
                })
                .map_err(self.torch_err())?;
            self.grads
                .accumulate(u, &g, (&self.comm, &self.tracks.compute), false)?;
            if let Some(d) = grad_in {
                grad_out = d;
            }
        }
        drop(kept);
        Ok(loss)
    }

    /// The attention layout of a batch whose rows hold packed samples.
    fn segments(&self, batch: &Batch) -> Result<Option<Segments>, EngineError> {
        batch
            .segments
            .as_ref()
            .map(|s| Segments::new(s, batch.rows, batch.seq_len, self.compute))
            .transpose()
            .map_err(self.torch_err())
    }

    /// fp32 master weights of this rank's optimizer partition of unit `u`, with where
    /// the partition starts in the padded unit.
    pub fn master(&mut self, u: usize) -> Result<(usize, Vec<f32>), EngineError> {
        self.install_all()?;
        Ok((self.optimizer.partition(u).start, self.optimizer.master(u)?))
    }

    pub fn unit_count(&self) -> usize {
        self.units.len()
    }

    pub fn is_embedding(&self, u: usize) -> bool {
        self.model.units[u].kind == UnitKind::Embedding
    }

    /// Peak device bytes this rank has held.
    pub fn device_peak(&self) -> u64 {
        self.device.peak()
    }

    /// Bytes on each tier now (device: the peak since the last call; NVMe: the swap
    /// stores' files, every rank's). State lent to a lane counts by its size.
    pub fn tier_bytes(&self) -> TierBytes {
        let zero = &self.plan.zero;
        let optimizer = match zero.offload_optimizer.tier {
            Tier::Device => 0,
            _ => self.optimizer.memory_bytes(),
        };
        let grads = match zero.offload_optimizer.tier {
            Tier::Device => 0,
            _ => self.grads.bytes(),
        };
        let params = self.units.memory_bytes();
        TierBytes {
            device: self.device.take_window_peak(),
            host: (params + optimizer + grads) as u64,
            nvme: self.stores.iter().flatten().map(|s| s.disk_bytes()).sum(),
        }
    }

    pub fn loss_scale(&self) -> f64 {
        self.optimizer.scaler.scale
    }

    /// Mean loss on `batches` evaluation micro-batches of this rank (no update).
    pub fn eval(&mut self, batches: usize) -> Result<f64, EngineError> {
        let plan = self.plan;
        let world = self.comm.world();
        let last = self.units.len() - 1;
        let (rows, seq) = (plan.batch.micro_batch_per_gpu, plan.data.seq_len);
        let (mut sum, mut count) = (0.0, 0.0);
        for b in 0..batches {
            let batch = self
                .dataset
                .batch(plan.train.seed, 1, 0, (b * world + self.rank) as u64, rows, seq);
            let shape = [rows as i64, seq as i64];
            let mut x =
                torch::tensor_tokens(&batch.inputs, &shape, self.compute).map_err(self.torch_err())?;
            let targets =
                torch::tensor_tokens(&batch.targets, &shape, self.compute).map_err(self.torch_err())?;
            let segments = self.segments(&batch)?;
            for u in 0..last {
                let (params, _gathered) = self.fetch(None, u)?;
                x = self
                    .model
                    .forward_unit(u, &params, &x, segments.as_ref())
                    .map_err(self.torch_err())?;
            }
            let (params, _gathered) = self.fetch(None, last)?;
            let tied = if self.model.config.tie_word_embeddings {
                Some(self.fetch(None, 0)?)
            } else {
                None
            };
            let (s, c) = self
                .model
                .loss(&params, tied.as_ref().map(|t| &t.0), &x, &targets)
                .map_err(self.torch_err())?;
            sum += s;
            count += c as f64;
        }
        let mut totals = [sum, count];
        self.comm.all_reduce(&mut totals, ReduceOp::Sum)?;
        Ok(totals[0] / totals[1].max(1.0))
    }
}

/// The element kind tch uses for a precision (re-exported for the trainer).
pub fn kind_for(precision: &Precision) -> Kind {
    torch::compute_kind(precision)
}
