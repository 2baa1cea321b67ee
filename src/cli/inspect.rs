//! `tierzero inspect`: a checkpoint's manifest, verified on request.

use super::common::Failure;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct InspectArgs {
    pub checkpoint: PathBuf,
    /// Read every file and check every checksum.
    #[arg(long)]
    pub verify: bool,
    /// Print the manifest as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(
    InspectArgs {
        checkpoint,
        verify,
        json,
    }: InspectArgs,
) -> Result<(), Failure> {
    let checkpoint = tierzero::checkpoint::Checkpoint::open(&checkpoint).map_err(anyhow::Error::from)?;
    if verify {
        checkpoint.verify().map_err(anyhow::Error::from)?;
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&checkpoint.manifest).context("serialising the manifest")?
        );
    } else {
        print!("{}", checkpoint.manifest.human());
        if verify {
            println!("verified: every slice of every file matches its checksum");
        }
    }
    Ok(())
}
