//! The simulated device: a rank's streams keep virtual clocks, so the engine's own
//! schedule, run on CPU tensors with its real math, tells how long a step would take on
//! a profiled machine (`tierzero train --simulate PROFILE`).
//!
//! It sits behind the Device seam as the CUDA streams do ([`Streams`], [`Stream`],
//! [`DeviceMark`]): the rank's thread issues compute on the compute stream, each lane's
//! worker enters the lane's stream, the optimizer thread its own. Work is charged to the
//! calling thread's stream with [`charge`]: the engine names each piece where it does it
//! (a unit's forward, a copy of so many bytes, a collective, an NVMe read, an AdamW
//! sweep), and the stream's clock advances by what the piece costs on the profile
//! (`plan::simulate::costs`, the prices the dry-run replay uses too). A mark is a
//! stream's virtual time; waiting for one moves the waiting stream's clock to it; a
//! host wait moves the calling thread's stream. The payload runs as on a CPU device
//! (every job done when its event fires), so the losses are a CPU run's, bit for bit;
//! only the clocks are the profiled machine's. Whatever orders work outside the seam
//! leaves the clocks unordered: the simulation shows it as a step that is too short.

use super::lanes::{DeviceMark, Mark, Stream, Streams};
use super::DeviceError;
use crate::plan::simulate::costs::{Costs, Work};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

thread_local! {
    /// The simulated stream the calling thread issues on, once it has entered one.
    static ENTERED: RefCell<Option<SimStream>> = const { RefCell::new(None) };
}

/// Distinguishes the simulated devices of one process (a thread may outlive a run).
static DEVICES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Work charged while [`deferring`], kept to be charged later.
    static DEFERRED: RefCell<Option<Vec<Work>>> = const { RefCell::new(None) };
}

/// Charges `work` to the calling thread's simulated stream (nothing on other devices).
pub fn charge(work: Work) {
    let kept = DEFERRED.with(|d| match d.borrow_mut().as_mut() {
        Some(later) => {
            later.push(work);
            true
        }
        None => false,
    });
    if kept {
        return;
    }
    ENTERED.with(|e| {
        if let Some(stream) = e.borrow().as_ref() {
            stream.run(work);
        }
    });
}

/// Runs `f`, keeping the work it charges instead of charging it (work a GPU does later
/// than the payload of a simulated device runs it), and returns that work too.
pub fn deferring<R>(f: impl FnOnce() -> R) -> (R, Vec<Work>) {
    let outer = DEFERRED.with(|d| d.borrow_mut().replace(Vec::new()));
    let result = f();
    let kept = DEFERRED.with(|d| std::mem::replace(&mut *d.borrow_mut(), outer));
    (result, kept.unwrap_or_default())
}

/// Whether the calling thread's simulated stream is a GPU's (false on other devices): the
/// engine charges the work a GPU does where a CPU device's differs.
pub fn gpu() -> bool {
    ENTERED.with(|e| e.borrow().as_ref().is_some_and(|s| s.0.costs.cuda()))
}

/// The calling thread's simulated stream, for work that other threads do on its behalf
/// (the NVMe pipeline's legs are the optimizer thread's).
pub fn entered() -> Option<SimStream> {
    ENTERED.with(|e| e.borrow().clone())
}

#[derive(Debug, Default)]
struct Clock {
    /// Virtual seconds.
    now: f64,
    /// Busy seconds per phase.
    busy: BTreeMap<&'static str, f64>,
    /// Seconds spent waiting for other streams' marks.
    waited: f64,
    /// When every rank has done what the stream's work so far waited for (the other
    /// ranks' turns at the disk after this rank's transfers), which its collectives wait
    /// for (`Clocks::meet`).
    peers: f64,
    /// The stream's disk: its NVMe transfers one at a time, each rank's in turn (the
    /// replay's `Clocks::disk_per_track`).
    disk: crate::plan::simulate::disk::Disk,
    /// Every piece of work and wait, when the run writes a trace.
    spans: Option<Vec<Span>>,
}

impl Clock {
    /// `work` from `start` to `end`: its phase's busy time, the clock at least at `end`,
    /// and its span when tracing.
    fn busy_with(&mut self, work: Work, start: f64, end: f64) {
        *self.busy.entry(work.phase()).or_default() += end - start;
        self.now = self.now.max(end);
        self.span(work.phase(), work.unit(), start, end);
    }

    /// Keeps a span for the trace, when tracing.
    fn span(&mut self, phase: &'static str, unit: Option<usize>, start: f64, end: f64) {
        if let Some(spans) = self.spans.as_mut() {
            spans.push(Span {
                phase,
                unit,
                start,
                end,
            });
        }
    }
}

/// A piece of work (its phase and unit) or a wait (phase "wait"), in virtual seconds.
#[derive(Clone, Copy, Debug)]
struct Span {
    phase: &'static str,
    unit: Option<usize>,
    start: f64,
    end: f64,
}

struct StreamState {
    name: &'static str,
    device: usize,
    costs: Arc<Costs>,
    clock: Mutex<Clock>,
}

/// One simulated stream: a virtual clock that work advances.
#[derive(Clone)]
pub struct SimStream(Arc<StreamState>);

impl SimStream {
    fn new(name: &'static str, device: usize, costs: Arc<Costs>, trace: bool) -> SimStream {
        SimStream(Arc::new(StreamState {
            name,
            device,
            costs,
            clock: Mutex::new(Clock {
                spans: trace.then(Vec::new),
                ..Clock::default()
            }),
        }))
    }

    fn clock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.0.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Advances the clock by what `work` costs. A stream's NVMe transfers go one at a
    /// time in its order on a disk of its own (streams share none, or the clocks would
    /// depend on the order the threads run in: `Clocks::disk_per_track`), each taking its
    /// turn there (`disk::Disk::take`: the stream goes on once the rank's own bytes are
    /// in); a collective starts once every rank has reached it, its wait for them a wait
    /// (`Clocks::meet`).
    pub fn run(&self, work: Work) {
        let mut clock = self.clock();
        let start = clock.now;
        match work {
            Work::NvmeRead(_) | Work::NvmeWrite(_) => {
                let turn = clock.disk.take(start, self.0.costs.transfer(work), 0);
                clock.peers = clock.peers.max(turn.all);
                clock.busy_with(work, turn.own.0, turn.own.1);
            }
            Work::Collective(_) | Work::Gather(_) | Work::Latency => {
                // the wait for the other ranks' turns is a wait, as the engine records it
                let at = start.max(clock.peers);
                if at > start {
                    clock.waited += at - start;
                    clock.span("wait", None, start, at);
                }
                clock.busy_with(work, at, at + self.0.costs.seconds(work));
            }
            _ => {
                let seconds = self.0.costs.seconds(work);
                clock.busy_with(work, start, start + seconds);
            }
        }
    }

    /// Later collectives on the stream end no earlier than every rank's work up to `at`
    /// (transfers the stream's thread placed on a disk of its own).
    pub fn after_peers(&self, at: f64) {
        let mut clock = self.clock();
        clock.peers = clock.peers.max(at);
    }

    /// Seconds `work` takes on this stream's machine.
    pub fn seconds(&self, work: Work) -> f64 {
        self.0.costs.seconds(work)
    }

    /// An NVMe transfer's time on this stream's machine: its disk's, and beyond it.
    pub fn transfer(&self, work: Work) -> crate::plan::simulate::costs::Transfer {
        self.0.costs.transfer(work)
    }

    /// A read of NVMe optimizer state submitted ahead of its update (`Costs::read_ahead`).
    pub fn read_ahead(&self, bytes: u64) -> crate::plan::simulate::costs::Transfer {
        self.0.costs.read_ahead(bytes)
    }

    /// What one unit's NVMe AdamW pipeline run takes beyond its legs (`Costs`).
    pub fn pipeline_overhead(&self) -> f64 {
        self.0.costs.pipeline_overhead()
    }

    /// Counts `work` done from `start` to `end` beside the stream's own order (a pipeline
    /// the stream's thread runs on others), and keeps the stream busy until `end`.
    pub fn overlapped(&self, work: Work, start: f64, end: f64) {
        self.clock().busy_with(work, start, end);
    }

    /// Counts `work` done from `start` to `end` on a second engine of the stream (a GPU's
    /// copy engine beside the thread that queued the copy), without moving the clock.
    pub fn beside(&self, work: Work, start: f64, end: f64) {
        let mut clock = self.clock();
        let now = clock.now;
        clock.busy_with(work, start, end);
        clock.now = now;
    }

    /// The thread's wait for a copy out of the device that is in at `at`: when it is not
    /// in yet, the clock goes on from `at` plus the thread's wake-up after such a wait.
    pub fn wait_for_copy(&self, at: f64) {
        if at > self.now() {
            self.wait_until(at + self.0.costs.d2h_wait());
        }
    }

    /// Later work starts no earlier than `at`, its collectives than `peers`.
    fn wait_for(&self, SimMark { at, peers }: SimMark) {
        self.after_peers(peers);
        self.wait_until(at);
    }

    /// Later work starts no earlier than `at`.
    fn wait_until(&self, at: f64) {
        let mut clock = self.clock();
        if at > clock.now {
            let start = clock.now;
            clock.waited += at - start;
            clock.now = at;
            clock.span("wait", None, start, at);
        }
    }

    pub fn now(&self) -> f64 {
        self.clock().now
    }

    /// A mark of the stream's time now.
    fn point(&self) -> SimMark {
        let clock = self.clock();
        SimMark {
            at: clock.now,
            peers: clock.peers,
        }
    }
}

/// A point in a simulated stream: its virtual time when the mark was taken, and when
/// every rank had done the same.
#[derive(Clone, Copy, Debug)]
pub struct SimMark {
    at: f64,
    peers: f64,
}

impl SimMark {
    /// The calling thread's stream goes on from the mark's time (a wait of work that is
    /// handed over outside the lanes, as the optimizer thread's updates are).
    pub fn wait_here(self) {
        if let Some(stream) = entered() {
            stream.wait_for(self);
        }
    }
}

impl DeviceMark for SimMark {
    /// Whether the calling thread's stream is past the mark (the payload is done once the
    /// lane's job has run, as on a CPU device; its time is the clocks'): a thread that
    /// finds a reduction's buffers free early on a GPU finds them so here, and one that
    /// would wait, waits.
    fn query(&self) -> bool {
        entered().is_none_or(|s| s.now() >= self.at)
    }

    /// A host wait: the calling thread's stream goes on from the mark's time.
    fn synchronize(&self) -> Result<(), DeviceError> {
        self.wait_here();
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Stream for SimStream {
    fn enter(&self) -> Result<(), DeviceError> {
        ENTERED.with(|e| *e.borrow_mut() = Some(self.clone()));
        Ok(())
    }

    fn mark(&self) -> Result<Mark, DeviceError> {
        Ok(Arc::new(self.point()))
    }

    fn wait(&self, mark: &Mark) -> Result<(), DeviceError> {
        let mark = mark
            .as_any()
            .downcast_ref::<SimMark>()
            .ok_or(DeviceError::ForeignMark)?;
        self.wait_for(*mark);
        Ok(())
    }

    /// Checked mode's delays are the host's; virtual time does not see them.
    fn delay(&self, _micros: u64) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// One stream's share of the simulated run so far.
#[derive(Clone, Debug)]
pub struct StreamFigures {
    pub name: &'static str,
    pub now: f64,
    pub busy: BTreeMap<&'static str, f64>,
    pub waited: f64,
}

/// One step on the simulated device: its virtual seconds (the compute stream's, from the
/// step's start to its end, waits included) and each stream's busy and waiting seconds
/// in it. `tokens_per_s` and `mfu` (against the profile's peak, every rank's) are filled
/// in by whoever knows the step's tokens.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SimulatedStep {
    pub profile: String,
    pub step_seconds: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// The profile's dense peak in the training precision, FLOP/s of one rank.
    #[serde(skip)]
    pub rank_peak: f64,
    /// Busy seconds per stream and phase.
    pub busy: BTreeMap<&'static str, BTreeMap<&'static str, f64>>,
    /// Seconds each stream waited for others.
    pub waited: BTreeMap<&'static str, f64>,
}

/// A rank's simulated streams: compute (the rank's thread), one per lane, the optimizer's.
pub struct SimStreams {
    id: usize,
    trace: bool,
    costs: Arc<Costs>,
    compute: SimStream,
    others: Mutex<Vec<SimStream>>,
}

impl SimStreams {
    /// The streams of one rank priced by `costs`, keeping every span for a trace when
    /// `trace`; the calling thread issues compute.
    pub fn new(costs: Arc<Costs>, trace: bool) -> SimStreams {
        let id = DEVICES.fetch_add(1, Ordering::Relaxed);
        let compute = SimStream::new("compute", id, costs.clone(), trace);
        let _ = compute.enter();
        SimStreams {
            id,
            trace,
            costs,
            compute,
            others: Mutex::new(Vec::new()),
        }
    }

    /// The stream named `name` (made at its first use).
    pub fn stream(&self, name: &'static str) -> SimStream {
        let mut others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = others.iter().find(|s| s.0.name == name) {
            return s.clone();
        }
        let s = SimStream::new(name, self.id, self.costs.clone(), self.trace);
        others.push(s.clone());
        s
    }

    /// The compute stream's virtual time.
    pub fn now(&self) -> f64 {
        self.compute.now()
    }

    /// The step between two [`Self::figures`].
    pub fn step(&self, before: &[StreamFigures], after: &[StreamFigures]) -> SimulatedStep {
        let earlier = |name: &str| before.iter().find(|f| f.name == name);
        let mut step = SimulatedStep {
            profile: self.costs.profile().name.clone(),
            rank_peak: self.costs.profile().peak_flops(self.costs.precision()),
            ..SimulatedStep::default()
        };
        for f in after {
            let was = earlier(f.name);
            if f.name == "compute" {
                step.step_seconds = f.now - was.map_or(0.0, |w| w.now);
            }
            let busy = f
                .busy
                .iter()
                .map(|(&phase, &s)| {
                    let before = was.and_then(|w| w.busy.get(phase)).copied().unwrap_or(0.0);
                    (phase, s - before)
                })
                .filter(|(_, s)| *s > 0.0)
                .collect();
            step.busy.insert(f.name, busy);
            step.waited
                .insert(f.name, f.waited - was.map_or(0.0, |w| w.waited));
        }
        step
    }

    /// The run's spans as Chrome trace events in virtual time: process `rank`, one
    /// thread per stream (empty unless made with `trace`).
    pub fn trace_events(&self, rank: usize) -> Vec<serde_json::Value> {
        let others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        let mut events = Vec::new();
        for s in std::iter::once(&self.compute).chain(others.iter()) {
            for span in s.clock().spans.iter().flatten() {
                let name = match span.unit {
                    Some(u) => format!("{} {u}", span.phase),
                    None => span.phase.to_string(),
                };
                events.push(serde_json::json!({
                    "name": name, "ph": "X", "pid": rank, "tid": s.0.name,
                    "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6,
                }));
            }
        }
        events
    }

    /// Every stream's clock and busy time so far, compute first.
    pub fn figures(&self) -> Vec<StreamFigures> {
        let others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        std::iter::once(&self.compute)
            .chain(others.iter())
            .map(|s| {
                let clock = s.clock();
                StreamFigures {
                    name: s.0.name,
                    now: clock.now,
                    busy: clock.busy.clone(),
                    waited: clock.waited,
                }
            })
            .collect()
    }
}

impl Streams for SimStreams {
    /// The calling thread's stream if it entered one of this device's, else compute.
    fn current(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        let own = entered().filter(|s| s.0.device == self.id);
        Ok(Arc::new(own.unwrap_or_else(|| self.compute.clone())))
    }

    fn lane(&self, name: &'static str) -> Result<Arc<dyn Stream>, DeviceError> {
        Ok(Arc::new(self.stream(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::simulate::profile::Profile;

    fn streams() -> SimStreams {
        let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json");
        let plan = crate::plan::load(&config, &[], Default::default()).unwrap().plan;
        let profile = Profile::load("h100-pcie5").unwrap();
        SimStreams::new(Arc::new(Costs::new(&plan, &profile)), false)
    }

    #[test]
    fn work_advances_the_issuing_threads_stream_and_waits_follow_marks() {
        let sim = streams();
        let copy = sim.stream("h2d");
        let before = sim.now();
        charge(Work::Forward(1));
        let forward = sim.now() - before;
        assert!(forward > 0.0);
        // a lane's work is its own: compute does not move
        let lane = copy.clone();
        std::thread::scope(|s| {
            s.spawn(move || {
                lane.enter().unwrap();
                charge(Work::H2d(1 << 30));
            });
        });
        assert_eq!(sim.now() - before, forward);
        // compute waits for the lane's mark: its clock moves to the lane's time
        let mark = copy.mark().unwrap();
        sim.current().unwrap().wait(&mark).unwrap();
        assert_eq!(sim.now(), copy.now());
        // a host wait on the compute thread does the same
        let later = SimMark {
            at: sim.now() + 1.0,
            peers: 0.0,
        };
        later.synchronize().unwrap();
        assert_eq!(sim.now(), copy.now() + 1.0);
    }
}
