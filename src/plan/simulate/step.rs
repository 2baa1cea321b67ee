//! The simulated step: the engine's schedule of one rank, replayed on virtual clocks.
//!
//! It follows the engine as it is at this commit (`engine/micro_batch.rs`, `engine/step_lanes.rs`,
//! `engine/prefetch.rs`, `engine/reduce.rs`, `engine/optimize.rs`), piece by piece,
//! with the same fetch order and limits (`plan::fetch`, `plan::rules`) and the same
//! bytes: per micro-batch, forward units 0..last with each stage-3 unit fetched (h2d
//! from its tier, then the all-gather on the one collectives lane, at most two ahead
//! within the bucket; with one rank a shard on the device is used in place), the final
//! unit and head, then backward by recompute in reverse, each gradient reduced on the collectives lane in chunks (pack, reduce-scatter, widen
//! and copy to the host, a one-thread host add, the NVMe read-modify-write where
//! gradients live there), the lanes drained at the micro-batch's end; then the
//! step's all-reduces and serial `sum_squares`, and the optimizer thread over the units
//! in forward order, which the next step's fetch of each unit waits for (each unit's
//! update placed as the next step meets it, so the disk serves its transfers and the
//! next forward's parameter reads unit by unit in the order they are submitted). The issuing
//! thread and the compute stream are one track (`clock::Track::Compute`).
//!
//! The gradient path is `step/reduce.rs`, the optimizer thread `step/optimizer.rs`.
//! Three steps run; the third is reported, so the optimizer of the one before overlaps
//! its forward as in a steady-state run. When the engine changes its schedule, these
//! files change with it: the prediction tests (`tests/simulate.rs`) hold the two
//! together on the CPU.

use super::clock::{Clocks, Mark, Track};
use super::costs::{Costs, Work as Cost};
use super::profile::Work;
use crate::plan::fetch::{may_request, Fetches, Limits, Purpose};
use crate::plan::partition::Partition;
use crate::plan::rules;
use crate::plan::{Plan, Tier};

mod optimizer;
mod reduce;

/// What one rank's step costs, by track, in virtual seconds.
pub(super) struct Replay<'a> {
    plan: &'a Plan,
    /// The profile's price of each piece of work.
    costs: Costs,
    pub clocks: Clocks,
    parts: Vec<Partition>,
    /// Each unit's parameter tier (`rules::param_tiers`).
    param_tiers: Vec<Tier>,
    /// The units used where they are stored (`rules::in_place_units`).
    in_place: Vec<bool>,
    /// Whether each unit's parameters in host memory are pinned (`rules::pinned_params`).
    pinned: Vec<bool>,
    /// Each unit's optimizer-state tier (`rules::optimizer_tiers`).
    optimizer_tiers: Vec<Tier>,
    /// Which units sum their gradient on the device (`rules::device_sums`).
    device_sums: Vec<bool>,
    /// Which units' sums stay there until the optimizer reads them
    /// (`rules::held_gradients`).
    kept: Vec<bool>,
    /// Which units' gradients are summed in their NVMe swap chunks
    /// (`rules::stored_gradients`).
    stored_gradients: Vec<bool>,
    /// When each unit's update of the previous step is installed (the optimizer thread).
    updated: Vec<Mark>,
    /// Reductions in flight on the collectives lane (their end marks).
    reducing: Vec<Mark>,
    /// Bytes across PCIe this step, host → device and device → host.
    pub pcie: [u64; 2],
    /// Units whose update of the last step is not installed yet.
    fresh: Vec<bool>,
    /// Units with a gradient already in their NVMe swap chunks this step (a later
    /// reduction reads it back before adding; the first one only writes).
    stored: Vec<bool>,
    /// Whether the persistent units' gathered copies are held (from the first fetch on).
    cached: bool,
    /// Whether the micro-batch under way is the step's last.
    last_micro: bool,
    /// When this step's first backward through the blocks started (after the final
    /// unit's), where the first sub-groups of NVMe optimizer state are read ahead from
    /// (`Optimizer::read_first_ahead`).
    ahead_at: Option<f64>,
    /// Those sub-groups once placed on the disk, for the runs that use them: (unit,
    /// chunk, when the reads are in).
    aheads: std::collections::VecDeque<(usize, usize, f64)>,
    /// When the next unit's first sub-group of NVMe optimizer state, read ahead by the
    /// update before it, is in.
    done_ahead: Option<f64>,
    /// Whether the micro-batch under way is the step's first.
    first_micro: bool,
    /// The compute track's busy seconds in the forward of this step's first micro-batch
    /// (what the next step can run beside the optimizer; `simulate::floor`).
    pub first_forward: f64,
    /// The bytes of NVMe optimizer state read ahead this step, during the backward.
    pub ahead_bytes: u64,
    /// The last step's updates not placed yet (`step/optimizer.rs`).
    updates: Option<optimizer::Updates>,
}

impl<'a> Replay<'a> {
    pub fn new(plan: &'a Plan, costs: Costs) -> Replay<'a> {
        let world = plan.world_size;
        let parts: Vec<Partition> = plan
            .model
            .config
            .unit_numels()
            .into_iter()
            .map(|n| Partition::new(n, world))
            .collect();
        let updated = vec![Clocks::default().mark(Track::Optimizer); parts.len()];
        let parts_len = parts.len();
        Replay {
            plan,
            costs,
            clocks: Clocks::default(),
            parts,
            param_tiers: rules::param_tiers(plan),
            in_place: rules::in_place_units(plan),
            pinned: rules::pinned_params(plan),
            optimizer_tiers: rules::optimizer_tiers(plan),
            device_sums: rules::device_sums(plan),
            kept: rules::held_gradients(plan),
            stored_gradients: rules::stored_gradients(plan),
            updated,
            reducing: Vec::new(),
            pcie: [0, 0],
            fresh: vec![false; parts_len],
            stored: vec![false; parts_len],
            cached: false,
            last_micro: true,
            ahead_at: None,
            aheads: std::collections::VecDeque::new(),
            done_ahead: None,
            first_micro: true,
            first_forward: 0.0,
            ahead_bytes: 0,
            updates: None,
        }
    }

    fn cuda(&self) -> bool {
        self.costs.cuda()
    }

    fn stage(&self) -> u8 {
        self.plan.zero.stage
    }

    fn world(&self) -> usize {
        self.plan.world_size
    }

    /// Bytes per element of parameters and activations.
    fn p(&self) -> u64 {
        self.plan.precision.bytes() as u64
    }

    /// Bytes of an element of the gradient a unit's backward hands to its reduction: the
    /// training precision, or a layered step's fp32 sum over the micro-batches.
    fn gradient_bytes(&self) -> u64 {
        if self.plan.train.layered_accumulation {
            4
        } else {
            self.p()
        }
    }

    /// Bytes of an element of a gradient summed in NVMe swap chunks.
    fn stored_element(&self) -> u64 {
        if rules::stored_bf16(self.plan) {
            2
        } else {
            4
        }
    }

    /// Elements of a chunk of the NVMe parameter store (`run/stores.rs`: the swap chunk
    /// for the largest shard).
    fn param_chunk(&self) -> u64 {
        let largest = self.parts.iter().map(|p| p.shard).max().unwrap_or(1);
        rules::swap_chunk(self.plan, largest).max(1) as u64
    }

    /// Elements of unit `u`'s optimizer partition.
    fn optimizer_len(&self, u: usize) -> u64 {
        self.parts[u].optimizer_len(self.stage()) as u64
    }

    /// One full step: the micro-batches, the step's reductions, the optimizer.
    pub fn step(&mut self) -> f64 {
        let start = self.clocks.now(Track::Compute);
        self.pcie = [0, 0];
        // a layered step is one pass over the units for every micro-batch
        let micro_batches = rules::passes(self.plan);
        self.ahead_bytes = 0;
        for micro in 0..micro_batches {
            self.first_micro = micro == 0;
            self.last_micro = micro + 1 == micro_batches;
            self.micro_batch();
        }
        self.after_micro_batches();
        self.optimizer();
        self.clocks.now(Track::Compute) - start
    }

    /// Runs a piece of compute after `after`.
    fn compute(&mut self, u: usize, work: Work, after: Option<Mark>) {
        if let Some(m) = after {
            self.clocks.wait(Track::Compute, m);
        }
        let seconds = self.costs.seconds(match work {
            Work::Forward => Cost::Forward(u),
            Work::Backward => Cost::Backward(u),
            Work::Head => Cost::Head,
        });
        let phase = if work == Work::Forward {
            "forward"
        } else {
            "backward"
        };
        self.clocks.run(Track::Compute, phase, Some(u), seconds, 0);
    }

    /// `install_through(u)`: compute waits for unit `u`'s update of the last step (with,
    /// for parameters on the device, the optimizer thread's copy of it there).
    /// Returns whether there was an update to install.
    fn install(&mut self, u: usize) -> bool {
        if !self.fresh[u] {
            return false;
        }
        self.update_through(u);
        self.fresh[u] = false;
        let m = self.updated[u];
        self.clocks.wait(Track::Compute, m);
        true
    }

    /// Issues the fetch of unit `u` (stage 3): its shard to the device, then the
    /// all-gather on the collectives lane. Returns the gathered unit's mark.
    fn issue_fetch(&mut self, u: usize) -> Mark {
        self.install(u);
        let part = self.parts[u];
        let shard_bytes = part.shard as u64 * self.p();
        let issued = self.clocks.mark(Track::Compute);
        let mut ready = issued;
        match self.param_tiers[u] {
            Tier::Device => {}
            tier => {
                // the h2d lane: (NVMe: read chunk by chunk through a bounce buffer, one in
                // flight) then a memcpy into the pinned slot (a host shard's on every core;
                // none for a pinned host shard, copied in place) and the copy
                self.clocks.wait(Track::H2d, issued);
                if tier == Tier::Nvme {
                    // after the updates the optimizer thread started before it
                    self.update_until(self.clocks.now(Track::H2d));
                    // chunk by chunk, as the parameter store reads them: each chunk takes
                    // its turn on the disk beside the other tracks' transfers
                    // (the read is one transfer the lane waits for: the last chunk
                    // pays its latency, and the ranks take their turns at it whole)
                    let chunk = self.param_chunk() * self.p();
                    let mut pieces = Vec::new();
                    let mut left = shard_bytes;
                    while left > 0 {
                        let bytes = chunk.min(left);
                        let read = self.costs.transfer(Cost::NvmeRead(bytes));
                        pieces.push(if bytes < left { read.bytes_only() } else { read });
                        left -= bytes;
                    }
                    self.clocks
                        .run_pieces_on_disk(Track::H2d, ("nvme_read", Some(u)), &pieces, shard_bytes);
                    let bounce = self.costs.seconds(Cost::Fill {
                        bytes: shard_bytes,
                        parallel: false,
                    });
                    self.clocks.run(Track::H2d, "nvme_read", Some(u), bounce, 0);
                }
                if self.cuda() {
                    if !self.pinned[u] {
                        let memcpy = self.costs.seconds(Cost::Fill {
                            bytes: shard_bytes,
                            parallel: tier == Tier::Cpu,
                        });
                        self.clocks.run(Track::H2d, "staging", Some(u), memcpy, 0);
                    }
                    let copy = self.costs.seconds(Cost::H2d(shard_bytes));
                    self.pcie[0] += shard_bytes;
                    ready = self.clocks.run(Track::H2d, "h2d", Some(u), copy, shard_bytes);
                } else if tier == Tier::Cpu {
                    let memcpy = self.costs.seconds(Cost::H2d(shard_bytes));
                    ready = self.clocks.run(Track::H2d, "h2d", Some(u), memcpy, shard_bytes);
                } else {
                    ready = self.clocks.mark(Track::H2d);
                }
            }
        }
        if self.world() == 1 && self.param_tiers[u] != Tier::Device {
            return ready;
        }
        self.clocks.wait(Track::Collectives, issued);
        self.clocks.wait(Track::Collectives, ready);
        let bytes = part.padded as u64 * self.p();
        let seconds = self.costs.seconds(Cost::Gather(bytes));
        self.clocks
            .meet(Track::Collectives, ("all_gather", Some(u)), seconds, bytes)
    }

    /// The gradient of unit `u` added into its sum over a layered step's micro-batches
    /// on the compute device (`engine/layered.rs`).
    fn sum_on_device(&mut self, u: usize, elements: usize) {
        let add = self.costs.seconds(Cost::OnDevice(4 * elements as u64));
        self.clocks.run(Track::Compute, "device_add", Some(u), add, 0);
    }

    /// One micro-batch, or a layered step's micro-batches unit by unit: forward, the
    /// final unit, backward by recompute.
    fn micro_batch(&mut self) {
        let layers = rules::layers(self.plan) as usize;
        let units = self.parts.len();
        let last = units - 1;
        let c = &self.plan.model.config;
        let tied = c.tie_word_embeddings;
        let threshold = self.plan.zero.param_persistence_threshold;
        let parts = self.parts.clone();
        let persistent = |u: usize| parts[u].numel <= threshold;
        let stage3 = self.stage() == 3;
        let mut order = rules::unit_schedule(self.plan);
        // cached persistent units are not fetched again while no update is pending
        if self.cached && !self.fresh.iter().any(|&f| f) {
            order.retain(|&(u, _)| !persistent(u));
        }
        self.cached = true;
        let limits = Limits {
            bucket: self.plan.zero.prefetch_bucket_size,
            max_live: self.plan.zero.max_live_parameters,
            persistence_threshold: threshold,
        };
        let numels: Vec<usize> = parts.iter().map(|p| p.numel).collect();
        let fetches = Fetches::new(order, &numels, persistent, self.plan.zero.max_reuse_distance);
        let mut fetcher = Queue {
            order: fetches.order().into_iter().collect(),
            fetches,
            taken: 0,
            held: Vec::new(),
            outstanding: Vec::new(),
            limits,
        };
        // forward
        let spans = self.clocks.spans().len();
        for u in 0..last {
            let ready = if stage3 {
                self.next(&mut fetcher, u, 0)
            } else {
                self.replica(u)
            };
            self.compute(u, Work::Forward, ready);
            for _ in 1..layers {
                self.compute(u, Work::Forward, None);
            }
        }
        if self.first_micro {
            self.first_forward = self.clocks.spans()[spans..]
                .iter()
                .filter(|s| s.track == Track::Compute && s.waited_for.is_none())
                .map(|s| s.end - s.start)
                .sum();
        }
        // the final unit (and the tied embedding), its loss and backward
        let ready = if stage3 {
            // the tied embedding's elements, unless already held for it (units used in
            // place are not the prefetcher's)
            let fetched = |u: usize| if self.in_place[u] { 0 } else { parts[u].numel };
            let tied_in_use = tied && !fetcher.held.contains(&0);
            let in_use = fetched(last) + if tied_in_use { fetched(0) } else { 0 };
            let a = self.next(&mut fetcher, last, in_use);
            let b = tied.then(|| self.next(&mut fetcher, 0, in_use)).flatten();
            later(a, b)
        } else {
            self.replica(last)
        };
        if self.plan.train.layered_accumulation {
            // each micro-batch's head, its gradients summed; a tied embedding's share
            // joins the embedding's own sum in backward
            for m in 0..layers {
                self.compute(last, Work::Head, if m == 0 { ready } else { None });
                self.sum_on_device(last, parts[last].numel);
                if tied {
                    let shared = (c.vocab_size * c.hidden_size).min(parts[0].numel);
                    self.sum_on_device(0, shared);
                }
            }
            self.accumulate(last, false);
        } else {
            self.compute(last, Work::Head, ready);
            self.accumulate(last, false);
            if tied {
                // the embedding's own gradient follows in backward
                self.accumulate(0, true);
            }
        }
        // the blocks' backward starts: the first sub-groups of NVMe state are read from
        // here, once a step, where this rank holds some of that unit's state
        if self.ahead_at.is_none() && self.optimizer_tiers[0] == Tier::Nvme && self.optimizer_len(0) > 0 {
            self.ahead_at = Some(self.clocks.now(Track::Compute));
        }
        // backward in reverse by recompute
        for u in (0..last).rev() {
            let ready = if stage3 {
                self.next(&mut fetcher, u, 0)
            } else {
                self.replica(u)
            };
            self.compute(u, Work::Backward, ready);
            if self.plan.train.layered_accumulation {
                self.sum_on_device(u, parts[u].numel);
                for _ in 1..layers {
                    self.compute(u, Work::Backward, None);
                    self.sum_on_device(u, parts[u].numel);
                }
            }
            self.accumulate(u, false);
        }
        // the prefetcher's end: the lanes are drained before the next micro-batch
        if self.stage() >= 2 {
            let drained = later(
                Some(self.clocks.mark(Track::Collectives)),
                Some(self.clocks.mark(Track::H2d)),
            );
            if let Some(m) = drained {
                self.clocks.wait(Track::Compute, m);
            }
            self.reducing.clear();
        }
    }

    /// Stages 0–2: the replica is whole; an update is installed (and at stages 1–2
    /// all-gathered on the compute thread) at the unit's first use.
    fn replica(&mut self, u: usize) -> Option<Mark> {
        if self.install(u) && rules::gathers_updates(self.stage(), self.world()) {
            let bytes = self.parts[u].padded as u64 * self.p();
            let seconds = self.costs.seconds(Cost::Gather(bytes));
            self.clocks
                .meet(Track::Compute, ("all_gather", Some(u)), seconds, bytes);
        }
        None
    }

    /// The prefetcher's `next(u)`: issue what the limits allow, take the head of the
    /// queue (or the unit held since its previous use), issue more. Returns the mark
    /// compute waits for.
    fn next(&mut self, f: &mut Queue, u: usize, in_use: usize) -> Option<Mark> {
        if self.in_place[u] {
            // used where it is stored (`rules::in_place_units`): not the prefetcher's
            self.install(u);
            return None;
        }
        // a cached persistent unit's use is not among the prefetcher's
        let use_ = (f.fetches.uses.get(f.taken).map(|s| s.0) == Some(u)).then_some(f.taken);
        let fetched = use_.is_none_or(|k| f.fetches.fetched[k]);
        self.fill(f, fetched, in_use);
        let mark = if fetched {
            let head = f.outstanding.first().map(|(v, _, _)| *v);
            match head {
                Some(v) if v == u => Some(f.outstanding.remove(0).2),
                // a cached persistent unit: nothing to wait for
                _ => None,
            }
        } else {
            // gathered at its previous use: compute waited for it then
            f.held.retain(|&v| v != u);
            None
        };
        if let Some(k) = use_ {
            f.taken += 1;
            if f.fetches.keep[k] {
                f.held.push(u);
            }
        }
        self.fill(f, false, in_use);
        mark
    }

    fn fill(&mut self, f: &mut Queue, needed: bool, in_use: usize) {
        let held: usize = f.held.iter().map(|&v| self.parts[v].numel).sum();
        while let Some(&(v, _)) = f.order.front() {
            let numel = self.parts[v].numel;
            let outstanding_numel: usize = f.outstanding.iter().map(|(_, n, _)| n).sum();
            let ok = may_request(
                needed && f.outstanding.is_empty(),
                f.outstanding.len(),
                outstanding_numel,
                numel,
                in_use + held,
                f.limits,
            );
            if !ok {
                break;
            }
            f.order.pop_front();
            let mark = self.issue_fetch(v);
            f.outstanding.push((v, numel, mark));
        }
    }
}

/// The stage-3 prefetcher's queue: the micro-batch's uses, what is still to be fetched,
/// what is in flight and what is held for a later use.
struct Queue {
    fetches: Fetches,
    /// Uses taken so far.
    taken: usize,
    order: std::collections::VecDeque<(usize, Purpose)>,
    /// (unit, elements, gathered mark), oldest first.
    outstanding: Vec<(usize, usize, Mark)>,
    /// Units held since a use for their next (`stage3_max_reuse_distance`).
    held: Vec<usize>,
    limits: Limits,
}

/// The later of two marks, with every rank through both.
fn later(a: Option<Mark>, b: Option<Mark>) -> Option<Mark> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Mark {
            peers: a.peers.max(b.peers),
            ..if a.at >= b.at { a } else { b }
        }),
        (a, None) => a,
        (None, b) => b,
    }
}

fn round_4k(bytes: u64) -> u64 {
    bytes.div_ceil(4096) * 4096
}
