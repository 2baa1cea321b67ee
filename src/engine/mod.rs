//! The ZeRO engine: one rank's owners and its step (the run that drives the ranks is
//! `run/`, what a plan costs is `plan/`).
//!
//! - `rank.rs`: one rank's engine: its three owners, where it computes, and the training
//!   step for stages 0–3
//! - `step_lanes.rs`: the step's lanes (collectives, h2d), opened and closed once a step
//! - `micro_batch.rs`: one micro-batch's forward and backward, and evaluation
//! - `layered.rs`: a step's micro-batches unit by unit (`train.layered_accumulation`)
//! - `compute_times.rs`: compute's spans on a GPU, timed by the device (no host sync per unit)
//! - `units.rs`, `gradients.rs`, `optimizer.rs`: the owners of parameters, gradient
//!   accumulators and optimizer state, each unit's residency a type
//! - `params.rs`: low-precision parameters as stored, and their residency
//! - `context.rs`: what a rank is given (plan, communicators, lanes, tracks)
//! - `error.rs`: what stops a rank, with the rank and the cause
//! - `prefetch.rs`: the stage-3 fetch schedule; fetches on the h2d and gather lanes
//! - `reduce.rs`: gradient reduce-scatters on the reduce lane (`overlap_comm`)
//! - `staging.rs`: a GPU's reduced stretches to the host through pinned buffers, two deep
//! - `grads.rs`: gradient accumulators (fp32, or bf16 with the optimizer on NVMe or where
//!   bf16 is exact)
//! - `optimize.rs`: the optimizer phase and installing its updates (`Installer`)
//! - `held.rs`: gradient sums held on the device, copied out for updates off it, two deep
//! - `start.rs`: where state starts: seeded init, Hugging Face weights, a checkpoint
//! - `snapshot.rs`: a rank's part of saving a checkpoint
//! - `setup.rs`: what a rank starts from: each unit's state, device reservations, arenas, streams

mod compute_times;
pub mod context;
pub mod error;
pub mod grad_store;
pub mod gradients;
pub mod grads;
mod held;
mod layered;
mod micro_batch;
pub mod optimize;
pub mod optimizer;
pub mod params;
pub mod prefetch;
pub mod rank;
pub mod reduce;
mod setup;
pub mod snapshot;
pub mod staging;
pub mod start;
mod step_lanes;
pub mod units;
mod update_copies;
