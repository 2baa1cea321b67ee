//! `tierzero estimate`: DeepSpeed's ZeRO-3 model-state estimate for every offload
//! combination.

use super::common::{parse_count, Failure};
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use tierzero::config::ConfigError;
use tierzero::plan::{self, estimate};

#[derive(Args)]
pub struct EstimateArgs {
    /// Total parameters (e.g. 2851e6), or take it from --config.
    #[arg(long, value_parser = parse_count)]
    pub params: Option<u64>,
    /// Parameters of the largest layer.
    #[arg(long, value_parser = parse_count)]
    pub largest_layer: Option<u64>,
    #[arg(long, default_value_t = 1)]
    pub gpus_per_node: u64,
    #[arg(long, default_value_t = 1)]
    pub nodes: u64,
    /// Read the model from a config instead of --params/--largest-layer.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(
    EstimateArgs {
        params,
        largest_layer,
        gpus_per_node,
        nodes,
        config,
        json,
    }: EstimateArgs,
) -> Result<(), Failure> {
    let (params, largest) = match (params, largest_layer, config) {
        (Some(p), Some(l), None) => (p, l),
        (None, None, Some(path)) => {
            let loaded = plan::load(&path, &[], tierzero::device::facts())?;
            let units = loaded.plan.model.config.unit_numels();
            (
                units.iter().sum::<usize>() as u64,
                units.iter().copied().max().unwrap_or(0) as u64,
            )
        }
        _ => {
            return Err(Failure::Config(ConfigError::invalid(
                "--params",
                "give either --params and --largest-layer, or --config",
                "e.g. tierzero estimate --params 2851e6 --largest-layer 32e6 --gpus-per-node 8",
            )))
        }
    };
    let rows = estimate::estimate_table(params, largest, gpus_per_node, nodes);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).context("serialising the estimate")?
        );
    } else {
        print!(
            "{}",
            estimate::render(params, largest, gpus_per_node, nodes, &rows)
        );
    }
    Ok(())
}
