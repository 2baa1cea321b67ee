//! Built-in throughput benchmarks. Each measures its hardware limit in the same run and
//! reports throughput next to it.

pub mod adam;
pub mod comm;
pub mod gpu;
pub mod memory;
pub mod nvme;
pub mod profile;
mod profile_gpu;
pub mod step;
pub mod swap;
pub mod unit;

/// The median of a benchmark's timings or rates (NaN for none).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}
