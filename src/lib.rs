//! tierzero: a ZeRO-3 trainer for large language models with GPU, host and NVMe tiers.
//!
//! The crate holds the configuration ([`config`]), the model shapes ([`model`]), the
//! ZeRO engine ([`zero`]) and the built-in benchmarks ([`bench`]); everything that lives
//! off the GPU (CPU AdamW, host buffers, NVMe I/O) is in the `tierzero-offload` crate.
//! See `README.md` for the architecture and `../shared/DESIGN.md` for the map.

pub mod bench;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod device;
pub mod engine;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod run;
pub mod torch;
