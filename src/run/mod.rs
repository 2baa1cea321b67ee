//! A training run as a process: what concerns the whole process rather than one rank's
//! step. Today: preemption (`preempt.rs`); the rest of "a run" (ranks as threads,
//! communicators, the metrics loop) still lives in `zero/trainer.rs`.

pub mod preempt;
