//! Stopping a save at a chosen step: what the crash-safety tests use to kill a save at
//! each step of its sequence in turn. (Durability is checked from outside the process,
//! on the system calls strace sees: `tests/checkpoint_crash.rs`.)
//!
//! `TIERZERO_CRASH_AT=point@step[:n]` sends SIGKILL to the process just before the
//! `n`-th (default first) time the save of step `step` reaches `point` (one of
//! [`POINTS`]). Unset, every point is one relaxed atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The environment variable naming the crash point.
pub const VAR: &str = "TIERZERO_CRASH_AT";

/// Every crash point, in the order a save reaches them; each is hit just before the
/// operation it names.
pub const POINTS: &[&str] = &[
    "stage-dir",        // creating .tmp-step-N
    "stage-file",       // creating one state file at its length, with its header
    "slice-write",      // one rank's write of one slice
    "slice-sync",       // one rank's fsync of one state file
    "manifest-write",   // creating and writing manifest.json
    "manifest-sync",    // its fsync
    "staging-sync",     // fsync of .tmp-step-N
    "rename",           // .tmp-step-N → step-N
    "exchange",         // saving a step again: .tmp-step-N ⇄ step-N, atomically
    "aside-rename",     // … where it cannot exchange: step-N → .aside-step-N
    "aside-publish",    // … then .tmp-step-N → step-N
    "root-sync",        // fsync of the checkpoints directory
    "old-remove",       // removing the replaced copy of step-N
    "latest-write",     // creating and writing .latest.tmp
    "latest-sync",      // its fsync
    "latest-rename",    // .latest.tmp → latest
    "latest-root-sync", // fsync of the checkpoints directory
    "prune-rename",     // step-K → .old-step-K, beyond keep_last
    "prune-remove",     // removing .old-step-K
    "committed",        // the save is complete
];

#[derive(Debug)]
struct Spec {
    point: String,
    step: u64,
    nth: u64,
}

fn parse(text: &str) -> Result<Spec, String> {
    let (point, rest) = text
        .split_once('@')
        .ok_or("expected point@step or point@step:n")?;
    if !POINTS.contains(&point) {
        return Err(format!(
            "unknown point {point:?}; the points are {}",
            POINTS.join(", ")
        ));
    }
    let (step, nth) = rest.split_once(':').unwrap_or((rest, "1"));
    let number = |s: &str, what: &str| {
        s.parse::<u64>()
            .map_err(|_| format!("{what} {s:?} is not a whole number"))
    };
    let nth = number(nth, "n")?;
    if nth == 0 {
        return Err("n counts from 1".into());
    }
    Ok(Spec {
        point: point.into(),
        step: number(step, "step")?,
        nth,
    })
}

fn spec() -> Option<&'static Spec> {
    static SPEC: OnceLock<Option<Spec>> = OnceLock::new();
    SPEC.get_or_init(|| parse(&std::env::var(VAR).ok()?).ok())
        .as_ref()
}

/// `TIERZERO_CRASH_NO_EXCHANGE=1` makes a save of an existing step take the path of a
/// file system without `RENAME_EXCHANGE` (two renames), so tests reach it on any disk.
pub fn no_exchange() -> bool {
    static SET: OnceLock<bool> = OnceLock::new();
    *SET.get_or_init(|| std::env::var("TIERZERO_CRASH_NO_EXCHANGE").is_ok_and(|v| v == "1"))
}

/// Checks `TIERZERO_CRASH_AT` at start-up, so a misspelt point is an error, not a save
/// that silently never stops.
pub fn check_env() -> Result<(), String> {
    match std::env::var(VAR) {
        Ok(text) => parse(&text).map(drop).map_err(|e| format!("{VAR}={text:?}: {e}")),
        Err(_) => Ok(()),
    }
}

static HITS: AtomicU64 = AtomicU64::new(0);

/// The save of step `step` is about to do what `point` names.
pub fn point(point: &'static str, step: u64) {
    debug_assert!(POINTS.contains(&point), "{point}");
    let Some(spec) = spec() else { return };
    if spec.point == point && spec.step == step && HITS.fetch_add(1, Ordering::SeqCst) + 1 == spec.nth {
        eprintln!(
            "{VAR}: killing the process at {point} (hit {}) of the save of step {step}",
            spec.nth
        );
        // SAFETY: kill(2) on our own pid; SIGKILL cannot be caught, nothing runs after it
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        loop {
            std::thread::park();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_specs_parse_or_name_the_problem() {
        let s = parse("slice-write@3:5").unwrap();
        assert_eq!((s.point.as_str(), s.step, s.nth), ("slice-write", 3, 5));
        assert_eq!(parse("rename@2").unwrap().nth, 1);
        assert!(parse("renme@2").unwrap_err().contains("unknown point \"renme\""));
        assert!(parse("rename").unwrap_err().contains("point@step"));
        assert!(parse("rename@x").unwrap_err().contains("step \"x\""));
        assert!(parse("rename@2:0").unwrap_err().contains("from 1"));
    }
}
