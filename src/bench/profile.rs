//! `tierzero bench profile`: this machine's hardware profile, measured, for the
//! simulated step (`plan --simulate FILE`).
//!
//! Compute is measured on the model code itself at each given config's shapes: a block's
//! forward and its backward by recompute, and the final unit with the LM head, with the
//! torch threads a rank of that config gets and its ranks running at once (as the
//! trainer's ranks share the cores), meeting after each run as they meet at a run's
//! collectives; rates are FLOPs as `plan::simulate::flops` counts them over the mean
//! time between meetings. Beside them: memcpy (one thread and every core), a one-thread
//! fp32 add, a device-memory copy, the collectives (`bench comm`'s Local
//! ranks), NVMe (`bench nvme`'s io_uring rows) and the CPU AdamW (`bench adam` over
//! in-memory arrays; the NVMe pipeline's, summing its state, from that pipeline's update
//! legs over sub-groups it just read, as the first config runs it). Every
//! number records the measurement that gave it. Where the configs compute on a GPU, the
//! compute, the matmul peaks, the device's copies and its memory are the GPU's
//! (`profile_gpu.rs`).

use super::profile_gpu::sync;

use super::adam::{run as adam_bench, AdamBenchArgs};
use super::comm::{run as comm_bench, Backend, CommBenchArgs};
use super::nvme::{run as nvme_bench, NvmeBenchArgs};
use super::{timed, REPEATS};
use crate::model::head::{Matmul, Weight};
use crate::model::Model;
use crate::plan::report::nvme_bytes;
use crate::plan::simulate::flops;
use crate::plan::simulate::profile::{
    Compute, Copies, CpuAdam, Figure, Link, Nvme, NvmeAt, NvmeLatency, Profile, Rate, Work,
};
use crate::plan::Plan;
use crate::run::rank_threads;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// The rates of one config's shapes: block forward, block backward, head, each timed on
/// rank 0 while every rank of the config does the same, each on its device.
fn compute_rates(plan: &Plan, overhead: f64) -> anyhow::Result<Vec<Rate>> {
    let threads = rank_threads(plan);
    tch::set_num_threads(threads as i32);
    let ranks = plan.train.devices.max(1);
    let results = on_every_rank(ranks, |r, meeting| {
        let device = plan.train.compute_device(plan.train.local_ranks().start + r);
        one_rank_rates(plan, (threads, device), overhead, meeting)
    });
    // the pace is every rank's; each rank's own time is its own: their mean
    let all = results.into_iter().collect::<anyhow::Result<Vec<Vec<Rate>>>>()?;
    let mut rates = all.first().cloned().unwrap_or_default();
    for (i, rate) in rates.iter_mut().enumerate() {
        let per_flop: Vec<f64> = all
            .iter()
            .filter_map(|r| r.get(i)?.own_flops_per_s.map(|own| 1.0 / own))
            .collect();
        if !per_flop.is_empty() {
            rate.own_flops_per_s = Some(per_flop.len() as f64 / per_flop.iter().sum::<f64>());
        }
    }
    Ok(rates)
}

/// A rank's inputs to its measured pieces: block 1's parameters, an input and an output
/// gradient of its shape, the final unit's parameters, the tied embedding, the targets.
type Inputs = (Tensor, Tensor, Tensor, Tensor, Option<Tensor>, Tensor);

fn one_rank_rates(
    plan: &Plan,
    (threads, device): (usize, Device),
    overhead: f64,
    meeting: &Meeting,
) -> anyhow::Result<Vec<Rate>> {
    let config = plan.model.config.clone();
    let kind = crate::torch::compute_kind(&plan.precision);
    let (rows, seq) = (plan.batch.micro_batch_per_gpu as i64, plan.data.seq_len as i64);
    let tokens = (rows * seq) as usize;
    let h = config.hidden_size as i64;
    let low_head = plan.train.low_precision_head;
    let head_matmul = if low_head { Matmul::Low } else { Matmul::Fp32 };
    let model = Model::new(config.clone(), kind).with_head(head_matmul);
    let last = model.units.len() - 1;
    let numel = |u: usize| model.units[u].numel as i64;
    let options = (kind, device);
    let inputs = (|| -> Result<_, tch::TchError> {
        let params = Tensor::f_randn([numel(1)], options)?.f_mul_scalar(0.02)?;
        let x = Tensor::f_randn([rows, seq, h], options)?;
        let dy = Tensor::f_randn([rows, seq, h], options)?.f_mul_scalar(1e-3)?;
        let final_params = Tensor::f_randn([numel(last)], options)?.f_mul_scalar(0.02)?;
        let embedding = if config.tie_word_embeddings {
            Some(Tensor::f_randn([numel(0)], options)?.f_mul_scalar(0.02)?)
        } else {
            None
        };
        let targets = Tensor::f_randint(config.vocab_size as i64, [rows, seq], (Kind::Int64, device))?;
        Ok((params, x, dy, final_params, embedding, targets))
    })();
    // a rank whose inputs failed still meets the others at every wait, then reports
    let inputs = inputs.map_err(anyhow::Error::from);
    let piece = |f: &dyn Fn(&Inputs) -> Result<(), tch::TchError>| {
        meeting.mean_seconds(|| match &inputs {
            Ok(inputs) => {
                f(inputs)?;
                sync(device)
            }
            Err(e) => Err(anyhow::anyhow!("{e:#}")),
        })
    };
    let forward = piece(&|(params, x, ..)| model.forward_unit(1, params, x, None).map(drop))?;
    let backward = piece(&|(params, x, dy, ..)| model.backward_unit(1, params, x, dy, None).map(drop))?;
    let head = piece(&|(_, x, _, final_params, embedding, targets)| {
        model
            .backward_final(final_params, embedding.as_ref(), x, targets, Weight::Mean(1.0))
            .map(drop)
    })?;
    let block = model.units[1].numel;
    let seq_len = seq as usize;
    let ranks = plan.train.devices.max(1);
    let source = |what: &str| {
        format!(
            "{what} of {} ({} tokens = {rows} × {seq}, hidden {h}) timed by `tierzero bench profile` on {}, {threads} torch threads per rank, {} ranks at once meeting after each run (the slowest sets the pace, as at a run's collectives; `own_flops_per_s`: each rank's own runs without its waits, the ranks' mean), the mean of at least {REPEATS} runs and 0.3 s",
            plan.model.source,
            tokens,
            if device.is_cuda() { "the GPU" } else { "the CPU" },
            plan.train.devices
        )
    };
    // the simulation adds the fixed overhead to every piece: the rate is the rest
    let rate_of = |flops: f64, seconds: f64| flops / (seconds - overhead).max(0.1 * seconds);
    let rate = |work: Work, dtype: &str, flops: f64, seconds: Paced, what: &str| Rate {
        work,
        dtype: dtype.to_string(),
        tokens,
        hidden: config.hidden_size,
        vocab: if work == Work::Head { config.vocab_size } else { 0 },
        seq_len,
        flops_per_s: rate_of(flops, seconds.pace),
        own_flops_per_s: (ranks > 1).then(|| rate_of(flops, seconds.own)),
        source: source(what),
    };
    let dtype = plan.precision.name();
    Ok(vec![
        rate(
            Work::Forward,
            dtype,
            flops::block_forward(&config, block, tokens, seq_len),
            forward,
            "a block's forward",
        ),
        rate(
            Work::Backward,
            dtype,
            flops::block_backward(&config, block, tokens, seq_len),
            backward,
            "a block's backward by recompute",
        ),
        // the head computes in fp32 unless the plan runs it in the training precision
        rate(
            Work::Head,
            if low_head { dtype } else { "fp32" },
            flops::head(&config, tokens),
            head,
            "the final unit's loss and backward",
        ),
    ])
}

/// On the CPU, the share of compute's rate lost while another thread keeps a core busy:
/// the first config's block forward on every rank at once (each with its torch threads,
/// as the run has them, the ranks meeting after each forward), timed alone and beside a
/// thread checksumming 32 MiB buffers (what an NVMe lane does most), three rounds
/// interleaved. None on a GPU.
fn lost_beside_a_thread(plan: &Plan, device: Device) -> anyhow::Result<Option<Figure>> {
    if device.is_cuda() {
        return Ok(None);
    }
    let threads = rank_threads(plan);
    let ranks = plan.train.devices.max(1);
    // the cores compute leaves free get a busy thread each first, as the simulation
    // takes them before compute's (`plan/simulate/contention.rs`): the last one measured
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let busy = cores.saturating_sub(ranks * threads) + 1;
    // runs enough for half a second
    let once = ranks_forward(plan, device, (ranks, 3))?;
    let runs = ((0.5 / once.max(1e-6)).ceil() as usize).clamp(3, 1000);
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        alone.push(ranks_forward(plan, device, (ranks, runs))?);
        beside.push(super::beside_busy_threads(busy, || {
            ranks_forward(plan, device, (ranks, runs))
        })?);
    }
    let (alone, beside) = (super::median(alone), super::median(beside));
    Ok(Some(Figure::new(
        (1.0 - alone / beside).clamp(0.0, 0.95),
        format!(
            "1 − a block's forward of {} alone ({:.3} ms) ÷ beside a thread checksumming ({:.3} ms; {busy} such threads on {cores} cores, one past the cores compute leaves free), {ranks} ranks at once meeting after each forward, {threads} torch threads each, means of {runs} forwards, medians of three rounds, `tierzero bench profile`",
            plan.model.source,
            alone * 1e3,
            beside * 1e3
        ),
    )))
}

/// The mean seconds of block 1's forward, `ranks` ranks at once meeting after each of
/// their `runs` ([`Meeting::mean_of`]).
fn ranks_forward(plan: &Plan, device: Device, (ranks, runs): (usize, usize)) -> anyhow::Result<f64> {
    tch::set_num_threads(rank_threads(plan) as i32);
    let times = on_every_rank(ranks, |_, meeting| -> anyhow::Result<Paced> {
        let kind = crate::torch::compute_kind(&plan.precision);
        let model = Model::new(plan.model.config.clone(), kind);
        let (rows, seq) = (plan.batch.micro_batch_per_gpu as i64, plan.data.seq_len as i64);
        let h = plan.model.config.hidden_size as i64;
        let set_up = || -> anyhow::Result<(Tensor, Tensor)> {
            let params =
                Tensor::f_randn([model.units[1].numel as i64], (kind, device))?.f_mul_scalar(0.02)?;
            let x = Tensor::f_randn([rows, seq, h], (kind, device))?;
            let _ = model.forward_unit(1, &params, &x, None)?;
            Ok((params, x))
        };
        let inputs = set_up();
        meeting.mean_of(runs, || match &inputs {
            Ok((params, x)) => {
                let _ = model.forward_unit(1, params, x, None)?;
                Ok(())
            }
            Err(e) => Err(anyhow::anyhow!("{e:#}")),
        })
    });
    times
        .into_iter()
        .try_fold(0.0_f64, |slowest, t| Ok(slowest.max(t?.pace)))
}

/// Where the measuring ranks' threads meet: a barrier, and a slot to agree on how many
/// runs each measurement takes (every rank must wait as often as the others).
struct Meeting {
    barrier: std::sync::Barrier,
    slot: std::sync::atomic::AtomicUsize,
}

impl Meeting {
    fn wait(&self) -> std::sync::BarrierWaitResult {
        self.barrier.wait()
    }

    /// The largest of the ranks' proposals, every rank calling it once.
    fn agree(&self, proposal: usize) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        // every rank has read the previous agreement before the slot is cleared, and the
        // slot is cleared before any rank proposes
        if self.wait().is_leader() {
            self.slot.store(0, Relaxed);
        }
        self.wait();
        self.slot.fetch_max(proposal, Relaxed);
        self.wait();
        self.slot.load(Relaxed)
    }

    /// The mean seconds of `f` between meetings: every rank runs it `runs` times, meeting
    /// the others after each, as a run's ranks meet at every unit's collectives, so the
    /// slowest sets the pace; beside it, the mean of this rank's own runs, without its
    /// waits for the others. Means, not medians: a step sums its pieces, the ones the
    /// scheduler cut included. A rank whose `f` fails still meets the others at every
    /// wait, so none waits for it forever, and reports after.
    fn mean_of(&self, runs: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Paced> {
        let mut failed = None;
        let mut own = std::time::Duration::ZERO;
        self.wait();
        let start = std::time::Instant::now();
        for _ in 0..runs {
            if failed.is_none() {
                let run = std::time::Instant::now();
                failed = f().err();
                own += run.elapsed();
            }
            self.wait();
        }
        let runs = runs.max(1) as f64;
        failed.map_or(
            Ok(Paced {
                pace: start.elapsed().as_secs_f64() / runs,
                own: own.as_secs_f64() / runs,
            }),
            Err,
        )
    }

    /// [`Self::mean_of`] after a warm-up, with runs enough for [`super::MIN_SECONDS`]
    /// (at least [`REPEATS`], at most [`super::MAX_REPEATS`]).
    fn mean_seconds(&self, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Paced> {
        let once = self.mean_of(1, &mut f);
        let runs = once.as_ref().map_or(REPEATS, |t| {
            (super::MIN_SECONDS / t.pace.max(1e-9)).ceil() as usize
        });
        let runs = self.agree(runs.clamp(REPEATS, super::MAX_REPEATS));
        let mean = self.mean_of(runs, &mut f);
        once.and(mean)
    }
}

/// Mean seconds of a piece the ranks run at once: between their meetings (the pace the
/// slowest sets) and of one rank's own runs (`own` ≤ `pace`; equal with one rank).
#[derive(Clone, Copy, Debug)]
struct Paced {
    pace: f64,
    own: f64,
}

/// `f(rank, meeting)` on a thread of its own for each of `ranks` ranks, the meeting
/// theirs; each rank's result, in rank order.
fn on_every_rank<T: Send>(
    ranks: usize,
    f: impl Fn(usize, &Meeting) -> anyhow::Result<T> + Sync,
) -> Vec<anyhow::Result<T>> {
    let meeting = Meeting {
        barrier: std::sync::Barrier::new(ranks),
        slot: Default::default(),
    };
    std::thread::scope(|s| {
        let (meeting, f) = (&meeting, &f);
        let handles: Vec<_> = (0..ranks).map(|r| s.spawn(move || f(r, meeting))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a measuring thread panicked")))
            })
            .collect()
    })
}

/// GB/s of `f` moving `bytes`.
fn gb_s(bytes: usize, f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    Ok(bytes as f64 / timed(f)? / 1e9)
}

fn copies(threads: usize) -> anyhow::Result<Copies> {
    use rayon::prelude::*;
    const N: usize = 1 << 26;
    let src = vec![1.0f32; N];
    let mut dst = vec![0.0f32; N];
    let bytes = N * 4;
    let one = gb_s(bytes, || {
        dst.copy_from_slice(&src);
        Ok(())
    })?;
    let all = gb_s(bytes, || {
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    })?;
    let add = gb_s(bytes, || {
        for (d, s) in dst.iter_mut().zip(&src) {
            *d += s;
        }
        Ok(())
    })?;
    let add_all = gb_s(bytes, || {
        crate::engine::grads::add_f32(&mut dst, &src);
        Ok(())
    })?;
    let raw = vec![1u8; bytes];
    let checksum = gb_s(bytes, || {
        std::hint::black_box(crc32c::crc32c(&raw));
        Ok(())
    })?;
    tch::set_num_threads(threads as i32);
    let a = Tensor::f_ones([N as i64], (Kind::Float, Device::Cpu))?;
    let mut b = Tensor::f_zeros([N as i64], (Kind::Float, Device::Cpu))?;
    let tensor_copy = gb_s(bytes, || {
        b.f_copy_(&a)?;
        Ok(())
    })?;
    let memcpy = |v: f64| Figure::new(v, "a one-thread memcpy of 256 MiB, `tierzero bench profile`");
    Ok(Copies {
        h2d_pinned: memcpy(one),
        h2d_pageable: memcpy(one),
        d2h_pinned: memcpy(one),
        d2h_pageable: memcpy(one),
        device_to_device: Figure::new(
            tensor_copy,
            format!("torch copy_ of a 256 MiB fp32 tensor with {threads} threads, `tierzero bench profile`"),
        ),
        host_memcpy: memcpy(one),
        host_memcpy_parallel: Figure::new(
            all,
            "a memcpy of 256 MiB on every core (rayon), `tierzero bench profile`",
        ),
        host_add: Figure::new(
            add,
            "a one-thread fp32 a += b over 256 MiB, `tierzero bench profile`",
        ),
        host_add_parallel: Figure::new(
            add_all,
            "the engine's accumulator add (every core) over 256 MiB, `tierzero bench profile`",
        ),
        d2h_wait_s: None,
        checksum: Some(Figure::new(
            checksum,
            "a one-thread crc32c of 256 MiB (the swap files' checksum), `tierzero bench profile`",
        )),
    })
}

/// Pipelined NVMe AdamW steps the profile times its update legs over.
const PIPELINED_CALLS: usize = 3;

/// Measures this machine: compute at each plan's shapes, copies, collectives between
/// `ranks` threads, NVMe in `nvme_dir`, the CPU AdamW.
/// `quick` measures the disk on a 256 MiB file (tests) instead of 2 GiB.
pub fn run(plans: &[Plan], nvme_dir: &Path, name: &str, quick: bool) -> anyhow::Result<Profile> {
    anyhow::ensure!(
        !plans.is_empty(),
        "give at least one --config whose shapes to measure"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = rank_threads(&plans[0]);
    tch::set_num_threads(threads as i32);
    // the configs' device: a GPU where they compute on one (every config's the same kind)
    let device_of = |p: &Plan| p.train.compute_device(p.train.local_ranks().start);
    let device = device_of(&plans[0]);
    anyhow::ensure!(
        plans.iter().all(|p| device_of(p).is_cuda() == device.is_cuda()),
        "the configs compute on different kinds of device (some on a GPU, some on the CPU): profile them in separate runs, one --config set per kind"
    );
    let small = Model::new(
        crate::config::model::ModelConfig::preset("llama-tiny").unwrap_or_else(|| unreachable!()),
        Kind::Float,
    );
    let p = Tensor::f_randn([small.units[1].numel as i64], (Kind::Float, device))?;
    let x = Tensor::f_randn([1, 8, 64], (Kind::Float, device))?;
    let overhead = timed(|| {
        let _ = small.forward_unit(1, &p, &x, None)?;
        sync(device)
    })?;
    let mut rates = Vec::new();
    for plan in plans {
        rates.extend(compute_rates(plan, overhead)?);
    }
    let lost_beside_a_thread = lost_beside_a_thread(&plans[0], device)?;
    tch::set_num_threads(threads as i32);
    // a GPU's matmul peak needs a product that fills it
    let side = if device.is_cuda() { 8192 } else { 1024 };
    let peak = |kind| crate::metrics::peak::matmul_flops(device, kind, side, 5);
    let (peak_fp32, peak_bf16) = (peak(Kind::Float)?, peak(Kind::BFloat16)?);
    let copies = match device {
        Device::Cuda(d) => super::profile_gpu::copies(d, copies(threads)?)?,
        _ => copies(threads)?,
    };
    let (about, memory) = match device {
        Device::Cuda(d) => {
            let (name, total) = super::profile_gpu::memory(d)?;
            (
                format!("This machine, measured by `tierzero bench profile`: one {name} (compute, its copies and memory), {cores} host cores (host copies and adds, the CPU AdamW, NVMe; the collectives between ranks as threads). The host's wake-up after a copy out of the GPU (copies.d2h_wait_s) is not measured here: a GPU run's trace gives it."),
                Figure::new(total, format!("the driver's total memory of the {name}, `tierzero bench profile`")),
            )
        }
        _ => (
            format!("This machine, measured by `tierzero bench profile`: {cores} cores, no GPU (compute on the CPU, lanes as threads)."),
            Figure::new(0.0, "CPU devices have no memory of their own"),
        ),
    };
    let ranks = plans.iter().map(|p| p.train.devices).max().unwrap_or(1).max(2);
    let comm = |bytes| {
        comm_bench(&CommBenchArgs {
            backend: Backend::Local,
            ranks,
            bytes,
            rounds: 5,
        })
    };
    let (large, tiny) = (comm(16 << 20)?, comm(4096)?);
    let w = ranks as f64;
    let bus = large.all_gather_gbs.min(large.reduce_scatter_gbs) * (w - 1.0) / w;
    let latency = 4096.0 / (tiny.all_gather_gbs.min(tiny.reduce_scatter_gbs) * 1e9);
    std::fs::create_dir_all(nvme_dir)?;
    let nvme = disk(plans, nvme_dir, quick)?;
    let nvme = Nvme {
        latency: Some(transfer_latency(&plans[0], nvme_dir, &nvme)?),
        cores: Some(super::disk_cores::cores_while_streaming(
            nvme_dir,
            if quick { 256 << 20 } else { 1 << 30 },
        )?),
        ..nvme
    };
    // the parameters' copy as the first config's update writes it
    let copy_fp32 = plans[0].precision == crate::plan::Precision::Fp32;
    let adam_flags = format!(
        "--params 2e7 --threads {cores}{}",
        if copy_fp32 { " --copy-dtype fp32" } else { "" }
    );
    let adam = adam_bench(&AdamBenchArgs {
        params: 20_000_000,
        threads: cores,
        grad_bf16: false,
        copy_fp32,
        kernel: tierzero_offload::adam::Kernel::detect(),
        repeats: 3,
    })?;
    // the sweep as the NVMe pipeline runs it, on sub-groups just read into its buffers
    // (slower here than `bench adam`'s summed sweep over in-memory arrays: `swap.rs`)
    let chunk = crate::plan::rules::optimizer_swap_chunk(&plans[0]);
    let pipelined_elements = if quick { 4_000_000 } else { 20_000_000 }.max(2 * chunk);
    // the gradient where the config's update reads it: beside the state, in its type
    let stored =
        crate::plan::rules::nvme_gradients(&plans[0]).then(|| crate::plan::rules::stored_bf16(&plans[0]));
    let pipelined = super::swap::pipelined_update(
        nvme_dir,
        (
            crate::run::engine_config(&plans[0]),
            crate::plan::rules::pipeline(&plans[0]),
        ),
        (pipelined_elements, chunk),
        (copy_fp32, stored),
        PIPELINED_CALLS,
    )?;
    Ok(Profile {
        name: name.to_string(),
        about,
        device: if device.is_cuda() { "cuda" } else { "cpu" }.into(),
        device_memory_bytes: memory,
        host_cores: cores,
        compute: Compute {
            threads,
            overhead_s: Figure::new(overhead, "a llama-tiny block's forward over 8 tokens, `tierzero bench profile`"),
            peak_flops_bf16: Figure::new(peak_bf16, format!("a {side}³ bf16 matmul, {threads} threads, `tierzero bench profile`")),
            peak_flops_fp32: Figure::new(peak_fp32, format!("a {side}³ fp32 matmul, {threads} threads, `tierzero bench profile`")),
            rates,
            lost_beside_a_thread,
        },
        copies,
        link: Link {
            name: format!("Local collectives ({ranks} ranks as threads)"),
            bus_gb_s: Figure::new(bus, format!("`tierzero bench comm --ranks {ranks} --size 16M`: the slower of all-gather and reduce-scatter, as bus bandwidth")),
            latency_s: Figure::new(latency, format!("`tierzero bench comm --ranks {ranks} --size 4K`: seconds per call")),
        },
        nvme,
        cpu_adam: CpuAdam {
            params_per_s: Figure::new(
                adam.params_per_s,
                format!("`tierzero bench adam {adam_flags}`, kernel {}", adam.kernel),
            ),
            summed_params_per_s: Some(Figure::new(
                pipelined,
                format!(
                    "`tierzero bench profile`: the update legs of {PIPELINED_CALLS} NVMe AdamW steps of {} parameters in sub-groups of {chunk} through one store, as the config runs them (the sweep summing its state, on each sub-group just read; the gradient {}, the parameters' copy in {}), the median step's; kernel {}",
                    pipelined_elements,
                    match stored {
                        Some(bf16) => format!("read beside the state in {} and summed", if bf16 { "bf16" } else { "fp32" }),
                        None => "in fp32 in host memory".into(),
                    },
                    if copy_fp32 { "fp32" } else { "bf16" },
                    adam.kernel
                ),
            )),
        },
    })
}

/// The disk under `nvme_dir` as a run uses its swap files (`bench nvme`'s best write and
/// `as_a_run_uses_it`: the read of a file rewritten in shuffled operations, both rates
/// divided by how much longer reads and writes at once take) over a
/// 2 GiB file (256 MiB when `quick`) and, for each plan whose machine's swap files are
/// larger, over a file of their size (whole GiB, at most 90% of the free space): a
/// virtual machine's disk whose host caches a few GB moves a small file several times
/// faster than a run's swap files, and over a file of their size where they are far
/// smaller (whole 64 MiB).
fn disk(plans: &[Plan], nvme_dir: &Path, quick: bool) -> anyhow::Result<Nvme> {
    const GIB: u64 = 1 << 30;
    let base = if quick { 256 << 20 } else { 2 * GIB };
    let free = crate::plan::disk::file_system(nvme_dir).map_or(u64::MAX, |(_, free)| free / 10 * 9);
    const SMALL: u64 = 64 << 20;
    let mut sizes = vec![base];
    if !quick {
        sizes.extend(
            plans
                .iter()
                .map(nvme_bytes)
                .filter(|&b| b > base)
                .map(|b| (b.div_ceil(GIB) * GIB).min(free / GIB * GIB)),
        );
    }
    // swap files far smaller than the base file: their own size too (whole 64 MiB), which
    // such a disk may serve faster still
    sizes.extend(
        plans
            .iter()
            .map(|p| nvme_bytes(p).div_ceil(SMALL) * SMALL)
            .filter(|&size| size > 0 && size < base),
    );
    sizes.sort_unstable();
    sizes.dedup();
    let mut rows = Vec::new();
    for &size in &sizes {
        let bench = nvme_bench(&NvmeBenchArgs {
            dir: nvme_dir.to_path_buf(),
            size_bytes: size,
            block_sizes: vec![1 << 20],
            queue_depths: vec![32],
            repeats: 1,
        })?;
        let command = format!(
            "`tierzero bench nvme --dir {} --size-mb {} --block-size 1M --queue-depth 32 --repeats 1`",
            nvme_dir.display(),
            size >> 20
        );
        // a run reads files it rewrites piecewise, while it writes: the one-at-a-time
        // disk of the simulation (`plan/simulate/disk.rs`) moves the mixed pass's bytes
        // in its time at these rates
        let run = &bench.as_a_run_uses_it;
        let write = bench.best("write");
        let slowdown = run.mixed_slowdown(write);
        let how = format!(
            "{command}, as a run uses its swap files: after a rewrite in shuffled operations, read {:.3} GB/s, and both at once {slowdown:.2}× the time of the two one after the other; each rate ÷ {slowdown:.2}",
            run.read_gbps
        );
        rows.push(NvmeAt {
            file_bytes: size,
            read_gb_s: Figure::new(
                run.read_gbps / slowdown,
                format!("{how} (write: the best of its rows, {write:.3} GB/s)"),
            ),
            write_gb_s: Figure::new(write / slowdown, how),
        });
    }
    let first = rows
        .iter()
        .find(|r| r.file_bytes == base)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no disk measured"))?;
    Ok(Nvme {
        read_gb_s: first.read_gb_s,
        write_gb_s: first.write_gb_s,
        by_file_size: if rows.len() > 1 { rows } else { Vec::new() },
        latency: None,
        cores: None,
    })
}

/// What the engine's NVMe transfers take beyond their bytes, as `plan`'s ranks pay it
/// (`bench::swap::transfer_latency`): a unit of 4096 elements a rank (48 KiB each way)
/// through the NVMe AdamW on every rank at once, pipelined as the plan's optimizer is.
/// Each leg's time less its bytes at the disk's rates (its ranks sharing them) is a
/// transfer's latency; the run's time less its legs, the pipeline's own. A small unit's
/// update is that: its time is the ring threads' and the pipeline's hand-offs. On a CPU
/// device the legs again beside threads busy on the cores compute takes: the store's
/// threads then wake into cores compute holds.
fn transfer_latency(plan: &Plan, nvme_dir: &Path, disk: &Nvme) -> anyhow::Result<NvmeLatency> {
    const ELEMENTS: usize = 4096;
    const CALLS: usize = 40;
    let ranks = plan.train.devices.max(1);
    let pipeline = crate::plan::rules::pipeline(plan);
    let mode = match (pipeline.pipeline_read, pipeline.pipeline_write) {
        (false, false) => {
            "on the calling thread, as the config runs it (no pipeline_read, no pipeline_write)"
        }
        _ => "on the pipeline's threads, as the config runs it",
    };
    let engine = crate::run::engine_config(plan);
    let measure = || super::swap::transfer_latency(nvme_dir, (engine, pipeline), ranks, ELEMENTS, CALLS);
    let m = measure()?;
    let (read, write) = (disk.read_gb_s.value, disk.write_gb_s.value);
    let bytes = ranks as f64 * m.leg_bytes as f64 / 1e9;
    let how = |m: &super::swap::TransferLatency, beside: &str| {
        format!(
            "`tierzero bench profile`: {ranks} ranks at once, each {CALLS} one-sub-group NVMe AdamW steps of {ELEMENTS} elements through one store {mode}{beside} (three fp32 states read and written, {} KiB each way): a step's median {:.3} ms, its read leg's {:.3} ms, its write leg's {:.3} ms, its update's {:.3} ms",
            m.leg_bytes >> 10,
            m.call_s * 1e3,
            m.read_s * 1e3,
            m.write_s * 1e3,
            m.update_s * 1e3,
        )
    };
    let legs = |m: &super::swap::TransferLatency, how: &str| {
        (
            Figure::new(
                (m.read_s - bytes / read).max(0.0),
                format!("{how}; the read leg less its bytes at {read:.2} GB/s shared by the ranks"),
            ),
            Figure::new(
                (m.write_s - bytes / write).max(0.0),
                format!("{how}; the write leg less its bytes at {write:.2} GB/s shared by the ranks"),
            ),
        )
    };
    let idle = how(&m, "");
    let (read_s, write_s) = legs(&m, &idle);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let on_cpu = !plan
        .train
        .compute_device(plan.train.local_ranks().start)
        .is_cuda();
    let beside_compute = if on_cpu {
        let busy = (ranks * rank_threads(plan)).min(cores);
        let b = super::beside_busy_threads(busy, measure)?;
        let beside = format!(", beside {busy} threads checksumming on {cores} cores (compute's)");
        Some(legs(&b, &how(&b, &beside)))
    } else {
        None
    };
    let (read_beside_compute_s, write_beside_compute_s) = beside_compute.unzip();
    Ok(NvmeLatency {
        read_s,
        write_s,
        pipeline_s: Figure::new(
            (m.call_s - m.read_s - m.write_s - m.update_s).max(0.0),
            format!("{idle}; the step less its legs"),
        ),
        read_beside_compute_s,
        write_beside_compute_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_beside_a_busy_thread_is_measured_on_the_cpu() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.json");
        let sets = ["train.accelerator=cpu".to_string()];
        let plan = crate::plan::load(&path, &sets, crate::plan::DeviceFacts::default())
            .unwrap()
            .plan;
        let lost = lost_beside_a_thread(&plan, Device::Cpu).unwrap().unwrap();
        assert!((0.0..=0.95).contains(&lost.value), "{lost:?}");
        assert!(
            lost.source.contains("beside a thread checksumming"),
            "{}",
            lost.source
        );
    }

    #[test]
    fn ranks_meet_as_often_as_each_other_and_a_failing_rank_reports_after() {
        let results = on_every_rank(3, |r, meeting| {
            assert_eq!(meeting.agree(r + 5), 7);
            assert_eq!(meeting.agree(10 - r), 10);
            let mut calls = 0;
            let mean = meeting.mean_seconds(|| {
                calls += 1;
                anyhow::ensure!(r != 1 || calls < 3, "rank {r} failed at its run {calls}");
                Ok(())
            });
            Ok((mean, calls))
        });
        let results: Vec<_> = results.into_iter().map(Result::unwrap).collect();
        assert!(results[0].0.is_ok() && results[2].0.is_ok());
        for paced in [&results[0].0, &results[2].0].map(|r| r.as_ref().unwrap()) {
            // a rank's own runs lie within the stretches between the meetings
            assert!(paced.own <= paced.pace, "{paced:?}");
        }
        assert_eq!(results[0].1, results[2].1);
        assert!(results[0].1 > REPEATS, "a warm-up and at least {REPEATS} runs");
        let failed = results[1].0.as_ref().unwrap_err().to_string();
        assert_eq!(failed, "rank 1 failed at its run 3");
        assert_eq!(results[1].1, 3, "no run after the failure");
    }
}
