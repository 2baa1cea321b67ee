//! `tierzero eval`: mean loss over `train.eval_batches` batches.

use super::common::{load_config, ConfigArgs, Failure};
use clap::Args;
use tierzero::run;

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    #[arg(long)]
    pub json: bool,
}

pub fn run(EvalArgs { config, json }: EvalArgs) -> Result<(), Failure> {
    let loaded = load_config(&config)?;
    let loss = run::evaluate(&loaded.plan).map_err(anyhow::Error::from)?;
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
