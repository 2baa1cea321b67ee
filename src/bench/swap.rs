//! `tierzero bench swap`: the pipelined NVMe optimizer step against its legs alone.
//!
//! In one run, over the same swap store: the read leg alone (every chunk of master,
//! exp_avg and exp_avg_sq), the AdamW alone (the same sweep on in-memory arrays), the
//! write leg alone, the read and write legs at the same time on disjoint extents, then
//! the pipelined step. `ratio_to_bound` = pipeline time ÷ max(read, adam, write): 1.0
//! means the slowest leg hides the other two completely — reachable only on a device
//! that reads and writes at full speed at once. `ratio_to_duplex_bound` = pipeline
//! time ÷ max(read+write together, adam) is the limit this device actually offers.

use super::median;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;
use tierzero_offload::adam::{self, AdamHyper, GradSlice, LowPrecisionOut, Sweep};
use tierzero_offload::convert::f32_to_bf16;
use tierzero_offload::crc;
use tierzero_offload::host::AlignedBuf;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey, TensorSpec};
use tierzero_offload::nvme::{open_engine, EngineChoice, EngineConfig};
use tierzero_offload::pipeline::{self, PipelineConfig};

#[derive(Clone, Debug)]
pub struct SwapBenchArgs {
    pub dir: PathBuf,
    pub params: usize,
    pub sub_group_size: usize,
    pub buffer_count: usize,
    pub engine: EngineConfig,
    pub repeats: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct SwapReport {
    pub engine: String,
    pub params: usize,
    pub sub_group_size: usize,
    pub buffer_count: usize,
    pub read_seconds: f64,
    pub adam_seconds: f64,
    pub write_seconds: f64,
    /// Read leg and write leg running at the same time (disjoint extents).
    pub read_write_seconds: f64,
    pub pipeline_seconds: f64,
    /// The pipeline's update legs summed: the AdamW of `adam_seconds` summing the state
    /// it reads and writes (the checksums of its transfers), each sweep on a sub-group
    /// just read into the I/O buffers.
    pub update_seconds: f64,
    pub read_gbps: f64,
    pub write_gbps: f64,
    pub pipeline_params_per_s: f64,
    pub ratio_to_bound: f64,
    pub ratio_to_duplex_bound: f64,
}

pub fn run(args: &SwapBenchArgs) -> anyhow::Result<SwapReport> {
    let n = args.params;
    anyhow::ensure!(n > 0, "--params must be positive");
    let (engine, _) = open_engine(&args.dir, args.engine, None, EngineChoice::Auto)?;
    // unit 0 is the optimizer state; unit 1 is a twin the duplex leg writes while unit 0
    // is read
    let specs: Vec<TensorSpec> = [0, 1]
        .into_iter()
        .flat_map(|unit| TensorSpec::optimizer(unit, 0, n))
        .collect();
    let name = format!(".tierzero-bench-swap-{}", std::process::id());
    let store = SwapStore::create(&args.dir, &name, engine.clone(), &specs, args.sub_group_size)?;
    // buffer_count counts buffers as DeepSpeed (and the engine) count them: one set is
    // a sub-group's master and both moments
    let sets = pipeline::sets_for(args.buffer_count, false);
    let pool = pipeline::buffer_pool_for(&store, sets, false)?;
    let twin_pool = pipeline::buffer_pool_for(&store, sets, false)?;
    let chunks = store.chunks(specs[0].key)?;
    let groups: Vec<(u32, u32, usize)> = (0..chunks).map(|c| (0, 0, c)).collect();
    let twin_groups: Vec<(u32, u32, usize)> = (0..chunks).map(|c| (1, 0, c)).collect();
    let grad = AlignedBuf::<f32>::zeroed(n)?;
    let mut low = AlignedBuf::<u16>::zeroed(n)?;
    // in-memory arrays for the AdamW leg
    let mut master = AlignedBuf::<f32>::zeroed(n)?;
    let mut exp_avg = AlignedBuf::<f32>::zeroed(n)?;
    let mut exp_avg_sq = AlignedBuf::<f32>::zeroed(n)?;
    let hyper = AdamHyper::default();
    let coefficients = hyper.coefficients(1, 1.0);

    // initialise the store (also a warm-up)
    pipeline::write_only(&store, &pool, &groups)?;
    pipeline::write_only(&store, &twin_pool, &twin_groups)?;
    let (mut reads, mut adams, mut writes, mut duplex, mut pipelines) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut updates = vec![];
    for _ in 0..args.repeats.max(1) {
        reads.push(pipeline::read_only(&store, &pool, &groups)?.as_secs_f64());
        let start = Instant::now();
        adam::step(
            &coefficients,
            Sweep {
                master: &mut master,
                exp_avg: &mut exp_avg,
                exp_avg_sq: &mut exp_avg_sq,
                grad: GradSlice::F32(&grad),
                low: LowPrecisionOut::Bf16(&mut low),
            },
        )?;
        adams.push(start.elapsed().as_secs_f64());
        writes.push(pipeline::write_only(&store, &pool, &groups)?.as_secs_f64());
        let start = Instant::now();
        std::thread::scope(|scope| -> anyhow::Result<()> {
            let twin = scope.spawn(|| pipeline::write_only(&store, &twin_pool, &twin_groups));
            pipeline::read_only(&store, &pool, &groups)?;
            twin.join()
                .map_err(|_| anyhow::anyhow!("duplex writer panicked"))??;
            Ok(())
        })?;
        duplex.push(start.elapsed().as_secs_f64());
        let sub_groups = pipeline::sub_groups(
            0,
            0,
            store.chunk_elems(),
            pipeline::GradIn::Host(GradSlice::F32(&grad)),
            LowPrecisionOut::Bf16(&mut low),
        );
        let config = PipelineConfig {
            sets,
            pipeline_read: true,
            pipeline_write: true,
        };
        let report = pipeline::nvme_adam_step(&store, &pool, sub_groups, &coefficients, config)?;
        pipelines.push(report.total.as_secs_f64());
        updates.push(report.update.as_secs_f64());
    }
    let (read, adam_s, write, pipe) = (median(reads), median(adams), median(writes), median(pipelines));
    let read_write = median(duplex);
    let bytes = (3 * n * 4) as u64;
    Ok(SwapReport {
        engine: engine.name().into(),
        params: n,
        sub_group_size: store.chunk_elems(),
        buffer_count: args.buffer_count,
        read_seconds: read,
        adam_seconds: adam_s,
        write_seconds: write,
        read_write_seconds: read_write,
        pipeline_seconds: pipe,
        update_seconds: median(updates),
        read_gbps: bytes as f64 / read / 1e9,
        write_gbps: bytes as f64 / write / 1e9,
        pipeline_params_per_s: n as f64 / pipe,
        ratio_to_bound: pipe / read.max(adam_s).max(write),
        ratio_to_duplex_bound: pipe / read_write.max(adam_s),
    })
}

impl SwapReport {
    pub fn human(&self) -> String {
        format!(
            "swap bench ({} engine, {} params, sub-groups of {}, {} buffers)\n  read alone  {:>8.3} s  {:>6.2} GB/s\n  adam alone  {:>8.3} s  (in the pipeline: {:.3} s)\n  write alone {:>8.3} s  {:>6.2} GB/s\n  read+write  {:>8.3} s  (both legs at once)\n  pipeline    {:>8.3} s  {:>8.1} Mparams/s\n  ratio_to_bound {:.3} (÷ max of the legs alone)   ratio_to_duplex_bound {:.3} (÷ read+write at once)",
            self.engine,
            self.params,
            self.sub_group_size,
            self.buffer_count,
            self.read_seconds,
            self.read_gbps,
            self.adam_seconds,
            self.update_seconds,
            self.write_seconds,
            self.write_gbps,
            self.read_write_seconds,
            self.pipeline_seconds,
            self.pipeline_params_per_s / 1e6,
            self.ratio_to_bound,
            self.ratio_to_duplex_bound
        )
    }
}

/// What one of the engine's NVMe transfers costs beyond its bytes, as a run pays it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TransferLatency {
    /// Median seconds of a one-sub-group pipelined AdamW over small states, every rank
    /// at once (its three reads, the update, its three writes; the pipeline's threads).
    pub call_s: f64,
    /// Its read leg's, write leg's and update's medians.
    pub read_s: f64,
    pub write_s: f64,
    pub update_s: f64,
    /// Bytes each leg moves.
    pub leg_bytes: u64,
}

/// Times the NVMe pipeline as a run of `ranks` ranks calls it for a small unit: each
/// rank on a thread of its own, one store and engine (`engine`) for all, `calls`
/// one-sub-group AdamW steps of `elements` each (three fp32 states read and written),
/// pipelined as `config` says (on the calling thread without `pipeline_read` and
/// `pipeline_write`).
/// A unit this small moves its bytes in microseconds; the rest is the transfers' way
/// through the store's ring threads and the pipeline's hand-offs.
pub fn transfer_latency(
    dir: &std::path::Path,
    (engine, config): (EngineConfig, PipelineConfig),
    ranks: usize,
    elements: usize,
    calls: usize,
) -> anyhow::Result<TransferLatency> {
    let (io, _) = open_engine(dir, engine, None, EngineChoice::Auto)?;
    let specs: Vec<TensorSpec> = (0..ranks as u32)
        .flat_map(|rank| TensorSpec::optimizer(0, rank, elements))
        .collect();
    let name = format!(".tierzero-bench-latency-{}", std::process::id());
    let store = SwapStore::create(dir, &name, io, &specs, elements)?;
    let coefficients = AdamHyper::default().coefficients(1, 1.0);
    type Times = (Vec<f64>, Vec<f64>, Vec<f64>);
    struct Legs(std::sync::Mutex<Times>);
    impl pipeline::Observer for Legs {
        fn leg(&self, leg: pipeline::Leg, _: u32, start: Instant, end: Instant, _: u64) {
            let mut legs = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let seconds = (end - start).as_secs_f64();
            match leg {
                pipeline::Leg::Read => legs.0.push(seconds),
                pipeline::Leg::Write => legs.1.push(seconds),
                pipeline::Leg::Update => legs.2.push(seconds),
                _ => {}
            }
        }
    }
    let legs = Legs(std::sync::Mutex::new((Vec::new(), Vec::new(), Vec::new())));
    let times = std::thread::scope(|scope| -> anyhow::Result<Vec<f64>> {
        let (store, legs, coefficients) = (&store, &legs, &coefficients);
        let threads: Vec<_> = (0..ranks as u32)
            .map(|rank| {
                scope.spawn(move || -> anyhow::Result<Vec<f64>> {
                    let pool = pipeline::buffer_pool_for(store, config.sets, false)?;
                    pipeline::write_only(store, &pool, &[(0, rank, 0)])?;
                    let grad = AlignedBuf::<f32>::zeroed(elements)?;
                    let mut low = AlignedBuf::<u16>::zeroed(elements)?;
                    let mut times = Vec::with_capacity(calls);
                    for _ in 0..calls {
                        let groups = pipeline::sub_groups(
                            0,
                            rank,
                            elements,
                            pipeline::GradIn::Host(GradSlice::F32(&grad)),
                            LowPrecisionOut::Bf16(&mut low),
                        );
                        let start = Instant::now();
                        pipeline::nvme_adam_step_observed(store, &pool, groups, coefficients, config, legs)?;
                        times.push(start.elapsed().as_secs_f64());
                    }
                    Ok(times)
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in threads {
            all.extend(
                t.join()
                    .map_err(|_| anyhow::anyhow!("a latency thread panicked"))??,
            );
        }
        Ok(all)
    })?;
    let (reads, writes, updates) = legs.0.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(TransferLatency {
        call_s: median(times),
        read_s: median(reads),
        write_s: median(writes),
        update_s: median(updates),
        leg_bytes: 3 * 4 * elements as u64,
    })
}

/// The NVMe pipeline's AdamW as a run's step sweeps it: parameters per second of its
/// update legs (the sweep summing its state, on each sub-group just read into the
/// pipeline's I/O buffers). `calls` pipelined steps of `elements` fp32 parameters in
/// sub-groups of `chunk`, the parameters' copy written in fp32 (`copy_fp32`, an fp32
/// run's) or bf16, through one store and engine (`engine`), pipelined as `config` says;
/// the median call's rate. The gradient is in host memory in fp32, or with `stored`
/// (`Some(bf16)`, a run whose gradients live beside the state: `rules::stored_gradients`)
/// in the store in that type, read with the state and summed in the sweep as a run's
/// is. Here it ran 0.35–0.39 G parameters/s (the gradient in host memory) where `bench
/// adam`'s summed sweep over in-memory arrays ran 0.48–0.52.
pub fn pipelined_update(
    dir: &std::path::Path,
    (engine, config): (EngineConfig, PipelineConfig),
    (elements, chunk): (usize, usize),
    (copy_fp32, stored): (bool, Option<bool>),
    calls: usize,
) -> anyhow::Result<f64> {
    let (io, _) = open_engine(dir, engine, None, EngineChoice::Auto)?;
    let grad_key = TensorKey {
        unit: 0,
        rank: 0,
        state: State::Grad,
    };
    let mut specs: Vec<TensorSpec> = TensorSpec::optimizer(0, 0, elements).collect();
    specs.extend(stored.map(|bf16| TensorSpec {
        key: grad_key,
        numel: elements,
        elem_bytes: if bf16 { 2 } else { 4 },
    }));
    let name = format!(".tierzero-bench-update-{}", std::process::id());
    let store = SwapStore::create(dir, &name, io, &specs, chunk)?;
    let pool = pipeline::buffer_pool_for(&store, config.sets, stored.is_some())?;
    let groups: Vec<(u32, u32, usize)> = (0..store.chunks(specs[0].key)?).map(|c| (0, 0, c)).collect();
    pipeline::write_only(&store, &pool, &groups)?;
    let mut grad = AlignedBuf::<f32>::zeroed(elements)?;
    grad.iter_mut()
        .enumerate()
        .for_each(|(i, g)| *g = super::adam::gradient(i));
    if let Some(bf16) = stored {
        let bits: Vec<u16> = if bf16 {
            grad.iter().map(|&g| f32_to_bf16(g)).collect()
        } else {
            Vec::new()
        };
        let bytes = if bf16 {
            crc::bytes_of(&bits)
        } else {
            crc::bytes_of(&grad)
        };
        let scratch = store.scratch(store.chunk_bytes(4))?;
        store.write_tensor(grad_key, bytes, scratch)?;
    }
    let mut copy = super::adam::ParamsCopy::zeroed(elements, copy_fp32)?;
    let hyper = AdamHyper::default();
    let mut rates = Vec::with_capacity(calls);
    for step in 1..=calls.max(1) as u64 {
        let grad = match stored {
            Some(bf16) => pipeline::GradIn::Stored { len: elements, bf16 },
            None => pipeline::GradIn::Host(GradSlice::F32(&grad)),
        };
        let groups = pipeline::sub_groups(0, 0, store.chunk_elems(), grad, copy.out());
        let report = pipeline::nvme_adam_step(&store, &pool, groups, &hyper.coefficients(step, 1.0), config)?;
        rates.push(elements as f64 / report.update.as_secs_f64().max(1e-9));
    }
    Ok(median(rates))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pipelined_update_is_timed_over_its_sub_groups_and_leaves_no_file() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let config = PipelineConfig {
            sets: 2,
            pipeline_read: true,
            pipeline_write: true,
        };
        for how in [
            (false, None),
            (true, None),
            (true, Some(false)),
            (false, Some(true)),
        ] {
            let rate = pipelined_update(
                dir.path(),
                (EngineConfig::default(), config),
                (300_000, 65_536),
                how,
                2,
            )
            .unwrap();
            assert!(rate.is_finite() && rate > 0.0, "{how:?}: {rate}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
