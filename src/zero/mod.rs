//! The ZeRO engine: partitions, the fetch/release schedule, the step.
//!
//! This build has the memory estimator; the engine itself lands with the ZeRO issue.

pub mod estimate;
