//! What a run shows a person: the progress bar, the end-of-run loss plot, and where the
//! time goes (`timeline.rs`: spans and per-step breakdowns; `trace.rs`: trace.json and
//! breakdown.png), the matmul peak MFU is measured against (`peak.rs`), and the host
//! memory and CPU time the process takes (`host.rs`); DeepSpeed's TensorBoard and CSV
//! monitors (`monitor.rs`).
//!
//! `loss.png` is drawn with plotters' bitmap backend: training loss per step (blue), eval
//! loss (red dots) and, for synthetic data, the known loss floor (grey). The build has no
//! font backend (nothing to load offline), so the plot has a frame and gridlines but no
//! text; the numbers are in `metrics.jsonl` and `summary.json`.

pub mod host;
pub mod monitor;
pub mod peak;
pub mod timeline;
pub mod trace;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;
use std::path::Path;

/// A progress bar on stderr when it is a terminal; plain log lines otherwise.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(steps: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} {msg} eta {eta}") {
            bar.set_style(style);
        }
        Progress { bar }
    }

    /// Advances to `step` with a status message.
    pub fn update(&self, step: u64, message: String) {
        self.bar.set_position(step);
        self.bar.set_message(message);
    }

    /// A line that stays: above the bar on a terminal, or on stdout for logs.
    pub fn line(&self, line: &str) {
        if self.bar.is_hidden() {
            println!("{line}");
        } else {
            self.bar.println(line);
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Draws `loss.png`: (step, loss) pairs, optional eval points and floor.
pub fn plot_loss(
    path: &Path,
    losses: &[(u64, f64)],
    evals: &[(u64, f64)],
    floor: Option<f64>,
) -> Result<(), String> {
    let finite: Vec<(u64, f64)> = losses.iter().copied().filter(|(_, l)| l.is_finite()).collect();
    if finite.is_empty() {
        return Ok(());
    }
    let last_step = finite.iter().map(|(s, _)| *s).max().unwrap_or(1).max(2);
    let values = finite
        .iter()
        .map(|(_, l)| *l)
        .chain(evals.iter().map(|(_, l)| *l))
        .chain(floor);
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let margin = ((high - low) * 0.05).max(1e-3);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .margin(20)
        .build_cartesian_2d(1u64..last_step, (low - margin)..(high + margin))
        .map_err(|x| e(&x))?;
    // gridlines every tenth of each axis, drawn by hand (no label text)
    let grid = RGBColor(225, 225, 225);
    for i in 0..=10u64 {
        let x = 1 + (last_step - 1) * i / 10;
        let y = low - margin + (high - low + 2.0 * margin) * i as f64 / 10.0;
        chart
            .draw_series(LineSeries::new([(x, low - margin), (x, high + margin)], grid))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(LineSeries::new([(1, y), (last_step, y)], grid))
            .map_err(|x| e(&x))?;
    }
    if let Some(f) = floor {
        chart
            .draw_series(LineSeries::new(
                [(1, f), (last_step, f)],
                RGBColor(120, 120, 120).stroke_width(2),
            ))
            .map_err(|x| e(&x))?;
    }
    chart
        .draw_series(LineSeries::new(finite.iter().copied(), BLUE.stroke_width(2)))
        .map_err(|x| e(&x))?;
    chart
        .draw_series(evals.iter().map(|&(s, l)| Circle::new((s, l), 4, RED.filled())))
        .map_err(|x| e(&x))?;
    root.draw(&Rectangle::new([(0, 0), (899, 499)], BLACK.stroke_width(1)))
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}
