//! The step's lanes, opened once per step and closed once. At stages 2–3 with overlap one
//! collectives lane issues every all-gather (stage 3) and reduce-scatter of the step in
//! the order the compute thread submits them — the schedule's, identical on every rank,
//! which is what keeps NCCL's communicators from deadlocking each other — and at stage 3
//! an h2d lane copies host and NVMe shards to device staging. The reducer runs on the
//! collectives lane for the whole step; each micro-batch's prefetcher uses both lanes.
//! When the step fails, the lane communicators are aborted, so no rank's lane waits for a
//! peer that will never come.
//!
//! The compute thread's own collectives come before the lanes (stages 1–2 gathering an
//! installed update: every unit is installed in the first micro-batch's forward, before
//! any reduction of the step) or after them (the step's all-reduces).

use super::error::EngineError;
use super::prefetch::{FetchLanes, Fetcher, Prefetcher};
use super::rank::RankEngine;
use super::reduce::Reducer;
use crate::comm::Collective;
use crate::device::lanes::Lane;
use crate::plan::fetch::{Fetches, Limits};
use std::sync::Arc;

/// The lanes of one step and the communicators they issue on.
pub(super) struct StepLanes<'a, C: Collective> {
    collectives: Arc<Lane<'a>>,
    /// Stage 3: shards from host memory or NVMe to device staging.
    h2d: Option<Arc<Lane<'a>>>,
    /// The gather and reduce communicators: aborted when the step fails.
    aborts: [C; 2],
}

impl<C: Collective> StepLanes<'_, C> {
    /// Fails every rank's pending and future collectives on the lanes' communicators.
    fn abort(&self, reason: &str) {
        for comm in &self.aborts {
            comm.abort(reason);
        }
    }
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    /// Every micro-batch of the step, with the step's lanes at stages 2–3 (with
    /// `overlap_comm` off the compute thread waits for each reduction). Returns the loss.
    pub(super) fn micro_batches(&mut self, step: u64, loss_scale: f64) -> Result<f64, EngineError> {
        if self.stage() < 2 || !self.overlap {
            return self.each_micro_batch(None, step, loss_scale);
        }
        let (rank, mode, streams) = (self.site.rank, self.lanes.mode, self.site.streams.clone());
        std::thread::scope(|scope| {
            let lanes = StepLanes {
                collectives: Arc::new(Lane::start_on(scope, rank, "collectives", mode, streams.clone())),
                h2d: (self.stage() == 3).then(|| Arc::new(Lane::start_on(scope, rank, "h2d", mode, streams))),
                aborts: [self.comms.reduce.clone(), self.comms.gather.clone()],
            };
            let buffers = self.grads.lend_chunk_buffers();
            self.grads.reduce_on(
                Reducer::new(
                    lanes.collectives.clone(),
                    self.comms.reduce.clone(),
                    self.tracks.reduce.clone(),
                    buffers,
                ),
                self.plan.zero.overlap_comm,
            );
            // a panic must not leave a handle on a lane: the scope would wait for its
            // thread forever instead of letting the panic reach the trainer
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.each_micro_batch(Some(&lanes), step, loss_scale)
            }));
            match &result {
                Ok(Err(e)) => lanes.abort(&e.to_string()),
                Err(_) => lanes.abort(&format!("rank {rank} panicked")),
                Ok(Ok(_)) => {}
            }
            // every handle on the lanes goes before the scope joins their threads
            drop(lanes);
            let stopped = self.grads.stop_reducing();
            let loss = result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            stopped.map(|()| loss)
        })
    }

    fn each_micro_batch(
        &mut self,
        lanes: Option<&StepLanes<'a, C>>,
        step: u64,
        loss_scale: f64,
    ) -> Result<f64, EngineError> {
        let world = self.comms.main.world();
        let micro_batches = self.plan.batch.gradient_accumulation_steps;
        if self.plan.train.layered_accumulation {
            // one pass over the units for every micro-batch
            self.grads.begin_micro_batch(true, true);
            let loss = self.prefetched(lanes, |engine, prefetcher| {
                engine.layered(prefetcher, step, loss_scale)
            })?;
            self.grads.absorb(true)?;
            return Ok(loss);
        }
        let mut loss = 0.0;
        for micro in 0..micro_batches {
            let global_micro = (micro * world + self.site.rank) as u64;
            self.grads
                .begin_micro_batch(micro == 0, micro + 1 == micro_batches);
            loss += self.prefetched(lanes, |engine, prefetcher| {
                engine.micro_batch(prefetcher, step, global_micro, loss_scale)
            })?;
        }
        self.grads.absorb(true)?;
        Ok(loss)
    }

    /// Runs `f` with a stage-3 prefetcher on the step's lanes (none without lanes or below
    /// stage 3), whose gather buffers come back afterwards; where `f` fails, the lanes are
    /// aborted first (a gather may wait for a peer).
    fn prefetched<T>(
        &mut self,
        lanes: Option<&StepLanes<'a, C>>,
        f: impl FnOnce(&mut Self, Option<&mut Prefetcher<'a, C>>) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let mut prefetcher = lanes.and_then(|lanes| self.prefetcher(lanes));
        let result = f(self, prefetcher.as_mut());
        if let Some(prefetcher) = prefetcher {
            if let (Err(e), Some(lanes)) = (&result, lanes) {
                lanes.abort(&e.to_string());
            }
            self.units.return_gather_buffers(prefetcher.finish());
        }
        result
    }

    /// A micro-batch's stage-3 prefetcher on the step's lanes (None below stage 3).
    fn prefetcher(&mut self, lanes: &StepLanes<'a, C>) -> Option<Prefetcher<'a, C>> {
        let h2d = lanes.h2d.clone()?;
        let threshold = self.plan.zero.param_persistence_threshold;
        let parts = self.units.parts();
        let mut order = crate::plan::rules::unit_schedule(self.plan);
        // a pending update invalidates every cached unit before its use, so while one is
        // pending every unit is fetched
        let pending = self.optimizer.any_pending();
        order.retain(|&(u, _)| pending || self.units.persistent(u).is_none());
        let numels: Vec<usize> = parts.iter().map(|p| p.numel).collect();
        let fetches = Fetches::new(
            order,
            &numels,
            |u| numels[u] <= threshold,
            self.plan.zero.max_reuse_distance,
        );
        let fetcher = Fetcher {
            comm: self.comms.gather.clone(),
            rank: self.site.rank,
            precision: self.plan.precision,
            kind: self.model.kind,
            compute: self.site.compute,
            parts,
            gather_track: self.tracks.prefetch.clone(),
            h2d_track: self.tracks.h2d.clone(),
            dropped: self.lanes.dropped,
            streams: self.site.streams.clone(),
            pinned: crate::plan::rules::pinned_params(self.plan),
        };
        let limits = Limits {
            bucket: self.plan.zero.prefetch_bucket_size,
            max_live: self.plan.zero.max_live_parameters,
            persistence_threshold: threshold,
        };
        Some(Prefetcher::new(
            fetches,
            self.plan.precision.bytes(),
            limits,
            self.site.device.clone(),
            self.tracks.compute.clone(),
            self.units.lend_gather_buffers(self.lanes.mode),
            FetchLanes {
                h2d,
                gather: lanes.collectives.clone(),
            },
            fetcher,
        ))
    }
}
