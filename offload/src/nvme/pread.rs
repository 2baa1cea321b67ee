//! The portable engine: a pool of threads doing pread/pwrite.
//!
//! Runs on any filesystem and kernel; with O_DIRECT files it is also what a plain
//! synchronous loop does per thread. It is the oracle the io_uring engine is tested
//! against.

use super::{BlockIo, Direction, Done, EngineConfig, IoError, Op, Pending};
use crossbeam_channel::Sender;
use std::os::unix::fs::FileExt;
use std::thread::JoinHandle;

type Job = (Op, Sender<Done>);

pub struct Pread {
    jobs: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    direct: bool,
}

impl Pread {
    /// `config.parallelism × config.queue_depth` threads (each is one request in flight).
    pub fn new(config: EngineConfig, direct: bool) -> Result<Pread, IoError> {
        let threads = (config.parallelism * config.queue_depth).clamp(1, 64);
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let workers = (0..threads)
            .map(|i| -> Result<JoinHandle<()>, IoError> {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("tierzero-pread-{i}"))
                    .spawn(move || {
                        for (op, reply) in rx {
                            let done = execute(op);
                            // the waiter may have given up; the buffer then drops here
                            let _ = reply.send(done);
                        }
                    })
                    .map_err(|source| IoError::Os {
                        op: "spawn",
                        path: "(pread thread)".into(),
                        offset: 0,
                        len: 0,
                        source,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pread {
            jobs: Some(tx),
            workers,
            direct,
        })
    }
}

/// Runs one operation to completion on the calling thread.
pub fn execute(mut op: Op) -> Done {
    let result = transfer(&mut op);
    Done::new(op.buf, result)
}

fn transfer(op: &mut Op) -> Result<(), IoError> {
    op.validate()?;
    let name = op.direction.name();
    let file = op.file.clone();
    let mut done = 0;
    while done < op.len {
        let offset = op.offset + done as u64;
        let n = match op.direction {
            Direction::Read => file
                .file()
                .read_at(&mut op.buf.as_bytes_mut()[done..op.len], offset),
            Direction::Write => file.file().write_at(&op.buf.as_bytes()[done..op.len], offset),
        };
        match n {
            Ok(0) => {
                return Err(IoError::Short {
                    op: name,
                    path: file.path().to_path_buf(),
                    offset: op.offset,
                    expected: op.len,
                    got: done,
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(IoError::from_os(name, file.path(), offset, op.len - done, e)),
        }
    }
    Ok(())
}

impl BlockIo for Pread {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn submit(&self, op: Op) -> Pending {
        let (reply, pending) = Pending::channel("pread");
        match &self.jobs {
            Some(jobs) => {
                if let Err(crossbeam_channel::SendError((op, _))) = jobs.send((op, reply)) {
                    return Pending::ready("pread", Done::new(op.buf, Err(IoError::Shutdown("pread"))));
                }
            }
            None => return Pending::ready("pread", Done::new(op.buf, Err(IoError::Shutdown("pread")))),
        }
        pending
    }
}

impl Drop for Pread {
    fn drop(&mut self) {
        // closing the queue ends each worker after the jobs already queued
        self.jobs.take();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
