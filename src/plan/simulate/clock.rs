//! Virtual clocks: the simulated device's streams and the issuing thread.
//!
//! Each track (the compute stream, every lane's stream, the CPU optimizer's thread, the
//! issuing host thread) has a time of its own, in seconds since the step began. Work
//! queued on a track starts at that time and moves it on by the work's cost; a wait
//! moves a track to the later of its own time and a [`Mark`]'s (`cudaStreamWaitEvent`),
//! and records the wait so the report can say which lane compute waited for. Nothing
//! runs: the clocks only add up what the schedule asks of each track, as a stream would
//! run it (in order, one piece at a time).

use super::costs::Transfer;
use super::disk::{Disk, Turn};
use serde::Serialize;

/// A track of the simulated machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Track {
    /// The device's compute stream, and the thread that issues the step's work, as one:
    /// the thread queues a unit and goes on (its own work is small beside the unit's
    /// kernels), and where it waits on the host the stream is taken to wait too, so
    /// the track is the later of the two (an upper bound where the thread runs ahead).
    Compute,
    /// Host → device copies of parameters.
    H2d,
    /// The collectives lane: all-gathers and reduce-scatters in schedule order.
    Collectives,
    /// Device → host copies of gradients.
    D2h,
    /// Host-side gradient accumulation.
    HostReduce,
    /// NVMe reads and writes.
    Nvme,
    /// The CPU optimizer.
    Optimizer,
}

impl Track {
    pub const ALL: [Track; 7] = [
        Track::Compute,
        Track::H2d,
        Track::Collectives,
        Track::D2h,
        Track::HostReduce,
        Track::Nvme,
        Track::Optimizer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Track::Compute => "compute",
            Track::H2d => "h2d",
            Track::Collectives => "collectives",
            Track::D2h => "d2h",
            Track::HostReduce => "host_reduce",
            Track::Nvme => "nvme",
            Track::Optimizer => "optimizer",
        }
    }

    pub(super) fn index(self) -> usize {
        Track::ALL.iter().position(|&t| t == self).unwrap_or(0)
    }
}

/// A point on a track's clock: done once the track has run what was queued before it;
/// `peers`, when every rank has done the same (the other ranks' turns at the disk after
/// this rank's transfers: [`Transfer::others`]), which a collective waits for.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct Mark {
    pub at: f64,
    pub track: Track,
    pub peers: f64,
}

impl Mark {
    /// A point at `at` of `track` that every rank reaches then too.
    pub fn at(at: f64, track: Track) -> Mark {
        Mark { at, track, peers: at }
    }
}

/// A piece of work or a wait on a track, in virtual seconds.
#[derive(Clone, Debug, Serialize)]
pub struct Span {
    pub track: Track,
    pub what: &'static str,
    pub unit: Option<usize>,
    pub start: f64,
    pub end: f64,
    /// An NVMe transfer's: when every rank's turn at the disk for it was in (the disk's
    /// own work for the rank's bytes falls anywhere up to then); other work's `end`.
    pub all: f64,
    pub bytes: u64,
    /// The track this span waited for (None: work).
    pub waited_for: Option<Track>,
    /// Work the track does not wait for ([`Clocks::beside`]: reads submitted ahead).
    pub ahead: bool,
}

/// Every track's clock and what was queued on it, and the rank's disk.
#[derive(Clone, Debug)]
pub struct Clocks {
    now: [f64; 7],
    /// Per track, when every rank has done what the track's work so far waited for.
    peers: [f64; 7],
    spans: Vec<Span>,
    /// The disk every track's NVMe transfers share, each track's one at a time
    /// (`disk::Disk`, the track its lane); or,
    /// as the simulated device times them, one per track (see [`Clocks::disk_per_track`]).
    disks: Vec<Disk>,
}

impl Default for Clocks {
    fn default() -> Clocks {
        Clocks {
            now: [0.0; 7],
            peers: [0.0; 7],
            spans: Vec::new(),
            disks: vec![Disk::default()],
        }
    }
}

impl Clocks {
    /// Clocks whose tracks each have a disk of their own, as the simulated device's
    /// streams do: its threads place their transfers in the order they run, and a disk
    /// they shared would make the virtual times depend on that order, so only the dry
    /// run shares one (a track's own transfers still go one at a time).
    pub fn disk_per_track() -> Clocks {
        Clocks {
            disks: vec![Disk::default(); Track::ALL.len()],
            ..Clocks::default()
        }
    }

    /// The disk `track`'s NVMe transfers take their time on.
    pub fn disk(&mut self, track: Track) -> &mut Disk {
        let i = if self.disks.len() == 1 { 0 } else { track.index() };
        &mut self.disks[i]
    }

    pub fn now(&self, track: Track) -> f64 {
        self.now[track.index()]
    }

    /// A mark of what is queued on `track` so far.
    pub fn mark(&self, track: Track) -> Mark {
        Mark {
            at: self.now(track),
            track,
            peers: self.peers[track.index()],
        }
    }

    /// Queues `seconds` of work on `track`; returns the mark of its end.
    pub fn run(
        &mut self,
        track: Track,
        what: &'static str,
        unit: Option<usize>,
        seconds: f64,
        bytes: u64,
    ) -> Mark {
        let start = self.now(track);
        self.place(track, (what, unit), (start, start + seconds.max(0.0)), bytes)
    }

    /// Queues an NVMe transfer on `track`: it starts once the track has run what was
    /// queued before it, sharing the disk with other tracks' transfers (`Disk::take`);
    /// the track goes on once the rank's own bytes are in, its collectives once every
    /// rank's are.
    pub fn run_on_disk(
        &mut self,
        track: Track,
        (what, unit): (&'static str, Option<usize>),
        transfer: Transfer,
        bytes: u64,
    ) -> Mark {
        let ready = self.now(track);
        let turn = self.disk(track).take(ready, transfer, track.index());
        self.place_turn(track, (what, unit), turn, bytes)
    }

    /// Queues an NVMe transfer on `track` in `pieces`, one after another, each taking its
    /// turn on the disk beside other tracks' transfers, where the ranks take their turns
    /// at the transfer whole: the rank's bytes are in the other ranks' share of all the
    /// pieces' disk time before the last piece is.
    pub fn run_pieces_on_disk(
        &mut self,
        track: Track,
        what: (&'static str, Option<usize>),
        pieces: &[Transfer],
        bytes: u64,
    ) -> Mark {
        let (mut start, mut ready) = (None, self.now(track));
        let (mut disk, mut others) = (0.0, 0.0);
        for piece in pieces {
            let whole = Transfer {
                others: 0.0,
                ..*piece
            };
            let turn = self.disk(track).take(ready, whole, track.index());
            start.get_or_insert(turn.own.0);
            ready = turn.all;
            disk += piece.disk;
            others = piece.others;
        }
        let start = start.unwrap_or(ready);
        let own = (ready - others * disk).max(start);
        self.place_turn(
            track,
            what,
            Turn {
                own: (start, own),
                all: ready,
            },
            bytes,
        )
    }

    /// An NVMe transfer of `track`'s placed on a disk: the track busy for the rank's own
    /// span, its collectives after every rank's turn.
    pub fn place_turn(
        &mut self,
        track: Track,
        what: (&'static str, Option<usize>),
        turn: Turn,
        bytes: u64,
    ) -> Mark {
        self.after_peers(track, turn.all);
        self.push(track, what, turn, bytes, false)
    }

    /// Queues a collective of `seconds` on `track`: it starts once the track has run what
    /// was queued before it and every rank has reached it too. A rank ahead waits inside
    /// the collective for the others' turns at the disk: a wait (for the NVMe track), as
    /// the engine records a collective's wait for its peers (`comm::record_collective`).
    pub fn meet(
        &mut self,
        track: Track,
        (what, unit): (&'static str, Option<usize>),
        seconds: f64,
        bytes: u64,
    ) -> Mark {
        let peers = Mark::at(self.peers[track.index()], Track::Nvme);
        self.wait(track, peers);
        self.run(track, what, unit, seconds, bytes)
    }

    /// Later collectives on `track` end no earlier than every rank's work up to `at`
    /// (transfers placed on a disk outside [`Clocks::run_on_disk`]).
    pub fn after_peers(&mut self, track: Track, at: f64) {
        let i = track.index();
        self.peers[i] = self.peers[i].max(at);
    }

    /// Work on `track` from `start` to `end` beside the track's own order (a pipeline of
    /// the track's thread running on others); the track is busy until `end`.
    pub fn place(
        &mut self,
        track: Track,
        what: (&'static str, Option<usize>),
        span: (f64, f64),
        bytes: u64,
    ) -> Mark {
        let turn = Turn {
            own: span,
            all: span.1,
        };
        self.push(track, what, turn, bytes, false)
    }

    /// [`Clocks::place`], the span marked as work the track does not wait for or not.
    fn push(
        &mut self,
        track: Track,
        (what, unit): (&'static str, Option<usize>),
        Turn {
            own: (start, end),
            all,
        }: Turn,
        bytes: u64,
        ahead: bool,
    ) -> Mark {
        let i = track.index();
        self.now[i] = self.now[i].max(end);
        // work that takes no time still counts its bytes (a CPU device's copy out, read
        // in place)
        if end > start || bytes > 0 {
            self.spans.push(Span {
                track,
                what,
                unit,
                start,
                end,
                all: all.max(end),
                bytes,
                waited_for: None,
                ahead,
            });
        }
        Mark {
            at: end,
            track,
            peers: self.peers[i],
        }
    }

    /// Work of `track`'s from `start` to `end` that the track does not wait for (reads
    /// a pipeline submits for the track's next run): counted, the track's clock unmoved.
    pub fn beside(&mut self, track: Track, what: (&'static str, Option<usize>), turn: Turn, bytes: u64) {
        let now = self.now(track);
        self.push(track, what, turn, bytes, true);
        self.now[track.index()] = now;
    }

    /// Later work on `track` starts no earlier than `mark`.
    pub fn wait(&mut self, track: Track, mark: Mark) {
        let i = track.index();
        self.peers[i] = self.peers[i].max(mark.peers);
        if mark.at > self.now[i] {
            self.spans.push(Span {
                track,
                what: "wait",
                unit: None,
                start: self.now[i],
                end: mark.at,
                all: mark.at,
                bytes: 0,
                waited_for: Some(mark.track),
                ahead: false,
            });
            self.now[i] = mark.at;
        }
    }

    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// The latest time of every track: when the step is done.
    pub fn end(&self) -> f64 {
        self.now.iter().copied().fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_starts_a_track_at_the_later_time_and_counts_as_waiting() {
        let mut c = Clocks::default();
        let copied = c.run(Track::H2d, "h2d", Some(1), 2.0, 100);
        c.run(Track::Compute, "forward", Some(0), 1.0, 0);
        c.wait(Track::Compute, copied);
        c.run(Track::Compute, "forward", Some(1), 1.0, 0);
        assert_eq!(c.now(Track::Compute), 3.0);
        let waits: Vec<_> = c.spans().iter().filter(|s| s.waited_for.is_some()).collect();
        assert_eq!(waits.len(), 1);
        assert_eq!(
            (waits[0].track, waits[0].waited_for, waits[0].end - waits[0].start),
            (Track::Compute, Some(Track::H2d), 1.0)
        );
        let busy: f64 = c
            .spans()
            .iter()
            .filter(|s| s.track == Track::Compute && s.waited_for.is_none())
            .map(|s| s.end - s.start)
            .sum();
        assert_eq!(busy, 2.0);
        assert_eq!(
            c.spans()
                .iter()
                .filter(|s| s.track == Track::H2d)
                .map(|s| s.bytes)
                .sum::<u64>(),
            100
        );
        // a mark already passed costs nothing
        c.wait(Track::Compute, copied);
        assert_eq!(c.now(Track::Compute), 3.0);
        assert_eq!(c.end(), 3.0);
    }

    #[test]
    fn a_collective_after_a_turn_at_the_disk_waits_inside_for_the_other_ranks() {
        let mut c = Clocks::default();
        let read = Transfer {
            disk: 4.0,
            latency: 0.0,
            others: 0.25,
        };
        let shard = c.run_on_disk(Track::H2d, ("nvme_read", Some(0)), read, 8);
        assert_eq!((shard.at, shard.peers), (3.0, 4.0));
        // the gather waits from when this rank's shard is in for the last rank's, and
        // ends its second after that
        c.wait(Track::Collectives, shard);
        let gathered = c.meet(Track::Collectives, ("all_gather", Some(0)), 1.0, 16);
        assert_eq!(gathered.at, 5.0);
        let gather = c.spans().iter().find(|s| s.what == "all_gather");
        assert_eq!(gather.map(|s| (s.start, s.end)), Some((4.0, 5.0)));
        let peers = c.spans().iter().find(|s| s.waited_for == Some(Track::Nvme));
        assert_eq!(
            peers.map(|s| (s.track, s.start, s.end)),
            Some((Track::Collectives, 3.0, 4.0))
        );
        // work that is no collective goes on from the rank's own time
        let mut c = Clocks::default();
        c.run_on_disk(Track::H2d, ("nvme_read", Some(0)), read, 8);
        let copied = c.run(Track::H2d, "h2d", Some(0), 1.0, 8);
        assert_eq!(copied.at, 4.0);
    }
}
