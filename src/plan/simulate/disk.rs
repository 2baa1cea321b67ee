//! The disk in virtual time, and the NVMe optimizer pipeline of one unit on it
//! (`offload/src/pipeline.rs`): the simulated device's optimizer thread
//! (`engine/optimize.rs`) and the dry-run replay (`step/optimizer.rs`) both time a unit's
//! sub-groups with [`schedule`].
//!
//! A rank's share of the disk is one [`Disk`]: every NVMe transfer of the rank — the
//! pipeline's legs, the h2d lane's parameter reads, the reduce lane's gradient chunks,
//! the new parameters written back — takes the first stretch of the disk's time, from
//! when it is ready, that no other transfer holds, for its bytes; its latency (the
//! profile's `nvme.latency`: the way back through the store's threads) follows while
//! the disk serves the next. A lane reading parameters while the optimizer streams its
//! state waits for the disk as on the machine. A pipelined unit's run reads the next
//! unit's first state once its own reads are submitted and a buffer set is free
//! ([`next_read_ready`]), after its own legs on the disk.
//!
//! A sub-group's read waits for a free buffer set (the write `sets` sub-groups back) and,
//! without `pipeline_read`, for the update before it (and, without `pipeline_write`, its
//! write); its update waits for its read, the update before it and, without
//! `pipeline_write`, the write before it; its write for its update. Reads and writes
//! share the disk: it serves one transfer at a time, the one ready first (a write on a
//! tie: it frees a buffer set), as a drive's mixed load measured here does within a few
//! per cent (`fio` on this VM's disk, 1 MiB at depth 32: read alone 1.49 GB/s, write
//! alone 4.05; together 1.46 and 0.59, 1.12 of the disk's time in all).

use super::costs::Transfer;
use tierzero_offload::pipeline::PipelineConfig;

/// Transfers a disk's timeline keeps at least (a dry run's three steps of the largest
/// config place well under this); past twice as many the oldest are forgotten, their
/// stretches long past for every track of a run on the simulated device.
const KEPT: usize = 1 << 16;

/// The stretches of virtual time a rank's disk is busy, in order, none overlapping.
#[derive(Clone, Debug, Default)]
pub struct Disk {
    busy: Vec<(f64, f64)>,
}

impl Disk {
    /// Places a transfer of `seconds` that is ready at `ready` in the first stretch from
    /// then on that the disk has free; returns its (start, end).
    pub fn place(&mut self, ready: f64, seconds: f64) -> (f64, f64) {
        if seconds <= 0.0 {
            return (ready, ready);
        }
        let mut start = ready;
        let mut at = self.busy.partition_point(|&(_, end)| end <= ready);
        while let Some(&(a, b)) = self.busy.get(at) {
            if start + seconds <= a {
                break;
            }
            start = start.max(b);
            at += 1;
        }
        let end = start + seconds;
        self.busy.insert(at, (start, end));
        if self.busy.len() > 2 * KEPT {
            self.busy.drain(..KEPT);
        }
        (start, end)
    }

    /// Places `transfer`, ready at `ready`: the disk is busy for its bytes alone, in
    /// the first free stretch from then on; the transfer ends its latency later.
    pub fn take(&mut self, ready: f64, transfer: Transfer) -> (f64, f64) {
        let (start, end) = self.place(ready, transfer.disk);
        (start, end + transfer.latency)
    }
}

/// The seconds of one sub-group's legs on the profiled machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Legs {
    pub read: Transfer,
    pub update: f64,
    pub write: Transfer,
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

/// Times every sub-group's legs from `start`, the rank's `disk` serving the reads and
/// writes. `ahead`: when the first sub-groups' state, read ahead, was in, one entry a
/// sub-group from the first (each one's update waits for that too; its `read` leg is
/// then its gradient's alone).
pub fn schedule(
    start: f64,
    legs: &[Legs],
    how: PipelineConfig,
    disk: &mut Disk,
    ahead: &[f64],
) -> Vec<Timed> {
    let n = legs.len();
    let sets = how.sets.max(1);
    let mut timed = vec![Timed::default(); n];
    let (mut reads, mut updates, mut writes) = (0, 0, 0);
    while writes < n {
        // every update whose legs are in: it runs on the CPU, beside the disk
        while updates < reads {
            let i = updates;
            let mut ready = timed[i].read.1;
            if let Some(j) = i.checked_sub(1) {
                ready = ready.max(timed[j].update.1);
            }
            if let Some(&at) = ahead.get(i) {
                ready = ready.max(at);
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
        // each kind of leg in sub-group order: a leg starts no earlier than the one
        // before it of its kind, even where a shared disk has a gap that only it fits
        if write {
            let after = writes
                .checked_sub(1)
                .map_or(ready, |j| ready.max(timed[j].write.0));
            timed[writes].write = disk.take(after, legs[writes].write);
            writes += 1;
        } else {
            let after = reads.checked_sub(1).map_or(ready, |j| ready.max(timed[j].read.0));
            timed[reads].read = disk.take(after, legs[reads].read);
            reads += 1;
        }
    }
    timed
}

/// When the reads of the sub-group after the `timed` ones (the next run's first, read
/// ahead) could be submitted, their run having started at `start`: after the last of
/// their reads was and once a buffer set is free (the write `sets` sub-groups back).
pub fn next_read_ready(start: f64, timed: &[Timed], how: PipelineConfig) -> f64 {
    let n = timed.len();
    let submitted = timed.last().map_or(start, |t| t.read.0);
    let set_free = n.checked_sub(how.sets.max(1)).map_or(start, |j| timed[j].write.1);
    submitted.max(set_free)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEG: Legs = Legs {
        read: Transfer {
            disk: 3.0,
            latency: 0.0,
        },
        update: 1.0,
        write: Transfer {
            disk: 2.0,
            latency: 0.0,
        },
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
            let t = schedule(10.0, &[LEG; 6], how, &mut Disk::default(), &[]);
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
    fn a_transfer_takes_the_first_free_stretch_of_the_disk_from_when_it_is_ready() {
        let mut disk = Disk::default();
        assert_eq!(disk.place(0.0, 2.0), (0.0, 2.0));
        assert_eq!(disk.place(5.0, 1.0), (5.0, 6.0));
        // ready before the first ends: after it, in the gap that holds it
        assert_eq!(disk.place(1.0, 2.0), (2.0, 4.0));
        // the gap left (4 to 5) is too short: after the last
        assert_eq!(disk.place(3.0, 1.5), (6.0, 7.5));
        assert_eq!(disk.place(4.0, 1.0), (4.0, 5.0));
        // no time for nothing
        assert_eq!(disk.place(1.5, 0.0), (1.5, 1.5));
        // nothing overlaps
        let mut spans = disk.busy.clone();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
    }

    #[test]
    fn without_pipelining_each_sub_group_runs_read_update_write_in_turn() {
        let how = PipelineConfig {
            sets: 1,
            pipeline_read: false,
            pipeline_write: false,
        };
        let t = schedule(0.0, &[LEG; 3], how, &mut Disk::default(), &[]);
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
        let t = schedule(0.0, &[LEG; 4], how, &mut Disk::default(), &[]);
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

    #[test]
    fn a_transfer_holds_the_disk_for_its_bytes_alone() {
        let mut disk = Disk::default();
        let t = Transfer {
            disk: 2.0,
            latency: 1.0,
        };
        assert_eq!(disk.take(0.0, t), (0.0, 3.0));
        // the next starts once the disk is free, before the first's latency is over
        assert_eq!(disk.take(0.0, t), (2.0, 5.0));
    }

    #[test]
    fn the_next_runs_state_is_read_once_a_buffer_set_is_free() {
        let how = PipelineConfig {
            sets: 2,
            pipeline_read: true,
            pipeline_write: true,
        };
        let t = schedule(1.0, &[LEG; 3], how, &mut Disk::default(), &[]);
        // after the last read was submitted, once the second sub-group's write freed its set
        assert_eq!(next_read_ready(1.0, &t, how), t[2].read.0.max(t[1].write.1));
        // one sub-group of two sets: from the run's start
        let one = schedule(1.0, &[LEG], how, &mut Disk::default(), &[]);
        assert_eq!(next_read_ready(1.0, &one, how), 1.0);
    }
}
