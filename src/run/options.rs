//! How a caller asks for a run: outputs, checkpoints, resume, tracing and the debug
//! switches tests use (blocking phases, one communicator, c10d in one process).

use crate::engine::context::LaneOptions;
use crate::plan::simulate::profile::Profile;

#[derive(Clone, Copy, Debug, Default)]
pub struct TrainOptions<'a> {
    /// Create the output directory and write metrics.jsonl; print progress.
    pub write_outputs: bool,
    /// Return the final fp32 master weights (tests, export).
    pub collect_master: bool,
    /// Run each optimizer phase to completion before the next step (a debug switch;
    /// the default runs it behind the next step's forward).
    pub blocking_optimizer: bool,
    /// Save checkpoints under `<output_dir>/checkpoints`: every `train.save_interval`
    /// steps and after the last.
    pub save_checkpoints: bool,
    /// Continue from this checkpoint directory.
    pub resume: Option<&'a std::path::Path>,
    /// Write `<output_dir>/trace.json` (also `train.trace`).
    pub trace: bool,
    /// Make every phase blocking (no prefetch worker, optimizer phase and NVMe legs
    /// one after another): a debug switch for the breakdown's `overlap`.
    pub no_overlap: bool,
    /// How the ranks' lanes run; None: as the environment says (`TIERZERO_CHECKED_LANES=1`
    /// checks them, see `Mode::from_env`), plain otherwise.
    pub lanes: Option<LaneOptions>,
    /// Ranks in one process share one communicator for everything (tests: `Local` fails
    /// any collective issued out of the ranks' common order or two at once by one rank,
    /// so a run that passes issues them as NCCL needs, from one thread per rank).
    pub one_communicator: bool,
    /// Ranks in one process talk through c10d as CUDA ranks do (a store served here on a
    /// loopback port; Gloo for CPU ranks): tests of that path without a GPU.
    pub c10d_in_process: bool,
    /// Time every step on this profiled machine's virtual clocks as well
    /// (`train --simulate PROFILE`; `device/sim.rs`): the run itself is the CPU run.
    pub simulate: Option<&'a Profile>,
}
