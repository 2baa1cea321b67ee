//! Preemption: SIGTERM or SIGUSR1 — what SLURM and Kubernetes send before they kill a
//! job, and what torchrun sends its workers when it shuts down — asks the run to finish
//! the step under way, save a checkpoint of it and exit with [`EXIT_PREEMPTED`].
//!
//! The handler only counts: the ranks learn of a request at the next step's loss
//! all-reduce, which carries each rank's flag beside its loss (`RankEngine::step`), so
//! every rank of every process stops after the same step, however far apart the signals
//! reached the processes. Before the steps begin ([`arm`]) there is nothing to save and
//! a signal exits at once; so does a second signal at least [`PATIENCE_S`] seconds after
//! the first (a step stuck in a collective). A second signal sooner is the same request
//! delivered twice (SLURM signals every process of a step, and torchrun forwards its own
//! SIGTERM to its workers) and changes nothing. Either exit is status 128 + the signal,
//! as a kill would be.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, Ordering};

/// The exit status of a run that stopped on a signal after saving its checkpoint
/// (sysexits' EX_TEMPFAIL: "try again later"; `--resume auto` continues it).
pub const EXIT_PREEMPTED: i32 = 75;

/// Seconds after the first signal from which a second one exits at once.
pub const PATIENCE_S: i64 = 2;

static SIGNALS: AtomicU32 = AtomicU32::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);
static FIRST_AT: AtomicI64 = AtomicI64::new(0);
static ARMED: AtomicBool = AtomicBool::new(false);

/// Seconds on the monotonic clock (async-signal-safe).
fn now_s() -> i64 {
    // SAFETY: clock_gettime writes the zeroed timespec it is given; async-signal-safe
    unsafe {
        let mut t: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t);
        t.tv_sec
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    LAST.store(signal, Ordering::SeqCst);
    let now = now_s();
    let first = SIGNALS.fetch_add(1, Ordering::SeqCst) == 0;
    if first {
        FIRST_AT.store(now, Ordering::SeqCst);
    }
    let impatient = !first && now - FIRST_AT.load(Ordering::SeqCst) >= PATIENCE_S;
    if !ARMED.load(Ordering::SeqCst) || impatient {
        // SAFETY: _exit is async-signal-safe
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Routes SIGTERM and SIGUSR1 to the preemption flag (the `train` command calls it).
pub fn install() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGUSR1] {
        // SAFETY: a zeroed sigaction with a handler that touches only atomics,
        // clock_gettime and _exit (async-signal-safe), installed for a valid signal
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The steps have begun: from now on a signal asks for a checkpoint first.
pub fn arm() {
    ARMED.store(true, Ordering::SeqCst);
}

/// Whether this process was asked to stop.
pub fn requested() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}

/// The name of the signal that asked, for the exit message.
pub fn signal_name() -> &'static str {
    match LAST.load(Ordering::SeqCst) {
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        _ => "a signal",
    }
}
