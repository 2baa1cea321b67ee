//! The simulated optimizer thread: every unit's AdamW in forward order from the end of
//! the step, with its state read from and written to its tier, and the new parameters
//! sent back to theirs.

use super::super::clock::{Mark, Track};
use super::super::costs::Work as Cost;
use super::super::disk::{next_read_ready, schedule, Legs};
use super::{round_4k, Replay};
use crate::plan::rules;
use crate::plan::Tier;

/// The optimizer thread's run over one step's units, placed unit by unit as the next
/// step's work meets it (see [`Replay::update_until`]).
pub(super) struct Updates {
    /// The next unit to update.
    next: usize,
    held: HeldCopies,
}

impl Replay<'_> {
    /// The optimizer thread: every unit in forward order, from the end of the step. Its
    /// units are placed as the next step meets them: a unit before compute waits for its
    /// update, and each unit that started before another track submits an NVMe transfer
    /// before that transfer, so the rank's one disk serves the two unit by unit in the
    /// order the machine's queue receives them (the next forward's parameter reads
    /// between the updates, not after all of them; a run that started before a read
    /// takes the disk whole before it, where the machine would queue the read behind
    /// the run's next sub-group).
    pub(super) fn optimizer(&mut self) {
        self.update_through(usize::MAX);
        let start = self.clocks.mark(Track::Compute);
        self.clocks.wait(Track::Optimizer, start);
        // the step's stored gradients are consumed here
        self.stored.fill(false);
        self.fresh.fill(true);
        self.aheads.clear();
        self.place_aheads(rules::read_ahead_sets(self.plan));
        self.updates = Some(Updates {
            next: 0,
            held: HeldCopies::default(),
        });
    }

    /// Places the updates of every unit up to `u` not placed yet.
    pub(super) fn update_through(&mut self, u: usize) {
        while self.updates.as_ref().is_some_and(|r| r.next <= u) {
            self.update_next();
        }
    }

    /// Places the updates that start before `t` (the optimizer thread reaches them by
    /// then), before a transfer another track submits at `t` takes its turn on the disk.
    pub(super) fn update_until(&mut self, t: f64) {
        while self.updates.is_some() && self.clocks.now(Track::Optimizer) < t {
            self.update_next();
        }
    }

    /// Places the next unit's update (the last one ends the run).
    fn update_next(&mut self) {
        let Some(mut run) = self.updates.take() else {
            return;
        };
        let u = run.next;
        self.update(u, &mut run);
        run.next += 1;
        if run.next < self.parts.len() {
            self.updates = Some(run);
        }
    }

    /// Unit `u`'s update on the optimizer thread.
    fn update(&mut self, u: usize, run: &mut Updates) {
        let swap_chunk = self.swap_chunk() as u64;
        let (stored, accumulator) = (self.stored_gradients[u], self.stored_element());
        let held = &mut run.held;
        let units = self.parts.len();
        let len = self.optimizer_len(u);
        // a sum held on the device for an update off it: its copy queued (the next
        // unit's beside this update, where it is the host's), then waited for
        self.queue_held(u, held);
        if u + 1 < units && self.optimizer_tiers[u] != Tier::Device {
            self.queue_held(u + 1, held);
        }
        if let Some(i) = held.queued.iter().position(|q| q.0 == u) {
            let (_, landed) = held.queued.remove(i);
            if landed > self.clocks.now(Track::Optimizer) {
                let woken = Mark::at(landed + self.costs.d2h_wait(), Track::D2h);
                self.clocks.wait(Track::Optimizer, woken);
            }
        }
        match self.optimizer_tiers[u] {
            Tier::Device => {
                // fused AdamW on the step's gradient sum, already on the device, or
                // on the host accumulator sent there; the span counts the 16 bytes of
                // state the engine's optimizer span counts
                let cost = if self.device_sums[u] {
                    Cost::DeviceAdamOnly(len)
                } else {
                    self.pcie[0] += if self.cuda() { len * 4 } else { 0 };
                    Cost::DeviceAdam(len)
                };
                let seconds = self.costs.seconds(cost);
                self.clocks
                    .run(Track::Optimizer, "optimizer", Some(u), seconds, 16 * len);
                if self.param_tiers[u] != Tier::Device {
                    // the new values out to the parameters' host buffer: pageable,
                    // but pinned where stage 0 or 3 updates a pinned unit's own buffer
                    let bytes = len * self.p();
                    let cost = if self.pinned[u] && matches!(self.stage(), 0 | 3) {
                        Cost::D2h(bytes)
                    } else {
                        Cost::D2hPageable(bytes)
                    };
                    let out = self.costs.seconds(cost);
                    self.clocks.run(Track::Optimizer, "d2h", Some(u), out, bytes);
                    self.pcie[1] += if self.cuda() { bytes } else { 0 };
                }
            }
            Tier::Cpu => {
                self.clocks.run(
                    Track::Optimizer,
                    "optimizer",
                    Some(u),
                    self.costs.seconds(Cost::Adam(len)),
                    16 * len,
                );
            }
            Tier::Nvme => {
                // the pipeline's sub-groups on one disk (`disk::schedule`, as the
                // simulated device's `LegClock` times them); the first sub-groups'
                // state read ahead since the backward's start, as many as the
                // pipeline has buffer sets where the backward moves nothing on the
                // disk, else one (`rules::read_ahead_sets`; placed on the disk as the
                // thread starts, kept for the runs that use them), or the first one's
                // by the update before, which placed it (`done_ahead`)
                let start = self.clocks.now(Track::Optimizer) + self.costs.pipeline_overhead();
                let how = rules::pipeline(self.plan);
                let done_ahead = self.done_ahead.take();
                let mut ends = Vec::new();
                let mut legs = Vec::new();
                let mut bytes = Vec::new();
                for i in 0..len.div_ceil(swap_chunk) {
                    let elements = swap_chunk.min(len - i * swap_chunk);
                    // what the disk moves: each state's chunk (and the stored
                    // gradient's) padded to the O_DIRECT alignment, as the store does
                    let states = 3 * round_4k(elements * 4);
                    let grad = if stored {
                        round_4k(elements * accumulator)
                    } else {
                        0
                    };
                    let early = match self.aheads.front() {
                        Some(&(unit, chunk, end)) if (unit, chunk as u64) == (u, i) => {
                            self.aheads.pop_front();
                            Some(end)
                        }
                        _ if i == 0 => done_ahead,
                        _ => None,
                    };
                    let read = match early.filter(|_| ends.len() == i as usize) {
                        Some(end) => {
                            ends.push(end);
                            grad
                        }
                        None => states + grad,
                    };
                    legs.push(Legs {
                        read: self.costs.transfer(Cost::NvmeRead(read)),
                        update: self.costs.seconds(Cost::AdamSummed(elements)),
                        write: self.costs.transfer(Cost::NvmeWrite(states)),
                    });
                    bytes.push((read, 16 * elements, states));
                }
                let next_len = if u + 1 < units {
                    self.optimizer_len(u + 1)
                } else {
                    0
                };
                // none where the next unit's state was read ahead with this one's
                let next_bytes = (how.pipeline_read
                    && next_len > 0
                    && self.optimizer_tiers[u + 1] == Tier::Nvme
                    && self.aheads.is_empty())
                .then(|| 3 * round_4k(swap_chunk.min(next_len) * 4));
                let disk = self.clocks.disk(Track::Optimizer);
                let lane = Track::Optimizer.index();
                let timed = schedule(start, &legs, how, (&mut *disk, lane), &ends);
                // the next unit's first state, read ahead once this run's reads are
                // submitted and a buffer set is free, after this run's legs on the
                // disk (`pipeline::nvme_adam_step_then`)
                let next = next_bytes.map(|bytes| {
                    let ready = next_read_ready(start, &timed, how);
                    (disk.take(ready, self.costs.read_ahead(bytes), lane), bytes)
                });
                if let Some((turn, bytes)) = next {
                    self.clocks
                        .beside(Track::Optimizer, ("nvme_read", Some(u + 1)), turn, bytes);
                    self.done_ahead = Some(turn.own.1);
                }
                for (t, (read, update, write)) in timed.into_iter().zip(bytes) {
                    let track = Track::Optimizer;
                    self.clocks
                        .place_turn(track, ("nvme_read", Some(u)), t.read_turn(), read);
                    self.clocks.place(track, ("optimizer", Some(u)), t.update, update);
                    self.clocks
                        .place_turn(track, ("nvme_write", Some(u)), t.write_turn(), write);
                }
            }
        }
        // the new parameters back to their tier: parameters on the device updated off
        // it copied there from the thread's buffer (`engine/update_copies.rs`)
        if self.param_tiers[u] == Tier::Device && self.optimizer_tiers[u] != Tier::Device {
            let bytes = len * self.p();
            let seconds = self.costs.seconds(Cost::H2d(bytes));
            self.clocks.run(Track::Optimizer, "h2d", Some(u), seconds, bytes);
            self.pcie[0] += if self.cuda() { bytes } else { 0 };
        }
        let shard = self.parts[u].shard as u64 * self.p();
        if self.param_tiers[u] == Tier::Nvme && self.stage() == 3 {
            self.clocks.run_on_disk(
                Track::Optimizer,
                ("nvme_write", Some(u)),
                self.costs.transfer(Cost::NvmeWrite(shard)),
                shard,
            );
        }
        self.updated[u] = self.clocks.mark(Track::Optimizer);
    }
}

impl Replay<'_> {
    /// The reads of the first `sets` sub-groups of NVMe state in the updates' order (the
    /// leading units' whose state is on NVMe, up to the first that is not or holds
    /// nothing: `Optimizer::read_first_ahead`), submitted when the backward started: on
    /// the disk from then, one after another, placed as the thread starts. Queues each
    /// (unit, chunk, end) for the run that uses it. The thread does not wait for them
    /// (its update of each does).
    fn place_aheads(&mut self, sets: usize) {
        let Some(at) = self.ahead_at.take() else {
            return;
        };
        let chunk = self.swap_chunk() as u64;
        let groups: Vec<(usize, usize, u64)> = (0..self.parts.len())
            .take_while(|&u| self.optimizer_tiers[u] == Tier::Nvme && self.optimizer_len(u) > 0)
            .flat_map(|u| {
                let len = self.optimizer_len(u);
                (0..len.div_ceil(chunk))
                    .map(move |i| (u, i as usize, 3 * round_4k(chunk.min(len - i * chunk) * 4)))
            })
            .take(sets.max(1))
            .collect();
        for (u, i, bytes) in groups {
            let read = self.costs.read_ahead(bytes);
            let turn = self
                .clocks
                .disk(Track::Optimizer)
                .take(at, read, Track::Optimizer.index());
            self.aheads.push_back((u, i, turn.own.1));
            self.clocks
                .beside(Track::Optimizer, ("nvme_read", Some(u)), turn, bytes);
            self.ahead_bytes += bytes;
        }
    }
}

/// The optimizer thread's copies of held sums out of a GPU (`engine/held.rs`): the units
/// queued (at most the one in use and the next) with when each copy is in, and when the
/// copy engine is free.
#[derive(Default)]
struct HeldCopies {
    queued: Vec<(usize, f64)>,
    free: f64,
}

impl Replay<'_> {
    /// Queues the copy of unit `u`'s sum where it is held on a GPU for an update off it
    /// (`rules::held_gradients`; a CPU device's is read in place) and not queued yet: on
    /// the copy engine from the later of the optimizer's time and the engine's last copy.
    fn queue_held(&mut self, u: usize, held: &mut HeldCopies) {
        let off_device = self.kept[u] && self.optimizer_tiers[u] != Tier::Device;
        if !off_device || !self.cuda() || held.queued.iter().any(|q| q.0 == u) || held.queued.len() >= 2 {
            return;
        }
        let bytes = 4 * self.optimizer_len(u);
        let start = self.clocks.now(Track::Optimizer).max(held.free);
        held.free = start + self.costs.seconds(Cost::D2h(bytes));
        self.clocks
            .place(Track::D2h, ("d2h", Some(u)), (start, held.free), bytes);
        self.pcie[1] += bytes;
        held.queued.push((u, held.free));
    }
}
