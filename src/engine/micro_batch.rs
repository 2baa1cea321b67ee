//! One micro-batch of a rank, and evaluation: each unit's parameters fetched (installed,
//! gathered at stage 3 from the prefetcher's lanes or here), the forward unit by unit
//! keeping each unit's input (or its whole graph where `rules::keeps_activations`), the
//! final unit's loss and backward, and backward in reverse through the kept graphs or by
//! recompute, each flat gradient reduced into its accumulator.

use super::error::EngineError;
use super::prefetch::Prefetcher;
use super::rank::RankEngine;
use crate::comm::{Collective, ReduceOp};
use crate::data::Batch;
use crate::device::cpu::Reservation;
use crate::device::lanes::{Mode, Stream};
use crate::device::sim;
use crate::metrics::timeline::Phase;
use crate::model::head::Weight;
use crate::model::{Graph, Segments};
use crate::plan::memory::kept_graph_bytes;
use crate::plan::rules::keeps_activations;
use crate::plan::simulate::costs::Work;
use crate::torch;
use std::sync::Arc;
use std::time::Instant;
use tch::{TchError, Tensor};

/// One micro-batch's data on the compute device.
pub(super) struct MicroData {
    pub tokens: Tensor,
    pub targets: Tensor,
    /// The attention layout of rows holding packed samples.
    pub segments: Option<Segments>,
    /// How its tokens weigh in the step's loss.
    pub weight: Weight,
    loss_scale: f64,
    accumulation: usize,
}

impl MicroData {
    /// The micro-batch's share of the step loss, from the final unit's loss sum over
    /// `count` counted tokens.
    pub fn loss_share(&self, loss_sum: f64, count: i64) -> f64 {
        match self.weight {
            Weight::PerToken(w) => loss_sum * w / self.loss_scale,
            Weight::Mean(_) => loss_sum / count.max(1) as f64 / self.accumulation as f64,
        }
    }
}

/// What a micro-batch's forward keeps for its backward.
struct Forward {
    /// Each unit's input (the token ids first).
    inputs: Vec<Tensor>,
    /// The graphs of the units that keep their activations.
    graphs: Vec<Option<Graph>>,
    /// Device memory of what is kept, held until the backward is done.
    kept: Vec<Reservation>,
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    /// Compute's stream on a GPU, where its spans are timed by the device
    /// (`compute_times.rs`); None on CPU devices and simulated ones.
    fn timed_stream(&self) -> Result<Option<Arc<dyn Stream>>, TchError> {
        match (self.site.compute, &self.site.streams) {
            (tch::Device::Cuda(_), Some(streams)) => streams
                .current()
                .map(Some)
                .map_err(|e| TchError::Torch(e.to_string())),
            _ => Ok(None),
        }
    }

    /// The step's compute starts: on a GPU the origin of its device-timed spans.
    pub(super) fn begin_compute(&mut self) -> Result<(), EngineError> {
        if let Some(stream) = self.timed_stream().map_err(self.torch_err())? {
            self.compute_times.begin(&*stream).map_err(self.torch_err())?;
        }
        Ok(())
    }

    /// The step's compute is queued: its device-timed spans go to the compute track.
    pub(super) fn end_compute(&mut self) {
        self.compute_times.flush(&self.tracks.compute);
    }

    /// Runs `f`, which computes one span of the step (a unit's forward or backward, the
    /// head): on a GPU between two timed marks of compute's stream, never waiting for
    /// its kernels; elsewhere timed on the host.
    pub(super) fn compute_span<T>(
        &mut self,
        (phase, unit): (Phase, Option<usize>),
        f: impl FnOnce(&Self) -> Result<T, TchError>,
    ) -> Result<T, EngineError> {
        let out = match self.timed_stream().map_err(self.torch_err())? {
            None => {
                let track = self.tracks.compute.clone();
                track.span(phase, unit, 0, || f(self))
            }
            Some(stream) => {
                let mut times = std::mem::take(&mut self.compute_times);
                let out = times.span(&*stream, (phase, unit), || f(self));
                self.compute_times = times;
                out
            }
        };
        out.map_err(self.torch_err())
    }

    /// Checked mode on a GPU: unit `u`'s compute (its forward, or its `backward`) starts
    /// late on the device as lane jobs do (a spin queued before it), so a lane that
    /// reads what compute writes without waiting for its mark reads it unwritten.
    /// Nothing on CPU devices, whose compute is done when the call returns, nor on a
    /// simulated one (virtual time does not see checked mode's delays).
    pub(super) fn checked_delay(&self, u: usize, backward: bool) -> Result<(), TchError> {
        let salt = Mode::round_salt("compute", self.site.rank, self.checked_round);
        let delay = self
            .lanes
            .mode
            .device_delay(salt, (2 * u + usize::from(backward)) as u64);
        match (&self.site.streams, delay) {
            (Some(streams), Some(micros)) => streams
                .current()
                .and_then(|compute| compute.delay(micros))
                .map_err(|e| TchError::Torch(e.to_string())),
            _ => Ok(()),
        }
    }

    /// The full parameters of unit `u` as a tensor of the compute kind, with the device
    /// memory its gathered form holds (stage 3) until dropped. At stage 3 the gather
    /// comes from the prefetcher's lanes when they run, else it happens here; a unit used
    /// in place (one rank, its shard on the device) is its stored tensor, holding nothing
    /// more.
    pub(super) fn fetch(
        &mut self,
        prefetch: Option<&mut Prefetcher<'a, C>>,
        u: usize,
    ) -> Result<(Tensor, Option<Reservation>), EngineError> {
        self.install_through(u)?;
        if let Some(tensor) = self.units.persistent(u) {
            return Ok((tensor, None));
        }
        if self.stage() < 3 || crate::plan::rules::in_place_units(self.plan)[u] {
            // the replica is already whole, or with one rank the stored shard on the
            // device is the whole unit (`rules::in_place_units`)
            return Ok((self.units.replica(u, &self.tracks.compute)?, None));
        }
        let (tensor, hold) = match prefetch {
            // a unit is requested only once its pending update is installed
            Some(prefetch) => prefetch.next(u, &mut self.installer())?,
            None => {
                let bytes = (self.units.part(u).padded * self.plan.precision.bytes()) as u64;
                let hold = self.site.device.reserve(bytes, &format!("gathered unit {u}"))?;
                (
                    self.units.gather_now(u, &self.comms.main, &self.tracks.compute)?,
                    Some(hold),
                )
            }
        };
        Ok(self.units.keep_if_small(u, tensor, hold))
    }

    /// Micro-batch `global_micro` of `step` on the compute device, with its tokens' weight
    /// in the step's loss (timed as the forward's on a CPU device).
    pub(super) fn micro_data(
        &mut self,
        step: u64,
        global_micro: u64,
        loss_scale: f64,
    ) -> Result<MicroData, EngineError> {
        let plan = self.plan;
        let accumulation = plan.batch.gradient_accumulation_steps;
        let (rows, seq) = (plan.batch.micro_batch_per_gpu, plan.data.seq_len);
        let data_start = Instant::now();
        let batch = self
            .dataset
            .batch(plan.train.seed, 0, step, global_micro, rows, seq);
        let shape = [rows as i64, seq as i64];
        let tokens =
            torch::tensor_tokens(&batch.inputs, &shape, self.site.compute).map_err(self.torch_err())?;
        let targets =
            torch::tensor_tokens(&batch.targets, &shape, self.site.compute).map_err(self.torch_err())?;
        let segments = self.segments(&batch)?;
        // the loss is the mean over the global batch's counted tokens: known in advance
        // where samples count different numbers of tokens, so each micro-batch weighs its
        // tokens by it (the reduction averages over ranks, hence the world size)
        let weight = match self.dataset.counted(step) {
            Some(total) => {
                Weight::PerToken(loss_scale * self.comms.main.world() as f64 / total.max(1) as f64)
            }
            None => Weight::Mean(loss_scale / accumulation as f64),
        };
        if self.timed_stream().map_err(self.torch_err())?.is_none() {
            // on a GPU the token ids' upload waits for compute's queued kernels, which
            // its device-timed spans already count
            self.tracks.compute.record(Phase::Forward, None, data_start, 0);
        }
        Ok(MicroData {
            tokens,
            targets,
            segments,
            weight,
            loss_scale,
            accumulation,
        })
    }

    /// Device memory for a micro-batch's token ids (and a packed batch's mask and
    /// positions), held until its backward is done.
    pub(super) fn reserve_tokens(&self, data: &MicroData) -> Result<Vec<Reservation>, EngineError> {
        let mut kept = vec![self
            .site
            .device
            .reserve(8 * data.tokens.numel() as u64, "token ids")?];
        if let Some(s) = &data.segments {
            // the mask ([B, 1, T, T] bools) and positions of packed rows
            let bytes = (s.mask.numel() + 8 * s.positions.numel()) as u64;
            kept.push(self.site.device.reserve(bytes, "packed rows' attention mask")?);
        }
        Ok(kept)
    }

    /// One micro-batch: forward, the final unit's loss and backward, backward through
    /// the kept graphs of units whose parameters stay on the device
    /// (`rules::keeps_activations`) and by recompute for the others. Returns this
    /// micro-batch's share of the step loss.
    pub(super) fn micro_batch(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        step: u64,
        global_micro: u64,
        loss_scale: f64,
    ) -> Result<f64, EngineError> {
        self.checked_round = (step << 24) ^ global_micro;
        let data = self.micro_data(step, global_micro, loss_scale)?;
        let forward = self.forward(prefetch.as_deref_mut(), &data)?;
        let (loss_sum, count, grad_out) = self.final_unit(
            prefetch.as_deref_mut(),
            &forward.inputs,
            &data.targets,
            data.weight,
        )?;
        self.backward(prefetch, forward, grad_out, data.segments.as_ref())?;
        Ok(data.loss_share(loss_sum, count))
    }

    /// The forward of every unit but the final one, keeping each unit's input (activation
    /// checkpoints on the device); units whose parameters stay on the device keep their
    /// graphs for backward.
    fn forward(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        data: &MicroData,
    ) -> Result<Forward, EngineError> {
        let plan = self.plan;
        let last = self.units.len() - 1;
        let segments = data.segments.as_ref();
        let mut kept = self.reserve_tokens(data)?;
        let mut inputs = vec![data.tokens.shallow_clone()];
        let mut graphs: Vec<Option<Graph>> = (0..last).map(|_| None).collect();
        for u in 0..last {
            let (params, gathered) = self.fetch(prefetch.as_deref_mut(), u)?;
            let keep = keeps_activations(plan, u);
            let (y, graph) = self.compute_span((Phase::Forward, Some(u)), |engine| {
                engine.checked_delay(u, false)?;
                let out = if keep {
                    let (y, graph) = engine.model.forward_keep(u, &params, &inputs[u], segments)?;
                    (y, Some(graph))
                } else {
                    (engine.model.forward_unit(u, &params, &inputs[u], segments)?, None)
                };
                sim::charge(Work::Forward(u));
                Ok(out)
            })?;
            if graph.is_some() {
                // without the prefetcher (which holds a held unit itself) the graph keeps
                // the gathered parameters alive: their memory stays reserved with it
                kept.extend(gathered);
                let bytes = kept_graph_bytes(plan);
                kept.push(
                    self.site
                        .device
                        .reserve(bytes, &format!("kept activations of unit {u}"))?,
                );
            }
            graphs[u] = graph;
            let bytes = (y.numel() * self.plan.precision.bytes()) as u64;
            kept.push(
                self.site
                    .device
                    .reserve(bytes, &format!("activation checkpoint of unit {}", u + 1))?,
            );
            inputs.push(y);
        }
        Ok(Forward { inputs, graphs, kept })
    }

    /// The final unit's loss and backward, its gradients (and a tied embedding's share)
    /// accumulated. Returns the loss sum, the counted tokens and the gradient of the
    /// final unit's input.
    fn final_unit(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        inputs: &[Tensor],
        targets: &Tensor,
        weight: Weight,
    ) -> Result<(f64, i64, Tensor), EngineError> {
        let last = self.units.len() - 1;
        let (params, gathered) = self.fetch(prefetch.as_deref_mut(), last)?;
        let tied = if self.model.config.tie_word_embeddings {
            Some(self.fetch(prefetch, 0)?)
        } else {
            None
        };
        let last_unit = self.compute_span((Phase::Backward, Some(last)), |engine| {
            engine.checked_delay(last, true)?;
            let tied = tied.as_ref().map(|t| &t.0);
            let out = engine
                .model
                .backward_final(&params, tied, &inputs[last], targets, weight)?;
            sim::charge(Work::Head);
            Ok(out)
        })?;
        drop((params, gathered, tied));
        self.grads.accumulate(
            last,
            &last_unit.params,
            (&self.comms.main, &self.tracks.compute),
            false,
        )?;
        if let Some(t) = &last_unit.tied {
            // the embedding's own gradient follows in backward
            self.grads.accumulate(
                0,
                &t.reshape([-1]),
                (&self.comms.main, &self.tracks.compute),
                true,
            )?;
        }
        Ok((last_unit.loss_sum, last_unit.count, last_unit.input))
    }

    /// Backward in reverse from the final unit's input gradient `grad_out`: through
    /// kept graphs, else by recompute; each unit's gradient accumulated.
    fn backward(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        forward: Forward,
        mut grad_out: Tensor,
        segments: Option<&Segments>,
    ) -> Result<(), EngineError> {
        let Forward {
            inputs,
            mut graphs,
            kept,
        } = forward;
        if self.overlap {
            self.optimizer.read_first_ahead();
        }
        for u in (0..graphs.len()).rev() {
            let graph = graphs[u].take();
            let (params, _gathered) = match graph {
                // a unit held gathered for its backward (`stage3_max_reuse_distance`) is
                // taken from the prefetcher, so its buffer, which the graph reads, goes
                // back to the pool only after this use
                Some(_) if prefetch.as_deref().is_some_and(|p| p.holds(u)) => {
                    (Tensor::new(), self.fetch(prefetch.as_deref_mut(), u)?.1)
                }
                Some(_) => (Tensor::new(), None),
                None => self.fetch(prefetch.as_deref_mut(), u)?,
            };
            let (g, grad_in) = self.compute_span((Phase::Backward, Some(u)), |engine| {
                engine.checked_delay(u, true)?;
                let grads = match graph {
                    Some(graph) => engine.model.backward_kept(graph, &grad_out)?,
                    None => engine
                        .model
                        .backward_unit(u, &params, &inputs[u], &grad_out, segments)?,
                };
                sim::charge(Work::Backward(u));
                Ok(grads)
            })?;
            self.grads
                .accumulate(u, &g, (&self.comms.main, &self.tracks.compute), false)?;
            if let Some(d) = grad_in {
                grad_out = d;
            }
        }
        drop(kept);
        Ok(())
    }

    /// The attention layout of a batch whose rows hold packed samples.
    pub(super) fn segments(&self, batch: &Batch) -> Result<Option<Segments>, EngineError> {
        batch
            .segments
            .as_ref()
            .map(|s| Segments::new(s, batch.rows, batch.seq_len, self.site.compute))
            .transpose()
            .map_err(self.torch_err())
    }

    /// Mean loss on `batches` evaluation micro-batches of this rank (no update).
    pub fn eval(&mut self, batches: usize) -> Result<f64, EngineError> {
        let plan = self.plan;
        let world = self.comms.main.world();
        let last = self.units.len() - 1;
        let (rows, seq) = (plan.batch.micro_batch_per_gpu, plan.data.seq_len);
        let (mut sum, mut count) = (0.0, 0.0);
        for b in 0..batches {
            let batch = self.dataset.batch(
                plan.train.seed,
                1,
                0,
                (b * world + self.site.rank) as u64,
                rows,
                seq,
            );
            let shape = [rows as i64, seq as i64];
            let mut x =
                torch::tensor_tokens(&batch.inputs, &shape, self.site.compute).map_err(self.torch_err())?;
            let targets =
                torch::tensor_tokens(&batch.targets, &shape, self.site.compute).map_err(self.torch_err())?;
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
        self.comms.main.all_reduce(&mut totals, ReduceOp::Sum)?;
        Ok(totals[0] / totals[1].max(1.0))
    }
}
