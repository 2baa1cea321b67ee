//! The CUDA side against the CPU side, on a GPU machine. Every test here is `#[ignore]`d
//! with its reason, so `cargo test` counts it as ignored where there is no GPU (CI, the
//! development machine) instead of passing it silently; on a GPU machine
//! `scripts/gpu-check.sh` runs them with `--ignored` from the stripped test binary
//! (README, "On a GPU"), and there a missing GPU fails them.

use serde_json::json;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use tierzero::comm::nccl::{self, Nccl};
use tierzero::comm::ReduceOp;
use tierzero::device::cuda::{self, Cuda};
use tierzero::plan::{from_json, Plan};
use tierzero::run::{train, TrainOptions};
use tierzero_offload::host::AlignedBuf;
use tierzero_offload::pool::HostRegister;

/// Fails the test when asked to run without a GPU (it was run with `--ignored`).
fn require_gpu() {
    assert!(
        tch::Cuda::is_available() && cuda::driver().is_ok(),
        "this test needs a GPU that torch and the CUDA driver see; run it on a GPU machine (scripts/gpu-check.sh)"
    );
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn pinned_copies_round_trip_on_the_copy_streams_with_timed_events() {
    require_gpu();
    let cuda = Cuda::open(0).unwrap();
    let n = 32 << 20;
    let mut src = AlignedBuf::<u8>::zeroed(n).unwrap();
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let mut back = AlignedBuf::<u8>::zeroed(n).unwrap();
    let pin = cuda.pinner();
    let (cs, cb) = (src.capacity_bytes(), back.capacity_bytes());
    pin.register(src.as_mut_ptr(), cs).unwrap();
    pin.register(back.as_mut_ptr(), cb).unwrap();
    let dev = Tensor::zeros([n as i64], (Kind::Uint8, Device::Cuda(0)));
    let addr = tierzero::torch::shim::device_ptr(&dev).unwrap();
    // torch zeroed `dev` on its own stream: our copy stream waits for that first
    let compute = cuda.current_stream().unwrap().cuda;
    cuda.order(&compute, &cuda.h2d).unwrap();
    let (start, end) = (cuda.timed_event().unwrap(), cuda.timed_event().unwrap());
    start.record(&cuda.h2d).unwrap();
    // SAFETY: `dev` holds n bytes; both buffers outlive the synchronize below.
    unsafe {
        cuda.copy_h2d(addr, &src[..n], &cuda.h2d).unwrap();
        cuda.order(&cuda.h2d, &cuda.d2h).unwrap();
        cuda.copy_d2h(&mut back[..n], addr, &cuda.d2h).unwrap();
    }
    end.record(&cuda.d2h).unwrap();
    let seconds = cuda::elapsed(&start, &end).unwrap();
    assert!(seconds > 0.0);
    assert!(src[..n] == back[..n]);
    // and torch's stream waits for our copy before reading `dev`
    cuda.order(&cuda.h2d, &compute).unwrap();
    assert_eq!(
        dev.sum(Kind::Int64).int64_value(&[]),
        src[..n].iter().map(|&b| b as i64).sum::<i64>()
    );
    pin.unregister(src.as_mut_ptr(), cs);
    pin.unregister(back.as_mut_ptr(), cb);
    println!("pinned H2D + D2H of {} MiB: {:.2} ms", n >> 20, seconds * 1e3);
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn one_rank_nccl_collectives_on_device_memory() {
    require_gpu();
    let cuda = Arc::new(Cuda::open(0).unwrap());
    let comm = Nccl::init(cuda, &nccl::unique_id().unwrap(), 1, 0).unwrap();
    for kind in [Kind::Float, Kind::BFloat16] {
        let x = Tensor::arange(1000, (kind, Device::Cuda(0)));
        let mut out = Tensor::zeros([1000], (kind, Device::Cuda(0)));
        comm.all_gather_device(&x, &mut out).unwrap();
        assert_eq!(out, x);
        let mut out = Tensor::zeros([1000], (kind, Device::Cuda(0)));
        comm.reduce_scatter_device(&x, &mut out, ReduceOp::Sum).unwrap();
        assert_eq!(out, x);
        let mut y = x.copy();
        comm.all_reduce_device(&mut y, ReduceOp::Avg).unwrap();
        comm.broadcast_device(&mut y, 0).unwrap();
        assert_eq!(y, x);
    }
    // the host-buffer Collective stages through the GPU
    use tierzero::comm::Collective;
    let mut host = [1.5f32, 2.5];
    comm.all_reduce(&mut host, ReduceOp::Sum).unwrap();
    assert_eq!(host, [1.5, 2.5]);
}

/// The communicators a CUDA rank trains with: joined through c10d's TCPStore by name,
/// all queueing on the GPU's collectives stream, driven in turn from one thread as the
/// engine's collectives lane drives them (the one order every rank shares); an abort
/// publishes its cause in the store and later calls fail with it.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn nccl_communicators_join_through_the_store_and_share_the_collectives_stream() {
    use tierzero::comm::gloo::Store;
    use tierzero::comm::Collective;
    require_gpu();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let timeout = std::time::Duration::from_secs(30);
    let store = Store::connect("127.0.0.1", port, true, timeout).unwrap();
    let cuda = Cuda::shared(0).unwrap();
    let comms: Vec<Nccl> = ["main", "gather", "reduce"]
        .iter()
        .map(|name| Nccl::join(store.clone(), name, cuda.clone(), 0, 1, timeout).unwrap())
        .collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            for round in 0..50 {
                for (i, comm) in comms.iter().enumerate() {
                    let shard: Vec<f32> = (0..4096).map(|x| (x + i + round) as f32).collect();
                    let mut out = vec![0f32; 4096];
                    comm.all_gather(&shard, &mut out).unwrap();
                    assert_eq!(out, shard);
                    comm.reduce_scatter(&shard, &mut out, ReduceOp::Avg).unwrap();
                    assert_eq!(out, shard);
                }
            }
        });
    });
    comms[1].abort("out of memory");
    let published = String::from_utf8(store.try_get("tierzero/abort").unwrap().unwrap()).unwrap();
    assert_eq!(published, "rank 0 stopped: out of memory");
    let mut one = [1f32];
    let err = comms[1]
        .all_reduce(&mut one, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of memory"), "{err}");
}

/// A lane on a GPU queues its jobs on its own torch pool stream, after the compute
/// queued before submission; compute waits for the job on its stream (the host goes
/// on), and the host wait returns once the device ran it.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn a_lane_on_its_gpu_stream_is_ordered_against_compute_by_events() {
    use tierzero::device::cuda::CudaStreams;
    use tierzero::device::lanes::{Lane, Mode, Streams};
    require_gpu();
    let cuda = Cuda::shared(0).unwrap();
    let streams: Arc<dyn Streams> = Arc::new(CudaStreams(cuda.clone()));
    let n = 16 << 20;
    let src = Tensor::ones([n], (Kind::Float, Device::Cuda(0)));
    let mut dst = Tensor::full([n], 7.0, (Kind::Float, Device::Cuda(0)));
    // queued on compute before the job: the lane must see it
    let _ = dst.fill_(0.0);
    std::thread::scope(|s| {
        let lane = Lane::start_on(s, 0, "h2d", Mode::Plain, Some(streams.clone()));
        let (a, b, c) = (src.shallow_clone(), dst.shallow_clone(), cuda.clone());
        let done = lane.submit(move || {
            let on_lane = c.current_stream().unwrap().same(&c.lane_stream("h2d").unwrap());
            if !on_lane {
                return Err("the job is not on the lane's stream".into());
            }
            let mut b = b;
            for _ in 0..50 {
                let _ = b.f_add_(&a).map_err(|e| e.to_string())?;
            }
            Ok(())
        });
        done.order_compute().unwrap();
        let sum = dst.sum(Kind::Double).double_value(&[]);
        assert_eq!(sum, 50.0 * n as f64);
        done.synchronize().unwrap();
        assert!(done.query());
    });
}

/// Device-tier optimizer state on a GPU is updated by torch's fused AdamW there: ten
/// steps agree with the CPU AdamW kernel within 1e-6 relative (1e-7 absolute near
/// zero), master and moments.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn fused_adamw_on_the_gpu_follows_the_cpu_kernel() {
    use tierzero_offload::adam::{self, AdamHyper, GradSlice, LowPrecisionOut, Sweep};
    require_gpu();
    let n = 1 << 20;
    let hyper = AdamHyper::default();
    let values = |seed: u32, scale: f32| -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 20011) as f32 / 20011.0 * scale - scale / 2.0)
            .collect()
    };
    let init = values(7, 2.0);
    let (mut master, mut m, mut v) = (init.clone(), vec![0f32; n], vec![0f32; n]);
    let gpu = Device::Cuda(0);
    let mut on_gpu = [
        Tensor::from_slice(&init).to(gpu),
        Tensor::zeros([n as i64], (Kind::Float, gpu)),
        Tensor::zeros([n as i64], (Kind::Float, gpu)),
    ];
    for step in 1..=10u64 {
        let grad = values(100 + step as u32, 0.2);
        let sweep = Sweep {
            master: &mut master,
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            grad: GradSlice::F32(&grad),
            low: LowPrecisionOut::None,
        };
        adam::step(&hyper.coefficients(step, 1.0), sweep).unwrap();
        let [p, em, ev] = &mut on_gpu;
        tierzero::torch::shim::fused_adam(p, &Tensor::from_slice(&grad).to(gpu), em, ev, step, &hyper)
            .unwrap();
    }
    for (what, ours, theirs) in [
        ("master", &master, &on_gpu[0]),
        ("exp_avg", &m, &on_gpu[1]),
        ("exp_avg_sq", &v, &on_gpu[2]),
    ] {
        let theirs = Vec::<f32>::try_from(&theirs.to(Device::Cpu)).unwrap();
        // torch.allclose semantics, as tests/adam_torch.rs: rtol 1e-6, atol 1e-7
        let outside = ours
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| (*a - *b).abs() > 1e-6 * b.abs() + 1e-7)
            .count();
        println!("{what}: {outside} of {n} elements outside rtol 1e-6 / atol 1e-7");
        assert_eq!(outside, 0, "{what}");
    }
}

fn tiny(
    accelerator: &str,
    (stage, param, optimizer): (u8, &str, &str),
    precision: &str,
    dir: &std::path::Path,
) -> Plan {
    tiny_with(accelerator, (stage, param, optimizer), precision, dir, &[])
}

/// [`tiny`] with config overrides (`key=value`).
fn tiny_with(
    accelerator: &str,
    (stage, param, optimizer): (u8, &str, &str),
    precision: &str,
    dir: &std::path::Path,
    sets: &[String],
) -> Plan {
    let config = json!({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": { "type": "AdamW", "params": { "lr": 3e-3, "weight_decay": 0.01 } },
        "bf16": { "enabled": precision == "bf16" },
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_param": { "device": param, "nvme_path": dir.join("params"), "max_in_cpu": 0 },
            "offload_optimizer": { "device": optimizer, "nvme_path": dir.join("optimizer") }
        },
        "model": { "preset": "llama-tiny" },
        "data": { "synthetic": "markov", "seq_len": 64 },
        "train": { "steps": 20, "devices": 1, "seed": 5, "accelerator": accelerator }
    });
    from_json(config, sets, tierzero::device::facts()).unwrap().plan
}

fn losses(plan: &Plan) -> Vec<f64> {
    train(plan, TrainOptions::default())
        .unwrap()
        .steps
        .iter()
        .map(|m| m.loss)
        .collect()
}

/// The tiny Llama on CUDA against its CPU run: host and NVMe tiers, and optimizer state
/// on the GPU, whose gradients stay there (`rules::gradients_on_device`; stage 3 with
/// parameters on the GPU or in host memory, and stage 0); parameters in host memory
/// also pinned (`offload_param.pin_memory`: copied to the GPU in place by DMA, and from
/// a device-tier optimizer straight into their registered buffer); parameters on the GPU
/// with the host's optimizer (stages 2 and 3); and layered steps.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn tiny_llama_on_cuda_follows_the_cpu_run() {
    require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let layouts = [
        (3, "cpu", "cpu", false),
        (3, "cpu", "cpu", true),
        (3, "nvme", "nvme", false),
        (3, "none", "none", false),
        (3, "cpu", "none", false),
        (3, "cpu", "none", true),
        (0, "none", "none", false),
        // parameters on the GPU, the host's optimizer: its new values copied there
        // through two pinned buffers (`engine/update_copies.rs`)
        (3, "none", "cpu", false),
        (2, "none", "cpu", false),
    ];
    // and with two micro-batches a step, the GPU's sums held on it for the host or
    // NVMe optimizer, which copies each into a pinned buffer (`rules::held_gradients`)
    // and a layered step (`train.layered_accumulation`): each unit's gradient summed
    // over three micro-batches on the GPU in fp32, reduced once
    let layouts = layouts
        .into_iter()
        .map(|l| (l, 1, false))
        .chain([
            ((3, "cpu", "cpu", false), 2, false),
            ((3, "nvme", "nvme", false), 2, false),
        ])
        .chain([
            ((3, "cpu", "cpu", false), 3, true),
            ((2, "none", "cpu", false), 3, true),
        ]);
    for ((stage, param, optimizer, pin), accumulation, layered) in layouts {
        for (precision, tolerance) in [("fp32", 1e-3), ("bf16", 2e-2)] {
            let layout = (stage, param, optimizer);
            let sets = [
                format!("gradient_accumulation_steps={accumulation}"),
                format!("train.layered_accumulation={layered}"),
            ];
            let with_pin = |mut plan: Plan| {
                plan.zero.offload_param.pin_memory = pin;
                plan
            };
            let cpu = with_pin(tiny_with("cpu", layout, precision, &tmp.path().join("a"), &sets));
            let gpu = with_pin(tiny_with("cuda", layout, precision, &tmp.path().join("b"), &sets));
            if accumulation > 1 {
                assert!(tierzero::plan::rules::held_gradients(&gpu).contains(&true));
            }
            let (cpu, gpu) = (losses(&cpu), losses(&gpu));
            let worst = cpu
                .iter()
                .zip(&gpu)
                .map(|(a, b)| (a - b).abs() / a.abs())
                .fold(0.0, f64::max);
            println!(
                "stage {stage} {param}/{optimizer} pinned {pin} {precision} accumulation {accumulation} layered {layered}: cpu {cpu:?}\n  cuda {gpu:?}\n  worst relative {worst:.2e}"
            );
            assert!(
                worst < tolerance,
                "stage {stage} {param}/{optimizer} pinned {pin} {precision}: {worst}"
            );
        }
    }
}

/// On a GPU the compute thread never waits for a unit's kernels: compute's spans come
/// from timed marks on its stream (`engine/compute_times.rs`), so the breakdown still
/// has each phase's device time, inside the step.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn compute_spans_on_the_gpu_are_the_devices_times() {
    use tierzero::metrics::timeline::Phase;
    require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    for layout in [(3, "none", "none"), (3, "cpu", "cpu")] {
        let result = train(&tiny("cuda", layout, "fp32", tmp.path()), TrainOptions::default()).unwrap();
        let step = result.steps.last().unwrap();
        let (forward, backward) = (
            step.breakdown.phase(Phase::Forward),
            step.breakdown.phase(Phase::Backward),
        );
        println!(
            "{layout:?}: step {:.4} s, forward {forward:.4} s, backward {backward:.4} s",
            step.step_seconds
        );
        assert!(forward > 0.0 && backward > 0.0, "{layout:?}: no compute spans");
        assert!(
            forward + backward <= step.step_seconds,
            "{layout:?}: spans outside the step"
        );
    }
}

/// On the GPU the checked lanes hold the ordering to the CPU run, and a wait left out
/// breaks it: compute's stream not waiting for a gather's mark, or for the mark of a
/// device update (the optimizer's own stream, `engine/optimize.rs`), lets the next use
/// read a buffer not yet written. Checked mode delays lanes, compute and the
/// optimizer's updates on the device, so the missing wait shows as a loss off the CPU
/// run's (or not finite).
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn a_dropped_wait_on_the_gpu_is_caught_by_the_checked_lanes() {
    use tierzero::engine::context::LaneOptions;
    use tierzero::engine::prefetch::DroppedWait;
    require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let checked = |dropped| TrainOptions {
        lanes: Some(LaneOptions::checked(9, 2000, dropped)),
        ..TrainOptions::default()
    };
    let off = |cpu: &[f64], gpu: &[f64]| {
        cpu.iter()
            .zip(gpu)
            .map(|(a, b)| {
                if b.is_finite() {
                    (a - b).abs() / a.abs()
                } else {
                    f64::INFINITY
                }
            })
            .fold(0.0, f64::max)
    };
    for (layout, dropped) in [
        ((3, "none", "none"), DroppedWait::ComputeOnUpdate),
        ((0, "none", "none"), DroppedWait::ComputeOnUpdate),
        ((3, "cpu", "cpu"), DroppedWait::ComputeOnGather),
    ] {
        let cpu = losses(&tiny("cpu", layout, "fp32", &tmp.path().join("a")));
        let plan = tiny("cuda", layout, "fp32", &tmp.path().join("b"));
        let run = |dropped| {
            let steps =
                train(&plan, checked(dropped)).map(|r| r.steps.iter().map(|m| m.loss).collect::<Vec<_>>());
            steps.unwrap_or_else(|e| {
                println!("{layout:?} {dropped:?}: the run failed: {e}");
                vec![f64::NAN; cpu.len()]
            })
        };
        let (kept, left_out) = (off(&cpu, &run(DroppedWait::None)), off(&cpu, &run(dropped)));
        println!(
            "{layout:?}: checked {kept:.2e} off the CPU run; without the wait ({dropped:?}) {left_out:.2e}"
        );
        assert!(
            kept < 1e-3,
            "{layout:?}: the checked run is {kept} off the CPU run"
        );
        assert!(
            left_out >= 1e-3,
            "{layout:?} {dropped:?}: the run matched the CPU run without the wait"
        );
    }
}

/// A GPU's stretches leave through the pinned staging two deep (`engine/staging.rs`):
/// every chunking of a gradient shorter than its unit (zeros past it), fp32 and bf16,
/// into a shard, a replica and through a device sum's flush, leaves the host
/// accumulator the bits the same reduction of the gradient on the CPU gives it.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it with --ignored"]
fn staged_reductions_from_the_gpu_leave_the_cpu_reductions_bits() {
    use tierzero::comm::local::Local;
    use tierzero::engine::grads::Grads;
    use tierzero::engine::reduce::{reduce_into, ChunkBuffers, OnDevice, Target};
    use tierzero::metrics::timeline::Track;
    use tierzero::plan::partition::Partition;
    require_gpu();
    let comm = Local::group(1).pop().unwrap();
    let part = Partition::new(1000, 1);
    let values: Vec<f32> = (0..600).map(|i| ((i * 31) % 97) as f32 / 9.0 - 3.3).collect();
    let track = Track::disabled();
    let bits = |g: &Grads| match g {
        Grads::F32(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        _ => unreachable!("fp32 accumulators"),
    };
    for kind in [Kind::Float, Kind::BFloat16] {
        let cpu = Tensor::from_slice(&values).to_kind(kind);
        let gpu = cpu.to_device(Device::Cuda(0));
        for chunk in [7, 64, 1 << 20] {
            let mut reduced = Vec::new();
            for grad in [&cpu, &gpu] {
                let mut buffers = ChunkBuffers::new(Kind::Float, 1 << 20);
                let start: Vec<f32> = (0..part.padded).map(|i| i as f32 * 0.01).collect();
                let mut shard = Grads::from_f32(&start).unwrap();
                let mut replica = Grads::from_f32(&start).unwrap();
                for (target, acc) in [(Target::Shard, &mut shard), (Target::Replica, &mut replica)] {
                    reduce_into(
                        &comm,
                        target,
                        0,
                        grad,
                        part,
                        Some(acc),
                        None,
                        &mut buffers,
                        &track,
                        chunk,
                    )
                    .unwrap();
                }
                // a device sum of two contributions, flushed by the second
                let sum = Tensor::zeros([part.padded as i64], (Kind::Float, grad.device()));
                let mut flushed = Grads::zeros(part.padded, false).unwrap();
                for (first, flush) in [(true, false), (false, true)] {
                    let on = OnDevice {
                        acc: sum.shallow_clone(),
                        first,
                        flush,
                    };
                    let acc = flush.then_some(&mut flushed);
                    reduce_into(
                        &comm,
                        Target::Shard,
                        0,
                        grad,
                        part,
                        acc,
                        Some(&on),
                        &mut buffers,
                        &track,
                        chunk,
                    )
                    .unwrap();
                }
                reduced.push([bits(&shard), bits(&replica), bits(&flushed)]);
            }
            assert_eq!(
                reduced[1], reduced[0],
                "{kind:?}, chunks of {chunk}: the GPU's, then the CPU's"
            );
        }
    }
}
