//! The commands, one file each: `train`, `plan`, `estimate`, `bench`, `export`,
//! `rendezvous`, `inspect`, `eval`, `generate`; `common.rs` holds what they share.

mod bench;
mod common;
mod estimate;
mod eval;
mod export;
mod generate;
mod inspect;
mod plan;
mod rendezvous;
mod train;

pub use common::Failure;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Command {
    /// Train a model from a config.
    Train(train::TrainArgs),
    /// Print the resolved plan: model size, batch math, what lives on which tier.
    Plan(plan::PlanArgs),
    /// DeepSpeed's ZeRO-3 model-state memory estimate for every offload combination.
    Estimate(estimate::EstimateArgs),
    /// Throughput benchmarks, each against its hardware limit measured in the same run.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Write a Hugging Face model directory: from a checkpoint, or (with --config) the
    /// configured model's initial weights (a preset's random init, or model.hf_dir).
    Export(export::ExportArgs),
    /// Check a multi-node launch: every node reaches node 0 and gets the same NCCL id.
    /// Takes torchrun's WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT when no --nnodes is given.
    Rendezvous(rendezvous::RendezvousArgs),
    /// Print a checkpoint's manifest in human form.
    Inspect(inspect::InspectArgs),
    /// Mean loss over `train.eval_batches` batches.
    Eval(eval::EvalArgs),
    /// Continue a prompt, chat messages or token ids with a checkpoint or a Hugging Face
    /// directory (greedy, or sampled with --temperature/--top-k/--top-p).
    Generate(generate::GenerateArgs),
}

/// Runs one command.
pub fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Train(args) => train::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Estimate(args) => estimate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Export(args) => export::run(args),
        Command::Rendezvous(args) => rendezvous::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Generate(args) => generate::run(args),
    }
}
