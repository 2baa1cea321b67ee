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

// gperftools' release rate (`TCMALLOC_RELEASE_RATE`), a C++ flag with no C setter: the
// page heap reads it each time it considers handing freed spans back to the kernel.
extern "C" {
    #[link_name = "_ZN62FLAG__namespace_do_not_use_directly_use_DECLARE_double_instead27FLAGS_tcmalloc_release_rateE"]
    static mut TCMALLOC_RELEASE_RATE: f64;
}

fn main() -> ExitCode {
    // Every allocation of the process, libtorch's included, is tcmalloc's (build.rs links
    // it whole into the executable, so its `malloc` takes the place of the C library's).
    // It never hands freed memory back unless `TCMALLOC_RELEASE_RATE` asks: a step frees
    // and allocates the same blocks again, and each page handed back is zeroed by the
    // kernel on its next touch (README, "Host memory and kernel time").
    if std::env::var_os("TCMALLOC_RELEASE_RATE").is_none() {
        // SAFETY: written once before any other thread exists; tcmalloc only reads it.
        unsafe { TCMALLOC_RELEASE_RATE = 0.0 };
    }
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
