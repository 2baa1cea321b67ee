//! Swap store and pipeline tests: checksums, stale files, ENOSPC, and the pipelined
//! NVMe AdamW equal to in-memory AdamW bit for bit.

use crate::adam::{self, AdamHyper, Coefficients, GradSlice, LowPrecisionOut, Sweep};
use crate::nvme::swap::{State, SwapStore, TensorKey, TensorSpec};
use crate::nvme::tests::{engines, test_dir};
use crate::nvme::{BlockIo, IoError};
use crate::pipeline::{
    buffer_pool_for, nvme_adam_step, nvme_adam_step_from, nvme_adam_step_then, read_ahead, sub_groups,
    GradIn, Leg, Observer, PipelineConfig, SubGroup,
};
use crate::pool::IoBuf;
use std::io::{Seek, SeekFrom, Write};
use std::sync::Arc;

fn specs(units: &[usize], rank: u32) -> Vec<TensorSpec> {
    units
        .iter()
        .enumerate()
        .flat_map(|(unit, &numel)| {
            State::OPTIMIZER
                .into_iter()
                .chain([State::Grad])
                .map(move |state| TensorSpec {
                    key: TensorKey {
                        unit: unit as u32,
                        rank,
                        state,
                    },
                    numel,
                    elem_bytes: 4,
                })
        })
        .collect()
}

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32 - 0.5) * scale
        })
        .collect()
}

fn as_bytes(x: &[f32]) -> &[u8] {
    crate::crc::bytes_of(x)
}

fn as_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), std::mem::size_of_val(x)) }
}

fn store_with(engine: Arc<dyn BlockIo>, dir: &std::path::Path, units: &[usize], chunk: usize) -> SwapStore {
    SwapStore::create(dir, "swap", engine, &specs(units, 0), chunk).unwrap()
}

/// Each unit's starting master, exp_avg and exp_avg_sq (non-negative), from `seed`,
/// written to `store`: returned, with the scratch buffer back.
fn initial_state(
    store: &SwapStore,
    units: &[usize],
    seed: u32,
    mut scratch: IoBuf,
) -> (Vec<[Vec<f32>; 3]>, IoBuf) {
    let mut memory = Vec::new();
    for (unit, &n) in units.iter().enumerate() {
        let u = seed + unit as u32;
        let sq: Vec<f32> = values(n, 20 + u, 0.001).iter().map(|v| v.abs()).collect();
        let state = [values(n, u, 2.0), values(n, 10 + u, 0.01), sq];
        for (s, data) in State::OPTIMIZER.iter().zip(&state) {
            let key = TensorKey {
                unit: unit as u32,
                rank: 0,
                state: *s,
            };
            scratch = store.write_tensor(key, as_bytes(data), scratch).unwrap();
        }
        memory.push(state);
    }
    (memory, scratch)
}

/// The reference: AdamW on each unit's state in memory, its bf16 output into `low`.
fn in_memory_step(c: &Coefficients, memory: &mut [[Vec<f32>; 3]], grads: &[Vec<f32>], low: &mut [Vec<u16>]) {
    for (((master, exp_avg, exp_avg_sq), grad), low) in
        memory.iter_mut().map(|[m, a, s]| (m, a, s)).zip(grads).zip(low)
    {
        let grad = GradSlice::F32(grad);
        let low = LowPrecisionOut::Bf16(low);
        adam::step(
            c,
            Sweep {
                master,
                exp_avg,
                exp_avg_sq,
                grad,
                low,
            },
        )
        .unwrap();
    }
}

/// Asserts that the state in `store` is `memory`'s bit for bit; the scratch buffer back.
fn assert_stored_state(store: &SwapStore, memory: &[[Vec<f32>; 3]], mut scratch: IoBuf, what: &str) -> IoBuf {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (unit, state) in memory.iter().enumerate() {
        for (s, expected) in State::OPTIMIZER.iter().zip(state) {
            let mut got = vec![0f32; expected.len()];
            let key = TensorKey {
                unit: unit as u32,
                rank: 0,
                state: *s,
            };
            scratch = store.read_tensor(key, as_bytes_mut(&mut got), scratch).unwrap();
            assert_eq!(bits(&got), bits(expected), "{what}: {s:?} unit {unit}");
        }
    }
    scratch
}

/// Every leg reported, in order: its kind, unit and bytes.
#[derive(Default)]
struct Recorded(std::sync::Mutex<Vec<(Leg, u32, u64)>>);

impl Observer for Recorded {
    fn leg(&self, leg: Leg, unit: u32, start: std::time::Instant, end: std::time::Instant, bytes: u64) {
        assert!(start <= end, "{leg:?} of unit {unit} ends before it starts");
        self.0.lock().unwrap().push((leg, unit, bytes));
    }
}

impl Recorded {
    /// The legs of one kind, in the order reported: (unit, bytes).
    fn of(&self, kind: Leg) -> Vec<(u32, u64)> {
        let legs = self.0.lock().unwrap();
        legs.iter().filter(|l| l.0 == kind).map(|l| (l.1, l.2)).collect()
    }
}

#[test]
fn pipeline_equals_in_memory_adamw_bit_for_bit() {
    // the buffer_count 2 runs read their gradients from the store, beside the state; the
    // runs without pipelining take the serial path (no stage threads); the third step runs
    // unit by unit, each run reading the next one's first state ahead (one buffer set:
    // once its last write is in)
    let dir = test_dir();
    // three units, the last with a ragged tail; chunks of 4096 elements
    let units = [10_000usize, 4096, 9_999];
    for engine in engines(dir.path(), None) {
        for (buffer_count, pipeline_read, pipeline_write) in [
            (1, false, false),
            (2, false, false),
            (2, true, false),
            (4, true, true),
            (1, true, true),
        ] {
            let store = store_with(engine.clone(), dir.path(), &units, 4096);
            let scratch = IoBuf::new(store.chunk_bytes(4)).unwrap();
            let (mut memory, mut scratch) = initial_state(&store, &units, 0, scratch);
            let stored = buffer_count == 2;
            let pool = buffer_pool_for(&store, buffer_count, stored).unwrap();
            let hyper = AdamHyper {
                lr: 1e-2,
                weight_decay: 0.1,
                ..AdamHyper::default()
            };
            for step in 1..=4u64 {
                let c = hyper.coefficients(step, 0.5);
                let grads: Vec<Vec<f32>> = units
                    .iter()
                    .enumerate()
                    .map(|(u, &n)| values(n, 100 * step as u32 + u as u32, 0.1))
                    .collect();
                let mut low_nvme: Vec<Vec<u16>> = units.iter().map(|&n| vec![0; n]).collect();
                let mut low_memory = low_nvme.clone();
                in_memory_step(&c, &mut memory, &grads, &mut low_memory);
                // on nvme, sub-group by sub-group
                let mut groups = Vec::new();
                for (u, (grad, low)) in grads.iter().zip(low_nvme.iter_mut()).enumerate() {
                    let grad = if stored {
                        let key = TensorKey {
                            unit: u as u32,
                            rank: 0,
                            state: State::Grad,
                        };
                        scratch = store.write_tensor(key, as_bytes(grad), scratch).unwrap();
                        GradIn::Stored {
                            len: grad.len(),
                            bf16: false,
                        }
                    } else {
                        GradIn::Host(GradSlice::F32(grad))
                    };
                    let unit = sub_groups(u as u32, 0, store.chunk_elems(), grad, LowPrecisionOut::Bf16(low));
                    let key = TensorKey {
                        unit: u as u32,
                        rank: 0,
                        state: State::Master,
                    };
                    assert_eq!(
                        unit.len(),
                        store.chunks(key).unwrap(),
                        "one sub-group per stored chunk"
                    );
                    groups.extend(unit);
                }
                let config = PipelineConfig {
                    sets: buffer_count,
                    pipeline_read,
                    pipeline_write,
                };
                // the first sub-group's state read ahead (odd steps), or another's, dropped
                // unused (the second step: its buffers come back for the first sub-group's
                // reads), or the first sub-groups' as many as there are buffer sets (the
                // fourth, across units), changes nothing
                let ahead_of = if step % 2 == 1 { (0, 0, 0) } else { (2, 0, 1) };
                let ahead = read_ahead(&store, &pool, ahead_of).unwrap();
                let legs = Recorded::default();
                let report = if step < 3 {
                    nvme_adam_step_from(&store, &pool, (groups, Some(ahead)), &c, config, &legs).unwrap()
                } else {
                    // a run a unit, as the engine's optimizer thread runs them, each reading
                    // the next one's first state ahead where its reads are pipelined
                    let mut report = crate::pipeline::PipelineReport::default();
                    let mut ahead = if step == 3 {
                        vec![ahead]
                    } else {
                        drop(ahead);
                        let first = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0)];
                        first[..buffer_count.min(4)]
                            .iter()
                            .map(|&g| read_ahead(&store, &pool, g).unwrap())
                            .collect()
                    };
                    let mut runs: Vec<Vec<SubGroup<'_>>> = Vec::new();
                    for g in groups {
                        match runs.last_mut() {
                            Some(run) if run[0].unit == g.unit => run.push(g),
                            _ => runs.push(vec![g]),
                        }
                    }
                    let count = runs.len();
                    for (i, run) in runs.into_iter().enumerate() {
                        let next = (i + 1 < count).then_some((i as u32 + 1, 0, 0));
                        let (one, next) =
                            nvme_adam_step_then(&store, &pool, (run, ahead, next), &c, config, &legs)
                                .unwrap();
                        assert_eq!(!next.is_empty(), pipeline_read && i + 1 < count);
                        ahead = next;
                        report.sub_groups += one.sub_groups;
                        report.bytes_read += one.bytes_read;
                        report.bytes_written += one.bytes_written;
                    }
                    report
                };
                assert_eq!(report.sub_groups, 3 + 1 + 3);
                // one read, update and write a sub-group, in sub-group order (the simulated
                // device's clock takes the i-th of a kind as sub-group i's); a used
                // read-ahead is its first sub-group's state, reported once, before its read
                let order = [0, 0, 0, 1, 2, 2, 2];
                for kind in [Leg::Read, Leg::Update, Leg::Write] {
                    let units: Vec<u32> = legs.of(kind).iter().map(|l| l.0).collect();
                    assert_eq!(units, order, "{kind:?} legs, step {step}");
                }
                let early = legs.of(Leg::ReadAhead);
                let chunk = 3 * 4 * 4096;
                // the ragged third sub-group of unit 0: 1808 elements, 8 KiB a state
                let tail = 3 * 8192;
                let expected = match (step, buffer_count, pipeline_read) {
                    (3, _, true) | (4, 1, true) => vec![(0, chunk), (1, chunk), (2, chunk)],
                    (4, 2, true) => vec![(0, chunk), (0, chunk), (1, chunk), (2, chunk)],
                    (4, 2, false) => vec![(0, chunk), (0, chunk)],
                    // unit 1's read ahead with unit 0's, kept through unit 0's run
                    (4, 4, _) => vec![(0, chunk), (0, chunk), (0, tail), (1, chunk), (2, chunk)],
                    (1 | 3 | 4, _, _) => vec![(0, chunk)],
                    _ => vec![],
                };
                assert_eq!(early, expected);
                if step % 2 == 1 {
                    let first = legs.0.lock().unwrap().iter().position(|l| l.0 == Leg::Read);
                    let ahead = legs.0.lock().unwrap().iter().position(|l| l.0 == Leg::ReadAhead);
                    assert!(ahead < first, "the read-ahead is reported before the first read");
                }
                let read: u64 = legs.of(Leg::Read).iter().chain(&early).map(|l| l.1).sum();
                assert_eq!(read, report.bytes_read);
                // the bytes the disk moved: each chunk's elements padded to 4 KiB (a
                // ragged tail moves less than a whole chunk)
                let moved: u64 = units
                    .iter()
                    .flat_map(|&n| {
                        (0..n.div_ceil(4096))
                            .map(move |c| (4 * (n - c * 4096).min(4096)).div_ceil(4096) as u64 * 4096)
                    })
                    .sum();
                assert_eq!(report.bytes_written, 3 * moved);
                assert_eq!(report.bytes_read, if stored { 4 } else { 3 } * moved);
                assert_eq!(low_nvme, low_memory, "{} step {step}", engine.name());
            }
            let what = format!("{} buffers {buffer_count}", engine.name());
            assert_stored_state(&store, &memory, scratch, &what);
            assert_eq!(pool.available(), pool.count());
        }
    }
}

/// The h2d lane's fetch with two chunks in flight reads the bytes the one-chunk reference
/// reads (a ragged last chunk, one chunk, a tensor of many), and a corrupted chunk is its
/// error once the read behind it is in.
#[test]
fn reads_two_chunks_ahead_equal_reads_one_at_a_time() {
    let dir = test_dir();
    for engine in engines(dir.path(), None) {
        let sizes = [5 * 4096 + 100, 4096, 12 * 4096];
        let store = store_with(engine.clone(), dir.path(), &sizes, 4096);
        let mut scratch = [IoBuf::new(16384).unwrap(), IoBuf::new(16384).unwrap()];
        for (unit, &n) in sizes.iter().enumerate() {
            let key = TensorKey {
                unit: unit as u32,
                rank: 0,
                state: State::Master,
            };
            let data = values(n, 11 + unit as u32, 1.0);
            let [a, b] = scratch;
            let a = store.write_tensor(key, as_bytes(&data), a).unwrap();
            let (mut one, mut ahead) = (vec![0f32; n], vec![0f32; n]);
            let a = store.read_tensor(key, as_bytes_mut(&mut one), a).unwrap();
            scratch = store
                .read_tensor_ahead(key, as_bytes_mut(&mut ahead), [a, b])
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ahead), bits(&one), "{} unit {unit}", engine.name());
            assert_eq!(bits(&ahead), bits(&data));
        }
        // chunk 3 of the last tensor flipped behind the store's back
        let key = TensorKey {
            unit: 2,
            rank: 0,
            state: State::Master,
        };
        let (path, offset) = store.placement(key).unwrap();
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(offset + 3 * 16384 + 9)).unwrap();
        f.write_all(&[0x5A]).unwrap();
        f.sync_all().unwrap();
        let mut out = vec![0f32; sizes[2]];
        let e = store
            .read_tensor_ahead(key, as_bytes_mut(&mut out), scratch)
            .err()
            .unwrap();
        assert!(matches!(e, IoError::Checksum { .. }), "{e}");
    }
}

/// Writes two chunks ahead leave the bytes and checksums of writes one at a time: each
/// tensor written by one is read back by the other's reference, and rewritten by the
/// other.
#[test]
fn writes_two_chunks_ahead_equal_writes_one_at_a_time() {
    let dir = test_dir();
    for engine in engines(dir.path(), None) {
        let sizes = [5 * 4096 + 100, 4096, 12 * 4096];
        let store = store_with(engine.clone(), dir.path(), &sizes, 4096);
        let mut scratch = [IoBuf::new(16384).unwrap(), IoBuf::new(16384).unwrap()];
        let mut one = IoBuf::new(16384).unwrap();
        for (unit, &n) in sizes.iter().enumerate() {
            let key = TensorKey {
                unit: unit as u32,
                rank: 0,
                state: State::ExpAvgSq,
            };
            let (first, second) = (values(n, 21 + unit as u32, 1.0), values(n, 31 + unit as u32, 2.0));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut back = vec![0f32; n];
            scratch = store.write_tensor_ahead(key, as_bytes(&first), scratch).unwrap();
            one = store.read_tensor(key, as_bytes_mut(&mut back), one).unwrap();
            assert_eq!(bits(&back), bits(&first), "{} unit {unit}", engine.name());
            one = store.write_tensor(key, as_bytes(&second), one).unwrap();
            scratch = store.write_tensor_ahead(key, as_bytes(&first), scratch).unwrap();
            scratch = store
                .read_tensor_ahead(key, as_bytes_mut(&mut back), scratch)
                .unwrap();
            assert_eq!(bits(&back), bits(&first), "{} unit {unit}", engine.name());
        }
    }
}

#[test]
fn corruption_and_truncation_are_detected_with_file_and_offset() {
    let dir = test_dir();
    for engine in engines(dir.path(), None) {
        let store = store_with(engine.clone(), dir.path(), &[3 * 4096], 4096);
        let key = TensorKey {
            unit: 0,
            rank: 0,
            state: State::ExpAvg,
        };
        let data = values(3 * 4096, 7, 1.0);
        let scratch = store
            .write_tensor(key, as_bytes(&data), IoBuf::new(16384).unwrap())
            .unwrap();
        // flip one byte of chunk 1 behind the store's back
        let path = store.dir().join("r0.exp_avg.swp");
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(16384 + 5)).unwrap();
        f.write_all(&[0xAB]).unwrap();
        f.sync_all().unwrap();
        let e = store.read_async(key, 1, scratch).unwrap().wait().unwrap_err();
        assert!(matches!(e, IoError::Checksum { offset: 16384, .. }), "{e}");
        assert!(e.to_string().contains("r0.exp_avg.swp"), "{e}");
        // a chunk that was never written cannot be read
        let never = TensorKey {
            unit: 0,
            rank: 0,
            state: State::Master,
        };
        let (e, _) = store
            .read_async(never, 0, IoBuf::new(16384).unwrap())
            .err()
            .unwrap();
        assert!(e.to_string().contains("never written"), "{e}");
        // truncation: reading chunk 2 now runs past the end
        f.set_len(16384 * 2).unwrap();
        let e = store
            .read_async(key, 2, IoBuf::new(16384).unwrap())
            .unwrap()
            .wait()
            .unwrap_err();
        assert!(
            e.to_string().contains("r0.exp_avg.swp") && e.to_string().contains("32768"),
            "{e}"
        );
        drop(store);
        assert!(!dir.path().join("swap").exists(), "the store removes its files");
    }
}

/// Overwrites the byte at `offset` of the file at `path`.
fn corrupt(path: &std::path::Path, offset: u64, byte: u8) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[byte]).unwrap();
}

/// Unit 0's eight sub-groups of 4096 elements, chunk i's gradient `grad(i)`.
fn eight_groups<'a>(grad: impl Fn(usize) -> GradIn<'a>) -> Vec<SubGroup<'a>> {
    (0..8)
        .map(|chunk| SubGroup {
            unit: 0,
            rank: 0,
            chunk,
            grad: grad(chunk),
            low: LowPrecisionOut::None,
        })
        .collect()
}

/// Two buffer sets through the three stages, or the serial path they become without
/// pipelining.
fn two_sets(pipelined: bool) -> PipelineConfig {
    PipelineConfig {
        sets: 2,
        pipeline_read: pipelined,
        pipeline_write: pipelined,
    }
}

#[test]
fn pipeline_stops_with_the_error_instead_of_hanging() {
    let dir = test_dir();
    let engine = engines(dir.path(), None).pop().unwrap();
    let store = store_with(engine, dir.path(), &[8 * 4096], 4096);
    let zeros = vec![0f32; 8 * 4096];
    let mut scratch = IoBuf::new(16384).unwrap();
    for state in State::OPTIMIZER {
        scratch = store
            .write_tensor(
                TensorKey {
                    unit: 0,
                    rank: 0,
                    state,
                },
                as_bytes(&zeros),
                scratch,
            )
            .unwrap();
    }
    corrupt(&store.dir().join("r0.master.swp"), 5 * 16384, 1);
    let pool = buffer_pool_for(&store, 2, false).unwrap();
    let grad = vec![0.1f32; 8 * 4096];
    let groups = || eight_groups(|chunk| GradIn::Host(GradSlice::F32(&grad[chunk * 4096..][..4096])));
    let c = AdamHyper::default().coefficients(1, 1.0);
    for pipelined in [true, false] {
        let config = two_sets(pipelined);
        let e = nvme_adam_step(&store, &pool, groups(), &c, config).unwrap_err();
        assert!(matches!(e, IoError::Checksum { offset: 81920, .. }), "{e}");
        assert_eq!(
            pool.available(),
            pool.count(),
            "pipelined {pipelined}: every buffer returned after the error"
        );
        // the update of the corrupted sub-group wrote nothing: its moments are as before
        let key = |state| TensorKey {
            unit: 0,
            rank: 0,
            state,
        };
        let read = store.read_async(key(State::ExpAvg), 5, IoBuf::new(16384).unwrap());
        let buf = read.unwrap().wait().unwrap();
        assert!(
            buf.typed::<f32>(4096).iter().all(|&x| x == 0.0),
            "pipelined {pipelined}"
        );
    }
    // a stored gradient's chunk is verified too, where the update passes its bytes
    scratch = store
        .write_tensor(
            TensorKey {
                unit: 0,
                rank: 0,
                state: State::Master,
            },
            as_bytes(&zeros),
            scratch,
        )
        .unwrap();
    store
        .write_tensor(
            TensorKey {
                unit: 0,
                rank: 0,
                state: State::Grad,
            },
            as_bytes(&grad),
            scratch,
        )
        .unwrap();
    corrupt(&store.dir().join("r0.grad.swp"), 3 * 16384 + 100, 7);
    let pool = buffer_pool_for(&store, 2, true).unwrap();
    let stored = || {
        eight_groups(|_| GradIn::Stored {
            len: 4096,
            bf16: false,
        })
    };
    for pipelined in [true, false] {
        let config = two_sets(pipelined);
        let e = nvme_adam_step(&store, &pool, stored(), &c, config).unwrap_err();
        assert!(
            matches!(&e, IoError::Checksum { offset: 49152, path, .. } if path.ends_with("r0.grad.swp")),
            "{e}"
        );
        assert_eq!(pool.available(), pool.count(), "pipelined {pipelined}");
    }
}

#[test]
fn discarding_dead_gradients_frees_their_file_and_keeps_the_state() {
    let dir = test_dir();
    let engine = engines(dir.path(), None).remove(0);
    let store = store_with(engine, dir.path(), &[10_000, 4096], 4096);
    let key = |state| TensorKey {
        unit: 0,
        rank: 0,
        state,
    };
    let master = values(10_000, 7, 1.0);
    let mut scratch = IoBuf::new(store.chunk_bytes(4)).unwrap();
    scratch = store
        .write_tensor(key(State::Master), as_bytes(&master), scratch)
        .unwrap();
    let grads = store.file_path(0, State::Grad);
    let before = std::fs::metadata(&grads).unwrap().len();
    assert!(before > 0);
    assert_eq!(store.discard(0, State::Grad).unwrap(), before);
    assert_eq!(std::fs::metadata(&grads).unwrap().len(), 0);
    assert_eq!(store.discard(3, State::Grad).unwrap(), 0, "no such file");
    let mut back = vec![0f32; 10_000];
    scratch = store
        .read_tensor(key(State::Master), as_bytes_mut(&mut back), scratch)
        .unwrap();
    assert_eq!(back, master);
    let mut dead = vec![0f32; 10_000];
    assert!(store
        .read_tensor(key(State::Grad), as_bytes_mut(&mut dead), scratch)
        .is_err());
}

#[test]
fn stale_files_are_removed_and_foreign_files_kept() {
    let dir = test_dir();
    let engine = engines(dir.path(), None).remove(0);
    let swap = dir.path().join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    std::fs::write(swap.join("OWNER"), "tierzero swap directory v1 pid=1\n").unwrap();
    std::fs::write(swap.join("r3.master.swp"), b"stale").unwrap();
    std::fs::write(swap.join("notes.txt"), b"mine").unwrap();
    let store = store_with(engine.clone(), dir.path(), &[4096], 4096);
    assert!(!swap.join("r3.master.swp").exists());
    assert!(swap.join("notes.txt").exists());
    // a second store on the same directory is refused while the first lives
    let e = SwapStore::create(dir.path(), "swap", engine.clone(), &specs(&[4096], 0), 4096)
        .err()
        .unwrap();
    assert!(e.to_string().contains("in use by another tierzero run"), "{e}");
    drop(store);
    assert!(
        swap.join("notes.txt").exists(),
        "never deletes what it did not create"
    );
    // a directory without a marker is not ours
    let foreign = dir.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    let e = SwapStore::create(dir.path(), "foreign", engine, &specs(&[4096], 0), 4096)
        .err()
        .unwrap();
    assert!(e.to_string().contains("not created by tierzero"), "{e}");
}

/// A real full disk: a 1 MiB tmpfs mounted by the test (root only; fails elsewhere).
#[test]
fn no_space_is_a_clear_error_naming_the_path() {
    let dir = test_dir();
    let mount = dir.path().join("small");
    std::fs::create_dir_all(&mount).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mount)
        .stderr(std::process::Stdio::null())
        .status();
    // CI runs as root and can mount: a machine that cannot is a red run, not a quiet pass
    assert!(
        matches!(status, Ok(s) if s.success()),
        "cannot mount a size-limited tmpfs at {} (this test needs root and mount rights)",
        mount.display()
    );
    let engine: Arc<dyn BlockIo> =
        Arc::new(crate::nvme::pread::Pread::new(Default::default(), false).unwrap());
    let result = SwapStore::create(&mount, "swap", engine, &specs(&[1 << 20], 0), 1 << 16);
    let _ = std::process::Command::new("umount").arg(&mount).status();
    let e = result.err().expect("4 MiB of state cannot fit in 1 MiB");
    assert!(matches!(e, IoError::NoSpace { .. }), "{e}");
    assert!(e.to_string().contains("small/swap/r0."), "{e}");
}

/// Read-aheads across units with the gradients stored beside the state (four buffers a
/// set): kept through the runs before theirs when they go on from the next run's first
/// sub-group, dropped before the run leases where they skip a unit; either way the
/// state is in-memory AdamW's bit for bit and every buffer comes back to the pool.
#[test]
fn read_aheads_kept_across_units_or_dropped_equal_in_memory_adamw() {
    let dir = test_dir();
    let units = [4096usize, 4096, 4096];
    for engine in engines(dir.path(), None) {
        for (pipeline_read, pipeline_write) in [(true, true), (false, false), (true, false)] {
            let store = store_with(engine.clone(), dir.path(), &units, 4096);
            let scratch = IoBuf::new(store.chunk_bytes(4)).unwrap();
            let (mut memory, mut scratch) = initial_state(&store, &units, 30, scratch);
            let sets = 3;
            let pool = buffer_pool_for(&store, sets, true).unwrap();
            let config = PipelineConfig {
                sets,
                pipeline_read,
                pipeline_write,
            };
            let c = AdamHyper::default().coefficients(1, 1.0);
            // step 1: every unit's read ahead, each kept through the runs before it;
            // step 2: units 0 and 2, the latter dropped by unit 0's run (it skips unit 1)
            for (step, first) in [(1u32, vec![0u32, 1, 2]), (2, vec![0, 2])] {
                let grads: Vec<Vec<f32>> = units.iter().map(|&n| values(n, 60 + step, 0.1)).collect();
                let mut low_nvme: Vec<Vec<u16>> = units.iter().map(|&n| vec![0; n]).collect();
                let mut low_memory = low_nvme.clone();
                in_memory_step(&c, &mut memory, &grads, &mut low_memory);
                for (u, grad) in grads.iter().enumerate() {
                    let key = TensorKey {
                        unit: u as u32,
                        rank: 0,
                        state: State::Grad,
                    };
                    scratch = store.write_tensor(key, as_bytes(grad), scratch).unwrap();
                }
                let mut ahead: Vec<_> = first
                    .iter()
                    .map(|&u| read_ahead(&store, &pool, (u, 0, 0)).unwrap())
                    .collect();
                let legs = Recorded::default();
                for (u, low) in low_nvme.iter_mut().enumerate() {
                    let grad = GradIn::Stored {
                        len: units[u],
                        bf16: false,
                    };
                    let run = sub_groups(u as u32, 0, store.chunk_elems(), grad, LowPrecisionOut::Bf16(low));
                    let next = (u + 1 < units.len()).then_some((u as u32 + 1, 0, 0));
                    let (_, later) =
                        nvme_adam_step_then(&store, &pool, (run, ahead, next), &c, config, &legs).unwrap();
                    ahead = later;
                }
                assert!(ahead.is_empty());
                let used: Vec<u32> = legs.of(Leg::ReadAhead).iter().map(|l| l.0).collect();
                let expected = match (step, pipeline_read) {
                    // unit 2's dropped; each pipelined run reads the next one's ahead
                    (2, false) => vec![0],
                    _ => vec![0, 1, 2],
                };
                assert_eq!(used, expected, "{} step {step} {config:?}", engine.name());
                assert_eq!(low_nvme, low_memory, "{} step {step} {config:?}", engine.name());
                // a dropped read-ahead's buffers come back once its reads complete
                let since = std::time::Instant::now();
                while pool.available() < pool.count() && since.elapsed().as_secs() < 30 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                assert_eq!(
                    pool.available(),
                    pool.count(),
                    "every buffer back after step {step}"
                );
            }
            assert_stored_state(&store, &memory, scratch, engine.name());
        }
    }
}
