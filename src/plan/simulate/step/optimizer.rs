//! The simulated optimizer thread: every unit's AdamW in forward order from the end of
//! the step, with its state read from and written to its tier, and the new parameters
//! sent back to theirs.

use super::super::clock::Track;
use super::super::costs::Work as Cost;
use super::{round_4k, Replay};
use crate::plan::rules;
use crate::plan::Tier;

impl Replay<'_> {
    /// The optimizer thread: every unit in forward order, from the end of the step.
    pub(super) fn optimizer(&mut self) {
        let start = self.clocks.mark(Track::Compute);
        self.clocks.wait(Track::Optimizer, start);
        let opt = &self.plan.zero.offload_optimizer;
        let swap_chunk = self.swap_chunk() as u64;
        let stored_grads = rules::stored_gradients(self.plan);
        let accumulator = if rules::bf16_gradients(self.plan) { 2 } else { 4 };
        // the step's stored gradients are consumed here
        self.stored.fill(false);
        for (u, stored) in stored_grads.into_iter().enumerate() {
            let len = self.optimizer_len(u);
            match self.optimizer_tiers[u] {
                Tier::Device if rules::device_accumulation(self.plan) => {
                    // fused AdamW on the step's gradient sum, already on the device; the
                    // span counts the 16 bytes of state the engine's optimizer span counts
                    let seconds = self.costs.seconds(Cost::DeviceAdamOnly(len));
                    self.clocks
                        .run(Track::Optimizer, "optimizer", Some(u), seconds, 16 * len);
                }
                Tier::Device => {
                    // the host accumulator to the device, then fused AdamW there
                    let grads = len * 4;
                    let seconds = self.costs.seconds(Cost::DeviceAdam(len));
                    self.clocks
                        .run(Track::Optimizer, "optimizer", Some(u), seconds, 16 * len);
                    self.pcie[0] += if self.cuda() { grads } else { 0 };
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
                    // the pipeline's sub-groups (`engine/optimize.rs`, `LegClock`): a read
                    // waits for a free buffer set and, without pipeline_read, for the last
                    // update (and its writes without pipeline_write); an update for its read
                    // and, without pipeline_write, the last write; a write for its update
                    let (sets, start) = (
                        rules::pipeline_sets(self.plan).max(1),
                        self.clocks.now(Track::Optimizer),
                    );
                    let at = |v: &[f64], i: usize, back: usize| {
                        i.checked_sub(back)
                            .and_then(|j| v.get(j).copied())
                            .unwrap_or(start)
                    };
                    let (mut reads, mut updates, mut writes) = (Vec::new(), Vec::new(), Vec::new());
                    for i in 0..len.div_ceil(swap_chunk) as usize {
                        let elements = swap_chunk.min(len - i as u64 * swap_chunk);
                        // what the disk moves: each state's chunk (and the stored
                        // gradient's) padded to the O_DIRECT alignment, as the store does
                        let states = 3 * round_4k(elements * 4);
                        let read_bytes = states
                            + if stored {
                                round_4k(elements * accumulator)
                            } else {
                                0
                            };
                        let mut ready = at(&writes, i, sets).max(at(&reads, i, 1));
                        if !opt.pipeline_read {
                            ready = ready.max(at(&updates, i, 1));
                            if !opt.pipeline_write {
                                ready = ready.max(at(&writes, i, 1));
                            }
                        }
                        let end = ready + self.costs.seconds(Cost::NvmeRead(read_bytes));
                        self.clocks
                            .place(Track::Optimizer, ("nvme_read", Some(u)), (ready, end), read_bytes);
                        reads.push(end);
                        let mut ready = end.max(at(&updates, i, 1));
                        if !opt.pipeline_write {
                            ready = ready.max(at(&writes, i, 1));
                        }
                        let end = ready + self.costs.seconds(Cost::Adam(elements));
                        self.clocks.place(
                            Track::Optimizer,
                            ("optimizer", Some(u)),
                            (ready, end),
                            16 * elements,
                        );
                        updates.push(end);
                        let ready = end.max(at(&writes, i, 1));
                        let end = ready + self.costs.seconds(Cost::NvmeWrite(states));
                        self.clocks
                            .place(Track::Optimizer, ("nvme_write", Some(u)), (ready, end), states);
                        writes.push(end);
                    }
                }
            }
            // the new parameters back to their tier
            let shard = self.parts[u].shard as u64 * self.p();
            if self.param_tiers[u] == Tier::Nvme && self.stage() == 3 {
                self.clocks.run(
                    Track::Optimizer,
                    "nvme_write",
                    Some(u),
                    self.costs.seconds(Cost::NvmeWrite(shard)),
                    shard,
                );
            }
            self.updated[u] = self.clocks.mark(Track::Optimizer);
            self.fresh[u] = true;
        }
    }
}
