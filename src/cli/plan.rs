//! `tierzero plan`: the resolved plan as a table or JSON, with the data opened as
//! `train` would open it and the disk-space check.

use super::common::{
    check_data, config_sets, disk_space_warning, load_config, load_config_on, ConfigArgs, Failure,
};
use anyhow::Context;
use clap::Args;
use tierzero::plan;
use tierzero::plan::capacity;
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
    /// The largest model the machine trains with this config: its model with the most
    /// layers whose plan fits the device, host memory and the NVMe path (on the
    /// --simulate profile's device when given), beside the largest DeepSpeed's ZeRO-3
    /// estimator places on the same capacities.
    #[arg(long)]
    pub largest: bool,
}

pub fn run(
    PlanArgs {
        config,
        json,
        simulate,
        trace,
        largest,
    }: PlanArgs,
) -> Result<(), Failure> {
    let profile = simulate.map(|p| load_profile(&p)).transpose()?;
    if largest {
        let facts = profile
            .as_ref()
            .map_or_else(tierzero::device::facts, |p| p.facts());
        return run_largest(&config, facts, json);
    }
    if let Some(profile) = profile {
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

pub(super) fn load_profile(name: &str) -> Result<Profile, tierzero::config::ConfigError> {
    Profile::load(name).map_err(|e| {
        tierzero::config::ConfigError::invalid(
            "--simulate",
            e.to_string(),
            "name a built-in profile or a file `tierzero bench profile` wrote",
        )
    })
}

/// Layers tried at most by `plan --largest` (a 1024-layer Llama-8B shape is ~225B).
const MAX_LAYERS: usize = 1024;

/// `plan --largest`: tierzero's largest model on the machine beside DeepSpeed's by its
/// estimator on the same device and host capacities.
fn run_largest(config: &ConfigArgs, facts: plan::DeviceFacts, json: bool) -> Result<(), Failure> {
    let sets = config_sets(config)?;
    let plan_with = |layers: usize| {
        let mut sets = sets.clone();
        sets.push(format!("model.num_hidden_layers={layers}"));
        plan::load(&config.config, &sets, facts).map(|l| l.plan)
    };
    let base = plan_with(1)?;
    let ours = capacity::largest(MAX_LAYERS, facts, plan_with)?;
    let fit = capacity::TierFit::of(&base, facts);
    // a CPU device's memory is the host's: DeepSpeed's GPU and CPU bytes share it
    let cpu = base.train.accelerator == plan::Accelerator::Cpu;
    let (device, host) = match (fit.device_budget, fit.host_memory) {
        (_, Some(h)) if cpu => (None, h),
        (Some(d), Some(h)) => (Some(d), h),
        _ => {
            return Err(Failure::Config(tierzero::config::ConfigError::invalid(
                "train.host_memory",
                "plan --largest needs the device's and the host's capacities",
                "run where torch sees the GPU, or give --simulate PROFILE, and train.host_memory",
            )))
        }
    };
    let without_nvme = |layers: usize| {
        let mut sets = sets.clone();
        sets.extend([
            format!("model.num_hidden_layers={layers}"),
            "train.nvme_space=1".into(),
        ]);
        plan::load(&config.config, &sets, facts).map(|l| l.plan)
    };
    let gpus = base.train.devices as u64;
    let found = capacity::Comparison {
        tierzero: ours,
        tierzero_without_nvme: match fit.nvme_space {
            Some(_) => capacity::largest(MAX_LAYERS, facts, without_nvme)?,
            None => None,
        },
        deepspeed_estimator: capacity::deepspeed_largest(
            MAX_LAYERS,
            (device, host, gpus),
            &base.model.config,
        ),
        deepspeed_nvme: match fit.nvme_space {
            Some(room) => capacity::deepspeed_nvme_largest(MAX_LAYERS, room, &base.model.config),
            None => None,
        },
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&found).context("serialising the capacities")?
        );
        return Ok(());
    }
    print!("{}", capacity::render(&base, &found, fit));
    Ok(())
}
