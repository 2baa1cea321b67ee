//! Stopping a save at a chosen step, and a record of its file-system operations: what
//! the crash-safety tests use to kill a save at each step of its sequence in turn and to
//! check that every write is made durable before the rename that publishes it.
//!
//! `TIERZERO_CRASH_AT=point@step[:n]` sends SIGKILL to the process just before the
//! `n`-th (default first) time the save of step `step` reaches `point` (one of
//! [`POINTS`]). Unset, every point is one relaxed atomic load.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

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

/// A file-system operation of a save, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Create(PathBuf),
    Write(PathBuf),
    /// fsync/fdatasync of a file.
    Sync(PathBuf),
    /// fsync of a directory.
    SyncDir(PathBuf),
    Rename(PathBuf, PathBuf),
    Exchange(PathBuf, PathBuf),
    Remove(PathBuf),
}

impl Op {
    /// The path the operation acts on (the source of a rename).
    pub fn path(&self) -> &Path {
        match self {
            Op::Create(p) | Op::Write(p) | Op::Sync(p) | Op::SyncDir(p) | Op::Remove(p) => p,
            Op::Rename(p, _) | Op::Exchange(p, _) => p,
        }
    }
}

static RECORDERS: AtomicUsize = AtomicUsize::new(0);
static LOG: Mutex<Vec<Op>> = Mutex::new(Vec::new());

/// Records `op` while a [`Recording`] is alive.
pub(super) fn record(op: impl FnOnce() -> Op) {
    if RECORDERS.load(Ordering::Relaxed) > 0 {
        LOG.lock().unwrap_or_else(|e| e.into_inner()).push(op());
    }
}

/// Records the operations of every save in this process while alive; [`Recording::ops`]
/// returns those under one checkpoints directory (tests running beside it save
/// elsewhere).
pub struct Recording {
    root: PathBuf,
}

impl Recording {
    pub fn start(root: &Path) -> Recording {
        RECORDERS.fetch_add(1, Ordering::SeqCst);
        Recording {
            root: root.to_path_buf(),
        }
    }

    /// The operations under the root so far, in the order they completed.
    pub fn ops(&self) -> Vec<Op> {
        let log = LOG.lock().unwrap_or_else(|e| e.into_inner());
        log.iter()
            .filter(|op| op.path().starts_with(&self.root))
            .cloned()
            .collect()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if RECORDERS.fetch_sub(1, Ordering::SeqCst) == 1 {
            LOG.lock().unwrap_or_else(|e| e.into_inner()).clear();
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
