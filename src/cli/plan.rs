//! `tierzero plan`: the resolved plan as a table or JSON, with the data opened as
//! `train` would open it and the disk-space check.

use super::common::{check_data, disk_space_warning, load_config, load_config_on, ConfigArgs, Failure};
use anyhow::Context;
use clap::Args;
use tierzero::plan;
use tierzero::plan::simulate::profile::Profile;

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Simulate a step on a machine: a built-in profile (h100-pcie5, h200, rtx4090) or
    /// a profile file (`tierzero bench profile` writes this machine's).
    #[arg(long, value_name = "PROFILE")]
    pub simulate: Option<String>,
    /// With --simulate: write the simulated step as a Chrome trace (one track per lane).
    #[arg(long, value_name = "FILE", requires = "simulate")]
    pub trace: Option<std::path::PathBuf>,
}

pub fn run(
    PlanArgs {
        config,
        json,
        simulate,
        trace,
    }: PlanArgs,
) -> Result<(), Failure> {
    if let Some(profile) = simulate {
        let profile = Profile::load(&profile).map_err(|e| {
            tierzero::config::ConfigError::invalid(
                "--simulate",
                e.to_string(),
                "name a built-in profile or a file `tierzero bench profile` wrote",
            )
        })?;
        let loaded = load_config_on(&config, profile.facts())?;
        return run_simulation(&loaded.plan, &profile, json, trace.as_deref());
    }
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

/// `plan --simulate`: the config's step replayed on a profiled machine (no data read,
/// nothing written but the trace).
fn run_simulation(
    plan: &plan::Plan,
    profile: &Profile,
    json: bool,
    trace: Option<&std::path::Path>,
) -> Result<(), Failure> {
    let simulation = plan::simulate::simulate(plan, profile);
    if let Some(path) = trace {
        let text = serde_json::to_string(&simulation.chrome_trace()).context("serialising the trace")?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&simulation).context("serialising the simulation")?
        );
    } else {
        print!("{}", simulation.human(plan));
    }
    Ok(())
}
