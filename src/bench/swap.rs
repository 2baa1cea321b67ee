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
        .flat_map(|unit| {
            State::OPTIMIZER.into_iter().map(move |state| TensorSpec {
                key: TensorKey { unit, rank: 0, state },
                numel: n,
                elem_bytes: 4,
            })
        })
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
            "swap bench ({} engine, {} params, sub-groups of {}, {} buffers)\n  read alone  {:>8.3} s  {:>6.2} GB/s\n  adam alone  {:>8.3} s\n  write alone {:>8.3} s  {:>6.2} GB/s\n  read+write  {:>8.3} s  (both legs at once)\n  pipeline    {:>8.3} s  {:>8.1} Mparams/s\n  ratio_to_bound {:.3} (÷ max of the legs alone)   ratio_to_duplex_bound {:.3} (÷ read+write at once)",
            self.engine,
            self.params,
            self.sub_group_size,
            self.buffer_count,
            self.read_seconds,
            self.read_gbps,
            self.adam_seconds,
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
