//! What a run tells the person running it, from rank 0's messages: a line of
//! `metrics.jsonl` per step, DeepSpeed's TensorBoard/CSV monitors, the progress bar and
//! its log lines, the wall-clock breakdown every `steps_per_print`, and at the end
//! `loss.png` and `breakdown.png`. The steps it keeps in memory are thinned past
//! `metrics::history::KEPT_STEPS` (a week-long run stays bounded); the file has them all.

use super::error::TrainError;
use super::rank::RankMessage;
use super::result::{scalars, StepMetrics, TrainResult};
use crate::metrics::history::Thinning;
use crate::metrics::host::{HostUsage, Span};
use crate::metrics::monitor::Monitors;
use crate::metrics::timeline::Breakdown;
use crate::metrics::trace::TierBytes;
use crate::metrics::Progress;
use crate::plan::Plan;
use std::fs::File;
use std::io::Write;
use std::time::Instant;

pub(super) struct Reporter<'p> {
    plan: &'p Plan,
    /// `metrics.jsonl`, when the run writes outputs.
    metrics: Option<File>,
    monitors: Option<Monitors>,
    progress: Option<Progress>,
    /// One rank's matmul peak (0 without outputs): MFU divides by it times the ranks.
    pub(super) peak: f64,
    flops_per_token: f64,
    tokens_per_step: u64,
    /// When the last progress line was printed.
    last_line: Instant,
    thinning: Thinning,
}

impl<'p> Reporter<'p> {
    /// Opens what a run starting at `first_step` writes (nothing unless `write_outputs`):
    /// the output directory, `metrics.jsonl` (appended to when resuming), the monitors
    /// (node 0 only) and the progress bar; measures the matmul peak MFU is against.
    pub(super) fn open(
        plan: &'p Plan,
        write_outputs: bool,
        first_step: u64,
    ) -> Result<Reporter<'p>, TrainError> {
        let output = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| TrainError::Output { path, source }
        };
        let mut reporter = Reporter {
            plan,
            metrics: None,
            monitors: None,
            progress: None,
            peak: 0.0,
            flops_per_token: plan.model.config.flops_per_token(plan.data.seq_len),
            tokens_per_step: plan.tokens_per_step() as u64,
            last_line: Instant::now(),
            thinning: Thinning::default(),
        };
        if !write_outputs {
            return Ok(reporter);
        }
        let dir = &plan.train.output_dir;
        std::fs::create_dir_all(dir).map_err(output(dir))?;
        let path = dir.join("metrics.jsonl");
        // a resumed run continues the metrics of the run it resumes
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(first_step > 0)
            .truncate(first_step == 0)
            .open(&path)
            .map_err(output(&path))?;
        reporter.metrics = Some(file);
        reporter.peak = crate::metrics::peak::peak_flops(plan);
        // DeepSpeed's monitors, from node 0 only
        if plan.train.launch.node_rank == 0 {
            reporter.monitors = Some(
                Monitors::open(
                    plan.monitors.tensorboard.as_deref(),
                    plan.monitors.csv.as_deref(),
                    plan.steps_per_print,
                )
                .map_err(|(path, source)| TrainError::Output { path, source })?,
            );
        }
        let progress = Progress::new(plan.train.steps);
        progress.update(first_step, String::new());
        reporter.progress = Some(progress);
        Ok(reporter)
    }

    /// One step's message from rank 0: its metrics into `result` and everywhere they go.
    pub(super) fn record(&mut self, message: RankMessage, result: &mut TrainResult) {
        let plan = self.plan;
        let seconds = message.seconds;
        let tokens_per_s = self.tokens_per_step as f64 / seconds.max(1e-9);
        let metrics = StepMetrics {
            step: message.step + 1,
            loss: message.report.loss,
            lr: message.report.lr,
            grad_norm: message.report.grad_norm,
            loss_scale: message.report.loss_scale,
            skipped: message.report.skipped,
            tokens: self.tokens_per_step * (message.step + 1),
            tokens_per_s,
            mfu: crate::metrics::peak::mfu(self.flops_per_token * tokens_per_s, self.peak, plan.world_size),
            step_seconds: seconds,
            eval_loss: message.eval_loss,
            breakdown: message.breakdown,
            memory: message.memory,
            host_rss: message.host.rss,
            simulated: message.simulated.map(|mut s| {
                s.tokens_per_s = self.tokens_per_step as f64 / s.step_seconds.max(1e-12);
                let flops = self.flops_per_token * s.tokens_per_s;
                s.mfu = crate::metrics::peak::mfu(flops, s.rank_peak, plan.world_size);
                s
            }),
        };
        result.preempted |= message.report.preempted;
        result.host = HostUsage {
            startup_peak_rss: message.host_start.peak_rss,
            steps: Span::between(message.host_start, message.host),
        };
        if plan.wall_clock_breakdown
            && plan.steps_per_print > 0
            && metrics.step.is_multiple_of(plan.steps_per_print)
        {
            let line = format!("step {:>6} {}", metrics.step, metrics.breakdown.line());
            match &self.progress {
                Some(progress) => progress.line(&line),
                None => tracing::info!("{line}"),
            }
        }
        if let Some(monitors) = self.monitors.as_mut() {
            let samples = metrics.step * plan.batch.train_batch_size as u64;
            if let Err(e) = monitors.record(samples, &scalars(&metrics, &metrics.breakdown, plan)) {
                tracing::warn!("writing the tensorboard/csv monitors: {e}");
            }
        }
        if let Some(file) = self.metrics.as_mut() {
            if let Ok(line) = serde_json::to_string(&metrics) {
                let _ = writeln!(file, "{line}");
            }
        }
        if let Some(progress) = &self.progress {
            let done = metrics.step;
            progress.update(
                done,
                format!("loss {:.4}  {:.0} tok/s", metrics.loss, metrics.tokens_per_s),
            );
            if done.is_multiple_of(plan.train.log_interval)
                || done == plan.train.steps
                || self.last_line.elapsed().as_secs() >= 10
            {
                self.last_line = Instant::now();
                let eta = seconds * (plan.train.steps - done) as f64;
                let eval = metrics
                    .eval_loss
                    .map(|l| format!("  eval {l:.4}"))
                    .unwrap_or_default();
                progress.line(&format!(
                    "step {done:>6}/{}  loss {:.4}{eval}  lr {:.2e}  grad_norm {:.3}  {:.0} tok/s  mfu {:.1}%  eta {:.0}s{}",
                    plan.train.steps,
                    metrics.loss,
                    metrics.lr,
                    metrics.grad_norm,
                    metrics.tokens_per_s,
                    100.0 * metrics.mfu,
                    eta,
                    if metrics.skipped { "  (skipped: overflow)" } else { "" }
                ));
                if let Some(s) = &metrics.simulated {
                    progress.line(&format!(
                        "         simulated on {}: {:.4} s/step  {:.0} tok/s  mfu {:.1}%",
                        s.profile,
                        s.step_seconds,
                        s.tokens_per_s,
                        100.0 * s.mfu
                    ));
                }
            }
            if let Some(saved) = &message.saved {
                progress.line(&format!("saved checkpoint {}", saved.display()));
            }
        }
        result.steps_run += 1;
        if let Some(eval) = metrics.eval_loss {
            result.evals.push((metrics.step, eval));
        }
        self.thinning.push(&mut result.steps, metrics, |m| m.step - 1);
    }

    /// The last step is in: the progress bar ends.
    pub(super) fn finish(&self) {
        if let Some(progress) = &self.progress {
            progress.finish();
        }
    }

    /// `breakdown.png` and `loss.png` of the kept steps, when the run writes outputs.
    pub(super) fn plots(&self, result: &TrainResult) {
        if self.metrics.is_none() {
            return;
        }
        let dir = &self.plan.train.output_dir;
        let per_step: Vec<(u64, Breakdown, TierBytes)> = result
            .steps
            .iter()
            .map(|m| (m.step, m.breakdown.clone(), m.memory))
            .collect();
        if let Err(e) = crate::metrics::trace::plot_breakdown(&dir.join("breakdown.png"), &per_step) {
            tracing::warn!("no breakdown plot: {e}");
        }
        let losses: Vec<(u64, f64)> = result.steps.iter().map(|m| (m.step, m.loss)).collect();
        if let Err(e) =
            crate::metrics::plot_loss(&dir.join("loss.png"), &losses, &result.evals, result.loss_floor)
        {
            tracing::warn!("no loss plot: {e}");
        }
    }
}
