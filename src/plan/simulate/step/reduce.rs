//! The simulated gradient path: each gradient's reduction (stages 2–3: pack,
//! reduce-scatter, widen and copy to the host, the host add, the NVMe read-modify-write
//! where gradients live there; stages 0–1: the copy to the host accumulator), and the
//! step's all-reduces and gradient norm after the micro-batches.

use super::super::clock::{Mark, Track};
use super::super::costs::{Costs, Work as Cost};
use super::{round_4k, Replay};
use crate::plan::rules;

impl Replay<'_> {
    /// `accumulate(u)`: the gradient's reduction on the collectives lane (stages 2–3),
    /// or its copy to the host accumulator on the compute thread (stages 0–1).
    /// `more`: another contribution to the unit follows in this micro-batch (the tied
    /// head's precedes the embedding's).
    pub(super) fn accumulate(&mut self, u: usize, more: bool) {
        let part = self.parts[u];
        let wire = self.plan.communication.kind().elt_size_in_bytes() as u64;
        if self.stage() < 2 && self.kept[u] {
            // a replica's gradient that stays on the device: added into its sum there,
            // stretch by stretch, in the compute thread
            let chunk = rules::chunk_elements(self.plan) as u64;
            let padded = part.padded as u64;
            for start in (0..padded).step_by(chunk.max(1) as usize) {
                let add = self.costs.seconds(Cost::OnDevice(4 * chunk.min(padded - start)));
                self.clocks.run(Track::Compute, "device_add", Some(u), add, 0);
            }
            return;
        }
        if self.stage() < 2 && self.cuda() {
            // to the host accumulator, in the compute thread: stretch by stretch in the
            // training precision (a layered step's fp32 sum) through the pinned staging,
            // widened as they are added
            let chunk = rules::chunk_elements(self.plan) as u64;
            let padded = part.padded as u64;
            let mut staged = None;
            for start in (0..padded).step_by(chunk.max(1) as usize) {
                let k = chunk.min(padded - start);
                self.stage_out(
                    Track::Compute,
                    ("d2h", u),
                    (k, self.gradient_bytes()),
                    &mut staged,
                );
            }
            self.land(Track::Compute, u, staged);
            return;
        }
        if self.stage() < 2 {
            // to the host accumulator as fp32, in the compute thread, which reads the
            // values where they are on a CPU device (counted, no copy: engine/reduce.rs)
            let bytes = part.padded as u64 * 4;
            self.clocks.run(Track::Compute, "d2h", Some(u), 0.0, bytes);
            self.clocks.run(
                Track::Compute,
                "host_add",
                Some(u),
                Costs::seconds_at(
                    bytes,
                    self.costs
                        .host_add_rate((rules::chunk_elements(self.plan) as u64).min(part.padded as u64)),
                ),
                0,
            );
            return;
        }
        // at most `rules::reduce_depth` reductions in flight: compute waits for the oldest
        while self.reducing.len() >= rules::reduce_depth(self.plan) {
            let oldest = self.reducing.remove(0);
            self.clocks.wait(Track::Compute, oldest);
        }
        let issued = self.clocks.mark(Track::Compute);
        self.clocks.wait(Track::Collectives, issued);
        let world = self.world() as u64;
        let stretch = (rules::chunk_elements(self.plan) as u64 / world).max(1);
        let shard = part.shard as u64;
        let chunks = shard.div_ceil(stretch);
        let nvme = self.stored_gradients[u];
        let swap_chunk = self.swap_chunk() as u64;
        let accumulator = self.stored_element();
        // gradient accumulation on the device: each stretch is added there, and only the
        // step's last contribution leaves for the host (`rules::device_sums`), none of a
        // gradient that stays there (`rules::gradients_on_device`)
        let on_device = self.device_sums[u];
        let to_host = !on_device || (self.last_micro && !more && !self.kept[u]);
        let mut staged = None;
        for chunk in 0..chunks {
            let k = stretch.min(shard - chunk * stretch);
            let out = 4 * k;
            if world > 1 {
                let bucket = wire * world * k;
                let pack = self.costs.seconds(Cost::OnDevice(bucket));
                self.clocks.run(Track::Collectives, "d2h", Some(u), pack, bucket);
                let rs = self.costs.seconds(Cost::Collective(bucket));
                self.clocks
                    .meet(Track::Collectives, ("reduce", Some(u)), rs, bucket);
            }
            if on_device {
                let add = self.costs.seconds(Cost::OnDevice(out));
                self.clocks.run(Track::Collectives, "device_add", Some(u), add, 0);
            }
            if !to_host {
                continue;
            }
            // to the host: with one rank the stretch straight from the gradient, else the
            // reduced stretch, which only a GPU copies; from a GPU in one DMA copy into
            // pinned memory in the kind it has there (a device sum fp32, a gradient in the
            // training precision, a reduced stretch in the communication type; reduce.rs,
            // `host_values`); then the add, widening 16-bit values as it reads them
            let kind = match (on_device, world) {
                (true, _) => 4,
                (false, 1) => self.gradient_bytes(),
                (false, _) => wire,
            };
            if self.cuda() {
                let name = if world == 1 { "d2h" } else { "copy_out" };
                self.stage_out(Track::Collectives, (name, u), (k, kind), &mut staged);
                continue;
            }
            // on a CPU device the add reads the values where they are (engine/reduce.rs:
            // with one rank counted as a copy out, which takes no time)
            if world == 1 {
                self.clocks.run(Track::Collectives, "d2h", Some(u), 0.0, 4 * k);
            }
            let add = self.costs.seconds(Cost::HostAdd(k));
            self.clocks.run(Track::Collectives, "host_add", Some(u), add, 0);
        }
        self.land(Track::Collectives, u, staged);
        if nvme && to_host {
            // the gradient's swap chunks, one at a time on the lane thread: each read
            // back (once a reduction of the step has stored some) and written
            let elements = self.optimizer_len(u);
            let stored = std::mem::replace(&mut self.stored[u], true);
            for c in 0..elements.div_ceil(swap_chunk) {
                let bytes = round_4k(swap_chunk.min(elements - c * swap_chunk) * accumulator);
                if stored {
                    let read = self.costs.transfer(Cost::NvmeRead(bytes));
                    self.clocks
                        .run_on_disk(Track::Collectives, ("nvme_read", Some(u)), read, bytes);
                }
                let write = self.costs.transfer(Cost::NvmeWrite(bytes));
                self.clocks
                    .run_on_disk(Track::Collectives, ("nvme_write", Some(u)), write, bytes);
            }
        }
        let done = self.clocks.mark(Track::Collectives);
        if self.plan.zero.overlap_comm {
            self.reducing.push(done);
        } else {
            self.clocks.wait(Track::Compute, done);
        }
    }

    /// A GPU's stretch of `k` elements of `kind` bytes leaving from `track`'s thread
    /// through the pinned staging (engine/staging.rs): its copy on the copy engine once
    /// queued, then the add of the stretch staged before it (`staged`), once that one's
    /// copy is in.
    fn stage_out(
        &mut self,
        track: Track,
        (name, u): (&'static str, usize),
        (k, kind): (u64, u64),
        staged: &mut Option<(Mark, u64)>,
    ) {
        let (copy, crossing) = self.to_host(k, kind);
        self.pcie[1] += crossing;
        let queued = self.clocks.mark(track);
        self.clocks.wait(Track::D2h, queued);
        let landed = self.clocks.run(Track::D2h, name, Some(u), copy, crossing);
        let before = staged.replace((landed, k));
        self.land(track, u, before);
    }

    /// The add of a staged stretch on `track`'s thread once its copy is in (with the
    /// thread's wake-up when it waits for it).
    fn land(&mut self, track: Track, u: usize, staged: Option<(Mark, u64)>) {
        let Some((landed, k)) = staged else {
            return;
        };
        if landed.at > self.clocks.now(track) {
            let woken = Mark {
                at: landed.at + self.costs.d2h_wait(),
                track: Track::D2h,
                peers: landed.peers,
            };
            self.clocks.wait(track, woken);
        }
        let add = self.costs.seconds(Cost::HostAdd(k));
        self.clocks.run(track, "host_add", Some(u), add, 0);
    }

    /// Seconds and bytes of `elements` reaching the host from a GPU tensor of `kind`
    /// bytes per element: one DMA copy into pinned memory in its own kind (reduce.rs,
    /// `host_values`).
    fn to_host(&self, elements: u64, kind: u64) -> (f64, u64) {
        let crossing = kind * elements;
        (self.costs.seconds(Cost::D2h(crossing)), crossing)
    }

    /// Elements per swap chunk: the store's rule over the largest optimizer partition,
    /// rounded up to whole 4 KiB pages of elements as the store rounds it.
    pub(super) fn swap_chunk(&self) -> usize {
        rules::optimizer_swap_chunk(self.plan).div_ceil(4096) * 4096
    }

    /// The step's all-reduces and the gradient norm, on the compute thread.
    pub(super) fn after_micro_batches(&mut self) {
        let mut seconds = 0.0;
        if self.stage() < 2 && self.world() > 1 {
            // stages 0–1: an fp32 all-reduce of each unit's gradient (a ring moves the
            // buffer twice)
            for p in &self.parts {
                seconds += 2.0 * self.costs.seconds(Cost::Collective(p.padded as u64 * 4));
            }
        }
        if self.world() > 1 {
            // the losses' all-reduce, and from stage 1 on the norm's
            let calls = if self.stage() >= 1 { 2.0 } else { 1.0 };
            seconds += calls * self.costs.seconds(Cost::Latency);
        }
        let stored = &self.stored_gradients;
        let shards: Vec<usize> = self.parts.iter().map(|p| p.shard).collect();
        let squared = rules::squares_as_added(self.plan, &shards);
        let kept = &self.kept;
        let passed = |u: usize| !stored[u] && !squared[u] && !kept[u];
        if (0..stored.len()).any(passed) {
            // Σ g²: a pass over every accumulator in memory whose sum was not gathered as
            // its last contribution was added, on every core
            let elements: u64 = (0..self.parts.len())
                .filter(|&u| passed(u))
                .map(|u| self.optimizer_len(u))
                .sum();
            seconds += self.costs.seconds(Cost::Pass(elements));
        }
        for u in (0..self.parts.len()).filter(|&u| kept[u]) {
            // a gradient that stayed on the device: its Σ g² taken there
            seconds += self.costs.seconds(Cost::OnDevice(4 * self.optimizer_len(u)));
        }
        if self.world() > 1 {
            self.clocks.meet(Track::Compute, ("reduce", None), seconds, 0);
        } else {
            self.clocks.run(Track::Compute, "reduce", None, seconds, 0);
        }
        // install_all: every update of the last step is in before this step's goes out
        for u in 0..self.parts.len() {
            self.install(u);
        }
    }
}
