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
//! the disk serves the next. A lane's own transfers go one after another. Where lanes
//! meet, the drive serves their queues together, as it does on the machine: a lane
//! reading parameters while the optimizer streams its state shares the disk with it
//! rather than waiting for it (`Disk::take`; in a `llama-1b` run on this VM's disk the
//! parameter reads overlapped the optimizer's transfers most of their time, and every
//! transfer in flight counts its whole time in its phase). A pipelined unit's run reads
//! the next unit's first state once its own reads are submitted and a buffer set is free
//! ([`next_read_ready`]), after its own legs on the disk.
//!
//! The ranks of a process run the same schedule and take the drive in turn, transfer by
//! transfer: a transfer's stretch is all ranks' time for the piece (the shared price).
//! Ranks that submit together (the first transfer of a lane after every rank was through
//! its last) queue one behind another, and the rank's own bytes are in before the turns
//! queued behind them, on average ([`Transfer::others`]). From then on the ranks go a
//! turn apart: each submits its next transfer as the turn before it ends, so a rank's
//! own bytes are in a turn after the disk starts on them, the others' turns following,
//! and its span runs from its submission (measured in a 2-rank run of the 134M config
//! here: rank 1 ran 35 ms behind rank 0 through the forward, each rank's state read took
//! 36–56 ms for 32 ms of its own bytes, and its write after the sweep waited behind the
//! other rank's read). What follows on the rank goes on from then (an update after its
//! read); a collective waits for every rank's ([`Turn::all`], `Clocks::meet`).
//!
//! A sub-group's read waits for a free buffer set (the write `sets` sub-groups back) and,
//! without `pipeline_read`, for the update before it (and, without `pipeline_write`, its
//! write); its update waits for its read, the update before it and, without
//! `pipeline_write`, the write before it; its write for its update. Its reads and writes
//! take the disk in turn (one lane): one transfer at a time, the one ready first (a write on a
//! tie: it frees a buffer set), as a drive's mixed load measured here does within a few
//! per cent (`fio` on this VM's disk, 1 MiB at depth 32: read alone 1.49 GB/s, write
//! alone 4.05; together 1.46 and 0.59, 1.12 of the disk's time in all).

use super::costs::Transfer;
use tierzero_offload::pipeline::PipelineConfig;

/// Transfers a disk's timeline keeps at least (a dry run's three steps of the largest
/// config place well under this); past twice as many the oldest are forgotten, their
/// stretches long past for every track of a run on the simulated device.
const KEPT: usize = 1 << 16;

/// What holds the disk at a time: a transfer of a lane in flight, or the disk's time a
/// transfer that shared it still owes ([`OWED`]).
#[derive(Clone, Copy, Debug)]
struct Held {
    start: f64,
    end: f64,
    lane: usize,
}

/// The lane of the disk's time a transfer that shared it owes: whoever meets it shares
/// the disk with it.
const OWED: usize = usize::MAX;

/// A rank's disk in virtual time: the stretches its time is taken for each transfer's
/// bytes, in order, none overlapping, and when each transfer's data was in flight.
#[derive(Clone, Debug, Default)]
pub struct Disk {
    busy: Vec<(f64, f64)>,
    /// Sorted by start; `longest` is the longest of them.
    held: Vec<Held>,
    longest: f64,
    /// Each lane's last transfer: (lane, when every rank's turn at it was in, when the
    /// rank's own data was).
    through: Vec<(usize, f64, f64)>,
}

impl Disk {
    /// The first stretch of `seconds` from `ready` on that the disk has free and in
    /// which none of `lane`'s own transfers is in flight.
    fn free(&self, ready: f64, seconds: f64, lane: usize) -> f64 {
        let near = self.near(ready);
        let own = |from: f64, to: f64| {
            near.iter()
                .take_while(|h| h.start < to)
                .filter(|h| h.lane == lane && h.end > from)
                .map(|h| h.end)
                .reduce(f64::max)
        };
        let mut start = ready;
        let mut at = self.busy.partition_point(|&(_, end)| end <= ready);
        loop {
            while let Some(&(a, b)) = self.busy.get(at) {
                if start + seconds <= a {
                    break;
                }
                start = start.max(b);
                at += 1;
            }
            match own(start, start + seconds) {
                Some(end) => start = end,
                None => return start,
            }
        }
    }

    /// What holds the disk from `from` on: every holder from the first that can still be
    /// in flight then (one starting the longest hold before it) to the last.
    fn near(&self, from: f64) -> &[Held] {
        &self.held[self.held.partition_point(|h| h.start < from - self.longest)..]
    }

    /// Takes the disk's time from `start` to `end` for a transfer's bytes.
    fn occupy(&mut self, start: f64, end: f64) {
        let at = self.busy.partition_point(|&(a, _)| a < start);
        self.busy.insert(at, (start, end));
        if self.busy.len() > 2 * KEPT {
            self.busy.drain(..KEPT);
        }
    }

    /// Places `transfer` of `lane`, ready at `ready`; returns when its data was in
    /// flight for this rank, its latency included, and when every rank's was. Its bytes
    /// take the disk's first stretch from then on that is free and that none of the
    /// lane's own transfers holds (a lane's go one after another, whole). Where that stretch is later than the data would be in by
    /// sharing the disk with other lanes' transfers, as a drive serves several queues at
    /// once, the data comes in as shared: an equal part of the disk's rate beside each
    /// transfer in flight. Those placed before keep their times (the replay has gone on
    /// from them), and the bytes' own stretch, kept later, is what they would have lost:
    /// whoever meets it shares the disk with it. Over a step the disk moves no more
    /// bytes than its rate allows; while a transfer shares it, more.
    /// The other ranks' turns ([`Transfer::others`]) hold the disk after the rank's own
    /// bytes are in: its data's span ends earlier by their share, the disk stays theirs.
    /// Ready before every rank was through the lane's last transfer, the ranks go a turn
    /// apart: the rank's bytes are in a turn after the disk starts on them, and its span
    /// starts when it was ready (or when the rank's own data of the lane's last transfer
    /// was in), as the engine times it.
    pub fn take(&mut self, ready: f64, transfer: Transfer, lane: usize) -> Turn {
        let seconds = transfer.disk;
        if seconds.is_nan() || seconds <= 0.0 {
            let end = ready + transfer.latency;
            return Turn {
                own: (ready, end),
                all: end,
            };
        }
        debug_assert!(seconds.is_finite(), "a transfer of {seconds} s on the disk");
        let start = self.free(ready, seconds, lane);
        let fifo = (start, start + seconds);
        let data = self.shared(ready, seconds, lane, fifo.1).unwrap_or(fifo);
        self.occupy(fifo.0, fifo.1);
        self.hold(data.0, data.1, lane);
        // the disk's time the bytes took that their data did not span (its data ends
        // no later and spans at least as long: what is owed follows it): owed
        if fifo.1 > data.1 {
            self.hold(fifo.0.max(data.1), fifo.1, OWED);
        }
        // ready before the other ranks were through the lane's last transfer, and taken
        // after their turns (one in a gap before them is not behind them): the ranks go a
        // turn apart, each submitting as the turn before it ends. Its span is the
        // engine's: from its submission, or from when the rank's own data of the lane's
        // last transfer was in, whichever is later.
        let (all, mine) = self.through(lane);
        let staggered = transfer.others > 0.0 && ready < all && data.0 >= all;
        let (start, own) = if staggered {
            (
                ready.max(mine).min(data.0),
                data.0 + (data.1 - data.0) / transfer.ranks(),
            )
        } else {
            (data.0, data.1 - transfer.others * (data.1 - data.0))
        };
        debug_assert!(start <= own, "a span from {start} to {own}");
        self.set_through(lane, data.1, own);
        Turn {
            own: (start, own + transfer.latency),
            all: data.1 + transfer.latency,
        }
    }

    /// When every rank's turn at `lane`'s last transfer was in, and when the rank's own
    /// data was (none yet: never).
    fn through(&self, lane: usize) -> (f64, f64) {
        self.through
            .iter()
            .find(|t| t.0 == lane)
            .map_or((f64::NEG_INFINITY, f64::NEG_INFINITY), |t| (t.1, t.2))
    }

    fn set_through(&mut self, lane: usize, all: f64, own: f64) {
        match self.through.iter_mut().find(|t| t.0 == lane) {
            Some(t) => (t.1, t.2) = (all, own),
            None => self.through.push((lane, all, own)),
        }
    }

    fn hold(&mut self, start: f64, end: f64, lane: usize) {
        if end <= start {
            return;
        }
        let at = self.held.partition_point(|h| h.start <= start);
        self.held.insert(at, Held { start, end, lane });
        self.longest = self.longest.max(end - start);
        // up to two holders a transfer (its data, what it owes): as many transfers as
        // the disk's stretches
        if self.held.len() > 4 * KEPT {
            self.held.drain(..2 * KEPT);
        }
    }

    /// When `seconds` of the disk's time for `lane`, ready at `ready`, would be in,
    /// sharing the disk equally with what holds it, if no later than `until`; a lane's
    /// own transfers are waited for whole.
    fn shared(&self, ready: f64, seconds: f64, lane: usize, until: f64) -> Option<(f64, f64)> {
        let near = self.near(ready);
        let near = &near[..near.partition_point(|h| h.start < until)];
        if !near.iter().any(|h| h.lane != lane && h.end > ready) {
            return None;
        }
        let mut from = ready;
        'start: while from < until {
            // what holds the disk at `from`, and when that changes: (time, +1 or −1,
            // the lane's own, its end)
            let (mut others, mut own) = (0, None);
            let mut changes = Vec::new();
            for h in near.iter().filter(|h| h.end > from) {
                let mine = h.lane == lane;
                if h.start > from {
                    changes.push((h.start, 1, mine, h.end));
                } else if mine {
                    own = Some(h.end);
                } else {
                    others += 1;
                }
                if !mine {
                    changes.push((h.end, -1, false, h.end));
                }
            }
            changes.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (mut at, mut left) = (from, seconds);
            for (time, change, mine, end) in changes.into_iter().chain([(until, 0, false, until)]) {
                if let Some(end) = own {
                    from = end;
                    continue 'start;
                }
                let share = 1.0 / f64::from(1 + others);
                let next = time.min(until);
                if (next - at) * share >= left {
                    return Some((from, (at + left / share).min(until)));
                }
                left -= (next - at) * share;
                at = next;
                if mine {
                    own = Some(end);
                } else {
                    others += change;
                }
                if at >= until {
                    break;
                }
            }
            return None;
        }
        None
    }
}

/// When a transfer's bytes were in flight for its rank (from its start to when they
/// were in, latency included), and when every rank's turn at the disk for the same
/// piece was in: what a collective after it waits for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Turn {
    pub own: (f64, f64),
    pub all: f64,
}

/// The seconds of one sub-group's legs on the profiled machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Legs {
    pub read: Transfer,
    /// The sweep's price with the ranks' sweeps sharing the cores.
    pub update: f64,
    pub write: Transfer,
}

impl Legs {
    /// The sweep's time where the ranks take the disk in turn. Its price shares the
    /// cores among n ranks sweeping at once; after a read taken in turn each rank's sweep
    /// starts a rank's turn at the disk after the one before it, and meets the others'
    /// only for what outlasts that: the shared price less n − 1 turns, at least its time
    /// alone. Measured: in a traced 2-rank run of the 134M config here the ranks' 64
    /// sweeps overlapped 0.000 s of 0.59 s, their reads 2.4 s of 4.1.
    pub fn update_in_turn(&self) -> f64 {
        // (n − 1)/n of n ranks, from the share the other ranks' turns take
        let others = 2.0 * self.write.others;
        (self.update - others * self.read.disk).max((1.0 - others) * self.update)
    }
}

/// When one sub-group's legs ran: (start, end) of its read, update and write, and when
/// every rank's turn at the disk for its read and for its write was in.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timed {
    pub read: (f64, f64),
    pub update: (f64, f64),
    pub write: (f64, f64),
    pub read_all: f64,
    pub write_all: f64,
}

impl Timed {
    /// Its read's turn at the disk.
    pub fn read_turn(&self) -> Turn {
        Turn {
            own: self.read,
            all: self.read_all,
        }
    }

    /// Its write's turn at the disk.
    pub fn write_turn(&self) -> Turn {
        Turn {
            own: self.write,
            all: self.write_all,
        }
    }
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
    (disk, lane): (&mut Disk, usize),
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
            timed[i].update = (ready, ready + legs[i].update_in_turn());
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
            let turn = disk.take(after, legs[writes].write, lane);
            (timed[writes].write, timed[writes].write_all) = (turn.own, turn.all);
            writes += 1;
        } else {
            let after = reads.checked_sub(1).map_or(ready, |j| ready.max(timed[j].read.0));
            let turn = disk.take(after, legs[reads].read, lane);
            (timed[reads].read, timed[reads].read_all) = (turn.own, turn.all);
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
            others: 0.0,
        },
        update: 1.0,
        write: Transfer {
            disk: 2.0,
            latency: 0.0,
            others: 0.0,
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
            let t = schedule(10.0, &[LEG; 6], how, (&mut Disk::default(), 0), &[]);
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
        let mut place = |ready, disk_s| {
            disk.take(
                ready,
                Transfer {
                    disk: disk_s,
                    latency: 0.0,
                    others: 0.0,
                },
                0,
            )
            .own
        };
        assert_eq!(place(0.0, 2.0), (0.0, 2.0));
        assert_eq!(place(5.0, 1.0), (5.0, 6.0));
        // ready before the first ends: after it, in the gap that holds it
        assert_eq!(place(1.0, 2.0), (2.0, 4.0));
        // the gap left (4 to 5) is too short: after the last
        assert_eq!(place(3.0, 1.5), (6.0, 7.5));
        assert_eq!(place(4.0, 1.0), (4.0, 5.0));
        // no time for nothing
        assert_eq!(place(1.5, 0.0), (1.5, 1.5));
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
        let t = schedule(0.0, &[LEG; 3], how, (&mut Disk::default(), 0), &[]);
        let expect = |i: f64| Timed {
            read: (6.0 * i, 6.0 * i + 3.0),
            update: (6.0 * i + 3.0, 6.0 * i + 4.0),
            write: (6.0 * i + 4.0, 6.0 * i + 6.0),
            read_all: 6.0 * i + 3.0,
            write_all: 6.0 * i + 6.0,
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
        let t = schedule(0.0, &[LEG; 4], how, (&mut Disk::default(), 0), &[]);
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
            others: 0.0,
        };
        assert_eq!(disk.take(0.0, t, 0).own, (0.0, 3.0));
        // the next starts once the disk is free, before the first's latency is over
        assert_eq!(disk.take(0.0, t, 0).own, (2.0, 5.0));
    }

    #[test]
    fn a_ranks_bytes_are_in_before_the_turns_queued_behind_them() {
        // two ranks' reads of 2 s each, first come first served: the disk's 4 s hold
        // both, a rank's own are in after 3 s on average, every rank's after 4
        let mut disk = Disk::default();
        let t = Transfer {
            disk: 4.0,
            latency: 0.5,
            others: 0.25,
        };
        let first = disk.take(1.0, t, 0);
        assert_eq!(
            first,
            Turn {
                own: (1.0, 4.5),
                all: 5.5
            }
        );
        // the rank's next transfer, ready before the others' turns are through, waits
        // for them on the disk; from then on the ranks go a turn apart, each submitting
        // as the turn before it ends: its own bytes are in after its turn alone, its span
        // from when it was submitted
        let next = disk.take(first.own.1, t, 0);
        assert_eq!(
            next,
            Turn {
                own: (4.5, 7.5),
                all: 9.5
            }
        );
        // one ready once every rank's turn is through starts them together again
        let again = disk.take(10.0, t, 0);
        assert_eq!(again.own, (10.0, 13.5));
        // an update between reads starts once its own bytes are in
        let how = PipelineConfig {
            sets: 2,
            pipeline_read: true,
            pipeline_write: true,
        };
        let legs = [Legs {
            read: t,
            update: 1.0,
            write: Transfer { latency: 0.0, ..t },
        }];
        let timed = schedule(0.0, &legs, how, (&mut Disk::default(), 0), &[]);
        assert_eq!(timed[0].read, (0.0, 3.5));
        // the sweep alone, the other rank's a turn later (`Legs::update_in_turn`)
        assert_eq!(timed[0].update, (3.5, 4.0));
        assert_eq!(timed[0].write, (4.0, 7.0));
        assert_eq!((timed[0].read_all, timed[0].write_all), (4.5, 8.0));
        // a shorter sweep: its write is ready while the other rank's read turn is on
        // the disk, and goes a turn ahead of the other's write
        let legs = [Legs {
            update: 0.5,
            ..legs[0]
        }];
        let timed = schedule(0.0, &legs, how, (&mut Disk::default(), 0), &[]);
        assert_eq!(timed[0].update, (3.5, 3.75));
        assert_eq!(timed[0].write, (3.75, 6.0));
        assert_eq!(timed[0].write_all, 8.0);
    }

    #[test]
    fn a_read_ahead_in_a_gap_before_the_others_turns_is_not_behind_them() {
        // a long sweep leaves the disk idle before the write: the next run's read, ahead
        // from the last read's start, takes that gap, before the other rank's write turn
        let turn = |disk| Transfer {
            disk,
            latency: 0.0,
            others: 0.25,
        };
        let how = PipelineConfig {
            sets: 2,
            pipeline_read: true,
            pipeline_write: true,
        };
        let legs = [Legs {
            read: turn(3.0),
            update: 8.0,
            write: turn(2.0),
        }];
        let mut disk = Disk::default();
        let timed = schedule(0.0, &legs, how, (&mut disk, 0), &[]);
        let ahead = disk.take(next_read_ready(0.0, &timed, how), turn(2.0), 0);
        assert!(
            ahead.own.0 <= ahead.own.1 && ahead.own.1 <= ahead.all,
            "{ahead:?}"
        );
    }

    #[test]
    fn a_sweep_after_a_read_in_turn_meets_the_other_ranks_sweeps_only_past_their_turns() {
        // two ranks: a 4 s read (a 2 s turn each), a 2 s sweep shared (1 s alone)
        let turn = |disk| Transfer {
            disk,
            latency: 0.0,
            others: 0.25,
        };
        let legs = |read, update| Legs {
            read: turn(read),
            update,
            write: turn(1.0),
        };
        assert_eq!(legs(4.0, 2.0).update_in_turn(), 1.0);
        // a sweep longer than a turn meets the other's for the rest
        assert_eq!(legs(1.0, 2.0).update_in_turn(), 1.5);
        // one rank: its price
        let alone = Legs {
            read: LEG.read,
            update: 2.0,
            write: LEG.write,
        };
        assert_eq!(alone.update_in_turn(), 2.0);
    }

    #[test]
    fn a_transfer_meeting_another_lanes_shares_the_disk_with_them() {
        let mut disk = Disk::default();
        let t = |disk| Transfer {
            disk,
            ..Transfer::default()
        };
        assert_eq!(disk.take(0.0, t(10.0), 0).own, (0.0, 10.0));
        // lane 1's second of bytes at half the disk's rate beside lane 0's transfer,
        // not after it; lane 0's keeps its time
        assert_eq!(disk.take(2.0, t(1.0), 1).own, (2.0, 4.0));
        // lane 0's own transfers go one after another, whole: the next after the first
        let (start, end) = disk.take(2.0, t(2.0), 0).own;
        assert_eq!(start, 10.0);
        // the second lane 1 took beside the first is owed from then: shared
        assert_eq!(end, 12.5);
        // beside two other lanes' transfers: a third of the disk's rate
        let mut disk = Disk::default();
        disk.take(0.0, t(10.0), 0);
        disk.take(0.0, t(10.0), 1);
        assert_eq!(disk.take(1.0, t(1.0), 2).own, (1.0, 4.0));
    }

    #[test]
    fn a_shared_disk_moves_no_more_than_its_rate_and_no_transfer_waits_longer_for_it() {
        // transfers of three lanes at odd times: each one's data is in no later than the
        // disk's first free stretch for its bytes (and its lane) would have it, and the
        // disk's time taken is the bytes' own
        let mut disk = Disk::default();
        let mut work = 0.0;
        for i in 0..60 {
            let ready = f64::from(i * 7 % 23) * 0.37 + f64::from(i) * 0.1;
            let seconds = 0.2 + f64::from(i * 5 % 11) * 0.13;
            let lane = (i % 3) as usize;
            let alone = disk.free(ready, seconds, lane) + seconds;
            let (start, end) = disk
                .take(
                    ready,
                    Transfer {
                        disk: seconds,
                        latency: 0.0,
                        others: 0.0,
                    },
                    lane,
                )
                .own;
            assert!(start >= ready && end <= alone, "{i}: {start} {end} {alone}");
            work += seconds;
        }
        let taken: f64 = disk.busy.iter().map(|(a, b)| b - a).sum();
        assert!((taken - work).abs() < 1e-9, "{taken} {work}");
        assert!(disk.busy.windows(2).all(|w| w[0].1 <= w[1].0));
        // a lane's data is in flight one transfer at a time
        for lane in 0..3 {
            let mut own: Vec<_> = disk.held.iter().filter(|h| h.lane == lane).collect();
            own.sort_by(|a, b| a.start.total_cmp(&b.start));
            assert!(
                own.windows(2).all(|w| w[0].end <= w[1].start + 1e-9),
                "lane {lane}"
            );
        }
    }

    #[test]
    fn the_next_runs_state_is_read_once_a_buffer_set_is_free() {
        let how = PipelineConfig {
            sets: 2,
            pipeline_read: true,
            pipeline_write: true,
        };
        let t = schedule(1.0, &[LEG; 3], how, (&mut Disk::default(), 0), &[]);
        // after the last read was submitted, once the second sub-group's write freed its set
        assert_eq!(next_read_ready(1.0, &t, how), t[2].read.0.max(t[1].write.1));
        // one sub-group of two sets: from the run's start
        let one = schedule(1.0, &[LEG], how, (&mut Disk::default(), 0), &[]);
        assert_eq!(next_read_ready(1.0, &one, how), 1.0);
    }
}
