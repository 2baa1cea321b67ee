//! Where the time goes: the trace is valid Chrome trace JSON with the expected tracks
//! and phases, spans nest, phase sums agree with the step time, and overlap is 1.0 with
//! every phase blocking and higher with the pipelines on.

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use tierzero::metrics::timeline::{Breakdown, Phase};
use tierzero::plan::{from_json, DeviceFacts, Plan};
use tierzero::run::{train, TrainOptions};

fn plan(dir: &std::path::Path) -> Plan {
    let config = json!({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 2048,
            "stage3_param_persistence_threshold": 0,
            "offload_param": { "device": "nvme", "nvme_path": dir.join("p"), "max_in_cpu": 0 },
            "offload_optimizer": { "device": "nvme", "nvme_path": dir.join("o"), "buffer_count": 8 }
        },
        "model": { "preset": "llama-tiny", "hidden_size": 64, "num_hidden_layers": 3 },
        "data": { "synthetic": "markov", "seq_len": 32 },
        "train": { "steps": 8, "devices": 2, "output_dir": dir.join("out") }
    });
    from_json(config, &[], DeviceFacts::default()).unwrap().plan
}

fn steady(breakdowns: &[Breakdown]) -> Breakdown {
    Breakdown::total(&breakdowns[1..])
}

#[test]
fn trace_has_every_track_and_phase_and_spans_nest() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(tmp.path());
    let result = train(
        &p,
        TrainOptions {
            trace: true,
            ..TrainOptions::default()
        },
    )
    .unwrap();
    let text = std::fs::read_to_string(p.train.output_dir.join("trace.json")).unwrap();
    let trace: Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut threads = BTreeMap::new();
    let mut phases = BTreeSet::new();
    let mut lanes: BTreeMap<(u64, u64), Vec<(f64, f64)>> = BTreeMap::new();
    for e in events {
        match e["ph"].as_str().unwrap() {
            "M" if e["name"] == "thread_name" => {
                threads.insert(
                    (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()),
                    e["args"]["name"].as_str().unwrap().to_string(),
                );
            }
            "X" => {
                let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
                assert!(dur >= 0.0, "{e}");
                phases.insert(e["cat"].as_str().unwrap().to_string());
                lanes
                    .entry((e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()))
                    .or_default()
                    .push((ts, ts + dur));
            }
            _ => {}
        }
    }
    for rank in 0..2u64 {
        for tid in 0..6u64 {
            assert!(
                threads.contains_key(&(rank, tid)),
                "rank {rank} track {tid}: {threads:?}"
            );
        }
    }
    // no "h2d": on CPU devices the parameters' NVMe reads land in device staging
    // directly (a GPU adds the copy from the pinned bounce buffer)
    for phase in [
        "forward",
        "backward",
        "all_gather",
        "reduce",
        "d2h",
        "nvme_read",
        "nvme_write",
        "optimizer",
        "wait",
    ] {
        assert!(phases.contains(phase), "no {phase} spans: {phases:?}");
    }
    // on one lane, spans are disjoint or nested (1 µs slack for rounding)
    for (lane, mut spans) in lanes {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<f64> = Vec::new();
        for (start, end) in spans {
            while open.last().is_some_and(|&e| e <= start + 1e-3) {
                open.pop();
            }
            if let Some(&outer) = open.last() {
                assert!(
                    end <= outer + 1e-3,
                    "lane {lane:?}: span {start}..{end} crosses the end of its parent at {outer}"
                );
            }
            open.push(end);
        }
    }
    // a phase running on one thread never exceeds the step; all of them together do
    // not exceed one step per track
    for b in &result.breakdowns() {
        assert!(b.phase(Phase::Backward) <= b.step_seconds * 1.01, "{b:?}");
        let sum: f64 = b.phases.iter().map(|p| p.1).sum();
        assert!(sum <= 6.0 * b.step_seconds * 1.01, "{b:?}");
        assert!((b.overlap - sum / b.step_seconds).abs() < 1e-9);
    }
    let metrics = std::fs::read_to_string(p.train.output_dir.join("metrics.jsonl")).unwrap_or_default();
    assert!(metrics.is_empty(), "no outputs without write_outputs");
}

#[test]
fn overlap_is_one_when_blocking_and_higher_with_pipelines() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(tmp.path());
    let blocking = train(
        &p,
        TrainOptions {
            no_overlap: true,
            ..TrainOptions::default()
        },
    )
    .unwrap();
    let overlapped = train(&p, TrainOptions::default()).unwrap();
    let (off, on) = (steady(&blocking.breakdowns()), steady(&overlapped.breakdowns()));
    println!("blocking:\n{}overlapped:\n{}", off.table(), on.table());
    // the phases' time with the ranks' waits for each other at the collectives (recorded
    // as waits, not as the collectives' work): one phase after another fills the step once
    let filled = |b: &Breakdown| {
        let peers: f64 = b
            .waits
            .iter()
            .filter(|(phase, _)| matches!(phase, Phase::AllGather | Phase::Reduce))
            .map(|w| w.1)
            .sum();
        b.overlap + peers / b.step_seconds
    };
    let (off_filled, on_filled) = (filled(&off), filled(&on));
    assert!(
        (0.85..=1.05).contains(&off_filled),
        "blocking overlap {} with the collectives' waits {off_filled}",
        off.overlap
    );
    assert!(
        on_filled > off_filled + 0.02,
        "overlap with the collectives' waits {on_filled} with pipelines vs {off_filled} blocking"
    );
    assert!(on.bound_ratio >= 1.0 && off.bound_ratio >= 1.0);
}
