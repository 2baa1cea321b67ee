//! The lanes' tests: order, events, failures, the issuer rule, kept buffers, and lanes on
//! a recording device (marks, waits, checked delays).

use super::*;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

#[test]
fn jobs_run_in_order_and_events_fire_after_their_job() {
    let log = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let lane = Lane::start(
            s,
            0,
            "h2d",
            Mode::Checked {
                seed: 7,
                max_delay_us: 500,
            },
        );
        let mut events = Vec::new();
        for i in 0..20 {
            let log = &log;
            events.push(lane.submit(move || {
                log.lock().unwrap().push(i);
                Ok(())
            }));
        }
        events[9].synchronize().unwrap();
        assert!(log.lock().unwrap().len() >= 10);
        lane.record().synchronize().unwrap();
        assert_eq!(*log.lock().unwrap(), (0..20).collect::<Vec<_>>());
    });
}

#[test]
fn a_lane_waits_for_another_lanes_event_without_blocking_the_issuer() {
    let value = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let (h2d, gather) = (
            Lane::start(
                s,
                1,
                "h2d",
                Mode::Checked {
                    seed: 3,
                    max_delay_us: 2000,
                },
            ),
            Lane::start(s, 1, "gather", Mode::Plain),
        );
        let value = &value;
        let written = h2d.submit(move || {
            std::thread::sleep(Duration::from_millis(20));
            value.store(42, Ordering::SeqCst);
            Ok(())
        });
        gather.wait(&written);
        let seen = Arc::new(AtomicUsize::new(0));
        let reader = seen.clone();
        let read = gather.submit(move || {
            reader.store(value.load(Ordering::SeqCst), Ordering::SeqCst);
            Ok(())
        });
        read.synchronize().unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 42);
    });
}

/// A lane is ordered by the thread that started it: a job submitted from another
/// thread does not run, and its event says why.
#[test]
fn a_job_from_another_thread_than_the_issuer_fails() {
    std::thread::scope(|s| {
        let lane = Lane::start(s, 0, "collectives", Mode::Plain);
        lane.submit(|| Ok(())).synchronize().unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let counter = ran.clone();
        let event = std::thread::scope(|t| {
            t.spawn(|| {
                lane.submit(move || {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
            })
            .join()
            .unwrap()
        });
        let message = event.synchronize().unwrap_err().to_string();
        assert!(message.contains("issuing thread"), "{message}");
        assert_eq!(ran.load(Ordering::SeqCst), 0);
    });
}

#[test]
fn a_failed_job_fails_its_event_and_every_later_one() {
    std::thread::scope(|s| {
        let lane = Lane::start(s, 2, "reduce", Mode::Plain);
        let ok = lane.submit(|| Ok(()));
        let bad = lane.submit(|| Err("reduce_scatter aborted".into()));
        let later = lane.submit(|| panic!("must not run"));
        ok.synchronize().unwrap();
        for e in [bad, later] {
            let message = e.synchronize().unwrap_err().to_string();
            assert_eq!(message, "rank 2: reduce lane: reduce_scatter aborted");
        }
    });
}

#[test]
fn keep_holds_a_buffer_until_its_event() {
    let dropped = Arc::new(AtomicUsize::new(0));
    struct Flag(Arc<AtomicUsize>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    std::thread::scope(|s| {
        let lane = Lane::start(s, 0, "d2h", Mode::Plain);
        let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(1);
        let event = lane.submit(move || Ok(gate_rx.recv()?));
        let mut keep = Keep::default();
        keep.keep_until(Flag(dropped.clone()), event.clone());
        assert_eq!((keep.collect(), dropped.load(Ordering::SeqCst)), (1, 0));
        gate_tx.send(()).unwrap();
        event.synchronize().unwrap();
        assert_eq!((keep.collect(), dropped.load(Ordering::SeqCst)), (0, 1));
    });
}

/// Device streams that log what the lanes ask of them; a mark is done once the test
/// says the "device" got there.
#[derive(Default)]
struct Logged {
    log: Mutex<Vec<String>>,
    marks: Mutex<Vec<Arc<LoggedMark>>>,
}

struct LoggedStream {
    name: String,
    device: Arc<Logged>,
}

struct LoggedMark {
    name: String,
    done: std::sync::atomic::AtomicBool,
}

impl Logged {
    fn note(&self, line: String) {
        self.log.lock().unwrap().push(line);
    }
    fn lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
    /// The device runs everything queued so far.
    fn finish_all(&self) {
        for m in self.marks.lock().unwrap().iter() {
            m.done.store(true, Ordering::SeqCst);
        }
    }
}

impl DeviceMark for LoggedMark {
    fn query(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
    fn synchronize(&self) -> Result<(), DeviceError> {
        while !self.query() {
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn name_of(mark: &Mark) -> String {
    mark.as_any().downcast_ref::<LoggedMark>().unwrap().name.clone()
}

impl Stream for LoggedStream {
    fn enter(&self) -> Result<(), DeviceError> {
        self.device.note(format!("{} entered", self.name));
        Ok(())
    }
    fn mark(&self) -> Result<Mark, DeviceError> {
        let mut marks = self.device.marks.lock().unwrap();
        let mark = Arc::new(LoggedMark {
            name: format!("{}#{}", self.name, marks.len()),
            done: Default::default(),
        });
        marks.push(mark.clone());
        drop(marks);
        self.device.note(format!("mark {}", mark.name));
        Ok(mark)
    }
    fn wait(&self, mark: &Mark) -> Result<(), DeviceError> {
        self.device.note(format!("{} waits {}", self.name, name_of(mark)));
        Ok(())
    }
    fn delay(&self, _micros: u64) -> Result<(), DeviceError> {
        self.device.note(format!("{} delayed", self.name));
        Ok(())
    }
}

impl Streams for Arc<Logged> {
    fn current(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        Ok(Arc::new(LoggedStream {
            name: "compute".into(),
            device: self.clone(),
        }))
    }
    fn lane(&self, name: &'static str) -> Result<Arc<dyn Stream>, DeviceError> {
        Ok(Arc::new(LoggedStream {
            name: name.into(),
            device: self.clone(),
        }))
    }
}

/// On a device a job's stream waits for the compute queued before its submission
/// (then, checked, for a delay of device work), its event fires when the device has
/// run it (not when the job returned), compute
/// waits for it on its stream without blocking, and another lane waits on its own
/// stream.
#[test]
fn on_a_device_lanes_order_by_marks_and_events_fire_with_the_device() {
    let device = Arc::new(Logged::default());
    let streams: Arc<dyn Streams> = Arc::new(device.clone());
    std::thread::scope(|s| {
        let checked = Mode::Checked {
            seed: 5,
            max_delay_us: 10,
        };
        let h2d = Lane::start_on(s, 0, "h2d", checked, Some(streams.clone()));
        let gather = Lane::start_on(s, 0, "gather", Mode::Plain, Some(streams.clone()));
        let log = device.clone();
        let copied = h2d.submit(move || {
            log.note("copy queued".into());
            Ok(())
        });
        // the job has run (queued its copy) but the device has not run it
        copied.ran().unwrap();
        assert!(!copied.query());
        let waited = gather.wait(&copied);
        copied.order_compute().unwrap();
        waited.ran().unwrap();
        let lines = device.lines();
        for (before, after) in [
            ("mark compute#0", "h2d waits compute#0"),
            ("h2d waits compute#0", "h2d delayed"),
            ("h2d delayed", "copy queued"),
            ("copy queued", "mark h2d#1"),
            ("mark h2d#1", "gather waits h2d#1"),
            ("mark h2d#1", "compute waits h2d#1"),
        ] {
            let at = |line| {
                lines
                    .iter()
                    .position(|l| l == line)
                    .unwrap_or_else(|| panic!("{line}: {lines:?}"))
            };
            assert!(at(before) < at(after), "{before} before {after}: {lines:?}");
        }
        assert!(lines.contains(&"h2d entered".to_string()));
        // the host wait returns only once the device got there
        let finisher = device.clone();
        let finish = s.spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            finisher.finish_all();
        });
        let start = Instant::now();
        copied.synchronize().unwrap();
        assert!(copied.query() && start.elapsed() >= Duration::from_millis(10));
        finish.join().unwrap();
    });
}

/// After a failure on a device, later jobs are skipped but still mark the stream, and
/// their events wait for the device before reporting the failure: a buffer a failed
/// or earlier job queued work on is not reused while that work may run.
#[test]
fn on_a_device_a_failure_still_waits_for_what_was_queued() {
    let device = Arc::new(Logged::default());
    let streams: Arc<dyn Streams> = Arc::new(device.clone());
    std::thread::scope(|s| {
        let lane = Lane::start_on(s, 3, "collectives", Mode::Plain, Some(streams.clone()));
        let log = device.clone();
        let bad = lane.submit(move || {
            log.note("collective queued".into());
            Err("the peer is gone".into())
        });
        let skipped = lane.submit(|| panic!("must not run"));
        let last = lane.record();
        // the worker has skipped it (and marked its stream)
        assert!(skipped.ran().is_err());
        for e in [&bad, &skipped, &last] {
            assert!(!e.query(), "the device has not run what was queued");
        }
        device.finish_all();
        for e in [bad, skipped, last] {
            assert!(e.query());
            let message = e.synchronize().unwrap_err().to_string();
            assert_eq!(message, "rank 3: collectives lane: the peer is gone");
        }
        assert_eq!(
            device
                .lines()
                .iter()
                .filter(|l| l.starts_with("mark collectives"))
                .count(),
            2
        );
    });
}
