//! `tierzero bench`: throughput benchmarks, each against its hardware limit measured in
//! the same run.

use super::common::{emit, load_config, parse_bytes, parse_count, ConfigArgs, Failure};
use anyhow::Context;
use clap::Subcommand;
use clap::ValueEnum;
use std::path::PathBuf;
use tierzero::bench::adam::{AdamBenchArgs, AdamBenchReport};
use tierzero_offload::adam::Kernel;

/// The gradient's and the parameters' copy's type in `bench adam`.
#[derive(Clone, Copy, ValueEnum)]
pub enum Dtype {
    Fp32,
    Bf16,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum KernelChoice {
    Auto,
    Reference,
    Portable,
    Avx2,
    Avx512,
}

#[derive(Subcommand)]
pub enum Bench {
    /// CPU AdamW params/s and GB/s against the kernel's memory roofline.
    Adam {
        #[arg(long, default_value = "100000000", value_parser = parse_count)]
        params: u64,
        /// Threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long, value_enum, default_value = "fp32")]
        grad_dtype: Dtype,
        /// The new parameters' copy the update writes (an fp32 run's is fp32).
        #[arg(long, value_enum, default_value = "bf16")]
        copy_dtype: Dtype,
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
    /// This machine's hardware profile for `plan --simulate`: compute at the configs'
    /// shapes, copies, collectives, NVMe and the CPU AdamW, each measured.
    Profile {
        /// Configs whose shapes to measure compute at (repeat the flag for several).
        #[arg(long = "config", required = true)]
        configs: Vec<PathBuf>,
        /// `--set key=value` applied to every config.
        #[arg(long = "set")]
        sets: Vec<String>,
        /// A directory on the disk the NVMe tiers use.
        #[arg(long, default_value = "runs/profile/nvme")]
        dir: PathBuf,
        /// Where to write the profile.
        #[arg(long, default_value = "runs/profile/this-machine.json")]
        out: PathBuf,
        /// The profile's name.
        #[arg(long, default_value = "this-machine")]
        name: String,
    },
    /// One block of a config as the engine computes it (flat parameters, backward by
    /// recompute and through a kept graph) beside torch with a tensor per parameter, and
    /// the host's gradient adds beside memcpy, in the same run.
    Unit {
        #[command(flatten)]
        config: ConfigArgs,
        /// The block to measure (1: the first).
        #[arg(long, default_value_t = 1)]
        unit: usize,
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

pub fn run(which: Bench) -> Result<(), Failure> {
    match which {
        Bench::Adam {
            params,
            threads,
            grad_dtype,
            copy_dtype,
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
                grad_bf16: matches!(grad_dtype, Dtype::Bf16),
                copy_fp32: matches!(copy_dtype, Dtype::Fp32),
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
            let report = tierzero::bench::memory::run(&loaded.plan, &stages).map_err(anyhow::Error::from)?;
            emit(&report, json, tierzero::bench::memory::MemoryReport::human)
        }
        Bench::Profile {
            configs,
            sets,
            dir,
            out,
            name,
        } => {
            let plans = configs
                .iter()
                .map(|c| tierzero::plan::load(c, &sets, tierzero::device::facts()).map(|l| l.plan))
                .collect::<Result<Vec<_>, _>>()?;
            let profile = tierzero::bench::profile::run(&plans, &dir, &name, false)?;
            if let Some(parent) = out.parent() {
                std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
            }
            let text = serde_json::to_string_pretty(&profile).context("serialising the profile")?;
            std::fs::write(&out, text + "\n").with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} compute rates)",
                out.display(),
                profile.compute.rates.len()
            );
            Ok(())
        }
        Bench::Unit { config, unit, json } => {
            let loaded = load_config(&config)?;
            let report = tierzero::bench::unit::run(&loaded.plan, unit)?;
            emit(&report, json, tierzero::bench::unit::UnitReport::human)
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
    }
}
