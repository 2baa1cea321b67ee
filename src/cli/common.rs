//! What the commands share: the config file and launch flags, number parsing, the
//! report printer, the errors that decide the exit status, and loading a config with
//! its warnings said once.

use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use tierzero::config::ConfigError;
use tierzero::plan::{self, Loaded};

/// The config file and its overrides, shared by the commands that read one.
#[derive(Args, Clone)]
pub struct ConfigArgs {
    /// A DeepSpeed ds_config JSON with tierzero's `model`, `data` and `train` sections.
    #[arg(long, short)]
    pub config: PathBuf,
    /// Override a key: `--set train.steps=20 --set zero_optimization.stage=3`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Number of ranks on this machine (same as `--set train.devices=N`).
    #[arg(long)]
    pub devices: Option<usize>,
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// Where this process sits in a multi-process run.
#[derive(Args, Clone)]
pub struct LaunchArgs {
    /// Processes (nodes) of a multi-process run (`train.nnodes`); without it, torchrun's
    /// WORLD_SIZE/RANK/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are used when set.
    #[arg(long)]
    pub nnodes: Option<usize>,
    /// This node's rank, 0..nnodes (`train.node_rank`).
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Address node 0 listens on (`train.master_addr`).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Port of the c10d store node 0 serves (`train.master_port`).
    #[arg(long)]
    pub master_port: Option<u16>,
}

/// Parses `100000000`, `1e8` or `100M`-free plain numbers.
pub fn parse_count(s: &str) -> Result<u64, String> {
    let v: f64 = s
        .replace('_', "")
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if v < 0.0 || v.fract() != 0.0 || !v.is_finite() {
        return Err(format!("{s:?} is not a whole non-negative number"));
    }
    Ok(v as u64)
}

/// Parses `1048576`, `1M`, `256K`, `8MiB`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim().trim_end_matches("iB").trim_end_matches('B');
    let (number, unit) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    Ok(parse_count(number)? * unit)
}

/// Prints a report as one JSON line or in human form.
pub fn emit<T: serde::Serialize>(
    report: &T,
    json: bool,
    human: impl FnOnce(&T) -> String,
) -> Result<(), Failure> {
    if json {
        println!(
            "{}",
            serde_json::to_string(report).context("serialising the report")?
        );
    } else {
        println!("{}", human(report));
    }
    Ok(())
}

/// Errors that decide the exit status.
pub enum Failure {
    Config(ConfigError),
    Other(anyhow::Error),
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        Failure::Config(e)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Other(e)
    }
}

pub fn load_config(args: &ConfigArgs) -> Result<Loaded, ConfigError> {
    load_config_on(args, tierzero::device::facts())
}

/// [`load_config`] as on a machine with `facts` (`plan --simulate`: the profile's).
pub fn load_config_on(args: &ConfigArgs, facts: tierzero::plan::DeviceFacts) -> Result<Loaded, ConfigError> {
    let loaded = plan::load(&args.config, &config_sets(args)?, facts)?;
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    Ok(loaded)
}

/// The `--set`s a config is loaded with: the user's, then `--devices` and the launch's.
pub fn config_sets(args: &ConfigArgs) -> Result<Vec<String>, ConfigError> {
    let mut sets = args.sets.clone();
    if let Some(n) = args.devices {
        sets.push(format!("train.devices={n}"));
    }
    launch_sets(&args.launch, &mut sets)?;
    Ok(sets)
}

/// Warns (once, on node 0, which writes the checkpoints) when `output_dir`'s disk cannot
/// hold the checkpoints the run keeps beside its NVMe swap files; returns the warning.
pub fn disk_space_warning(plan: &tierzero::plan::Plan) -> Option<String> {
    let warning = (plan.train.launch.node_rank == 0)
        .then(|| tierzero::checkpoint::space::warning(plan))
        .flatten()?;
    tracing::warn!("{warning}");
    Some(warning)
}

/// Opens the data as `train` will (token file: exists, holds a window, ids within the
/// vocabulary; text: read and tokenized into its cache), so `plan` fails where `train`
/// would, before anyone waits for a job. A failure names the key to fix.
pub fn check_data(plan: &tierzero::plan::Plan) -> Result<(), ConfigError> {
    use tierzero::plan::DataSource;
    let Err(e) = tierzero::data::Dataset::open(plan) else {
        return Ok(());
    };
    let key = match (&plan.data.source, &e) {
        (
            DataSource::Text { tokenizer, .. },
            tierzero::data::DataError::Read { path, .. } | tierzero::data::DataError::Invalid { path, .. },
        ) if path == tokenizer => "data.tokenizer",
        _ => "data.path",
    };
    Err(ConfigError::invalid(
        key,
        e.to_string(),
        "point it at the data train should read (or set data.synthetic)",
    ))
}

/// The launch flags as `--set`s, or torchrun's environment when no `--nnodes` is given.
pub fn launch_sets(args: &LaunchArgs, sets: &mut Vec<String>) -> Result<(), ConfigError> {
    let flags = [
        ("nnodes", args.nnodes.map(|v| v.to_string())),
        ("node_rank", args.node_rank.map(|v| v.to_string())),
        ("master_addr", args.master_addr.clone()),
        ("master_port", args.master_port.map(|v| v.to_string())),
    ];
    if args.nnodes.is_none() {
        let torchrun = tierzero::comm::rendezvous::Topology::from_torchrun(|k| std::env::var(k).ok())
            .map_err(|e| {
                ConfigError::invalid(
                    "WORLD_SIZE",
                    e,
                    "launch with torchrun, or use --nnodes/--node-rank",
                )
            })?;
        if let Some(t) = torchrun {
            sets.extend([
                format!("train.nnodes={}", t.processes),
                format!("train.node_rank={}", t.index),
                "train.devices=1".to_string(),
                format!("train.first_device={}", t.first_device),
                format!("train.master_addr={}", t.master_addr),
                format!("train.master_port={}", t.master_port),
            ]);
        }
    }
    for (key, value) in flags {
        if let Some(v) = value {
            sets.push(format!("train.{key}={v}"));
        }
    }
    Ok(())
}
