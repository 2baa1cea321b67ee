//! What a rank is given: the run's shared inputs, its communicators, how its lanes run,
//! and the tracks its threads record on; and what a step reports.

use super::prefetch::DroppedWait;
use super::start::Start;
use crate::comm::Collective;
use crate::data::Dataset;
use crate::device::lanes::Mode;
use crate::metrics::timeline::{Timeline, Track};
use crate::model::Model;
use crate::plan::simulate::profile::Profile;
use crate::plan::Plan;
use tierzero_offload::nvme::swap::SwapStore;

/// Per-step numbers one rank reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepReport {
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub loss_scale: f64,
    pub skipped: bool,
    /// Some process of the run was asked to stop (`run/preempt.rs`): every rank saves
    /// this step and ends.
    pub preempted: bool,
}

/// What every rank of a run shares: the plan, the model, the data, the swap stores and
/// where the state starts.
#[derive(Clone, Copy)]
pub struct RankContext<'a> {
    pub plan: &'a Plan,
    pub model: &'a Model,
    pub dataset: &'a Dataset,
    pub optimizer_store: Option<&'a SwapStore>,
    pub param_store: Option<&'a SwapStore>,
    pub start: &'a Start,
    /// Where the rank's threads record their spans (None: not recorded).
    pub timeline: Option<&'a Timeline>,
    /// False: every phase blocking (no prefetch worker, no NVMe read/write pipelining);
    /// a debug switch that makes the breakdown's `overlap` 1.0 (less the ranks' waits for
    /// each other).
    pub overlap: bool,
    /// How the rank's lanes run (checked in tests), and a wait left out on purpose.
    pub lanes: LaneOptions,
    /// Time the step on this profiled machine's virtual clocks (`device/sim.rs`): the
    /// payload runs on the CPU as it would without it.
    pub simulate: Option<&'a Profile>,
}

/// How a rank's lanes run: [`Mode::Checked`] in tests; `dropped` leaves one wait out on
/// purpose (a test shows the checked mode then fails the run's equivalence).
#[derive(Clone, Copy, Debug, Default)]
pub struct LaneOptions {
    pub mode: Mode,
    pub dropped: DroppedWait,
}

impl LaneOptions {
    /// Checked lanes (reproducible from `seed`, jobs late by up to `max_delay_us`) with
    /// `dropped` left out.
    pub fn checked(seed: u64, max_delay_us: u64, dropped: DroppedWait) -> LaneOptions {
        LaneOptions {
            mode: Mode::Checked { seed, max_delay_us },
            dropped,
        }
    }

    /// Plain lanes, or checked ones when the environment asks (`Mode::from_env`).
    pub fn from_env() -> LaneOptions {
        LaneOptions {
            mode: Mode::from_env(),
            dropped: DroppedWait::None,
        }
    }
}

/// A rank's communicators: the compute thread's, the prefetch worker's (stage-3
/// gathers ahead of compute) and the reducer's (`overlap_comm` reduce-scatters). Each
/// thread has its own, so their collectives never interleave.
#[derive(Clone)]
pub struct Comms<C> {
    pub main: C,
    pub gather: C,
    pub reduce: C,
}

impl<C: Collective> Comms<C> {
    /// Fails every rank's pending and future collectives on all three.
    pub fn abort(&self, reason: &str) {
        for c in [&self.main, &self.gather, &self.reduce] {
            c.abort(reason);
        }
    }
}

/// The tracks of one rank's threads.
#[derive(Clone, Default)]
pub(super) struct Tracks {
    pub compute: Track,
    /// The gather lane (stage-3 all-gathers).
    pub prefetch: Track,
    /// The h2d lane (shards into device staging, parameter NVMe reads).
    pub h2d: Track,
    pub optimizer: Track,
    pub nvme_read: Track,
    pub nvme_write: Track,
    pub reduce: Track,
}

impl Tracks {
    pub(super) fn new(timeline: Option<&Timeline>, rank: usize) -> Tracks {
        let Some(t) = timeline else {
            return Tracks::default();
        };
        Tracks {
            compute: t.track(rank, "compute"),
            prefetch: t.track(rank, "gather"),
            optimizer: t.track(rank, "optimizer"),
            nvme_read: t.track(rank, "nvme read"),
            nvme_write: t.track(rank, "nvme write"),
            reduce: t.track(rank, "reduce"),
            h2d: t.track(rank, "h2d"),
        }
    }
}
