//! What the disk's transfers take from the host's cores: every core kept busy
//! checksumming a buffer in cache, its progress counted alone and beside a thread
//! streaming O_DIRECT reads (then writes) of a file through the swap store's engine. The
//! share of progress lost, in cores, is what the disk takes while it streams.
//!
//! On bare metal that is the kernel's submission and completion of the requests; on a
//! virtual machine also the hypervisor's work for the virtual disk, which it takes from
//! the guest's cores (counted there as steal, beside no guest time). On this project's
//! KVM machines a disk streaming 0.9 GB/s beside a block's forward on both cores took
//! about 5.5 of each core's 14 seconds as steal, and the forward took 1.8× its time; the
//! busy threads here lost 35–43% of their progress whether the disk moved 0.4 or 1.8
//! GB/s in the window, so the cost is the disk's busy time, not its bytes. The
//! simulation prices it beside the transfers' checksums where compute or the CPU AdamW
//! runs beside the disk (`plan/simulate/contention.rs`).

use super::median;
use super::nvme::{engine_config, operations, uring_pool};
use crate::plan::simulate::profile::{Figure, NvmeCores};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};
use tierzero_offload::nvme::{pread::Pread, uring::Uring, BlockFile, BlockIo};

/// How long each measurement's window lasts.
const WINDOW: Duration = Duration::from_millis(750);

/// Rounds of (alone, beside reads, beside writes), interleaved; medians are kept.
const ROUNDS: usize = 3;

/// The busy threads' buffer: in a core's cache, so they ask nothing of memory.
const BUSY_BYTES: usize = 256 << 10;

/// The cores the disk takes from the host while it reads and while it writes, streamed
/// through `size` bytes of a file in `dir` (rounded to whole operations) while every
/// core works.
pub fn cores_while_streaming(dir: &Path, size: u64) -> anyhow::Result<NvmeCores> {
    let probe = tierzero_offload::nvme::probe(dir)?;
    anyhow::ensure!(
        probe.direct.is_ok(),
        "O_DIRECT is not available in {}: {}",
        dir.display(),
        probe.fallback_reason()
    );
    let path = dir.join(format!(".tierzero-bench-cores-{}", std::process::id()));
    let result = measure(&path, size, probe.uring.is_ok());
    let _ = std::fs::remove_file(&path);
    result
}

fn measure(path: &Path, size: u64, uring_ok: bool) -> anyhow::Result<NvmeCores> {
    let (block, depth) = (1 << 20, 32);
    let config = engine_config(block, depth);
    let pool = uring_pool(block, depth)?;
    let op = pool.buffer_bytes() as u64;
    let size = size.div_ceil(op).max(1) * op;
    let file = BlockFile::open(path, true, true)?;
    file.preallocate(size)?;
    let engine: Box<dyn BlockIo> = if uring_ok {
        Box::new(Uring::new(config, true, Some(&pool))?)
    } else {
        Box::new(Pread::new(config, true)?)
    };
    // the file holds data before it is read
    operations(
        engine.as_ref(),
        &file,
        &pool,
        (0..size).step_by(op as usize).map(|o| (o, true)),
        size,
    )?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // the stream for a window: operations round the file until the window ends
    let stream = |write: bool| -> anyhow::Result<u64> {
        let deadline = Instant::now() + WINDOW;
        let mut done = 0u64;
        let ops = (0..)
            .map(|i: u64| ((i * op) % size, write))
            .take_while(|_| Instant::now() < deadline)
            .inspect(|_| done += op);
        operations(engine.as_ref(), &file, &pool, ops, size)?;
        Ok(done)
    };
    let (mut alone, mut read, mut write) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let (rate, _) = busy_progress(cores, || {
            std::thread::sleep(WINDOW);
            Ok(0)
        })?;
        alone.push(rate);
        read.push(busy_progress(cores, || stream(false))?);
        write.push(busy_progress(cores, || stream(true))?);
    }
    let alone = median(alone);
    // the cores lost while the stream ran: every core's share of progress lost
    let figure = |runs: Vec<(f64, (u64, f64))>, what: &str| {
        let kept = median(runs.iter().map(|&(rate, _)| rate / alone).collect());
        let gb_s = median(runs.iter().map(|&(_, (b, s))| b as f64 / s / 1e9).collect());
        Figure::new(
            cores as f64 * (1.0 - kept).max(0.0),
            format!(
                "`tierzero bench profile`: {cores} threads checksumming {} KiB buffers, one a core, kept {:.0}% of their progress beside a thread {what} O_DIRECT operations of {} MiB ({depth} requests of 1 MiB in flight, {gb_s:.2} GB/s): the cores lost while the disk streams; medians of {ROUNDS} rounds of {} ms, interleaved with the threads alone",
                BUSY_BYTES >> 10,
                kept * 100.0,
                op >> 20,
                WINDOW.as_millis()
            ),
        )
    };
    Ok(NvmeCores {
        while_reading: figure(read, "reading"),
        while_writing: figure(write, "writing"),
    })
}

/// Sets its flag when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The busy threads' progress (checksums a second, all threads together) while `during`
/// runs, with what it returns and its seconds.
fn busy_progress<T>(
    threads: usize,
    during: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(f64, (T, f64))> {
    let stop = AtomicBool::new(false);
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (stop, start) = (&stop, &start);
                s.spawn(move || {
                    let buf = vec![1u8; BUSY_BYTES];
                    start.wait();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::black_box(crc32c::crc32c(std::hint::black_box(&buf)));
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        // the workers stop once `during` ends, however it ends (a panic included)
        let stopping = Stop(&stop);
        start.wait();
        let t0 = Instant::now();
        let out = during();
        drop(stopping);
        let seconds = t0.elapsed().as_secs_f64();
        let done: u64 = workers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
        Ok((done as f64 / seconds, (out?, seconds)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cores_the_disk_takes_are_measured_while_it_reads_and_while_it_writes() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let cores = cores_while_streaming(dir.path(), 64 << 20).unwrap();
        let most = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        for (figure, what) in [
            (&cores.while_reading, "reading"),
            (&cores.while_writing, "writing"),
        ] {
            assert!((0.0..=most).contains(&figure.value), "{figure:?}");
            assert!(figure.source.contains(what), "{}", figure.source);
        }
        // the file is gone
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
