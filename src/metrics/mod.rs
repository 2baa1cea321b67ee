//! What a run shows a person: the progress bar, the end-of-run loss plot, and where the
//! time goes (`timeline.rs`: spans and per-step breakdowns; `trace.rs`: trace.json and
//! breakdown.png), the matmul peak MFU is measured against (`peak.rs`), and the host
//! memory and CPU time the process takes (`host.rs`); DeepSpeed's TensorBoard and CSV
//! monitors (`monitor.rs`); the bounded per-step history a long run keeps (`history.rs`);
//! `summary.json` (`summary.rs`).
//!
//! `loss.png` is drawn with plotters' bitmap backend: training loss per step (blue), eval
//! loss (red dots, each with its value) and, for synthetic data, the known loss floor
//! (grey), with a title, labelled axes with tick values and a legend. The text is drawn
//! with DejaVu Sans, shipped inside the binary ([`register_font`]): no system font needed.

pub mod history;
pub mod host;
pub mod monitor;
pub mod peak;
pub mod summary;
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

/// Makes the shipped font (DejaVu Sans, Bitstream Vera licence: `assets/fonts/`)
/// plotters' "sans-serif", once per process: every picture's text is drawn with it.
pub fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let bytes: &'static [u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
        // the bytes are a valid TrueType font (a unit test draws text with them)
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, bytes);
    });
}

/// The legend every picture draws: upper right, on a translucent white box.
pub(crate) fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    size: u32,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", size))
        .draw()
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
    register_font();
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
        .caption("Training loss", ("sans-serif", 22))
        .margin(15)
        // room on the right for the last step's label (six digits on a long run)
        .margin_right(35)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(1u64..last_step, (low - margin)..(high + margin))
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc("loss (nats per token)")
        .light_line_style(RGBColor(235, 235, 235))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|x| e(&x))?;
    if let Some(f) = floor {
        let grey = RGBColor(120, 120, 120);
        chart
            .draw_series(LineSeries::new([(1, f), (last_step, f)], grey.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(format!("loss floor of the synthetic data ({f:.4})"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], grey.stroke_width(2)));
    }
    chart
        .draw_series(LineSeries::new(finite.iter().copied(), BLUE.stroke_width(2)))
        .map_err(|x| e(&x))?
        .label("training loss")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    if !evals.is_empty() {
        chart
            .draw_series(evals.iter().map(|&(s, l)| Circle::new((s, l), 4, RED.filled())))
            .map_err(|x| e(&x))?
            .label("eval loss")
            .legend(|(x, y)| Circle::new((x + 10, y), 4, RED.filled()));
        // each eval point's value beside it (a few at most, so they stay readable)
        let every = evals.len().div_ceil(12);
        chart
            .draw_series(evals.iter().step_by(every).map(|&(s, l)| {
                Text::new(
                    format!("{l:.3}"),
                    (s, l),
                    ("sans-serif", 12).into_font().color(&RED),
                )
            }))
            .map_err(|x| e(&x))?;
    }
    draw_legend(&mut chart, 14).map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped font draws text: a caption leaves dark pixels where a build without a
    /// font backend left the canvas white.
    #[test]
    fn the_shipped_font_draws_text() {
        register_font();
        let (w, h) = (200u32, 40u32);
        let mut pixels = vec![255u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
            root.draw(&Text::new("loss 1.234", (5, 5), ("sans-serif", 24)))
                .unwrap();
            root.present().unwrap();
        }
        let dark = pixels.chunks(3).filter(|p| p.iter().all(|&c| c < 128)).count();
        assert!(dark > 100, "{dark} dark pixels");
    }
}
