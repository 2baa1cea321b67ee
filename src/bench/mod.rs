//! Built-in throughput benchmarks. Each measures its hardware limit in the same run and
//! reports throughput next to it.

pub mod adam;
pub mod comm;
pub mod gpu;
pub mod memory;
pub mod nvme;
pub mod profile;
pub mod step;
pub mod swap;
