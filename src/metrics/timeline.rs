//! Where the time goes: spans of every rank's threads, per-step breakdowns, the trace.
//!
//! Each thread that works for a rank (compute, prefetch, optimizer, NVMe pipeline) owns
//! a [`Track`] and records wall-clock spans on it: a phase (forward, backward,
//! all-gather, …), the unit it concerns, start and end, bytes moved, and whether the
//! thread was working or waiting for that phase. At the end of each step the rank asks
//! the [`Timeline`] for the [`Breakdown`] of the step's wall-clock window: each phase's
//! time is the sum of its working spans clipped to the window, so a phase that ran on
//! another thread while compute went on counts in full and the phase times can add up to
//! more than the step. On CUDA the same spans come from event timings per stream.
//!
//! - `overlap` = sum of phase times ÷ step time: 1.0 when phases run one after another
//!   (less the time ranks waited for each other at collectives, a wait, not work),
//!   higher the more of them run at once;
//! - `bound_ratio` = step time ÷ the longest phase: 1.0 when everything hides behind it.

use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
    AllGather,
    /// Reduce-scatter and all-reduce.
    Reduce,
    /// Host → device copies (on CPU devices: host buffers into tensors).
    H2d,
    /// Device → host copies (tensors into host buffers).
    D2h,
    NvmeRead,
    NvmeWrite,
    Optimizer,
}

impl Phase {
    pub const ALL: [Phase; 9] = [
        Phase::Forward,
        Phase::Backward,
        Phase::AllGather,
        Phase::Reduce,
        Phase::H2d,
        Phase::D2h,
        Phase::NvmeRead,
        Phase::NvmeWrite,
        Phase::Optimizer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::AllGather => "all_gather",
            Phase::Reduce => "reduce",
            Phase::H2d => "h2d",
            Phase::D2h => "d2h",
            Phase::NvmeRead => "nvme_read",
            Phase::NvmeWrite => "nvme_write",
            Phase::Optimizer => "optimizer",
        }
    }

    fn index(self) -> usize {
        Phase::ALL.iter().position(|&p| p == self).unwrap_or(0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub phase: Phase,
    /// True when the thread was waiting for `phase` (done elsewhere), not doing it.
    pub wait: bool,
    /// The unit it concerns (None: the whole model, e.g. a norm all-reduce).
    pub unit: Option<usize>,
    /// Nanoseconds since the timeline's origin.
    pub start: u64,
    pub end: u64,
    pub bytes: u64,
}

struct TrackData {
    rank: usize,
    name: &'static str,
    spans: Mutex<Vec<Span>>,
    /// Spans already accounted to a step, kept for the trace.
    archive: Mutex<Vec<Span>>,
}

/// Every track of a run.
pub struct Timeline {
    origin: Instant,
    keep_for_trace: bool,
    tracks: Mutex<Vec<Arc<TrackData>>>,
}

/// One thread's recorder; a disabled track records nothing and costs a branch.
#[derive(Clone, Default)]
pub struct Track {
    inner: Option<(Arc<TrackData>, Instant)>,
}

impl Track {
    pub fn disabled() -> Track {
        Track { inner: None }
    }

    /// Records a span that started at `start` and ends now.
    pub fn record(&self, phase: Phase, unit: Option<usize>, start: Instant, bytes: u64) {
        self.record_between(phase, false, unit, start, Instant::now(), bytes);
    }

    /// Records time spent waiting for `phase`, from `start` to now.
    pub fn waited(&self, phase: Phase, unit: Option<usize>, start: Instant) {
        self.record_between(phase, true, unit, start, Instant::now(), 0);
    }

    pub fn record_between(
        &self,
        phase: Phase,
        wait: bool,
        unit: Option<usize>,
        start: Instant,
        end: Instant,
        bytes: u64,
    ) {
        let Some((data, origin)) = &self.inner else { return };
        let ns = |t: Instant| t.saturating_duration_since(*origin).as_nanos() as u64;
        let span = Span {
            phase,
            wait,
            unit,
            start: ns(start),
            end: ns(end).max(ns(start)),
            bytes,
        };
        data.spans.lock().unwrap_or_else(|p| p.into_inner()).push(span);
    }

    /// Runs `f` as one span.
    pub fn span<T>(&self, phase: Phase, unit: Option<usize>, bytes: u64, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.record(phase, unit, start, bytes);
        out
    }

    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }
}

/// One rank's step: time per phase, time the compute thread waited per phase, bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Breakdown {
    pub step_seconds: f64,
    /// Working time per phase (seconds), every thread of the rank.
    pub phases: Vec<(Phase, f64)>,
    /// Time a thread of the rank sat waiting for a phase.
    pub waits: Vec<(Phase, f64)>,
    pub bytes: Vec<(Phase, u64)>,
    pub overlap: f64,
    pub bound_ratio: f64,
}

impl Breakdown {
    pub fn phase(&self, phase: Phase) -> f64 {
        self.phases.iter().find(|(p, _)| *p == phase).map_or(0.0, |x| x.1)
    }

    pub fn busiest(&self) -> (Phase, f64) {
        self.phases
            .iter()
            .copied()
            .fold((Phase::Forward, 0.0), |m, x| if x.1 > m.1 { x } else { m })
    }

    /// The breakdown as a JSON object for metrics.jsonl: seconds per phase and wait.
    /// Serializes as [`Breakdown::json`] (a serde `serialize_with`).
    pub fn serialize_json<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serde::Serialize::serialize(&self.json(), serializer)
    }

    pub fn json(&self) -> serde_json::Value {
        let map = |v: &[(Phase, f64)]| -> serde_json::Map<String, serde_json::Value> {
            v.iter()
                .map(|(p, s)| (p.name().to_string(), serde_json::json!(s)))
                .collect()
        };
        let bytes: serde_json::Map<String, serde_json::Value> = self
            .bytes
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(p, b)| (p.name().to_string(), serde_json::json!(b)))
            .collect();
        serde_json::json!({
            "seconds": map(&self.phases),
            "waits": map(&self.waits),
            "bytes": bytes,
            "overlap": self.overlap,
            "bound_ratio": self.bound_ratio,
        })
    }

    /// The whole run (or any set of steps) as one breakdown: times and bytes per step
    /// averaged, ratios from the totals.
    pub fn total(steps: &[Breakdown]) -> Breakdown {
        let n = steps.len().max(1) as f64;
        let sum = |pick: &dyn Fn(&Breakdown) -> &[(Phase, f64)], p: Phase| -> f64 {
            steps
                .iter()
                .map(|b| pick(b).iter().find(|x| x.0 == p).map_or(0.0, |x| x.1))
                .sum::<f64>()
        };
        let step: f64 = steps.iter().map(|b| b.step_seconds).sum();
        let phases: Vec<(Phase, f64)> = Phase::ALL.iter().map(|&p| (p, sum(&|b| &b.phases, p))).collect();
        let total: f64 = phases.iter().map(|p| p.1).sum();
        let longest = phases.iter().map(|p| p.1).fold(0.0, f64::max);
        Breakdown {
            step_seconds: step / n,
            waits: Phase::ALL
                .iter()
                .map(|&p| (p, sum(&|b| &b.waits, p) / n))
                .collect(),
            bytes: Phase::ALL
                .iter()
                .map(|&p| {
                    let bytes: u64 = steps
                        .iter()
                        .map(|b| b.bytes.iter().find(|x| x.0 == p).map_or(0, |x| x.1))
                        .sum();
                    (p, bytes / steps.len().max(1) as u64)
                })
                .collect(),
            overlap: if step > 0.0 { total / step } else { 0.0 },
            bound_ratio: if longest > 0.0 { step / longest } else { 0.0 },
            phases: phases.into_iter().map(|(p, t)| (p, t / n)).collect(),
        }
    }

    /// Achieved GB/s per link (bytes moved ÷ time in the phase), where bytes moved.
    pub fn rates(&self) -> Vec<(Phase, f64)> {
        self.bytes
            .iter()
            .filter(|(_, b)| *b > 0)
            .filter_map(|&(p, b)| {
                let t = self.phase(p);
                (t > 0.0).then(|| (p, b as f64 / t / 1e9))
            })
            .collect()
    }

    /// A table: seconds per step of each phase, waits, bytes and GB/s.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<12}{:>12}{:>12}{:>14}{:>10}\n",
            "phase", "ms/step", "waited ms", "bytes/step", "GB/s"
        );
        let rates = self.rates();
        for (i, (p, t)) in self.phases.iter().enumerate() {
            let wait = self.waits.get(i).map_or(0.0, |w| w.1);
            let bytes = self.bytes.get(i).map_or(0, |b| b.1);
            let rate = rates
                .iter()
                .find(|r| r.0 == *p)
                .map_or(String::new(), |r| format!("{:.2}", r.1));
            out.push_str(&format!(
                "{:<12}{:>12.2}{:>12.2}{:>14}{:>10}\n",
                p.name(),
                1e3 * t,
                1e3 * wait,
                bytes,
                rate
            ));
        }
        out.push_str(&format!(
            "step {:.2} ms; overlap {:.2} (phase time ÷ step time); bound_ratio {:.2} (step ÷ longest phase)\n",
            1e3 * self.step_seconds,
            self.overlap,
            self.bound_ratio
        ));
        out
    }

    /// One line: the phases that took time, the ratios.
    pub fn line(&self) -> String {
        let mut parts: Vec<String> = self
            .phases
            .iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|(p, s)| format!("{} {:.1}ms", p.name(), 1e3 * s))
            .collect();
        let waited: f64 = self.waits.iter().map(|w| w.1).sum();
        parts.push(format!("waited {:.1}ms", 1e3 * waited));
        format!(
            "step {:.1}ms = {}; overlap {:.2}, bound_ratio {:.2}",
            1e3 * self.step_seconds,
            parts.join(", "),
            self.overlap,
            self.bound_ratio
        )
    }
}

impl Timeline {
    /// `keep_for_trace`: keep every span for [`Timeline::trace`] (else spans are dropped
    /// once a step has accounted them).
    pub fn new(keep_for_trace: bool) -> Arc<Timeline> {
        Arc::new(Timeline {
            origin: Instant::now(),
            keep_for_trace,
            tracks: Mutex::new(Vec::new()),
        })
    }

    /// Whether the run writes a trace.
    pub fn keeps_for_trace(&self) -> bool {
        self.keep_for_trace
    }

    pub fn track(&self, rank: usize, name: &'static str) -> Track {
        let data = Arc::new(TrackData {
            rank,
            name,
            spans: Mutex::new(Vec::new()),
            archive: Mutex::new(Vec::new()),
        });
        self.tracks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(data.clone());
        Track {
            inner: Some((data, self.origin)),
        }
    }

    /// The breakdown of rank `rank` over the window `start..end`; spans that ended
    /// inside it are then retired (kept for the trace when asked to).
    pub fn breakdown(&self, rank: usize, start: Instant, end: Instant) -> Breakdown {
        let ns = |t: Instant| t.saturating_duration_since(self.origin).as_nanos() as u64;
        let (lo, hi) = (ns(start), ns(end));
        let mut work = [0u64; 9];
        let mut wait = [0u64; 9];
        let mut bytes = [0u64; 9];
        let tracks = self.tracks.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for track in tracks.iter().filter(|t| t.rank == rank) {
            let mut spans = track.spans.lock().unwrap_or_else(|p| p.into_inner());
            let mut retired = Vec::new();
            spans.retain(|s| {
                let clipped = s.end.min(hi).saturating_sub(s.start.max(lo));
                let i = s.phase.index();
                if s.wait {
                    wait[i] += clipped;
                } else {
                    work[i] += clipped;
                    if s.end <= hi && s.end > lo {
                        bytes[i] += s.bytes;
                    }
                }
                let keep = s.end > hi;
                if !keep {
                    retired.push(*s);
                }
                keep
            });
            if self.keep_for_trace {
                track
                    .archive
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(retired);
            }
        }
        let step = (hi - lo) as f64 * 1e-9;
        let phases: Vec<(Phase, f64)> = Phase::ALL
            .iter()
            .map(|&p| (p, work[p.index()] as f64 * 1e-9))
            .collect();
        let sum: f64 = phases.iter().map(|p| p.1).sum();
        let longest = phases.iter().map(|p| p.1).fold(0.0, f64::max);
        Breakdown {
            step_seconds: step,
            waits: Phase::ALL
                .iter()
                .map(|&p| (p, wait[p.index()] as f64 * 1e-9))
                .collect(),
            bytes: Phase::ALL.iter().map(|&p| (p, bytes[p.index()])).collect(),
            overlap: if step > 0.0 { sum / step } else { 0.0 },
            bound_ratio: if longest > 0.0 { step / longest } else { 0.0 },
            phases,
        }
    }

    /// Every recorded span as (rank, track name, span), for the trace.
    pub fn spans(&self) -> Vec<(usize, &'static str, Span)> {
        let tracks = self.tracks.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out = Vec::new();
        for t in tracks {
            for s in t
                .archive
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .chain(t.spans.lock().unwrap_or_else(|p| p.into_inner()).iter())
            {
                out.push((t.rank, t.name, *s));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn breakdown_clips_spans_to_the_window_and_sums_threads() {
        let timeline = Timeline::new(true);
        let (a, b) = (timeline.track(0, "compute"), timeline.track(0, "optimizer"));
        let other = timeline.track(1, "compute");
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        a.record_between(Phase::Forward, false, Some(0), ms(0), ms(40), 0);
        b.record_between(Phase::Optimizer, false, Some(0), ms(0), ms(30), 0);
        a.record_between(Phase::Optimizer, true, Some(1), ms(40), ms(50), 0);
        b.record_between(Phase::NvmeRead, false, None, ms(90), ms(150), 64);
        other.record_between(Phase::Forward, false, None, ms(0), ms(100), 0);
        let d = timeline.breakdown(0, ms(0), ms(100));
        assert!((d.step_seconds - 0.1).abs() < 1e-9);
        assert!(
            (d.phase(Phase::Forward) - 0.04).abs() < 1e-9,
            "other ranks excluded"
        );
        assert!(
            (d.phase(Phase::NvmeRead) - 0.01).abs() < 1e-9,
            "clipped to the window"
        );
        assert!((d.overlap - 0.8).abs() < 1e-9);
        assert!((d.bound_ratio - 2.5).abs() < 1e-9);
        assert_eq!(
            d.waits.iter().find(|w| w.0 == Phase::Optimizer).map(|w| w.1),
            Some(0.01)
        );
        // the span still running past the window counts in the next one
        let next = timeline.breakdown(0, ms(100), ms(200));
        assert!((next.phase(Phase::NvmeRead) - 0.05).abs() < 1e-9);
        assert_eq!(
            next.bytes.iter().find(|b| b.0 == Phase::NvmeRead).map(|b| b.1),
            Some(64)
        );
        assert_eq!(timeline.spans().len(), 5);
    }
}
