//! `tierzero rendezvous`: checks a multi-node launch before a job waits on it.

use super::common::{emit, Failure, LaunchArgs};
use clap::Args;

#[derive(Args)]
pub struct RendezvousArgs {
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Ranks (GPUs) on each node.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Seconds to wait for every node.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    #[arg(long)]
    pub json: bool,
}

pub fn run(
    RendezvousArgs {
        launch: l,
        devices,
        timeout,
        json,
    }: RendezvousArgs,
) -> Result<(), Failure> {
    use tierzero::comm::launch;
    let flags = launch::LaunchFlags {
        nnodes: l.nnodes,
        node_rank: l.node_rank,
        master_addr: l.master_addr,
        master_port: l.master_port,
        devices,
    };
    let topo = launch::topology(&flags, |k| std::env::var(k).ok()).map_err(|e| anyhow::anyhow!(e))?;
    let report =
        launch::check(&topo, std::time::Duration::from_secs(timeout)).map_err(|e| anyhow::anyhow!(e))?;
    emit(&report, json, launch::RendezvousReport::human)
}
