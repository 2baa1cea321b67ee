//! Criterion benches of the kernels and pipelines under the engine (`cargo bench`):
//! AdamW per kernel, bf16/fp16 conversion, the `Local` collectives between two rank
//! threads beside a plain memcpy of the same bytes, and the NVMe optimizer pipeline.
//! `tierzero bench` stays the user-facing command (it reports against measured limits);
//! these track regressions of each piece with criterion's statistics.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use tierzero::comm::local::Local;
use tierzero::comm::{Collective, ReduceOp};
use tierzero_offload::adam::{self, AdamHyper, GradSlice, Kernel, LowPrecisionOut, Sweep};
use tierzero_offload::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use tierzero_offload::nvme::swap::{SwapStore, TensorSpec};
use tierzero_offload::nvme::{open_engine, EngineChoice, EngineConfig};
use tierzero_offload::pipeline::{self, PipelineConfig};

const PARAMS: usize = 1 << 20;

fn adamw(c: &mut Criterion) {
    let mut group = c.benchmark_group("adamw");
    group.throughput(Throughput::Elements(PARAMS as u64));
    let coefficients = AdamHyper::default().coefficients(1, 1.0);
    let grad: Vec<f32> = (0..PARAMS).map(|i| (i % 97) as f32 * 1e-3 - 0.05).collect();
    for kernel in [Kernel::Reference, Kernel::Portable, Kernel::Avx2, Kernel::Avx512] {
        if !kernel.is_supported() {
            continue;
        }
        let (mut master, mut m, mut v) = (vec![0.5f32; PARAMS], vec![0f32; PARAMS], vec![0f32; PARAMS]);
        let mut low = vec![0u16; PARAMS];
        group.bench_function(BenchmarkId::new("step", kernel.name()), |b| {
            b.iter(|| {
                let sweep = Sweep {
                    master: &mut master,
                    exp_avg: &mut m,
                    exp_avg_sq: &mut v,
                    grad: GradSlice::F32(&grad),
                    low: LowPrecisionOut::Bf16(&mut low),
                };
                adam::step_with(kernel, &coefficients, sweep).expect("equal lengths")
            })
        });
    }
    group.finish();
}

/// A 16-bit format: its name, fp32 → it, it → fp32.
type Conversion = (&'static str, fn(f32) -> u16, fn(u16) -> f32);

fn conversion(c: &mut Criterion) {
    let mut group = c.benchmark_group("convert");
    group.throughput(Throughput::Elements(PARAMS as u64));
    let values: Vec<f32> = (0..PARAMS).map(|i| i as f32 * 1.7e-3 - 900.0).collect();
    let mut bits = vec![0u16; PARAMS];
    let mut back = vec![0f32; PARAMS];
    let pairs: [Conversion; 2] = [
        ("bf16", f32_to_bf16, bf16_to_f32),
        ("f16", f32_to_f16, f16_to_f32),
    ];
    for (name, to, from) in pairs {
        group.bench_function(format!("f32_to_{name}"), |b| {
            b.iter(|| bits.iter_mut().zip(&values).for_each(|(o, &x)| *o = to(x)))
        });
        group.bench_function(format!("{name}_to_f32"), |b| {
            b.iter(|| back.iter_mut().zip(&bits).for_each(|(o, &x)| *o = from(x)))
        });
    }
    group.finish();
}

/// Two rank threads each make their buffers once, then run `op` on them `iters` times
/// (only the loop is timed).
fn on_two_ranks<B>(
    iters: u64,
    make: impl Fn(usize) -> B + Sync,
    op: impl Fn(&Local, &mut B) + Sync,
) -> std::time::Duration {
    let barrier = std::sync::Barrier::new(3);
    let mut elapsed = std::time::Duration::ZERO;
    std::thread::scope(|s| {
        for comm in Local::group(2) {
            let (make, op, barrier) = (&make, &op, &barrier);
            s.spawn(move || {
                let mut buffers = make(comm.rank());
                barrier.wait();
                (0..iters).for_each(|_| op(&comm, &mut buffers));
                barrier.wait();
            });
        }
        barrier.wait();
        let start = std::time::Instant::now();
        barrier.wait();
        elapsed = start.elapsed();
    });
    elapsed
}

fn collectives(c: &mut Criterion) {
    let mut group = c.benchmark_group("local_collectives");
    let n = 4 * PARAMS; // 16 MiB of fp32: one rank's full buffer
    group.throughput(Throughput::Bytes(4 * n as u64));
    let source = vec![1.0f32; n];
    let mut target = vec![0f32; n];
    group.bench_function("memcpy", |b| {
        b.iter(|| target.copy_from_slice(black_box(&source)))
    });
    group.bench_function("all_gather", |b| {
        b.iter_custom(|iters| {
            on_two_ranks(
                iters,
                |rank| (vec![rank as f32; n / 2], vec![0f32; n]),
                |comm, (shard, full)| comm.all_gather(shard, full).expect("two ranks"),
            )
        })
    });
    group.bench_function("reduce_scatter", |b| {
        b.iter_custom(|iters| {
            on_two_ranks(
                iters,
                |_| (vec![1.0f32; n], vec![0f32; n / 2]),
                |comm, (full, shard)| {
                    comm.reduce_scatter(full, shard, ReduceOp::Avg)
                        .expect("two ranks")
                },
            )
        })
    });
    group.finish();
}

fn nvme_pipeline(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let (engine, _) =
        open_engine(dir.path(), EngineConfig::default(), None, EngineChoice::Auto).expect("an engine");
    let specs: Vec<TensorSpec> = TensorSpec::optimizer(0, 0, PARAMS).collect();
    let chunk = PARAMS / 4;
    let store = SwapStore::create(dir.path(), "bench", engine, &specs, chunk).expect("a swap store");
    let pool = pipeline::buffer_pool_for(&store, 2, false).expect("buffers");
    let chunks = store.chunks(specs[0].key).expect("chunks");
    let all: Vec<(u32, u32, usize)> = (0..chunks).map(|c| (0, 0, c)).collect();
    pipeline::write_only(&store, &pool, &all).expect("initial state");
    let coefficients = AdamHyper::default().coefficients(1, 1.0);
    let grad = vec![1e-3f32; PARAMS];
    let mut low = vec![0u16; PARAMS];
    let mut group = c.benchmark_group("nvme_pipeline");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(24 * PARAMS as u64)); // 12 B/param read + written
    group.bench_function("adam_step", |b| {
        b.iter(|| {
            let groups = pipeline::sub_groups(
                0,
                0,
                store.chunk_elems(),
                pipeline::GradIn::Host(GradSlice::F32(&grad)),
                LowPrecisionOut::Bf16(&mut low),
            );
            let config = PipelineConfig {
                sets: 2,
                pipeline_read: true,
                pipeline_write: true,
            };
            pipeline::nvme_adam_step(&store, &pool, groups, &coefficients, config).expect("the pipeline")
        })
    });
    group.finish();
}

criterion_group!(benches, adamw, conversion, collectives, nvme_pipeline);
criterion_main!(benches);
