//! What the process takes from the host, measured by the kernel rather than predicted:
//! resident set (now and its peak, `/proc/self/status`), CPU time in user and kernel
//! mode and minor page faults (`getrusage`). The peak can be reset
//! (`/proc/self/clear_refs`), so the peak of the training steps is told apart from that
//! of start-up.

use serde::Serialize;

/// One reading of the process's host usage.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Usage {
    /// Resident set size now (VmRSS), bytes.
    pub rss: u64,
    /// Peak resident set since start or the last [`reset_peak`] (VmHWM), bytes.
    pub peak_rss: u64,
    /// CPU seconds in user mode, all threads.
    pub user_s: f64,
    /// CPU seconds in kernel mode, all threads.
    pub system_s: f64,
    /// Minor page faults so far, all threads: pages the kernel mapped (and zeroed) on
    /// first touch.
    pub minor_faults: u64,
}

impl Usage {
    /// Reads the process's usage now; zeros where the kernel does not say (not Linux).
    pub fn now() -> Usage {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let (user_s, system_s, minor_faults) = cpu_and_faults();
        Usage {
            rss: status_kib(&status, "VmRSS:") * 1024,
            peak_rss: status_kib(&status, "VmHWM:") * 1024,
            user_s,
            system_s,
            minor_faults,
        }
    }
}

/// Usage over a span of the run: CPU time between two readings, and the peak resident
/// set seen at the end of it.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Span {
    pub user_s: f64,
    pub system_s: f64,
    /// Kernel time as a fraction of the process's CPU time over the span.
    pub kernel_fraction: f64,
    pub peak_rss: u64,
    /// Minor page faults over the span: memory the kernel mapped (and zeroed) afresh.
    pub minor_faults: u64,
}

impl Span {
    pub fn between(start: Usage, end: Usage) -> Span {
        let user_s = end.user_s - start.user_s;
        let system_s = end.system_s - start.system_s;
        let minor_faults = end.minor_faults.saturating_sub(start.minor_faults);
        Span {
            user_s,
            system_s,
            kernel_fraction: system_s / (user_s + system_s).max(1e-9),
            peak_rss: end.peak_rss,
            minor_faults,
        }
    }
}

/// For a process whose allocator is glibc's (a library user's; the `tierzero` binary
/// links tcmalloc, which never hands memory back: `src/main.rs`), makes glibc's malloc
/// keep freed memory for reuse instead of handing it back to the kernel: no allocation
/// is served by its own `mmap` (glibc maps every block above 32 MiB on its own and
/// unmaps it on free, so each of libtorch's per-unit gradient and activation tensors
/// came back as fresh pages, zeroed by the kernel on first touch: at `llama-1b` scale
/// most of the process's CPU time was kernel time), the heap's top is trimmed only past
/// 2 GiB free (`mallopt` takes an `int`; −1, never, costs more kernel time on a VM than
/// the faults it saves: README, "Host memory and kernel time"), and every thread
/// allocates from the one main arena. The steps' working set then stays mapped and is
/// reused step after step. One arena, because glibc serves a block larger than a
/// secondary arena's 64 MiB heap from its own `mmap` whatever `M_MMAP_MAX` says, and
/// any thread that has ever allocated holds a secondary arena once the main one was
/// busy: with one arena per core, `llama-1b`'s 243 MB block gradients and 1.05 GB
/// embedding tensors were still mapped and unmapped every step (16.9 M minor page
/// faults in 3 steps, 3.5 M with one arena). `train` calls it (arenas a thread already
/// holds stay). Returns whether glibc took the settings (under another allocator
/// glibc's settings go unused).
pub fn reuse_freed_memory() -> bool {
    // SAFETY: mallopt only sets allocator parameters (under the allocator's own lock).
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
            && libc::mallopt(libc::M_ARENA_MAX, 1) == 1
    }
}

/// Starts the peak resident set afresh from the current one (Linux ≥ 4.0); returns
/// whether the kernel did it.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn status_kib(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// User and kernel CPU seconds and minor page faults of the process so far.
fn cpu_and_faults() -> (f64, f64, u64) {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole rusage into the pointer it is given.
    let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
    if !ok {
        return (0.0, 0.0, 0);
    }
    // SAFETY: initialised by the successful call above.
    let usage = unsafe { usage.assume_init() };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    let faults = u64::try_from(usage.ru_minflt).unwrap_or(0);
    (seconds(usage.ru_utime), seconds(usage.ru_stime), faults)
}

/// A process's host usage over a run: the peak resident set of its start-up, and the CPU
/// time and peak resident set of its steps.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct HostUsage {
    pub startup_peak_rss: u64,
    pub steps: Span,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_touched_buffer_shows_in_the_resident_set_and_its_peak() {
        // other tests of this binary allocate and free concurrently: only the direction
        // is certain, and a test beside it freeing as much as the buffer takes can hide it
        // once, so it is tried a few times
        let mut tries = Vec::new();
        for _ in 0..5 {
            let before = Usage::now();
            assert!(before.rss > 0 && before.peak_rss >= before.rss, "{before:?}");
            let mut buffer = vec![0u8; 64 << 20];
            for page in buffer.chunks_mut(4096) {
                page[0] = 1;
            }
            let during = Usage::now();
            std::hint::black_box(&buffer);
            drop(buffer);
            assert!(during.user_s + during.system_s >= before.user_s + before.system_s);
            if during.peak_rss >= before.rss + (32 << 20) {
                return;
            }
            tries.push((before, during));
        }
        panic!("a 64 MiB buffer never showed in the peak resident set: {tries:?}");
    }

    #[test]
    fn a_fresh_mapping_is_faulted_in_on_first_touch() {
        const BYTES: usize = 64 << 20;
        let before = Usage::now();
        // SAFETY: a private anonymous mapping of BYTES, written within its bounds and
        // unmapped after the last write.
        unsafe {
            let at = libc::mmap(
                std::ptr::null_mut(),
                BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(at, libc::MAP_FAILED);
            let bytes = at.cast::<u8>();
            for page in (0..BYTES).step_by(4096) {
                bytes.add(page).write_volatile(1);
            }
            libc::munmap(at, BYTES);
        }
        let span = Span::between(before, Usage::now());
        // one fault a 4 KiB page, or a 2 MiB one where transparent huge pages are on;
        // other tests' threads only add to the count
        assert!(span.minor_faults >= (BYTES >> 21) as u64, "{span:?}");
    }
}
