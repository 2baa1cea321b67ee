//! A training run as a process: its ranks as threads (`train.rs`, `rank.rs`), their
//! communicators (`comms.rs`) and NVMe swap stores (`stores.rs`), where the state starts
//! (`prepare.rs`), what the caller asks (`options.rs`), what it reports (`result.rs`,
//! written by `report.rs`) and what stops it (`error.rs`, `preempt.rs`); `generate.rs`
//! loads weights onto one device to continue prompts.

mod comms;
mod error;
pub mod generate;
mod options;
pub mod preempt;
mod prepare;
mod rank;
mod report;
mod result;
mod stores;
mod train;

pub use error::TrainError;
pub use options::TrainOptions;
pub use prepare::{evaluate, initial_weights};
pub use rank::rank_threads;
pub use result::{StepMetrics, TrainResult};
pub use stores::engine_config;
pub use train::train;
