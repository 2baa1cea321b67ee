//! Block I/O on NVMe: asynchronous reads and writes of aligned buffers at file offsets.
//!
//! One trait, [`BlockIo`], two engines in their own files, like crossbeam-channel's
//! flavors: [`uring::Uring`] (io_uring, O_DIRECT, registered fixed buffers, requests split
//! by `aio.block_size`, `aio.queue_depth` in flight per ring, `intra_op_parallelism`
//! rings) and [`pread::Pread`] (a thread pool over pread/pwrite, which runs anywhere and
//! is the test oracle). [`probe`] checks the kernel and the directory at start-up and
//! [`open_engine`] falls back to `Pread`, saying why, when io_uring or O_DIRECT is not
//! available. [`swap`] builds the optimizer-state store on top.
//!
//! An [`Op`] owns its buffer while in flight; [`Pending::wait`] hands it back with the
//! result, error or not, so nothing is lost on failure.

pub mod fault;
pub mod pread;
pub mod probe;
pub mod swap;
pub mod uring;

pub use probe::{probe, ProbeReport};

use crate::pool::{BufferPool, IoBuf};
use crossbeam_channel::{Receiver, Sender};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// O_DIRECT alignment of offsets, lengths and buffers used everywhere (the largest
/// logical block size in use; `statx` DIOALIGN reports 512 on the disks here).
pub const DIRECT_ALIGN: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{op} {path} at offset {offset} (+{len} bytes): {source}")]
    Os {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        len: usize,
        source: std::io::Error,
    },
    #[error("no space left on the device holding {path} (writing {len} bytes at offset {offset}); free space or point nvme_path elsewhere")]
    NoSpace { path: PathBuf, offset: u64, len: usize },
    #[error(
        "{op} {path} at offset {offset}: short transfer, {got} of {expected} bytes (is the file truncated?)"
    )]
    Short {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        expected: usize,
        got: usize,
    },
    #[error("{op} {path}: offset {offset} and length {len} must be multiples of {align} bytes for O_DIRECT")]
    Misaligned {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        len: usize,
        align: u64,
    },
    #[error("{op} {path}: the {capacity}-byte buffer is smaller than the {len}-byte transfer")]
    BufferTooSmall {
        op: &'static str,
        path: PathBuf,
        len: usize,
        capacity: usize,
    },
    #[error("checksum mismatch in {path} at offset {offset} ({len} bytes): stored {expected:08x}, read {got:08x}; the swap file is corrupted")]
    Checksum {
        path: PathBuf,
        offset: u64,
        len: usize,
        expected: u32,
        got: u32,
    },
    #[error("{path}: {message}")]
    Store { path: PathBuf, message: String },
    #[error("the {0} I/O engine has shut down")]
    Shutdown(&'static str),
}

impl IoError {
    /// Maps an OS error of a transfer, turning ENOSPC into its own variant.
    pub fn from_os(
        op: &'static str,
        path: &Path,
        offset: u64,
        len: usize,
        source: std::io::Error,
    ) -> IoError {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            return IoError::NoSpace {
                path: path.to_path_buf(),
                offset,
                len,
            };
        }
        IoError::Os {
            op,
            path: path.to_path_buf(),
            offset,
            len,
            source,
        }
    }
}

/// A file opened for block I/O, with the path errors name.
#[derive(Debug)]
pub struct BlockFile {
    file: File,
    path: PathBuf,
    direct: bool,
}

impl BlockFile {
    /// Opens (or with `create`, creates) `path` for reading and writing, with O_DIRECT
    /// when `direct`.
    pub fn open(path: &Path, create: bool, direct: bool) -> Result<Arc<BlockFile>, IoError> {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(create);
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = options.open(path).map_err(|source| IoError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Arc::new(BlockFile {
            file,
            path: path.to_path_buf(),
            direct,
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Reserves `[0, len)` on disk (fallocate), so ENOSPC surfaces now, not mid-step.
    pub fn preallocate(&self, len: u64) -> Result<(), IoError> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a plain syscall on an fd we own.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, len as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        match error.raw_os_error() {
            // filesystems without fallocate: extend the file instead
            Some(libc::EOPNOTSUPP) => self
                .file
                .set_len(len)
                .map_err(|e| IoError::from_os("extend", &self.path, 0, len as usize, e)),
            _ => Err(IoError::from_os(
                "preallocate",
                &self.path,
                0,
                len as usize,
                error,
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Read,
    Write,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }
}

/// One transfer of `len` bytes between `buf` and `file` at `offset`.
#[derive(Debug)]
pub struct Op {
    pub direction: Direction,
    pub file: Arc<BlockFile>,
    pub offset: u64,
    pub len: usize,
    pub buf: IoBuf,
}

impl Op {
    pub fn read(file: &Arc<BlockFile>, offset: u64, len: usize, buf: IoBuf) -> Op {
        Op {
            direction: Direction::Read,
            file: file.clone(),
            offset,
            len,
            buf,
        }
    }

    pub fn write(file: &Arc<BlockFile>, offset: u64, len: usize, buf: IoBuf) -> Op {
        Op {
            direction: Direction::Write,
            file: file.clone(),
            offset,
            len,
            buf,
        }
    }

    /// Checks the buffer size and, for O_DIRECT files, the alignment.
    fn validate(&self) -> Result<(), IoError> {
        let op = self.direction.name();
        if self.len > self.buf.capacity() {
            return Err(IoError::BufferTooSmall {
                op,
                path: self.file.path.clone(),
                len: self.len,
                capacity: self.buf.capacity(),
            });
        }
        if self.file.direct
            && (!self.offset.is_multiple_of(DIRECT_ALIGN) || !(self.len as u64).is_multiple_of(DIRECT_ALIGN))
        {
            return Err(IoError::Misaligned {
                op,
                path: self.file.path.clone(),
                offset: self.offset,
                len: self.len,
                align: DIRECT_ALIGN,
            });
        }
        Ok(())
    }
}

/// What comes back from an operation: the buffer, always, the result, and when the
/// engine had it (io_uring without `overlap_events` reaps a whole batch at once: each of
/// its operations is stamped when the batch's last one completed).
#[derive(Debug)]
pub struct Done {
    pub buf: IoBuf,
    pub result: Result<(), IoError>,
    pub at: std::time::Instant,
}

impl Done {
    /// An operation finished now.
    pub fn new(buf: IoBuf, result: Result<(), IoError>) -> Done {
        Done {
            buf,
            result,
            at: std::time::Instant::now(),
        }
    }

    /// The buffer if the transfer succeeded.
    pub fn into_result(self) -> Result<IoBuf, IoError> {
        self.result.map(|()| self.buf)
    }
}

/// An operation in flight.
#[must_use = "an operation's buffer comes back only through wait()"]
pub struct Pending {
    rx: Receiver<Done>,
    engine: &'static str,
}

impl Pending {
    /// A channel pair: engines complete through the sender.
    pub(crate) fn channel(engine: &'static str) -> (Sender<Done>, Pending) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        (tx, Pending { rx, engine })
    }

    /// An operation that finished before it started (validation failed).
    pub(crate) fn ready(engine: &'static str, done: Done) -> Pending {
        let (tx, pending) = Pending::channel(engine);
        // the receiver is alive and the channel has room for one
        let _ = tx.send(done);
        pending
    }

    /// Blocks until the operation completes.
    pub fn wait(self) -> Result<Done, IoError> {
        self.rx.recv().map_err(|_| IoError::Shutdown(self.engine))
    }
}

/// Asynchronous block I/O on aligned buffers.
pub trait BlockIo: Send + Sync {
    /// `"uring"` or `"pread"`.
    fn name(&self) -> &'static str;
    /// Whether files for this engine should be opened with O_DIRECT.
    fn direct(&self) -> bool;
    /// Starts the transfer; returns at once.
    fn submit(&self, op: Op) -> Pending;
    /// Registers `pool`'s buffers with the engine, so that transfers into and out of them
    /// skip pinning their pages each time (io_uring's fixed buffers); the engine keeps the
    /// pool until it is dropped. False where it cannot (the transfers work all the same).
    fn register_pool(&self, pool: &crate::pool::BufferPool) -> bool {
        let _ = pool;
        false
    }
}

/// Settings shared by both engines (DeepSpeed's `aio` section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub block_size: usize,
    pub queue_depth: usize,
    /// io_uring rings (Uring) or worker threads (Pread).
    pub parallelism: usize,
    pub single_submit: bool,
    pub overlap_events: bool,
}

impl Default for EngineConfig {
    /// DeepSpeed's `aio` defaults.
    fn default() -> Self {
        EngineConfig {
            block_size: 1 << 20,
            queue_depth: 8,
            parallelism: 1,
            single_submit: false,
            overlap_events: true,
        }
    }
}

/// Which engine to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring with O_DIRECT where the probe allows, else pread.
    Auto,
    Uring,
    Pread,
}

/// Opens the best engine for `dir`. The reason for a fallback is logged and returned.
pub fn open_engine(
    dir: &Path,
    config: EngineConfig,
    pool: Option<&BufferPool>,
    choice: EngineChoice,
) -> Result<(Arc<dyn BlockIo>, ProbeReport), IoError> {
    let report = probe(dir)?;
    let direct = report.direct.is_ok();
    let use_uring = match choice {
        EngineChoice::Pread => false,
        EngineChoice::Uring => true,
        EngineChoice::Auto => report.uring.is_ok() && direct,
    };
    if use_uring {
        match uring::Uring::new(config, direct, pool) {
            Ok(engine) => return Ok((Arc::new(engine), report)),
            Err(e) if choice == EngineChoice::Auto => {
                tracing::warn!("io_uring engine failed to start ({e}); using the pread engine");
            }
            Err(e) => return Err(e),
        }
    } else if choice == EngineChoice::Auto {
        tracing::warn!(
            "using the pread engine for {}: {}",
            dir.display(),
            report.fallback_reason()
        );
    }
    Ok((Arc::new(pread::Pread::new(config, direct)?), report))
}

#[cfg(test)]
pub(crate) mod tests;
