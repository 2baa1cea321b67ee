//! `tierzero train`: the run, then its summary (`summary.json`, the memory and host
//! lines); a run stopped by SIGTERM/SIGUSR1 exits with `EXIT_PREEMPTED`.

use super::common::{disk_space_warning, load_config, load_config_on, ConfigArgs, Failure};
use anyhow::Context;
use clap::Args;
use tierzero::metrics::summary::Summary;
use tierzero::plan;
use tierzero::run::{self, TrainOptions};

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Resume from a checkpoint directory, `latest` (the newest checkpoint under
    /// output_dir; an error if none), or `auto` (the newest if there is one, else a
    /// fresh start: one command for a job's first launch and its restarts).
    #[arg(long)]
    pub resume: Option<String>,
    /// Write a Chrome trace of every step to <output_dir>/trace.json.
    #[arg(long)]
    pub trace: bool,
    /// Also time every step on a profiled machine's virtual clocks: a built-in profile
    /// (h100-pcie5, h200, rtx4090) or a profile file (`tierzero bench profile` writes
    /// this machine's). The plan is made for that machine; the run computes here, on
    /// the CPU, with its real math (metrics.jsonl → `simulated`).
    #[arg(long, value_name = "PROFILE")]
    pub simulate: Option<String>,
    /// Write no checkpoint: neither every `train.save_interval` steps, nor after the
    /// last step, nor on SIGTERM/SIGUSR1 (Hugging Face's `save_strategy: "no"`; for
    /// benchmarks, whose final save of NVMe-resident state can be the size of the swap
    /// files). The metrics, plots and summary are written as always.
    #[arg(long)]
    pub no_save: bool,
}

pub fn run(
    TrainArgs {
        config,
        resume,
        trace,
        simulate,
        no_save,
    }: TrainArgs,
) -> Result<(), Failure> {
    let profile = simulate.as_deref().map(super::plan::load_profile).transpose()?;
    let loaded = match &profile {
        Some(profile) => {
            // a CPU profile is this machine's (or one like it): the plan is this CPU's
            let facts = if profile.is_cpu() {
                tierzero::device::facts()
            } else {
                profile.facts()
            };
            let mut loaded = load_config_on(&config, facts)?;
            // the machine's plan, computed on this CPU
            loaded.plan.train.accelerator = plan::Accelerator::Cpu;
            println!(
                "simulating {}: the plan is made for it, the steps run on this CPU and are timed on its clocks",
                profile.name
            );
            loaded
        }
        None => load_config(&config)?,
    };
    if no_save {
        println!("--no-save: this run writes no checkpoint (train.save_interval is not acted on, nor a preemption signal)");
    } else {
        disk_space_warning(&loaded.plan);
    }
    let output_dir = &loaded.plan.train.output_dir;
    let resume_dir = match resume.as_deref() {
        Some(r) => tierzero::checkpoint::save::resolve(r, output_dir).map_err(anyhow::Error::from)?,
        None => None,
    };
    if resume.as_deref() == Some("auto") && resume_dir.is_none() {
        println!(
            "--resume auto: no checkpoint under {} yet; starting from step 0",
            tierzero::checkpoint::save::root(output_dir).display()
        );
    }
    print!("{}", plan::plan_table(&loaded.plan));
    let options = TrainOptions {
        write_outputs: true,
        save_checkpoints: !no_save,
        resume: resume_dir.as_deref(),
        trace,
        simulate: profile.as_ref(),
        ..TrainOptions::default()
    };
    tierzero::run::preempt::install().context("installing the SIGTERM/SIGUSR1 handler")?;
    let result = run::train(&loaded.plan, options).map_err(anyhow::Error::from)?;
    let launch = &loaded.plan.train.launch;
    if launch.node_rank != 0 {
        println!(
            "node {} of {}: done in {:.1}s; node 0 wrote the metrics to {}",
            launch.node_rank,
            launch.nnodes,
            result.seconds,
            loaded.plan.train.output_dir.display()
        );
        exit_if_preempted(&result);
        return Ok(());
    }
    let first = result.steps.first().map_or(f64::NAN, |m| m.loss);
    let last = result.steps.last().map_or(f64::NAN, |m| m.loss);
    let summary = result.summary(&loaded.plan);
    let tokens_per_s = summary.tokens_per_s;
    let output_dir = &loaded.plan.train.output_dir;
    let summary_path = output_dir.join("summary.json");
    std::fs::write(
        &summary_path,
        serde_json::to_vec_pretty(&summary).context("serialising the summary")?,
    )
    .with_context(|| format!("writing {}", summary_path.display()))?;
    print_memory(&loaded.plan, &result, &summary);
    println!(
        "done: {} steps in {:.1}s, loss {first:.4} -> {last:.4}, {tokens_per_s:.0} tokens/s; {}/{{metrics.jsonl,loss.png,summary.json}}",
        result.steps_run,
        result.seconds,
        output_dir.display()
    );
    exit_if_preempted(&result);
    Ok(())
}

/// Memory measured beside memory predicted: each rank's device reservations, torch's
/// allocators, and the process's host memory and kernel time.
fn print_memory(plan: &plan::Plan, result: &run::TrainResult, summary: &Summary) {
    let predicted = &summary.device_bytes_predicted;
    for (rank, peak) in result.device_peaks.iter().enumerate() {
        println!(
            "rank {rank}: device memory reserved by the engine, peak {peak} bytes, plan predicted {} ({:+.1}%; {} more in compute temporaries)",
            predicted.reserved(),
            100.0 * (*peak as f64 / predicted.reserved().max(1) as f64 - 1.0),
            predicted.transient
        );
    }
    for (rank, stats) in result.gpu_memory.iter().enumerate() {
        // gradient accumulators are host arenas: what torch's allocator holds is
        // the prediction's tensors (`DeviceBytes::in_tensors`)
        println!(
            "rank {rank}: torch CUDA allocator peak {} bytes allocated ({} reserved), plan predicted {} for device-tier parameters and optimizer state, gathered units, activations and temporaries ({:+.1}%)",
            stats.peak_allocated,
            stats.peak_reserved,
            predicted.in_tensors(),
            100.0 * (stats.peak_allocated as f64 / predicted.in_tensors().max(1) as f64 - 1.0)
        );
    }
    if let Some(peak) = result.cpu_allocator_peak {
        let ranks = plan.train.devices as u64;
        let predicted = ranks * predicted.in_tensors();
        println!(
            "libtorch CPU allocator: peak {peak} bytes in the steps ({ranks} ranks of this process), plan predicted {predicted} for device-tier parameters and optimizer state, gathered units, activations and temporaries ({:+.1}%)",
            100.0 * (peak as f64 / predicted.max(1) as f64 - 1.0)
        );
    }
    let host = &result.host.steps;
    println!(
        "host: peak resident {:.2} GB in the steps, plan predicted {:.2} GB ({:+.1}%; {:.2} GB at start-up), kernel time {:.0}% of {:.1} CPU-seconds, {} minor page faults",
        host.peak_rss as f64 / 1e9,
        summary.host_bytes_predicted.total as f64 / 1e9,
        100.0 * (host.peak_rss as f64 / summary.host_bytes_predicted.total.max(1) as f64 - 1.0),
        result.host.startup_peak_rss as f64 / 1e9,
        100.0 * host.kernel_fraction,
        host.user_s + host.system_s,
        host.minor_faults
    );
}

/// A run stopped by SIGTERM/SIGUSR1 ends with `EXIT_PREEMPTED` after saying where it
/// stopped, so a scheduler (or a person) can tell it from a finished or failed run.
fn exit_if_preempted(result: &run::TrainResult) {
    if result.preempted {
        let step = result.steps.last().map_or(0, |m| m.step);
        eprintln!(
            "preempted by {}: stopped after step {step} and saved its checkpoint; `--resume auto` continues (exit status {})",
            tierzero::run::preempt::signal_name(),
            tierzero::run::preempt::EXIT_PREEMPTED
        );
        std::process::exit(tierzero::run::preempt::EXIT_PREEMPTED);
    }
}
