//! `tierzero export`: a Hugging Face directory from a checkpoint, or from a config's
//! initial weights.

use super::common::{parse_bytes, Failure};
use anyhow::Context;
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use tierzero::plan;
use tierzero::run;

#[derive(Args)]
pub struct ExportArgs {
    pub checkpoint: Option<PathBuf>,
    /// Export the model a config describes instead of a checkpoint.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    #[arg(long)]
    pub hf: PathBuf,
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: ExportDtype,
    /// Largest safetensors shard, in bytes.
    #[arg(long, default_value = "5G", value_parser = parse_bytes)]
    pub max_shard_size: u64,
}

pub fn run(
    ExportArgs {
        checkpoint,
        config,
        sets,
        hf,
        dtype,
        max_shard_size,
    }: ExportArgs,
) -> Result<(), Failure> {
    let dtype = match dtype {
        ExportDtype::Fp32 => tierzero::model::hf::SaveDtype::F32,
        ExportDtype::Bf16 => tierzero::model::hf::SaveDtype::Bf16,
        ExportDtype::Fp16 => tierzero::model::hf::SaveDtype::F16,
    };
    let config = match (checkpoint, config) {
        (Some(checkpoint), None) => {
            let report =
                tierzero::checkpoint::export::export(&checkpoint, &hf, dtype, max_shard_size as usize)
                    .map_err(anyhow::Error::from)?;
            println!(
                "wrote {} from step {} ({} units, {} parameters); peak memory grew by {} bytes (largest unit {} bytes)",
                hf.display(),
                report.step,
                report.units,
                report.parameters,
                report.rss_growth_bytes.map_or("?".into(), |b| b.to_string()),
                report.largest_unit_bytes
            );
            return Ok(());
        }
        (None, Some(config)) => config,
        _ => {
            return Err(Failure::Other(anyhow::anyhow!(
                "give a checkpoint directory or --config (not both)"
            )))
        }
    };
    let loaded = plan::load(&config, &sets, tierzero::device::facts())?;
    let weights = run::initial_weights(&loaded.plan).map_err(anyhow::Error::from)?;
    tierzero::model::hf::save(
        &hf,
        &loaded.plan.model.config,
        &weights,
        dtype,
        max_shard_size as usize,
    )
    .map_err(anyhow::Error::from)?;
    let plan = serde_json::to_value(&loaded.plan).context("serialising the plan")?;
    tierzero::model::hf::Companions::from_plan_json(&plan)
        .write(&hf)
        .map_err(anyhow::Error::from)?;
    println!("wrote {}", hf.display());
    Ok(())
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ExportDtype {
    Fp32,
    Bf16,
    Fp16,
}
