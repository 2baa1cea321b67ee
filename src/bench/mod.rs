//! Built-in throughput benchmarks. Each measures its hardware limit in the same run and
//! reports throughput next to it.

pub mod adam;
pub mod comm;
mod disk_cores;
pub mod gpu;
pub mod memory;
pub mod nvme;
pub mod profile;
mod profile_gpu;
pub mod step;
pub mod swap;
pub mod unit;

use std::time::Instant;

/// The median of a benchmark's timings or rates (NaN for none).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Timed runs a measurement takes at least ([`timed`]).
const REPEATS: usize = 3;

/// Short work is repeated until its runs add up to this many seconds (at most
/// [`MAX_REPEATS`] runs): a median of three sub-millisecond runs follows the machine's
/// noise more than the work.
const MIN_SECONDS: f64 = 0.3;
const MAX_REPEATS: usize = 1000;

/// `f` while `threads` threads keep a core each busy checksumming a 32 MiB buffer (what
/// an NVMe lane does most), stopped once `f` returns.
fn beside_busy_threads<T>(threads: usize, f: impl FnOnce() -> T) -> T {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let stop = &stop;
        for _ in 0..threads {
            s.spawn(move || {
                let buf = vec![1u8; 32 << 20];
                while !stop.load(Ordering::Relaxed) {
                    std::hint::black_box(crc32c::crc32c(&buf));
                }
            });
        }
        let out = f();
        stop.store(true, Ordering::Relaxed);
        out
    })
}

/// Median seconds of `f` after one warm-up: [`REPEATS`] runs, more for short work.
fn timed(mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(REPEATS);
    while times.len() < REPEATS || (times.iter().sum::<f64>() < MIN_SECONDS && times.len() < MAX_REPEATS) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(median(times))
}
