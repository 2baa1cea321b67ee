//! `tierzero eval`: mean loss over `train.eval_batches` batches of the held-out data, of
//! a checkpoint's weights or the config's own (a preset's init, or `model.hf_dir`).

use super::common::{load_config, ConfigArgs, Failure};
use clap::Args;
use tierzero::run;

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// A checkpoint directory, or `latest` (the run's newest under `train.output_dir`).
    #[arg(long)]
    pub checkpoint: Option<String>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(
    EvalArgs {
        config,
        checkpoint,
        json,
    }: EvalArgs,
) -> Result<(), Failure> {
    let loaded = load_config(&config)?;
    let dir = match checkpoint {
        Some(c) => tierzero::checkpoint::save::resolve(&c, &loaded.plan.train.output_dir)
            .map_err(anyhow::Error::from)?,
        None => None,
    };
    let loss = run::evaluate(&loaded.plan, dir.as_deref()).map_err(anyhow::Error::from)?;
    if json {
        println!(
            "{}",
            serde_json::json!({ "loss": loss, "batches": loaded.plan.train.eval_batches })
        );
    } else {
        println!(
            "eval loss {loss:.4} over {} batches",
            loaded.plan.train.eval_batches
        );
    }
    Ok(())
}
