//! An injected I/O error in the [`BlockIo`] seam, for tests of what a failing disk does
//! to a run: `TIERZERO_IO_FAULT=read@N:eio` (or `write@N:enospc`, any errno name below)
//! makes the `N`-th read (or write) the process submits fail with that error, exactly as
//! the kernel would report it (the buffer comes back, the error names the file, offset
//! and length). Unset, [`wrap`] returns the engine as it is. A real full disk is also
//! tested (a size-limited tmpfs); a real EIO cannot be had without a failing device.

use super::{BlockIo, Direction, Done, IoError, Op, Pending};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The environment variable naming the fault.
pub const VAR: &str = "TIERZERO_IO_FAULT";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fault {
    direction: Direction,
    nth: u64,
    errno: i32,
}

fn parse(text: &str) -> Result<Fault, String> {
    let (what, errno) = text
        .split_once(':')
        .ok_or("expected read@N:errno or write@N:errno")?;
    let (direction, nth) = what
        .split_once('@')
        .ok_or("expected read@N:errno or write@N:errno")?;
    let direction = match direction {
        "read" => Direction::Read,
        "write" => Direction::Write,
        other => return Err(format!("{other:?} is neither read nor write")),
    };
    let nth = nth
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("N {nth:?} is not a whole number from 1"))?;
    let errno = match errno {
        "eio" => libc::EIO,
        "enospc" => libc::ENOSPC,
        "erofs" => libc::EROFS,
        "edquot" => libc::EDQUOT,
        other => {
            return Err(format!(
                "errno {other:?} is not one of eio, enospc, erofs, edquot"
            ))
        }
    };
    Ok(Fault {
        direction,
        nth,
        errno,
    })
}

/// Checks `TIERZERO_IO_FAULT` at start-up: a misspelt fault is an error, not a test that
/// silently injects nothing.
pub fn check_env() -> Result<(), String> {
    match std::env::var(VAR) {
        Ok(text) => parse(&text).map(drop).map_err(|e| format!("{VAR}={text:?}: {e}")),
        Err(_) => Ok(()),
    }
}

/// Operations of the fault's direction submitted so far, over every engine of the
/// process (the count the fault's N refers to).
static SEEN: AtomicU64 = AtomicU64::new(0);

/// An engine that fails one operation as the fault says and passes every other one on.
struct Faulty {
    inner: Arc<dyn BlockIo>,
    fault: Fault,
}

impl BlockIo for Faulty {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn direct(&self) -> bool {
        self.inner.direct()
    }

    fn register_pool(&self, pool: &crate::pool::BufferPool) -> bool {
        self.inner.register_pool(pool)
    }

    fn submit(&self, op: Op) -> Pending {
        if op.direction == self.fault.direction && SEEN.fetch_add(1, Ordering::SeqCst) + 1 == self.fault.nth {
            let source = std::io::Error::from_raw_os_error(self.fault.errno);
            tracing::warn!("{VAR}: failing this {} with {source}", op.direction.name());
            let result = Err(IoError::from_os(
                op.direction.name(),
                &op.file.path,
                op.offset,
                op.len,
                source,
            ));
            return Pending::ready(self.inner.name(), Done::new(op.buf, result));
        }
        self.inner.submit(op)
    }
}

/// `engine`, failing as `TIERZERO_IO_FAULT` says when it is set.
pub fn wrap(engine: Arc<dyn BlockIo>) -> Arc<dyn BlockIo> {
    match std::env::var(VAR).ok().and_then(|t| parse(&t).ok()) {
        Some(fault) => Arc::new(Faulty { inner: engine, fault }),
        None => engine,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_or_name_the_problem() {
        let f = parse("read@3:eio").unwrap();
        assert_eq!((f.direction, f.nth, f.errno), (Direction::Read, 3, libc::EIO));
        assert_eq!(parse("write@1:enospc").unwrap().errno, libc::ENOSPC);
        assert!(parse("read@3").unwrap_err().contains("read@N:errno"));
        assert!(parse("seek@3:eio")
            .unwrap_err()
            .contains("neither read nor write"));
        assert!(parse("read@0:eio").unwrap_err().contains("from 1"));
        assert!(parse("read@2:ebadf").unwrap_err().contains("not one of"));
    }
}
