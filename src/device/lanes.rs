//! Lanes: ordered queues of device work with events, as CUDA streams are, on CPU threads.
//!
//! A rank issues work from one thread (the compute lane on CPU is that thread itself,
//! since tch computes synchronously there). Copies, NVMe reads and collectives go to
//! [`Lane`]s: each a FIFO worker thread that runs its jobs in submission order. Every
//! submission gets a sequence number; an [`Event`] is a lane and a sequence number, and
//! fires when the lane has finished that job (CUDA's `cudaEventRecord` after the job).
//! [`Lane::wait`] orders a lane after an event of another lane without blocking the
//! issuing thread (`cudaStreamWaitEvent`); [`Event::synchronize`] blocks the issuing
//! thread (`cudaEventSynchronize`).
//!
//! A buffer a lane reads or writes must not be reused before the lane is done with it:
//! [`Keep`] holds buffers until their event fires (`keep_until`, what FSDP2 and
//! ProcessGroupNCCL do instead of `record_stream`).
//!
//! On a GPU each lane also has a device stream ([`Streams`], the CUDA layer's torch pool
//! streams): its worker makes the stream torch's current one, so a job *queues* device
//! work and returns, and the job's event carries a device mark recorded after it. Every
//! job's stream first waits for the compute work the issuing thread had queued when it
//! submitted the job, so a lane sees what compute wrote before, as on CPU where compute
//! is synchronous; compute waits for a lane's result with [`Event::order_compute`]
//! (device-side on a GPU, a host wait on CPU). The engine's ordering is thus the same
//! code on both, and what CPU tests check about it holds on the GPU.
//!
//! **Checked mode** makes a missing wait visible: every lane job starts after a random
//! delay, so work that is not ordered by an event really runs late, and pools NaN-fill
//! every buffer the moment it becomes reusable (see `pool.rs`), so code that reads a
//! buffer before its producer's event, or releases it before its consumer's event,
//! computes with NaN and fails the equivalence tests.

use super::DeviceError;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// A point in a device stream's queue (a CUDA event): done once the device has run
/// everything queued on the stream before it.
pub trait DeviceMark: Send + Sync {
    /// Whether the device has got there (an error of the device's counts as not there:
    /// the host wait reports it).
    fn query(&self) -> bool;
    /// Blocks the calling thread until the device has got there.
    fn synchronize(&self) -> Result<(), DeviceError>;
    /// For the device's streams to recognise their own marks.
    fn as_any(&self) -> &dyn std::any::Any;
    /// Seconds the device took from `earlier` to this mark, both taken with
    /// [`Stream::timed_mark`] (waits for both); None where the device does not time them.
    fn seconds_since(&self, _earlier: &Mark) -> Option<f64> {
        None
    }
}

pub type Mark = Arc<dyn DeviceMark>;

/// A device stream (a CUDA stream).
pub trait Stream: Send + Sync {
    /// Makes this stream the calling thread's current one for torch (a lane's worker
    /// calls it before its first job).
    fn enter(&self) -> Result<(), DeviceError>;
    /// A mark of what is queued on the stream so far.
    fn mark(&self) -> Result<Mark, DeviceError>;
    /// A mark that also keeps the device's time ([`DeviceMark::seconds_since`]).
    fn timed_mark(&self) -> Result<Mark, DeviceError> {
        self.mark()
    }
    /// Later work on this stream waits for `mark` (the calling thread goes on).
    fn wait(&self, mark: &Mark) -> Result<(), DeviceError>;
    /// Queues device work that takes about `micros` microseconds (checked mode: a lane's
    /// job starts late on the device as it does on the host).
    fn delay(&self, micros: u64) -> Result<(), DeviceError>;
}

/// A rank's device streams: its lanes' and compute's. CPU devices have none (their work
/// is done when the call returns).
pub trait Streams: Send + Sync {
    /// Torch's current stream on the calling thread (compute, on the issuing thread).
    fn current(&self) -> Result<Arc<dyn Stream>, DeviceError>;
    /// The stream of lane `name` (the same one at every call).
    fn lane(&self, name: &'static str) -> Result<Arc<dyn Stream>, DeviceError>;
}

/// A job's device side: the mark recorded after it, once its worker has run it.
type Slot = Arc<OnceLock<Mark>>;

/// Why lane work did not complete.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LaneError {
    #[error("rank {rank}: {lane} lane: {message}")]
    Failed {
        rank: usize,
        lane: &'static str,
        message: String,
    },
    #[error("rank {rank}: {lane} lane stopped before its work was done")]
    Stopped { rank: usize, lane: &'static str },
}

/// How lanes run: plainly, or checked (random delays before each job; pools poison
/// reusable buffers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    #[default]
    Plain,
    /// Each job waits 0..`max_delay_us` microseconds first (seeded, reproducible).
    Checked { seed: u64, max_delay_us: u64 },
}

impl Mode {
    pub fn is_checked(self) -> bool {
        matches!(self, Mode::Checked { .. })
    }

    /// Checked mode's delay of the `n`th piece of device work of a stream salted by
    /// `salt` ([`Mode::salt`]), in microseconds (reproducible); none in plain mode.
    pub fn device_delay(self, salt: u64, n: u64) -> Option<u64> {
        match self {
            Mode::Checked { seed, max_delay_us } => Some(shuffle(seed ^ salt ^ n) % max_delay_us.max(1)),
            Mode::Plain => None,
        }
    }

    /// What checked mode mixes into the delays of stream `name` of `rank`.
    pub fn salt(name: &str, rank: usize) -> u64 {
        name.bytes().fold(rank as u64 + 1, |h, b| {
            h.wrapping_mul(31).wrapping_add(u64::from(b))
        })
    }

    /// [`Mode::salt`] for the `round` of stream `name` of `rank` (a step, a micro-batch),
    /// so that checked mode's delays differ from one round to the next.
    pub fn round_salt(name: &str, rank: usize, round: u64) -> u64 {
        Mode::salt(name, rank) ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// The mode tests run in: `TIERZERO_CHECKED_LANES=1` (or a seed) turns it on for
    /// any run; tests ask for it explicitly.
    pub fn from_env() -> Mode {
        match std::env::var("TIERZERO_CHECKED_LANES") {
            Ok(v) if !v.is_empty() && v != "0" => Mode::Checked {
                seed: v.parse().unwrap_or(1),
                max_delay_us: 300,
            },
            _ => Mode::Plain,
        }
    }
}

/// What a lane has finished, shared by the lane and its events.
struct Progress {
    done: Mutex<Finished>,
    changed: Condvar,
}

#[derive(Default)]
struct Finished {
    seq: u64,
    /// The first failure and its job's number: later jobs are skipped and every wait
    /// on that job or a later one reports it.
    failed: Option<(u64, String)>,
    stopped: bool,
}

/// A point in a lane's queue: fires when the lane has finished every job submitted
/// before it was recorded.
#[derive(Clone)]
pub struct Event {
    rank: usize,
    lane: &'static str,
    seq: u64,
    progress: Arc<Progress>,
    /// On a device: the job's mark, and the streams compute waits on.
    device: Option<(Slot, Arc<dyn Streams>)>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({} #{})", self.lane, self.seq)
    }
}

impl Event {
    /// An event that has already fired (work done on the issuing thread).
    pub fn done() -> Event {
        Event {
            rank: 0,
            lane: "compute",
            seq: 0,
            progress: Arc::new(Progress {
                done: Mutex::new(Finished::default()),
                changed: Condvar::new(),
            }),
            device: None,
        }
    }

    /// Whether the lane has finished the work before this event, on the device too (after
    /// a failure, once the skipped jobs' marks say the device is done with what was
    /// queued: nothing more will touch their buffers).
    pub fn query(&self) -> bool {
        let ran = {
            let done = self.progress.done.lock().unwrap_or_else(|e| e.into_inner());
            done.seq >= self.seq || done.stopped
        };
        ran && self.mark().is_none_or(|m| m.query())
    }

    /// The device mark of the event's job, once its worker has run it.
    fn mark(&self) -> Option<&Mark> {
        self.device.as_ref().and_then(|(slot, _)| slot.get())
    }

    /// The event's outcome if it has fired, without blocking.
    fn synchronize_now(&self) -> Option<Result<(), LaneError>> {
        self.query().then(|| self.synchronize())
    }

    /// Blocks the calling thread until the event fires (on a device: until the device has
    /// run the job's work); the lane's failure if it failed.
    pub fn synchronize(&self) -> Result<(), LaneError> {
        let ran = self.ran();
        // a failed job's mark too: what it queued before failing may still run
        let on_device = self.mark().map_or(Ok(()), |mark| mark.synchronize());
        ran?;
        on_device.map_err(|e| self.failed(e.to_string()))
    }

    /// Orders the calling thread's later compute after the event: on a device its
    /// current stream waits for the job's mark (the thread goes on once the job is
    /// queued); on CPU the thread waits for the job.
    pub fn order_compute(&self) -> Result<(), LaneError> {
        self.ran()?;
        match (&self.device, self.mark()) {
            (Some((_, streams)), Some(mark)) => streams
                .current()
                .and_then(|compute| compute.wait(mark))
                .map_err(|e| self.failed(e.to_string())),
            _ => Ok(()),
        }
    }

    fn failed(&self, message: String) -> LaneError {
        LaneError::Failed {
            rank: self.rank,
            lane: self.lane,
            message,
        }
    }

    /// Blocks until the lane's worker has run the job (queued it, on a device).
    fn ran(&self) -> Result<(), LaneError> {
        let mut done = self.progress.done.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // after a failure the later jobs are skipped quickly: their marks are set
            if done.seq >= self.seq {
                return match &done.failed {
                    Some((at, message)) if *at <= self.seq => Err(self.failed(message.clone())),
                    _ => Ok(()),
                };
            }
            if done.stopped {
                return Err(LaneError::Stopped {
                    rank: self.rank,
                    lane: self.lane,
                });
            }
            done = self
                .progress
                .changed
                .wait(done)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Why a lane job failed: any error of the work it did (the lane keeps its message for
/// the job's event and every later one).
pub type JobError = Box<dyn std::error::Error + Send + Sync>;

/// A job, called with `true` to run it, or `false` to skip it after an earlier failure
/// (on a device it still marks its stream, so waits on it cover what was queued before).
type Job<'env> = Box<dyn FnOnce(bool) -> Result<(), JobError> + Send + 'env>;

/// One FIFO lane of a rank (h2d, d2h, gather, reduce): a worker thread of `scope`.
pub struct Lane<'env> {
    rank: usize,
    name: &'static str,
    jobs: Option<Sender<Job<'env>>>,
    /// Serialises submissions, so sequence numbers follow queue order; holds the last
    /// job's device slot.
    submitting: Mutex<Option<Slot>>,
    submitted: AtomicU64,
    progress: Arc<Progress>,
    device: Option<OnDevice>,
    mode: Mode,
    /// Mixed into checked mode's random delays (the lane's name and rank).
    salt: u64,
    /// The thread that started the lane: the only one whose submissions order it (on a
    /// GPU the order of a rank's collectives on one stream must be the same on every
    /// rank, and that is the issuing thread's order).
    issuer: std::thread::ThreadId,
}

/// A lane's device side: its stream and the rank's streams.
#[derive(Clone)]
struct OnDevice {
    stream: Result<Arc<dyn Stream>, DeviceError>,
    streams: Arc<dyn Streams>,
}

impl<'env> Lane<'env> {
    /// Starts lane `name` of `rank` on a thread of `scope`; it runs until dropped.
    pub fn start<'scope>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        rank: usize,
        name: &'static str,
        mode: Mode,
    ) -> Lane<'env> {
        Lane::start_on(scope, rank, name, mode, None)
    }

    /// [`Lane::start`] on a device with `streams` (None: CPU devices): the lane's jobs
    /// queue their device work on the lane's stream.
    pub fn start_on<'scope>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        rank: usize,
        name: &'static str,
        mode: Mode,
        streams: Option<Arc<dyn Streams>>,
    ) -> Lane<'env> {
        let device = streams.map(|streams| OnDevice {
            stream: streams.lane(name),
            streams,
        });
        let (jobs, queue) = crossbeam_channel::unbounded::<Job<'env>>();
        let progress = Arc::new(Progress {
            done: Mutex::new(Finished::default()),
            changed: Condvar::new(),
        });
        let worker = progress.clone();
        let salt = Mode::salt(name, rank);
        let enter = device.as_ref().map(|d| d.stream.clone());
        scope.spawn(move || {
            // torch queues this thread's device work on the lane's stream; if that fails,
            // every job fails with the reason
            let entered = match enter {
                Some(stream) => stream.and_then(|s| s.enter()),
                None => Ok(()),
            };
            serve(queue, worker, (name, mode, salt), entered)
        });
        Lane {
            rank,
            name,
            jobs: Some(jobs),
            submitting: Mutex::new(None),
            submitted: AtomicU64::new(0),
            progress,
            device,
            mode,
            salt,
            issuer: std::thread::current().id(),
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Queues `job` after everything submitted before; returns the event of its end.
    /// On a device the job's stream first waits for the compute work queued so far on
    /// the calling thread, and the event's mark follows the device work the job queued.
    pub fn submit(&self, job: impl FnOnce() -> Result<(), JobError> + Send + 'env) -> Event {
        // only the issuing thread orders a lane: a job submitted from another fails (its
        // event, and every later one, reports why) instead of racing the issuer's order
        let foreign = std::thread::current().id() != self.issuer;
        let job = move || {
            if foreign {
                return Err("submitted from a thread other than the lane's issuing thread".into());
            }
            job()
        };
        let mut last = self.submitting.lock().unwrap_or_else(|e| e.into_inner());
        // counted only when queued (below): a submission that fails half way leaves no gap
        let seq = self.submitted.load(Ordering::SeqCst) + 1;
        let (job, slot): (Job<'env>, Option<Slot>) = match &self.device {
            None => (Box::new(move |run: bool| if run { job() } else { Ok(()) }), None),
            Some(device) => {
                let slot = Slot::default();
                // taken here, on the issuing thread: what compute had queued at submission
                let after = device.streams.current().and_then(|compute| compute.mark());
                let (stream, filled) = (device.stream.clone(), slot.clone());
                // checked mode on a device: the job's device work starts late too
                let delay = self.mode.device_delay(self.salt, seq);
                let on_device = move |run: bool| {
                    let stream = stream?;
                    let outcome = if run {
                        stream.wait(&after?)?;
                        if let Some(micros) = delay {
                            stream.delay(micros)?;
                        }
                        job()
                    } else {
                        Ok(())
                    };
                    // a mark even after a failure: whatever the job queued is covered
                    let _ = filled.set(stream.mark()?);
                    outcome
                };
                (Box::new(on_device), Some(slot))
            }
        };
        self.submitted.store(seq, Ordering::SeqCst);
        if let Some(jobs) = &self.jobs {
            // a closed queue means the worker is gone: the event reports it as stopped
            let _ = jobs.send(job);
        }
        *last = slot.clone();
        self.event(seq, slot)
    }

    /// The event of everything submitted so far.
    pub fn record(&self) -> Event {
        let last = self.submitting.lock().unwrap_or_else(|e| e.into_inner());
        self.event(self.submitted.load(Ordering::SeqCst), last.clone())
    }

    /// Orders this lane's later work after `event` (the issuing thread goes on; on a
    /// device the lane's stream waits for the event's mark).
    pub fn wait(&self, event: &Event) -> Event {
        if event.synchronize_now().is_some_and(|r| r.is_ok()) {
            return self.record();
        }
        let event = event.clone();
        let stream = self.device.as_ref().map(|d| d.stream.clone());
        self.submit(move || {
            event.ran()?;
            if let (Some(stream), Some(mark)) = (stream, event.mark()) {
                stream?.wait(mark)?;
            }
            Ok(())
        })
    }

    fn event(&self, seq: u64, slot: Option<Slot>) -> Event {
        Event {
            rank: self.rank,
            lane: self.name,
            seq,
            progress: self.progress.clone(),
            device: slot.zip(self.device.as_ref().map(|d| d.streams.clone())),
        }
    }
}

impl Drop for Lane<'_> {
    /// Hangs up; the worker finishes the queued jobs and exits (the scope joins it).
    fn drop(&mut self) {
        self.jobs = None;
    }
}

/// The worker: runs jobs in order; after a failure it skips the rest (their events
/// report the failure), as a CUDA stream in an error state does.
fn serve(
    queue: Receiver<Job<'_>>,
    progress: Arc<Progress>,
    (name, mode, salt): (&'static str, Mode, u64),
    entered: Result<(), DeviceError>,
) {
    let mut rng = match mode {
        Mode::Checked { seed, .. } => seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        Mode::Plain => 0,
    };
    for job in queue {
        let failed = progress.done.lock().map_or(true, |d| d.failed.is_some());
        let outcome = if failed {
            // skipped, its event reports the failure
            let _ = job(false);
            Ok(())
        } else if let Err(message) = &entered {
            let _ = job(false);
            Err(format!("its device stream: {message}"))
        } else {
            if let Mode::Checked { max_delay_us, .. } = mode {
                // a reproducible delay per job
                rng = shuffle(rng);
                std::thread::sleep(Duration::from_micros(rng % max_delay_us.max(1)));
            }
            // checked mode: a blocking copy between host and a GPU in the job fails it
            let run = || match mode {
                Mode::Checked { .. } => crate::torch::in_checked_lane(name, || job(true)),
                Mode::Plain => job(true),
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                Ok(ran) => ran.map_err(|e| e.to_string()),
                Err(panic) => Err(panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "lane job panicked".into())),
            }
        };
        let mut done = progress.done.lock().unwrap_or_else(|e| e.into_inner());
        done.seq += 1;
        if let Err(message) = outcome {
            let at = done.seq;
            done.failed.get_or_insert((at, message));
        }
        progress.changed.notify_all();
    }
    let mut done = progress.done.lock().unwrap_or_else(|e| e.into_inner());
    done.stopped = true;
    progress.changed.notify_all();
}

/// One xorshift64 step: checked mode's reproducible random delays.
fn shuffle(mut x: u64) -> u64 {
    x |= 1;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// Buffers held until the events of their last uses fire (`keep_until`).
#[derive(Default)]
pub struct Keep {
    held: Vec<(Event, Box<dyn Send>)>,
}

impl Keep {
    /// Holds `buffer` until `event` fires.
    pub fn keep_until<B: Send + 'static>(&mut self, buffer: B, event: Event) {
        self.collect();
        self.held.push((event, Box::new(buffer)));
    }

    /// Drops what is no longer in use; returns how many are still held.
    pub fn collect(&mut self) -> usize {
        self.held.retain(|(event, _)| !event.query());
        self.held.len()
    }

    /// Waits for every held buffer's event and drops them all.
    pub fn drain(&mut self) {
        for (event, _) in &self.held {
            let _ = event.synchronize();
        }
        self.held.clear();
    }
}

impl Drop for Keep {
    fn drop(&mut self) {
        self.drain();
    }
}

#[cfg(test)]
mod tests;
