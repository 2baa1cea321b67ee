//! The simulated optimizer thread: every unit's AdamW in forward order from the end of
//! the step, with its state read from and written to its tier, and the new parameters
//! sent back to theirs.

use super::super::clock::Track;
use super::super::costs::{Costs, Work as Cost};
use super::{round_4k, Replay};
use crate::plan::rules;
use crate::plan::Tier;

impl Replay<'_> {
    /// The optimizer thread: every unit in forward order, from the end of the step.
    pub(super) fn optimizer(&mut self) {
        let start = self.clocks.mark(Track::Compute);
        self.clocks.wait(Track::Optimizer, start);
        let (read_gb_s, write_gb_s, adam) = self.costs.shared();
        let opt = &self.plan.zero.offload_optimizer;
        let swap_chunk = self.swap_chunk() as u64;
        let stored_grads = rules::stored_gradients(self.plan);
        let accumulator = if rules::bf16_gradients(self.plan) { 2 } else { 4 };
        let pipelined = (opt.pipeline_read || opt.pipeline_write) && rules::pipeline_sets(self.plan) >= 2;
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
                    let n = len.div_ceil(swap_chunk);
                    let states = 3 * round_4k(swap_chunk * 4);
                    let read_bytes = states
                        + if stored {
                            round_4k(swap_chunk * accumulator)
                        } else {
                            0
                        };
                    let (r, w) = (
                        Costs::seconds_at(read_bytes, read_gb_s),
                        Costs::seconds_at(states, write_gb_s),
                    );
                    let up = swap_chunk.min(len) as f64 / adam;
                    for i in 0..n {
                        // serial read → update → write per sub-group, or a pipeline whose
                        // slowest stage sets the pace after the first sub-group
                        let (rr, uu, ww) = if pipelined && i > 0 {
                            let slowest = r.max(up).max(w);
                            (
                                if r == slowest { r } else { 0.0 },
                                if up == slowest { up } else { 0.0 },
                                if w == slowest { w } else { 0.0 },
                            )
                        } else {
                            (r, up, w)
                        };
                        self.clocks
                            .run(Track::Optimizer, "nvme_read", Some(u), rr, read_bytes);
                        self.clocks.run(Track::Optimizer, "optimizer", Some(u), uu, 0);
                        self.clocks
                            .run(Track::Optimizer, "nvme_write", Some(u), ww, states);
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
                    Costs::seconds_at(shard, write_gb_s),
                    shard,
                );
            }
            self.updated[u] = self.clocks.mark(Track::Optimizer);
            self.fresh[u] = true;
        }
    }
}
