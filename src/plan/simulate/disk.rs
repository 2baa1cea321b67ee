//! The NVMe optimizer pipeline of one unit in virtual time, on one disk
//! (`offload/src/pipeline.rs`): the simulated device's optimizer thread
//! (`engine/optimize.rs`) and the dry-run replay (`step/optimizer.rs`) both time a unit's
//! sub-groups with [`schedule`].
//!
//! A sub-group's read waits for a free buffer set (the write `sets` sub-groups back) and,
//! without `pipeline_read`, for the update before it (and, without `pipeline_write`, its
//! write); its update waits for its read, the update before it and, without
//! `pipeline_write`, the write before it; its write for its update. Reads and writes
//! share the disk: it serves one transfer at a time, the one ready first (a write on a
//! tie: it frees a buffer set), as a drive's mixed load measured here does within a few
//! per cent (`fio` on this VM's disk, 1 MiB at depth 32: read alone 1.49 GB/s, write
//! alone 4.05; together 1.46 and 0.59, 1.12 of the disk's time in all).

use tierzero_offload::pipeline::PipelineConfig;

/// The seconds of one sub-group's legs on the profiled machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Legs {
    pub read: f64,
    pub update: f64,
    pub write: f64,
}

/// When one sub-group's legs ran: (start, end) of its read, update and write.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timed {
    pub read: (f64, f64),
    pub update: (f64, f64),
    pub write: (f64, f64),
}

/// The end of leg `i − back` of a kind whose first `done` legs are timed (`start` before
/// the first sub-group; None while that leg is not timed yet).
fn ended(
    timed: &[Timed],
    done: usize,
    i: usize,
    back: usize,
    leg: fn(&Timed) -> (f64, f64),
    start: f64,
) -> Option<f64> {
    match i.checked_sub(back) {
        None => Some(start),
        Some(j) => (j < done).then(|| leg(&timed[j]).1),
    }
}

/// Times every sub-group's legs from `start`, one disk serving the reads and writes.
pub fn schedule(start: f64, legs: &[Legs], how: PipelineConfig) -> Vec<Timed> {
    let n = legs.len();
    let sets = how.sets.max(1);
    let mut timed = vec![Timed::default(); n];
    let (mut reads, mut updates, mut writes) = (0, 0, 0);
    let mut disk = start;
    while writes < n {
        // every update whose legs are in: it runs on the CPU, beside the disk
        while updates < reads {
            let i = updates;
            let mut ready = timed[i].read.1;
            if let Some(j) = i.checked_sub(1) {
                ready = ready.max(timed[j].update.1);
            }
            if !how.pipeline_write {
                match ended(&timed, writes, i, 1, |t| t.write, start) {
                    Some(w) => ready = ready.max(w),
                    None => break,
                }
            }
            timed[i].update = (ready, ready + legs[i].update);
            updates += 1;
        }
        let read_ready = (reads < n)
            .then(|| {
                let i = reads;
                let mut ready = ended(&timed, writes, i, sets, |t| t.write, start)?;
                if !how.pipeline_read {
                    ready = ready.max(ended(&timed, updates, i, 1, |t| t.update, start)?);
                    if !how.pipeline_write {
                        ready = ready.max(ended(&timed, writes, i, 1, |t| t.write, start)?);
                    }
                }
                Some(ready)
            })
            .flatten();
        let write_ready = (writes < updates).then(|| timed[writes].update.1);
        let (write, ready) = match (read_ready, write_ready) {
            (Some(r), Some(w)) if r < w => (false, r),
            (_, Some(w)) => (true, w),
            (Some(r), None) => (false, r),
            (None, None) => {
                debug_assert!(false, "an NVMe pipeline whose next leg waits for nothing timed");
                break;
            }
        };
        let begin = ready.max(disk);
        if write {
            disk = begin + legs[writes].write;
            timed[writes].write = (begin, disk);
            writes += 1;
        } else {
            disk = begin + legs[reads].read;
            timed[reads].read = (begin, disk);
            reads += 1;
        }
    }
    timed
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEG: Legs = Legs {
        read: 3.0,
        update: 1.0,
        write: 2.0,
    };

    fn overlap(a: (f64, f64), b: (f64, f64)) -> bool {
        a.0 < b.1 && b.0 < a.1
    }

    #[test]
    fn one_disk_serves_the_reads_and_writes_one_at_a_time() {
        for how in [
            PipelineConfig {
                sets: 1,
                pipeline_read: false,
                pipeline_write: false,
            },
            PipelineConfig {
                sets: 2,
                pipeline_read: true,
                pipeline_write: true,
            },
            PipelineConfig {
                sets: 4,
                pipeline_read: true,
                pipeline_write: false,
            },
            PipelineConfig {
                sets: 3,
                pipeline_read: false,
                pipeline_write: true,
            },
        ] {
            let t = schedule(10.0, &[LEG; 6], how);
            let disk: Vec<_> = t.iter().flat_map(|t| [t.read, t.write]).collect();
            for (i, a) in disk.iter().enumerate() {
                assert!(a.0 >= 10.0);
                for b in &disk[i + 1..] {
                    assert!(!overlap(*a, *b), "{how:?}: {a:?} and {b:?} on one disk");
                }
            }
            for (i, s) in t.iter().enumerate() {
                assert!(
                    s.update.0 >= s.read.1 && s.write.0 >= s.update.1,
                    "{how:?} {i}: {s:?}"
                );
                if i >= how.sets {
                    assert!(
                        s.read.0 >= t[i - how.sets].write.1,
                        "{how:?} {i}: a free buffer set"
                    );
                }
            }
            // no faster than the disk's own 6 × (3 + 2) seconds
            let last = t.last().map(|s| s.write.1).unwrap_or(0.0);
            assert!(last >= 10.0 + 30.0, "{how:?}: {last}");
        }
    }

    #[test]
    fn without_pipelining_each_sub_group_runs_read_update_write_in_turn() {
        let how = PipelineConfig {
            sets: 1,
            pipeline_read: false,
            pipeline_write: false,
        };
        let t = schedule(0.0, &[LEG; 3], how);
        let expect = |i: f64| Timed {
            read: (6.0 * i, 6.0 * i + 3.0),
            update: (6.0 * i + 3.0, 6.0 * i + 4.0),
            write: (6.0 * i + 4.0, 6.0 * i + 6.0),
        };
        assert_eq!(t, vec![expect(0.0), expect(1.0), expect(2.0)]);
    }

    #[test]
    fn pipelined_reads_run_ahead_and_updates_hide_behind_the_disk() {
        let how = PipelineConfig {
            sets: 2,
            pipeline_read: true,
            pipeline_write: true,
        };
        let t = schedule(0.0, &[LEG; 4], how);
        // read 0, read 1 (a second set), then write 0 (read 2 waits for its set), then
        // write 1 (ready at 7, before read 2 at 8)
        assert_eq!(t[0].read, (0.0, 3.0));
        assert_eq!(t[1].read, (3.0, 6.0));
        assert_eq!(t[0].write, (6.0, 8.0));
        assert_eq!(t[1].write, (8.0, 10.0));
        assert_eq!(t[2].read, (10.0, 13.0));
        // the disk busy throughout: 4 × 5 seconds
        assert_eq!(t[3].write.1, 20.0);
    }
}
