//! What each piece of a step's work costs on a profiled machine: one definition for the
//! replay of the schedule (`step.rs`, the dry run) and for the simulated device that
//! times the engine itself (`device/sim.rs`, with payload).
//!
//! A piece of work is a [`Work`]: a unit's forward or backward, the LM head, a copy of so
//! many bytes of a kind (pinned or pageable host → device, a fill of pinned staging,
//! device → host, on the device), a collective over the link, an NVMe read or write, a
//! host add, the CPU AdamW over so many elements. [`Costs::seconds`] turns it into
//! seconds with the profile's rates; the machine's NVMe and cores are shared by the
//! ranks of a process, all running the same schedule.

use super::flops;
use super::profile::{Figure, Profile, Shape, Work as Kernel};
use crate::plan::report::nvme_bytes;
use crate::plan::rules;
use crate::plan::Plan;

const GB: f64 = 1e9;

/// One piece of a step's work, as the simulated device is charged with it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Work {
    /// Unit `u`'s forward (not the final unit's).
    Forward(usize),
    /// Unit `u`'s backward: by recompute, or through kept activations where the plan
    /// keeps them; the embedding's is a dense gradient of its table.
    Backward(usize),
    /// The final unit: its norm, the LM head, the loss and their backward.
    Head,
    /// Bytes to the device by DMA from pinned memory (on a CPU device: a memcpy).
    H2d(u64),
    /// Bytes to the device from pageable memory (on a CPU device: a memcpy).
    H2dPageable(u64),
    /// A host memcpy into pinned staging, on every core or on one thread.
    Fill {
        bytes: u64,
        parallel: bool,
    },
    /// Bytes out of the device into pinned memory (on a CPU device: a memcpy).
    D2h(u64),
    /// Bytes out of the device into pageable memory (on a CPU device: a memcpy).
    D2hPageable(u64),
    /// A copy within device memory.
    OnDevice(u64),
    /// The host's fp32 add of `elements` into an accumulator.
    HostAdd(u64),
    /// A collective over the whole buffer of `bytes`.
    Collective(u64),
    /// An all-gather into a buffer of `bytes` (priced as any collective).
    Gather(u64),
    /// A collective of a few bytes: the link's latency.
    Latency,
    NvmeRead(u64),
    NvmeWrite(u64),
    /// The CPU AdamW over `elements`.
    Adam(u64),
    /// The NVMe pipeline's CPU AdamW over `elements`, summing the state it reads and
    /// writes as it passes it (those transfers' checksums).
    AdamSummed(u64),
    /// The host accumulator of `elements` to the device and torch's fused AdamW there.
    DeviceAdam(u64),
    /// Torch's fused AdamW over `elements` whose gradient is already on the device.
    DeviceAdamOnly(u64),
    /// A pass over `elements` fp32 values on every core (the gradient norm's Σ g²).
    Pass(u64),
}

impl Work {
    /// The unit it concerns, where it is one unit's compute.
    pub fn unit(self) -> Option<usize> {
        match self {
            Work::Forward(u) | Work::Backward(u) => Some(u),
            _ => None,
        }
    }

    /// The phase it is busy time of, as the trainer's breakdown names phases.
    pub fn phase(self) -> &'static str {
        match self {
            Work::Forward(_) => "forward",
            Work::Backward(_) | Work::Head => "backward",
            Work::H2d(_) | Work::H2dPageable(_) | Work::Fill { .. } => "h2d",
            Work::D2h(_) | Work::D2hPageable(_) | Work::OnDevice(_) | Work::HostAdd(_) => "d2h",
            Work::Collective(_) | Work::Latency | Work::Pass(_) => "reduce",
            Work::Gather(_) => "all_gather",
            Work::NvmeRead(_) => "nvme_read",
            Work::NvmeWrite(_) => "nvme_write",
            Work::Adam(_) | Work::AdamSummed(_) | Work::DeviceAdam(_) | Work::DeviceAdamOnly(_) => {
                "optimizer"
            }
        }
    }
}

/// An NVMe transfer on the profiled machine: the disk's time for its bytes, then what
/// the transfer takes beyond them (`nvme.latency`: its way back through the store's ring
/// threads), while the disk serves other transfers.
///
/// The ranks of a process take the disk in turn, each transfer whole (the drive's queue
/// serves them first come, first served): `disk` is the time all ranks' transfers of
/// the schedule's piece take together, and a rank's own bytes are in `others` of it
/// before that on average, the turns queued behind its own ((n − 1)/2n of n ranks', 0
/// for one rank) where the ranks submit together; in a turn, 1/n of it, after the disk
/// starts on them where they go a turn apart ([`Disk::take`](super::disk::Disk::take)).
/// Measured on a 2-rank run here: the ranks' parameter reads overlapped 0.07 s of 3.3 s,
/// and the rank whose read came first waited in the gather after it for the other's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Transfer {
    pub disk: f64,
    pub latency: f64,
    pub others: f64,
}

impl Transfer {
    pub fn seconds(self) -> f64 {
        self.disk + self.latency
    }

    /// The same transfer without its latency: a piece of a larger one whose latency
    /// the last piece pays.
    pub fn bytes_only(self) -> Transfer {
        Transfer { latency: 0.0, ..self }
    }

    /// The ranks taking their turns at the transfer: n of `others` = (n − 1)/2n.
    pub fn ranks(self) -> f64 {
        1.0 / (1.0 - 2.0 * self.others)
    }
}

/// The profile's rates for one plan.
#[derive(Clone, Debug)]
pub struct Costs {
    plan: Plan,
    profile: Profile,
    numels: Vec<usize>,
    /// The disk's (read, write) GB/s over files the size of the machine's swap files,
    /// looked up once: every NVMe piece of work is priced at them.
    disk: (f64, f64),
    /// Seconds an NVMe read, a write and a pipelined unit update take beyond their bytes
    /// (`nvme.latency`).
    nvme_latency: (f64, f64, f64),
    /// What an NVMe read and a write beside compute wait for a core, on average
    /// (`contention.rs`; none on a GPU): on top of their latency, except a read submitted
    /// ahead ([`Costs::read_ahead`]).
    nvme_wait: (f64, f64),
    /// Each unit's forward and backward (the final unit's: the head) time × these: 1
    /// (empty), or more on a CPU device where the lanes' host work takes cores from that
    /// piece of compute (`contention.rs`).
    compute_stretch: Vec<[f64; 2]>,
    /// The CPU AdamW's time × this: 1, or more where the lanes' host work beside its
    /// sweeps (the disk's own, first) takes cores from it (`contention.rs`).
    optimizer_stretch: f64,
}

impl Costs {
    pub fn new(plan: &Plan, profile: &Profile) -> Costs {
        Costs {
            plan: plan.clone(),
            profile: profile.clone(),
            numels: plan.model.config.unit_numels(),
            disk: profile.nvme.rates_for(nvme_bytes(plan)),
            nvme_latency: profile.nvme.latency.as_ref().map_or((0.0, 0.0, 0.0), |l| {
                (l.read_s.value, l.write_s.value, l.pipeline_s.value)
            }),
            nvme_wait: (0.0, 0.0),
            compute_stretch: Vec::new(),
            optimizer_stretch: 1.0,
        }
    }

    /// How much longer an NVMe read's and a write's latency is beside compute that holds
    /// the cores than on idle ones (`nvme.latency`; none where not measured).
    pub fn nvme_latency_beside_compute(&self) -> (f64, f64) {
        self.profile.nvme.latency.as_ref().map_or((0.0, 0.0), |l| {
            let extra = |idle: &Figure, beside: &Option<Figure>| {
                beside.as_ref().map_or(0.0, |b| (b.value - idle.value).max(0.0))
            };
            (
                extra(&l.read_s, &l.read_beside_compute_s),
                extra(&l.write_s, &l.write_beside_compute_s),
            )
        })
    }

    /// These prices with `wait` (read, write) seconds added to an NVMe read's latency
    /// and a write's: what those beside compute wait for a core, on average (not to a
    /// read submitted ahead, [`Costs::read_ahead`]).
    pub fn with_nvme_waits(self, wait: (f64, f64)) -> Costs {
        Costs {
            nvme_wait: wait,
            ..self
        }
    }

    /// These prices with unit u's forward `stretch[u][0]` times as long and its backward
    /// (the final unit's: the head) `stretch[u][1]` times.
    pub fn with_compute_stretch(self, stretch: Vec<[f64; 2]>) -> Costs {
        Costs {
            compute_stretch: stretch,
            ..self
        }
    }

    /// These prices with the CPU AdamW's sweeps `stretch` times as long.
    pub fn with_optimizer_stretch(self, stretch: f64) -> Costs {
        Costs {
            optimizer_stretch: stretch,
            ..self
        }
    }

    /// The machine's disk's (read, write) GB/s for its swap files, every rank's
    /// transfers together.
    pub fn disk_rates(&self) -> (f64, f64) {
        self.disk
    }

    /// How many times its time at the profile's rate unit u's forward (`slot` 0) or
    /// backward (1; the final unit's: the head) is priced.
    pub fn compute_stretch_of(&self, u: usize, slot: usize) -> f64 {
        self.compute_stretch.get(u).map_or(1.0, |s| s[slot])
    }

    /// How many times its time at the profile's rate the CPU AdamW is priced.
    pub fn optimizer_stretch(&self) -> f64 {
        self.optimizer_stretch
    }

    /// The ranks of a process, which share its disk and cores.
    pub fn ranks(&self) -> f64 {
        self.plan.train.devices.max(1) as f64
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The training precision's name (the profile's rates and peaks are by it).
    pub fn precision(&self) -> &'static str {
        self.plan.precision.name()
    }

    pub fn cuda(&self) -> bool {
        !self.profile.is_cpu()
    }

    pub fn seconds_at(bytes: u64, gb_s: f64) -> f64 {
        bytes as f64 / (gb_s * GB)
    }

    /// An NVMe transfer's time on the disk and beyond it (none for other work, whose
    /// time is all `disk`'s; nothing at all when no byte moves: a pipeline leg whose
    /// reads a read-ahead made).
    pub fn transfer(&self, work: Work) -> Transfer {
        self.nvme(work, self.nvme_wait)
    }

    /// A read of `bytes` of NVMe optimizer state submitted ahead of the update that takes
    /// it (`pipeline::read_ahead`, and a run's read of the next unit's first sub-group):
    /// no thread waits for it as it completes, so beside compute it waits for no core
    /// (measured: such a read of the default config during the backward takes its idle
    /// time, where the reduce lane's writes there wait a time slice).
    pub fn read_ahead(&self, bytes: u64) -> Transfer {
        self.nvme(Work::NvmeRead(bytes), (0.0, 0.0))
    }

    /// [`Costs::transfer`] with `wait` (read, write) beyond the latency on idle cores.
    fn nvme(&self, work: Work, wait: (f64, f64)) -> Transfer {
        let (read, write, _) = self.shared();
        let (bytes, gb_s, latency) = match work {
            Work::NvmeRead(bytes) => (bytes, read, self.nvme_latency.0 + wait.0),
            Work::NvmeWrite(bytes) => (bytes, write, self.nvme_latency.1 + wait.1),
            other => {
                return Transfer {
                    disk: self.seconds(other),
                    ..Transfer::default()
                }
            }
        };
        if bytes == 0 {
            return Transfer::default();
        }
        let ranks = self.ranks();
        Transfer {
            disk: Self::seconds_at(bytes, gb_s),
            latency,
            others: (ranks - 1.0) / (2.0 * ranks),
        }
    }

    /// What one unit's NVMe AdamW pipeline run takes beyond its legs (`nvme.latency`,
    /// measured in the mode of the config the profile was made with: its threads started
    /// and joined, or none on the calling thread).
    pub fn pipeline_overhead(&self) -> f64 {
        self.nvme_latency.2
    }

    /// The machine's NVMe read and write rates (over files the size of its swap files)
    /// and CPU AdamW rate as one rank sees them: the ranks of a process share its disk
    /// and cores, and all run the same schedule.
    fn shared(&self) -> (f64, f64, f64) {
        let ranks = self.ranks();
        let p = &self.profile;
        let (read, write) = self.disk;
        (read / ranks, write / ranks, p.cpu_adam.params_per_s.value / ranks)
    }

    /// A host→device copy's rate: pinned or pageable on a GPU, a memcpy on a CPU.
    fn h2d_rate(&self, pinned: bool) -> f64 {
        let c = &self.profile.copies;
        match (self.cuda(), pinned) {
            (false, _) => c.host_memcpy.value,
            (true, true) => c.h2d_pinned.value,
            (true, false) => c.h2d_pageable.value,
        }
    }

    /// A copy out of the device's rate: into pinned host memory on a GPU (every stretch
    /// leaves through pinned staging, `engine/reduce.rs`) or pageable memory (device-tier
    /// state's new values, `engine/optimize.rs`), a memcpy on a CPU.
    fn d2h_rate(&self, pinned: bool) -> f64 {
        let c = &self.profile.copies;
        match (self.cuda(), pinned) {
            (false, _) => c.host_memcpy.value,
            (true, true) => c.d2h_pinned.value,
            (true, false) => c.d2h_pageable.value,
        }
    }

    /// The host's wait beyond the transfer when it waits for a copy out of a GPU (its
    /// wake-up; a staged copy that is in before the host asks costs none).
    pub fn d2h_wait(&self) -> f64 {
        match &self.profile.copies.d2h_wait_s {
            Some(wait) if self.cuda() => wait.value,
            _ => 0.0,
        }
    }

    /// A collective moving `bytes` (the whole buffer) over the link: a ring's (W-1)/W of
    /// it, plus the call's latency.
    fn collective(&self, bytes: u64) -> f64 {
        let w = self.plan.world_size as f64;
        let link = &self.profile.link;
        link.latency_s.value + bytes as f64 * (w - 1.0) / w / (link.bus_gb_s.value * GB)
    }

    /// The rate of the host's accumulator add over a stretch of `elements`: on every
    /// core when it is long (`rules::PARALLEL_CHUNK`), else one thread's.
    pub fn host_add_rate(&self, elements: u64) -> f64 {
        let copies = &self.profile.copies;
        if elements as usize > rules::PARALLEL_CHUNK {
            copies.host_add_parallel.value
        } else {
            copies.host_add.value
        }
    }

    fn tokens(&self) -> usize {
        self.plan.batch.micro_batch_per_gpu * self.plan.data.seq_len
    }

    fn shape(&self, tokens: usize) -> Shape {
        let c = &self.plan.model.config;
        Shape {
            tokens,
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            seq_len: self.plan.data.seq_len,
        }
    }

    /// Seconds of a unit's forward or backward, or the head, on the compute stream. With
    /// several ranks, at a rank's own rate (`Rate::own_flops_per_s`, where the profile
    /// has it): a run's ranks do not meet after every piece as the profile's do, where
    /// the slowest sets each piece's pace (see `bench profile`; their drift at a run's
    /// collectives is not priced).
    fn compute(&self, u: usize, kernel: Kernel) -> f64 {
        let c = &self.plan.model.config;
        let (tokens, seq) = (self.tokens(), self.plan.data.seq_len);
        let dtype = self.plan.precision.name();
        let overhead = self.profile.compute.overhead_s.value;
        let numel = self.numels[u];
        let (flops, kernel, dtype) = if kernel == Kernel::Head {
            // model/head.rs computes the logits in the 16-bit training precision on a GPU
            // or a CPU with bf16 units, else in fp32
            let low = self.plan.train.low_precision_head;
            (flops::head(c, tokens), kernel, if low { dtype } else { "fp32" })
        } else if u == 0 {
            // a gather of rows; in backward a dense gradient of the table
            let bytes = if kernel == Kernel::Backward {
                (numel * self.plan.precision.bytes()) as u64
            } else {
                0
            };
            return (overhead + Self::seconds_at(bytes, self.profile.copies.device_to_device.value))
                * self.stretch(u, kernel);
        } else if kernel == Kernel::Forward {
            (flops::block_forward(c, numel, tokens, seq), kernel, dtype)
        } else if rules::keeps_activations(&self.plan, u) {
            (flops::block_backward_kept(c, numel, tokens, seq), kernel, dtype)
        } else {
            (flops::block_backward(c, numel, tokens, seq), kernel, dtype)
        };
        let shape = self.shape(tokens);
        let rate = if self.plan.world_size < 2 {
            self.profile.rate(kernel, dtype, shape)
        } else {
            self.profile.own_rate(kernel, dtype, shape)
        };
        (overhead + flops / rate) * self.stretch(u, kernel)
    }

    /// How much longer unit `u`'s `kernel` takes for the lanes' host work beside it.
    fn stretch(&self, u: usize, kernel: Kernel) -> f64 {
        self.compute_stretch_of(u, usize::from(kernel != Kernel::Forward))
    }

    /// Seconds `work` takes on the profiled machine.
    pub fn seconds(&self, work: Work) -> f64 {
        let copies = &self.profile.copies;
        let adam = self.shared().2;
        match work {
            Work::Forward(u) => self.compute(u, Kernel::Forward),
            Work::Backward(u) => self.compute(u, Kernel::Backward),
            Work::Head => self.compute(self.numels.len() - 1, Kernel::Head),
            Work::H2d(bytes) => Self::seconds_at(bytes, self.h2d_rate(true)),
            Work::H2dPageable(bytes) => Self::seconds_at(bytes, self.h2d_rate(false)),
            Work::Fill { bytes, parallel } => {
                let rate = if parallel {
                    copies.host_memcpy_parallel.value
                } else {
                    copies.host_memcpy.value
                };
                Self::seconds_at(bytes, rate)
            }
            Work::D2h(bytes) => Self::seconds_at(bytes, self.d2h_rate(true)),
            Work::D2hPageable(bytes) => Self::seconds_at(bytes, self.d2h_rate(false)),
            Work::OnDevice(bytes) => Self::seconds_at(bytes, copies.device_to_device.value),
            Work::HostAdd(elements) => Self::seconds_at(4 * elements, self.host_add_rate(elements)),
            Work::Collective(bytes) | Work::Gather(bytes) => self.collective(bytes),
            Work::Latency => self.profile.link.latency_s.value,
            Work::NvmeRead(_) | Work::NvmeWrite(_) => self.transfer(work).seconds(),
            Work::Adam(elements) => elements as f64 / adam * self.optimizer_stretch,
            Work::AdamSummed(elements) => {
                let summed = self.profile.cpu_adam.summed_params_per_s.as_ref();
                elements as f64 / summed.map_or(adam, |f| f.value / self.ranks()) * self.optimizer_stretch
            }
            Work::DeviceAdam(elements) => {
                Self::seconds_at(4 * elements, self.h2d_rate(false))
                    + self.seconds(Work::DeviceAdamOnly(elements))
            }
            // 28 bytes of memory traffic per element on the device
            Work::DeviceAdamOnly(elements) => Self::seconds_at(28 * elements, copies.device_to_device.value),
            Work::Pass(elements) => Self::seconds_at(4 * elements, copies.host_memcpy_parallel.value),
        }
    }
}
