//! Block I/O tests on a real disk (the crate's `target/` directory, ext4 here): both
//! engines round-trip random sizes and offsets, agree with each other, report errors
//! with the path and offset, and hand every buffer back.

use super::*;
use crate::pool::{BufferPool, IoBuf};
use std::sync::Arc;

/// A scratch directory on the same disk as the build (not tmpfs).
pub(crate) fn test_dir() -> tempfile::TempDir {
    let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-nvme");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

pub(crate) fn engines(dir: &std::path::Path, pool: Option<&BufferPool>) -> Vec<Arc<dyn BlockIo>> {
    let config = EngineConfig {
        block_size: 64 << 10,
        queue_depth: 8,
        parallelism: 2,
        ..EngineConfig::default()
    };
    let report = probe(dir).unwrap();
    let direct = report.direct.is_ok();
    let mut out: Vec<Arc<dyn BlockIo>> = vec![Arc::new(pread::Pread::new(config, direct).unwrap())];
    // CI's machines have io_uring: one without it is worth a red run, not a quiet pass
    if let Err(e) = report.uring {
        panic!("io_uring is unavailable here ({e}); every engine test needs both engines");
    }
    out.push(Arc::new(uring::Uring::new(config, direct, pool).unwrap()));
    out
}

fn fill(buf: &mut IoBuf, seed: u64) {
    let mut x = seed | 1;
    for b in buf.as_bytes_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

#[test]
fn round_trips_random_sizes_and_offsets_on_both_engines() {
    let dir = test_dir();
    let pool = BufferPool::new(4, 1 << 20).unwrap();
    for engine in engines(dir.path(), Some(&pool)) {
        let file = BlockFile::open(
            &dir.path().join(format!("{}.bin", engine.name())),
            true,
            engine.direct(),
        )
        .unwrap();
        file.preallocate(64 << 20).unwrap();
        let mut rng = 12345u64;
        for round in 0..40 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
            let pages = 1 + (rng >> 33) as usize % 256; // up to 1 MiB
            let offset = ((rng >> 20) % 15_000) * DIRECT_ALIGN;
            let len = pages * DIRECT_ALIGN as usize;
            // alternate pooled (fixed) and unpooled buffers
            let mut buf = if round % 2 == 0 {
                pool.lease()
            } else {
                IoBuf::new(len).unwrap()
            };
            fill(&mut buf, rng);
            let expected = buf.as_bytes()[..len].to_vec();
            let buf = engine
                .submit(Op::write(&file, offset, len, buf))
                .wait()
                .unwrap()
                .into_result()
                .unwrap();
            drop(buf);
            let back = engine
                .submit(Op::read(&file, offset, len, IoBuf::new(len).unwrap()))
                .wait()
                .unwrap()
                .into_result()
                .unwrap();
            assert_eq!(
                &back.as_bytes()[..len],
                &expected[..],
                "{} round {round}",
                engine.name()
            );
        }
        assert_eq!(pool.available(), 4, "every pooled buffer came back");
    }
}

#[test]
fn engines_agree_with_each_other() {
    let dir = test_dir();
    let engines = engines(dir.path(), None);
    let path = dir.path().join("shared.bin");
    let writer_file = BlockFile::open(&path, true, engines[1].direct()).unwrap();
    let mut buf = IoBuf::new(3 << 20).unwrap();
    fill(&mut buf, 99);
    let expected = buf.as_bytes().to_vec();
    engines[1]
        .submit(Op::write(&writer_file, 8192, 3 << 20, buf))
        .wait()
        .unwrap()
        .into_result()
        .unwrap();
    let reader_file = BlockFile::open(&path, false, engines[0].direct()).unwrap();
    let back = engines[0]
        .submit(Op::read(
            &reader_file,
            8192,
            3 << 20,
            IoBuf::new(3 << 20).unwrap(),
        ))
        .wait()
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(back.as_bytes(), &expected[..]);
}

#[test]
fn concurrent_reads_and_writes_from_many_threads() {
    let dir = test_dir();
    for engine in engines(dir.path(), None) {
        let file = BlockFile::open(&dir.path().join("c.bin"), true, engine.direct()).unwrap();
        file.preallocate(32 * 65536).unwrap();
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (engine, file) = (engine.clone(), file.clone());
                s.spawn(move || {
                    for i in 0..4u64 {
                        let offset = (t * 4 + i) * 65536;
                        let mut buf = IoBuf::new(65536).unwrap();
                        fill(&mut buf, t * 100 + i);
                        let expected = buf.as_bytes().to_vec();
                        let pending = engine.submit(Op::write(&file, offset, 65536, buf));
                        pending.wait().unwrap().into_result().unwrap();
                        let back = engine
                            .submit(Op::read(&file, offset, 65536, IoBuf::new(65536).unwrap()))
                            .wait()
                            .unwrap()
                            .into_result()
                            .unwrap();
                        assert_eq!(back.as_bytes(), &expected[..]);
                    }
                });
            }
        });
    }
}

#[test]
fn misaligned_and_oversized_requests_are_errors_that_return_the_buffer() {
    let dir = test_dir();
    for engine in engines(dir.path(), None) {
        let file = BlockFile::open(&dir.path().join("m.bin"), true, engine.direct()).unwrap();
        if engine.direct() {
            let done = engine
                .submit(Op::write(&file, 100, 4096, IoBuf::new(4096).unwrap()))
                .wait()
                .unwrap();
            assert_eq!(done.buf.capacity(), 4096);
            let e = done.result.unwrap_err().to_string();
            assert!(
                e.contains("m.bin") && e.contains("offset 100") && e.contains("O_DIRECT"),
                "{e}"
            );
        }
        let done = engine
            .submit(Op::write(&file, 0, 8192, IoBuf::new(4096).unwrap()))
            .wait()
            .unwrap();
        assert!(
            matches!(done.result, Err(IoError::BufferTooSmall { .. })),
            "{:?}",
            done.result
        );
    }
}

#[test]
fn reading_past_the_end_is_a_short_transfer_naming_the_file() {
    let dir = test_dir();
    for engine in engines(dir.path(), None) {
        let file = BlockFile::open(&dir.path().join("short.bin"), true, engine.direct()).unwrap();
        file.preallocate(8192).unwrap();
        let done = engine
            .submit(Op::read(&file, 4096, 16384, IoBuf::new(16384).unwrap()))
            .wait()
            .unwrap();
        let e = done.result.unwrap_err().to_string();
        assert!(
            e.contains("short.bin") && e.contains("short transfer"),
            "{}: {e}",
            engine.name()
        );
    }
}

#[test]
fn a_missing_file_names_its_path() {
    let dir = test_dir();
    let e = BlockFile::open(&dir.path().join("nope/missing.bin"), false, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.bin"), "{e}");
}

#[test]
fn probe_reports_and_auto_prefers_uring_with_direct() {
    let dir = test_dir();
    let (engine, report) =
        open_engine(dir.path(), EngineConfig::default(), None, EngineChoice::Auto).unwrap();
    println!("probe: {report:?}, engine {}", engine.name());
    if report.uring.is_ok() && report.direct.is_ok() {
        assert_eq!(engine.name(), "uring");
        assert!(engine.direct());
    } else {
        assert_eq!(engine.name(), "pread");
    }
    let (engine, _) = open_engine(dir.path(), EngineConfig::default(), None, EngineChoice::Pread).unwrap();
    assert_eq!(engine.name(), "pread");
    // the probe leaves nothing behind
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Pools registered after the engine started (as the trainer makes its pools) take the
/// next slots of every ring's fixed-buffer table: transfers through their buffers
/// (`READ_FIXED`/`WRITE_FIXED`) round-trip beside plain ones, the pool the engine was
/// built with keeps its slots, and a pool that does not fit the table is refused (its
/// buffers then go through plain reads and writes).
#[test]
fn pools_registered_later_carry_fixed_transfers() {
    let dir = test_dir();
    let config = EngineConfig {
        block_size: 64 << 10,
        parallelism: 2,
        ..EngineConfig::default()
    };
    let direct = probe(dir.path()).unwrap().direct.is_ok();
    let first = BufferPool::new(3, 256 << 10).unwrap();
    let engine = uring::Uring::new(config, direct, Some(&first)).unwrap();
    assert!(engine.uses_fixed_buffers());
    let later = BufferPool::new(2, 1 << 20).unwrap();
    assert!(engine.register_pool(&later));
    let too_many = BufferPool::new(uring::FIXED_SLOTS, 4096).unwrap();
    assert!(!engine.register_pool(&too_many), "past the table's slots");
    let file = BlockFile::open(&dir.path().join("fixed.bin"), true, direct).unwrap();
    file.preallocate(8 << 20).unwrap();
    for (round, pool) in [&first, &later, &too_many, &later, &first]
        .into_iter()
        .enumerate()
    {
        let len = pool.buffer_bytes().min(256 << 10);
        let offset = round as u64 * (1 << 20);
        let mut buf = pool.lease();
        fill(&mut buf, round as u64 + 7);
        let expected = buf.as_bytes()[..len].to_vec();
        drop(
            engine
                .submit(Op::write(&file, offset, len, buf))
                .wait()
                .unwrap()
                .into_result()
                .unwrap(),
        );
        let back = engine
            .submit(Op::read(&file, offset, len, later.lease()))
            .wait()
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(&back.as_bytes()[..len], &expected[..], "round {round}");
    }
    assert_eq!(
        (first.available(), later.available()),
        (3, 2),
        "every buffer came back"
    );
}

/// A store's scratch buffers for its long-lived users are its engine's registered ones
/// while one is free, plain ones after, and go back when dropped.
#[test]
fn a_stores_scratch_buffers_are_registered_while_they_last() {
    use crate::nvme::swap::{State, SwapStore, TensorKey, TensorSpec};
    let dir = test_dir();
    let (engine, _) = open_engine(dir.path(), EngineConfig::default(), None, EngineChoice::Uring).unwrap();
    let key = TensorKey {
        unit: 0,
        rank: 0,
        state: State::Param,
    };
    let specs = [TensorSpec {
        key,
        numel: 10_000,
        elem_bytes: 2,
    }];
    let store = SwapStore::create(dir.path(), "params", engine, &specs, 4096).unwrap();
    let bytes = store.chunk_bytes(2);
    let (a, b) = (store.scratch(bytes).unwrap(), store.scratch(bytes).unwrap());
    let spare = [store.scratch(bytes).unwrap(), store.scratch(bytes).unwrap()];
    let c = store.scratch(bytes).unwrap();
    assert!(a.registered_index().is_some() && b.registered_index().is_some());
    assert!(
        spare.iter().all(|s| s.registered_index().is_some()),
        "four: two each for the h2d lane's reads and the writes"
    );
    assert!(c.registered_index().is_none(), "a fifth is a plain buffer");
    let values: Vec<u8> = (0..20_000).map(|i| (i % 251) as u8).collect();
    let a = store.write_tensor(key, &values, a).unwrap();
    let mut back = vec![0u8; 20_000];
    store.read_tensor(key, &mut back, b).unwrap();
    assert_eq!(back, values);
    drop((a, c, spare));
    assert!(
        store.scratch(bytes).unwrap().registered_index().is_some(),
        "back to the store"
    );
}
