//! The `tierzero` command line: train, bench, estimate, plan, export, inspect, eval.
//!
//! Configuration errors exit with status 2 before anything is written; other failures
//! exit with status 1. Logs go through `tracing` (`RUST_LOG=debug` for more).

mod cli;

use clap::Parser;
use cli::Failure;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "tierzero",
    version,
    about = "ZeRO-3 training with GPU, host and NVMe memory tiers"
)]
struct Cli {
    #[command(subcommand)]
    command: cli::Command,
}

fn main() -> ExitCode {
    // before any thread exists: a thread that takes a malloc arena of its own keeps it
    tierzero::metrics::host::reuse_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    for check in [
        tierzero::checkpoint::crash::check_env,
        tierzero_offload::nvme::fault::check_env,
    ] {
        if let Err(e) = check() {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    // before any tensor or thread: libtorch's CPU allocations are counted from here on
    if let Err(e) = tierzero::torch::shim::count_cpu_allocations() {
        tracing::warn!("libtorch's CPU memory will not be measured: {e}");
    }
    match cli::run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Config(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(Failure::Other(e)) => {
            eprintln!("error: {}", chain(&e));
            ExitCode::from(1)
        }
    }
}

/// An error and its causes, each said once: most of this crate's errors already name
/// their cause in their own message, so a cause whose text the message so far contains
/// is left out (anyhow's `{:#}` would repeat it).
fn chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}
