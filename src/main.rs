//! The `tierzero` command line: train, bench, estimate, plan, export, inspect, eval.
//!
//! Configuration errors exit with status 2 before anything is written; other failures
//! exit with status 1. Logs go through `tracing` (`RUST_LOG=debug` for more).

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use tierzero::bench::adam::{AdamBenchArgs, AdamBenchReport};
use tierzero::config::ConfigError;
use tierzero::plan::estimate;
use tierzero::plan::{self, Loaded};
use tierzero::zero::trainer::{self, TrainOptions};
use tierzero_offload::adam::Kernel;

#[derive(Parser)]
#[command(
    name = "tierzero",
    version,
    about = "ZeRO-3 training with GPU, host and NVMe memory tiers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The config file and its overrides, shared by the commands that read one.
#[derive(Args, Clone)]
struct ConfigArgs {
    /// A DeepSpeed ds_config JSON with tierzero's `model`, `data` and `train` sections.
    #[arg(long, short)]
    config: PathBuf,
    /// Override a key: `--set train.steps=20 --set zero_optimization.stage=3`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Number of ranks on this machine (same as `--set train.devices=N`).
    #[arg(long)]
    devices: Option<usize>,
    #[command(flatten)]
    launch: LaunchArgs,
}

/// Where this process sits in a multi-process run.
#[derive(Args, Clone)]
struct LaunchArgs {
    /// Processes (nodes) of a multi-process run (`train.nnodes`); without it, torchrun's
    /// WORLD_SIZE/RANK/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are used when set.
    #[arg(long)]
    nnodes: Option<usize>,
    /// This node's rank, 0..nnodes (`train.node_rank`).
    #[arg(long)]
    node_rank: Option<usize>,
    /// Address node 0 listens on (`train.master_addr`).
    #[arg(long)]
    master_addr: Option<String>,
    /// Port of the c10d store node 0 serves (`train.master_port`).
    #[arg(long)]
    master_port: Option<u16>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model from a config.
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// Resume from a checkpoint directory, `latest` (the newest checkpoint under
        /// output_dir; an error if none), or `auto` (the newest if there is one, else a
        /// fresh start: one command for a job's first launch and its restarts).
        #[arg(long)]
        resume: Option<String>,
        /// Write a Chrome trace of every step to <output_dir>/trace.json.
        #[arg(long)]
        trace: bool,
    },
    /// Print the resolved plan: model size, batch math, what lives on which tier.
    Plan {
        #[command(flatten)]
        config: ConfigArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// DeepSpeed's ZeRO-3 model-state memory estimate for every offload combination.
    Estimate {
        /// Total parameters (e.g. 2851e6), or take it from --config.
        #[arg(long, value_parser = parse_count)]
        params: Option<u64>,
        /// Parameters of the largest layer.
        #[arg(long, value_parser = parse_count)]
        largest_layer: Option<u64>,
        #[arg(long, default_value_t = 1)]
        gpus_per_node: u64,
        #[arg(long, default_value_t = 1)]
        nodes: u64,
        /// Read the model from a config instead of --params/--largest-layer.
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Throughput benchmarks, each against its hardware limit measured in the same run.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
    /// Write a Hugging Face model directory: from a checkpoint, or (with --config) the
    /// configured model's initial weights (a preset's random init, or model.hf_dir).
    Export {
        checkpoint: Option<PathBuf>,
        /// Export the model a config describes instead of a checkpoint.
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        #[arg(long)]
        hf: PathBuf,
        #[arg(long, value_enum, default_value = "bf16")]
        dtype: ExportDtype,
        /// Largest safetensors shard, in bytes.
        #[arg(long, default_value = "5G", value_parser = parse_bytes)]
        max_shard_size: u64,
    },
    /// Check a multi-node launch: every node reaches node 0 and gets the same NCCL id.
    /// Takes torchrun's WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT when no --nnodes is given.
    Rendezvous {
        #[command(flatten)]
        launch: LaunchArgs,
        /// Ranks (GPUs) on each node.
        #[arg(long, default_value_t = 1)]
        devices: usize,
        /// Seconds to wait for every node.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        #[arg(long)]
        json: bool,
    },
    /// Print a checkpoint's manifest in human form.
    Inspect {
        checkpoint: PathBuf,
        /// Read every file and check every checksum.
        #[arg(long)]
        verify: bool,
        /// Print the manifest as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Mean loss over `train.eval_batches` batches.
    Eval {
        #[command(flatten)]
        config: ConfigArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportDtype {
    Fp32,
    Bf16,
    Fp16,
}

#[derive(Clone, Copy, ValueEnum)]
enum GradDtype {
    Fp32,
    Bf16,
}

#[derive(Clone, Copy, ValueEnum)]
enum KernelChoice {
    Auto,
    Reference,
    Portable,
    Avx2,
    Avx512,
}

#[derive(Subcommand)]
enum Bench {
    /// CPU AdamW params/s and GB/s against the kernel's memory roofline.
    Adam {
        #[arg(long, default_value = "100000000", value_parser = parse_count)]
        params: u64,
        /// Threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long, value_enum, default_value = "fp32")]
        grad_dtype: GradDtype,
        #[arg(long, value_enum, default_value = "auto")]
        kernel: KernelChoice,
        /// Timed repeats after one warm-up round.
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        #[arg(long)]
        json: bool,
    },
    /// NVMe block I/O against a plain O_DIRECT loop and fio.
    Nvme {
        /// A directory on the NVMe drive to test.
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = 512)]
        size_mb: u64,
        /// Block size (e.g. 1M, 256K); default: 256K, 1M and 8M.
        #[arg(long, value_parser = parse_bytes)]
        block_size: Option<u64>,
        /// Requests in flight; default: 8 and 32.
        #[arg(long)]
        queue_depth: Option<usize>,
        /// Interleaved rounds per case (medians are reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        #[arg(long)]
        json: bool,
    },
    /// The Local collectives (ranks as threads) against memcpy in the same run.
    Comm {
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// `local` (ranks as threads), `gloo` (c10d Gloo over a loopback TCPStore, ranks
        /// as threads) or `gloo-processes` (the same between processes of this binary).
        #[arg(long, default_value = "local")]
        backend: String,
        /// Set on the processes `gloo-processes` starts: this process's rank.
        #[arg(long, hide = true)]
        worker_rank: Option<usize>,
        /// Set on the processes `gloo-processes` starts: the store's port.
        #[arg(long, hide = true)]
        master_port: Option<u16>,
        /// Bytes each rank receives per collective (e.g. 64M).
        #[arg(long, default_value = "64M", value_parser = parse_bytes)]
        size: u64,
        /// Interleaved rounds (medians are reported).
        #[arg(long, default_value_t = 9)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// The pipelined NVMe optimizer step against its read, update and write alone.
    Swap {
        #[arg(long, default_value = "100000000", value_parser = parse_count)]
        params: u64,
        #[arg(long)]
        dir: PathBuf,
        /// Elements per sub-group (DeepSpeed's sub_group_size).
        #[arg(long, default_value = "10000000", value_parser = parse_count)]
        sub_group_size: u64,
        /// Buffers of one sub-group each, as offload_optimizer.buffer_count counts them
        /// (DeepSpeed's meaning: 3 make one set of master and moments in flight).
        #[arg(long, default_value_t = 4)]
        buffer_count: usize,
        #[arg(long, default_value = "1M", value_parser = parse_bytes)]
        block_size: u64,
        #[arg(long, default_value_t = 32)]
        queue_depth: usize,
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        #[arg(long)]
        json: bool,
    },
    /// Tokens/s and MFU of a config, and its step time against a dense single rank.
    Step {
        #[command(flatten)]
        config: ConfigArgs,
        /// Steps per run (the first is a warm-up).
        #[arg(long, default_value_t = 6)]
        steps: u64,
        #[arg(long)]
        json: bool,
    },
    /// Peak device memory per rank for several ZeRO stages.
    Memory {
        #[command(flatten)]
        config: ConfigArgs,
        /// Stages to compare, e.g. 0,3.
        #[arg(long, value_delimiter = ',', default_value = "0,3")]
        stages: Vec<u8>,
        /// Steps per stage.
        #[arg(long, default_value_t = 3)]
        steps: u64,
        #[arg(long)]
        json: bool,
    },
    /// Host↔device copy bandwidth: pinned and pageable, each direction and both at
    /// once, against torch's own pinned copy in the same run.
    H2d {
        /// Bytes per copy, in MiB.
        #[arg(long, default_value_t = 256)]
        size_mb: usize,
        #[arg(long)]
        json: bool,
    },
    /// What this GPU machine offers: device, memory, bf16 matmul, copies, NCCL.
    Gpu {
        #[arg(long)]
        json: bool,
    },
}

/// Parses `100000000`, `1e8` or `100M`-free plain numbers.
fn parse_count(s: &str) -> Result<u64, String> {
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
fn parse_bytes(s: &str) -> Result<u64, String> {
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
fn emit<T: serde::Serialize>(
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
enum Failure {
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

fn load_config(args: &ConfigArgs) -> Result<Loaded, ConfigError> {
    let mut sets = args.sets.clone();
    if let Some(n) = args.devices {
        sets.push(format!("train.devices={n}"));
    }
    launch_sets(&args.launch, &mut sets)?;
    let loaded = plan::load(&args.config, &sets, tierzero::device::facts())?;
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    Ok(loaded)
}

/// Warns (once, on node 0, which writes the checkpoints) when `output_dir`'s disk cannot
/// hold the checkpoints the run keeps beside its NVMe swap files; returns the warning.
fn disk_space_warning(plan: &tierzero::plan::Plan) -> Option<String> {
    let warning = (plan.train.launch.node_rank == 0)
        .then(|| tierzero::checkpoint::space::warning(plan))
        .flatten()?;
    tracing::warn!("{warning}");
    Some(warning)
}

/// Opens the data as `train` will (token file: exists, holds a window, ids within the
/// vocabulary; text: read and tokenized into its cache), so `plan` fails where `train`
/// would, before anyone waits for a job. A failure names the key to fix.
fn check_data(plan: &tierzero::plan::Plan) -> Result<(), ConfigError> {
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
fn launch_sets(args: &LaunchArgs, sets: &mut Vec<String>) -> Result<(), ConfigError> {
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

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Plan { config, json } => {
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
        Command::Estimate {
            params,
            largest_layer,
            gpus_per_node,
            nodes,
            config,
            json,
        } => {
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
        Command::Bench { which } => match which {
            Bench::Adam {
                params,
                threads,
                grad_dtype,
                kernel,
                repeats,
                json,
            } => {
                let kernel = match kernel {
                    KernelChoice::Auto => Kernel::detect(),
                    KernelChoice::Reference => Kernel::Reference,
                    KernelChoice::Portable => Kernel::Portable,
                    KernelChoice::Avx2 => Kernel::Avx2,
                    KernelChoice::Avx512 => Kernel::Avx512,
                };
                let args = AdamBenchArgs {
                    params: params as usize,
                    threads: threads
                        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
                    grad_bf16: matches!(grad_dtype, GradDtype::Bf16),
                    kernel,
                    repeats: repeats.max(1),
                };
                let report: AdamBenchReport = tierzero::bench::adam::run(&args)?;
                emit(&report, json, AdamBenchReport::human)
            }
            Bench::Nvme {
                dir,
                size_mb,
                block_size,
                queue_depth,
                repeats,
                json,
            } => {
                let args = tierzero::bench::nvme::NvmeBenchArgs {
                    repeats,
                    dir,
                    size_bytes: size_mb << 20,
                    block_sizes: block_size.map_or(vec![256 << 10, 1 << 20, 8 << 20], |b| vec![b as usize]),
                    queue_depths: queue_depth.map_or(vec![8, 32], |d| vec![d]),
                };
                let report = tierzero::bench::nvme::run(&args)?;
                emit(&report, json, tierzero::bench::nvme::NvmeReport::human)
            }
            Bench::Swap {
                params,
                dir,
                sub_group_size,
                buffer_count,
                block_size,
                queue_depth,
                repeats,
                json,
            } => {
                let args = tierzero::bench::swap::SwapBenchArgs {
                    dir,
                    params: params as usize,
                    sub_group_size: sub_group_size as usize,
                    buffer_count,
                    engine: tierzero_offload::nvme::EngineConfig {
                        block_size: block_size as usize,
                        queue_depth,
                        ..Default::default()
                    },
                    repeats,
                };
                let report = tierzero::bench::swap::run(&args)?;
                emit(&report, json, tierzero::bench::swap::SwapReport::human)
            }
            Bench::Comm {
                ranks,
                backend,
                worker_rank,
                master_port,
                size,
                rounds,
                json,
            } => {
                use tierzero::bench::comm::Backend;
                let backend = match backend.as_str() {
                    "local" => Backend::Local,
                    "gloo" => Backend::Gloo,
                    "gloo-processes" => Backend::GlooProcesses,
                    other => {
                        return Err(
                            anyhow::anyhow!("--backend {other:?}: use local, gloo or gloo-processes").into(),
                        )
                    }
                };
                let args = tierzero::bench::comm::CommBenchArgs {
                    backend,
                    ranks,
                    bytes: size as usize,
                    rounds,
                };
                if let (Some(rank), Some(port)) = (worker_rank, master_port) {
                    // a rank process of `gloo-processes`: rank 0 reports
                    tierzero::bench::comm::worker(&args, rank, port).map_err(anyhow::Error::from)?;
                    return Ok(());
                }
                let report = tierzero::bench::comm::run(&args).map_err(anyhow::Error::from)?;
                emit(&report, json, tierzero::bench::comm::CommReport::human)
            }
            Bench::Memory {
                config,
                stages,
                steps,
                json,
            } => {
                let mut loaded = load_config(&config)?;
                loaded.plan.train.steps = steps;
                let report =
                    tierzero::bench::memory::run(&loaded.plan, &stages).map_err(anyhow::Error::from)?;
                emit(&report, json, tierzero::bench::memory::MemoryReport::human)
            }
            Bench::Step { config, steps, json } => {
                let loaded = load_config(&config)?;
                let report = tierzero::bench::step::run(&loaded.plan, steps).map_err(anyhow::Error::from)?;
                emit(&report, json, tierzero::bench::step::StepReport::human)
            }
            Bench::H2d { size_mb, json } => {
                let report = tierzero::bench::gpu::h2d(size_mb).map_err(anyhow::Error::from)?;
                emit(&report, json, tierzero::bench::gpu::H2dReport::human)
            }
            Bench::Gpu { json } => {
                let report = tierzero::bench::gpu::gpu().map_err(anyhow::Error::from)?;
                emit(&report, json, tierzero::bench::gpu::GpuReport::human)
            }
        },
        Command::Train {
            config,
            resume,
            trace,
        } => {
            let loaded = load_config(&config)?;
            disk_space_warning(&loaded.plan);
            let output_dir = &loaded.plan.train.output_dir;
            let resume_dir = match resume.as_deref() {
                Some(r) => tierzero::checkpoint::save::resolve(r, output_dir).map_err(anyhow::Error::from)?,
                None => None,
            };
            if resume.as_deref() == Some("auto") && resume_dir.is_none() {
                println!(
                    "--resume auto: no checkpoint under {} yet; starting from step 0",
                    tierzero::checkpoint::save::root(output_dir).display()
                );
            }
            print!("{}", plan::plan_table(&loaded.plan));
            let options = TrainOptions {
                write_outputs: true,
                save_checkpoints: true,
                resume: resume_dir.as_deref(),
                trace,
                ..TrainOptions::default()
            };
            tierzero::run::preempt::install().context("installing the SIGTERM/SIGUSR1 handler")?;
            let result = trainer::train(&loaded.plan, options).map_err(anyhow::Error::from)?;
            let launch = &loaded.plan.train.launch;
            if launch.node_rank != 0 {
                println!(
                    "node {} of {}: done in {:.1}s; node 0 wrote the metrics to {}",
                    launch.node_rank,
                    launch.nnodes,
                    result.seconds,
                    loaded.plan.train.output_dir.display()
                );
                exit_if_preempted(&result);
                return Ok(());
            }
            let first = result.steps.first().map_or(f64::NAN, |m| m.loss);
            let last = result.steps.last().map_or(f64::NAN, |m| m.loss);
            let tokens_per_s =
                result.steps.iter().map(|m| m.tokens_per_s).sum::<f64>() / result.steps.len().max(1) as f64;
            let predicted = tierzero::plan::memory::predict(&loaded.plan);
            let host_predicted = tierzero::plan::host_memory::predict_host(&loaded.plan);
            // the first step (start-up, first gathers) is left out of the breakdown
            let breakdowns = result.breakdowns();
            let steady = breakdowns
                .get(1..)
                .filter(|b| !b.is_empty())
                .unwrap_or(&breakdowns);
            let breakdown = tierzero::metrics::timeline::Breakdown::total(steady);
            let rates: serde_json::Map<String, serde_json::Value> = breakdown
                .rates()
                .into_iter()
                .map(|(p, r)| (p.name().to_string(), serde_json::json!(r)))
                .collect();
            let summary = serde_json::json!({
                "breakdown": breakdown.json(),
                "gb_per_s": rates,
                "memory": result.steps.last().map(|m| m.memory),
                "steps": result.steps.len(),
                "seconds": result.seconds,
                "first_loss": result.steps.first().map(|m| m.loss),
                "last_loss": result.steps.last().map(|m| m.loss),
                "loss_floor": result.loss_floor,
                "tokens_per_s": tokens_per_s,
                "device_bytes_predicted": predicted,
                "device_bytes_measured_peak": result.device_peaks,
                "accelerator": loaded.plan.train.accelerator,
                "gpu_memory": result.gpu_memory,
                "cpu_allocator_peak": result.cpu_allocator_peak,
                "mfu": result.steps.last().map(|m| m.mfu),
                "host": result.host,
                "host_bytes_predicted": host_predicted,
            });
            let output_dir = &loaded.plan.train.output_dir;
            let summary_path = output_dir.join("summary.json");
            std::fs::write(
                &summary_path,
                serde_json::to_vec_pretty(&summary).context("serialising the summary")?,
            )
            .with_context(|| format!("writing {}", summary_path.display()))?;
            for (rank, peak) in result.device_peaks.iter().enumerate() {
                println!(
                    "rank {rank}: device memory reserved by the engine, peak {peak} bytes, plan predicted {} ({:+.1}%; {} more in compute temporaries)",
                    predicted.reserved(),
                    100.0 * (*peak as f64 / predicted.reserved().max(1) as f64 - 1.0),
                    predicted.transient
                );
            }
            for (rank, stats) in result.gpu_memory.iter().enumerate() {
                // gradient accumulators are host arenas: what torch's allocator holds is
                // the prediction's tensors (`DeviceBytes::in_tensors`)
                println!(
                    "rank {rank}: torch CUDA allocator peak {} bytes allocated ({} reserved), plan predicted {} for device-tier parameters and optimizer state, gathered units, activations and temporaries ({:+.1}%)",
                    stats.peak_allocated,
                    stats.peak_reserved,
                    predicted.in_tensors(),
                    100.0 * (stats.peak_allocated as f64 / predicted.in_tensors().max(1) as f64 - 1.0)
                );
            }
            if let Some(peak) = result.cpu_allocator_peak {
                let ranks = loaded.plan.train.devices as u64;
                let predicted = ranks * predicted.in_tensors();
                println!(
                    "libtorch CPU allocator: peak {peak} bytes in the steps ({ranks} ranks of this process), plan predicted {predicted} for device-tier parameters and optimizer state, gathered units, activations and temporaries ({:+.1}%)",
                    100.0 * (peak as f64 / predicted.max(1) as f64 - 1.0)
                );
            }
            let host = &result.host.steps;
            println!(
                "host: peak resident {:.2} GB in the steps, plan predicted {:.2} GB ({:+.1}%; {:.2} GB at start-up), kernel time {:.0}% of {:.1} CPU-seconds",
                host.peak_rss as f64 / 1e9,
                host_predicted.total as f64 / 1e9,
                100.0 * (host.peak_rss as f64 / host_predicted.total.max(1) as f64 - 1.0),
                result.host.startup_peak_rss as f64 / 1e9,
                100.0 * host.kernel_fraction,
                host.user_s + host.system_s
            );
            println!(
                "done: {} steps in {:.1}s, loss {first:.4} -> {last:.4}, {tokens_per_s:.0} tokens/s; {}/{{metrics.jsonl,loss.png,summary.json}}",
                result.steps.len(),
                result.seconds,
                output_dir.display()
            );
            exit_if_preempted(&result);
            Ok(())
        }
        Command::Eval { config, json } => {
            let loaded = load_config(&config)?;
            let loss = trainer::evaluate(&loaded.plan).map_err(anyhow::Error::from)?;
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
        Command::Export {
            checkpoint,
            config,
            sets,
            hf,
            dtype,
            max_shard_size,
        } => {
            let dtype = match dtype {
                ExportDtype::Fp32 => tierzero::model::hf::SaveDtype::F32,
                ExportDtype::Bf16 => tierzero::model::hf::SaveDtype::Bf16,
                ExportDtype::Fp16 => tierzero::model::hf::SaveDtype::F16,
            };
            let config = match (checkpoint, config) {
                (Some(checkpoint), None) => {
                    let report = tierzero::checkpoint::export::export(
                        &checkpoint,
                        &hf,
                        dtype,
                        max_shard_size as usize,
                    )
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
            let weights = trainer::initial_weights(&loaded.plan).map_err(anyhow::Error::from)?;
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
        Command::Rendezvous {
            launch: l,
            devices,
            timeout,
            json,
        } => {
            use tierzero::comm::launch;
            let flags = launch::LaunchFlags {
                nnodes: l.nnodes,
                node_rank: l.node_rank,
                master_addr: l.master_addr,
                master_port: l.master_port,
                devices,
            };
            let topo = launch::topology(&flags, |k| std::env::var(k).ok()).map_err(|e| anyhow::anyhow!(e))?;
            let report = launch::check(&topo, std::time::Duration::from_secs(timeout))
                .map_err(|e| anyhow::anyhow!(e))?;
            emit(&report, json, launch::RendezvousReport::human)
        }
        Command::Inspect {
            checkpoint,
            verify,
            json,
        } => {
            let checkpoint =
                tierzero::checkpoint::Checkpoint::open(&checkpoint).map_err(anyhow::Error::from)?;
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
    }
}

/// A run stopped by SIGTERM/SIGUSR1 ends with `EXIT_PREEMPTED` after saying where it
/// stopped, so a scheduler (or a person) can tell it from a finished or failed run.
fn exit_if_preempted(result: &trainer::TrainResult) {
    if result.preempted {
        let step = result.steps.last().map_or(0, |m| m.step);
        eprintln!(
            "preempted by {}: stopped after step {step} and saved its checkpoint; `--resume auto` continues (exit status {})",
            tierzero::run::preempt::signal_name(),
            tierzero::run::preempt::EXIT_PREEMPTED
        );
        std::process::exit(tierzero::run::preempt::EXIT_PREEMPTED);
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    for check in [
        tierzero::checkpoint::crash::check_env,
        tierzero_offload::nvme::fault::check_env,
    ] {
        if let Err(e) = check() {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    // before any tensor or thread: libtorch's CPU allocations are counted from here on
    if let Err(e) = tierzero::torch::shim::count_cpu_allocations() {
        tracing::warn!("libtorch's CPU memory will not be measured: {e}");
    }
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Config(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(Failure::Other(e)) => {
            eprintln!("error: {}", chain(&e));
            ExitCode::from(1)
        }
    }
}

/// An error and its causes, each said once: most of this crate's errors already name
/// their cause in their own message, so a cause whose text the message so far contains
/// is left out (anyhow's `{:#}` would repeat it).
fn chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}
