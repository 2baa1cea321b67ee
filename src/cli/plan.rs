//! `tierzero plan`: the resolved plan as a table or JSON, with the data opened as
//! `train` would open it and the disk-space check.

use super::common::{check_data, disk_space_warning, load_config, ConfigArgs, Failure};
use anyhow::Context;
use clap::Args;
use tierzero::plan;

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(PlanArgs { config, json }: PlanArgs) -> Result<(), Failure> {
    let mut loaded = load_config(&config)?;
    check_data(&loaded.plan)?;
    loaded.warnings.extend(disk_space_warning(&loaded.plan));
    if json {
        let value = serde_json::json!({
            "plan": loaded.plan,
            "model_states": plan::report::model_states(&loaded.plan),
            "device_bytes_per_rank": tierzero::plan::memory::predict(&loaded.plan),
            "parameters": loaded.plan.model.config.num_parameters(),
            "warnings": loaded.warnings,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).context("serialising the plan")?
        );
    } else {
        print!("{}", plan::plan_table(&loaded.plan));
    }
    Ok(())
}
