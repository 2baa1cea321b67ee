//! Preemption: SIGTERM or SIGUSR1 — what SLURM and Kubernetes send before they kill a
//! job, and what torchrun sends its workers when it shuts down — asks the run to finish
//! the step under way, save a checkpoint of it and exit with [`EXIT_PREEMPTED`]; a
//! second signal exits at once (status 128 + the signal, as a kill would).
//!
//! The handler only counts: the ranks learn of a request at the next step's loss
//! all-reduce, which carries each rank's flag beside its loss (`RankEngine::step`), so
//! every rank of every process stops after the same step, however far apart the signals
//! reached the processes.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// The exit status of a run that stopped on a signal after saving its checkpoint
/// (sysexits' EX_TEMPFAIL: "try again later"; `--resume auto` continues it).
pub const EXIT_PREEMPTED: i32 = 75;

static SIGNALS: AtomicU32 = AtomicU32::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    LAST.store(signal, Ordering::SeqCst);
    if SIGNALS.fetch_add(1, Ordering::SeqCst) > 0 {
        // SAFETY: _exit is async-signal-safe; a second signal means "now"
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Routes SIGTERM and SIGUSR1 to the preemption flag (the `train` command calls it).
pub fn install() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGUSR1] {
        // SAFETY: a zeroed sigaction with a handler that touches only atomics and
        // _exit (async-signal-safe), installed for a valid signal number
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
