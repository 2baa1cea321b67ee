//! The timeline for people: `trace.json` (Chrome trace-event format; opens in Perfetto
//! and chrome://tracing) and `breakdown.png`.
//!
//! Trace: one process per rank, one thread per track (compute, the gather, reduce and
//! h2d lanes, optimizer, nvme read, nvme write); each span is a complete event named `<phase> u<unit>` (or
//! `wait <phase> u<unit>` for time a thread waited), with bytes in its args.
//! Plot: per step, stacked bars of phase seconds (rank 0; colours in the order of
//! [`Phase::ALL`]: forward, backward, all_gather, reduce, h2d, d2h, nvme_read,
//! nvme_write, optimizer) over the step time (black line), and below it bytes per tier
//! over the run (device peak in the step: blue; host: green; NVMe: red); titles, axes
//! with units and tick values, and legends naming each phase and tier, in the shipped
//! font (`metrics::register_font`).

use super::timeline::{Breakdown, Phase, Timeline};
use plotters::prelude::*;
use serde_json::json;
use std::io::Write;
use std::path::Path;

/// One trace thread per track, in this order (the names `engine::context::Tracks` gives).
const TRACKS: [&str; 7] = [
    "compute",
    "gather",
    "optimizer",
    "nvme read",
    "nvme write",
    "reduce",
    "h2d",
];

/// Writes every span of `timeline` to `path`.
pub fn write_trace(path: &Path, timeline: &Timeline) -> std::io::Result<()> {
    let mut spans = timeline.spans();
    spans.sort_by_key(|(rank, track, s)| (*rank, *track, s.start, std::cmp::Reverse(s.end)));
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
    let mut first = true;
    let mut emit = |event: serde_json::Value, out: &mut std::io::BufWriter<std::fs::File>| {
        let sep = if first { "" } else { ",\n" };
        first = false;
        write!(out, "{sep}{event}")
    };
    let mut ranks: Vec<usize> = spans.iter().map(|s| s.0).collect();
    ranks.dedup();
    for &rank in &ranks {
        emit(
            json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": format!("rank {rank}")}}),
            &mut out,
        )?;
        for (tid, name) in TRACKS.iter().enumerate() {
            emit(
                json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}),
                &mut out,
            )?;
        }
    }
    for (rank, track, s) in spans {
        let tid = TRACKS.iter().position(|t| *t == track).unwrap_or(0);
        let unit = s.unit.map(|u| format!(" u{u}")).unwrap_or_default();
        let name = format!("{}{}{unit}", if s.wait { "wait " } else { "" }, s.phase.name());
        emit(
            json!({
                "ph": "X", "name": name, "cat": if s.wait { "wait" } else { s.phase.name() },
                "pid": rank, "tid": tid,
                "ts": s.start as f64 / 1e3, "dur": (s.end - s.start) as f64 / 1e3,
                "args": {"unit": s.unit, "bytes": s.bytes}
            }),
            &mut out,
        )?;
    }
    out.write_all(b"\n]}\n")?;
    out.flush()
}

/// Bytes on each tier at one step (device: the step's peak).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct TierBytes {
    pub device: u64,
    pub host: u64,
    pub nvme: u64,
}

const COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
];

type StepChart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One of `breakdown.png`'s charts: `caption` (text, size) over optimizer steps `steps`,
/// y from 0 to `y` (top, label), its mesh drawn.
fn step_chart<'a, 'b>(
    area: &'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>,
    caption: (&str, u32),
    steps: std::ops::Range<f64>,
    y: (f64, &str),
) -> Result<StepChart<'a, 'b>, DrawingAreaErrorKind<<BitMapBackend<'b> as DrawingBackend>::ErrorType>> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption.0, ("sans-serif", caption.1))
        .margin(12)
        // room on the right for the last step's label (six digits on a long run)
        .margin_right(35)
        .x_label_area_size(40)
        .y_label_area_size(65)
        .build_cartesian_2d(steps, 0.0..y.0)?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc(y.1)
        .light_line_style(RGBColor(235, 235, 235))
        .label_style(("sans-serif", 13))
        .draw()?;
    Ok(chart)
}

/// Draws `breakdown.png` from rank 0's per-step breakdowns and tier bytes.
pub fn plot_breakdown(path: &Path, steps: &[(u64, Breakdown, TierBytes)]) -> Result<(), String> {
    if steps.is_empty() {
        return Ok(());
    }
    super::register_font();
    let e = |x: &dyn std::fmt::Display| format!("drawing {}: {x}", path.display());
    let root = BitMapBackend::new(path, (900, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (top, bottom) = root.split_vertically(480);
    let first = steps[0].0;
    let last = steps[steps.len() - 1].0 + 1;
    let highest = steps
        .iter()
        .map(|(_, b, _)| b.phases.iter().map(|p| p.1).sum::<f64>().max(b.step_seconds))
        .fold(1e-9, f64::max);
    let steps_axis = first as f64..last as f64;
    // headroom above the tallest bar for the legend
    let mut chart = step_chart(
        &top,
        ("Where each step's time goes (rank 0)", 20),
        steps_axis.clone(),
        (highest * 1.8, "seconds (phases stacked)"),
    )
    .map_err(|x| e(&x))?;
    for (i, phase) in Phase::ALL.iter().enumerate() {
        let bars: Vec<Rectangle<(f64, f64)>> = steps
            .iter()
            .filter_map(|(step, breakdown, _)| {
                let below: f64 = Phase::ALL[..i].iter().map(|p| breakdown.phase(*p)).sum();
                let h = breakdown.phase(*phase);
                let x = *step as f64;
                (h > 0.0).then(|| Rectangle::new([(x, below), (x + 0.8, below + h)], COLORS[i].filled()))
            })
            .collect();
        if bars.is_empty() {
            continue;
        }
        let color = COLORS[i];
        chart
            .draw_series(bars)
            .map_err(|x| e(&x))?
            .label(phase.name())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .draw_series(LineSeries::new(
            steps.iter().map(|(s, b, _)| (*s as f64 + 0.4, b.step_seconds)),
            BLACK.stroke_width(2),
        ))
        .map_err(|x| e(&x))?
        .label("step wall time")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    super::draw_legend(&mut chart, 13).map_err(|x| e(&x))?;
    let largest = steps
        .iter()
        .map(|(_, _, t)| t.device.max(t.host).max(t.nvme))
        .max()
        .unwrap_or(0);
    // GiB, or MiB for small models
    let (unit, scale) = if largest >= 1 << 30 {
        ("GiB", 30)
    } else {
        ("MiB", 20)
    };
    let gib = |b: u64| b as f64 / (1u64 << scale) as f64;
    let most = gib(largest).max(1e-9);
    let mut memory = step_chart(
        &bottom,
        ("Model state by tier", 18),
        steps_axis,
        (most * 1.6, unit),
    )
    .map_err(|x| e(&x))?;
    for (pick, name, color) in [
        (0usize, "device (peak in the step)", RGBColor(31, 119, 180)),
        (1, "host", RGBColor(44, 160, 44)),
        (2, "NVMe", RGBColor(214, 39, 40)),
    ] {
        let series = steps.iter().map(|(s, _, t)| {
            let v = [t.device, t.host, t.nvme][pick];
            (*s as f64 + 0.4, gib(v))
        });
        memory
            .draw_series(LineSeries::new(series, color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    super::draw_legend(&mut memory, 13).map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}
