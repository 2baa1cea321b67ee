//! Stage-3 prefetch: the next units' fetch (NVMe → host, then all-gather) runs on a
//! worker thread while the current unit computes.
//!
//! Per micro-batch, the order in which units are fetched is fixed and the same on every
//! rank ([`schedule`]). The compute thread asks for units ahead of time, as many as fit
//! in `stage3_prefetch_bucket_size` elements (at least the one it needs now), and takes
//! them in order. The worker gathers on its own communicator, so its collectives never
//! interleave with the compute thread's reduce-scatters; since every rank issues its
//! requests at the same points of the same program and always before it waits, the two
//! communicators cannot deadlock each other. DeepSpeed's PartitionedParameterCoordinator
//! plays this role with a CUDA stream per direction.

use super::partition::Partition;
use super::rank::{EngineError, LowParams};
use crate::comm::Collective;
use crate::config::plan::Precision;
use crate::device::cpu::{CpuDevice, Reservation};
use crate::metrics::timeline::{Phase as TimedPhase, Track};
use crossbeam_channel::{Receiver, Sender};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;
use tierzero_offload::nvme::swap::{State, SwapStore, TensorKey};
use tierzero_offload::pool::IoBuf;

/// Why a unit is fetched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Forward,
    /// The final unit, for the loss and its backward.
    Final,
    /// The embedding again, for the tied LM head (alive together with the final unit).
    Tied,
    Backward,
}

/// The fetch order of one micro-batch: forward 0..last, the final unit (and the tied
/// embedding), then backward last-1..0. Units that stay gathered (`persistent`) appear
/// only at their first use.
pub fn schedule(units: usize, tied: bool, persistent: impl Fn(usize) -> bool) -> Vec<(usize, Phase)> {
    let last = units - 1;
    let mut order: Vec<(usize, Phase)> = (0..last).map(|u| (u, Phase::Forward)).collect();
    order.push((last, Phase::Final));
    if tied {
        order.push((0, Phase::Tied));
    }
    order.extend((0..last).rev().map(|u| (u, Phase::Backward)));
    let mut seen = vec![false; units];
    order.retain(|&(u, _)| {
        let keep = !(persistent(u) && seen[u]);
        seen[u] = true;
        keep
    });
    order
}

/// How far ahead to gather: `stage3_prefetch_bucket_size` elements outstanding, and
/// `stage3_max_live_parameters` elements gathered at once (in use plus outstanding);
/// units of at most `persistence_threshold` elements stay gathered and do not count.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub bucket: usize,
    pub max_live: usize,
    pub persistence_threshold: usize,
}

/// Whether to ask for one more unit now: always when nothing is outstanding (the unit
/// needed next), otherwise while the outstanding elements stay within the bucket and the
/// live ones (`in_use` + outstanding) within `max_live`.
pub fn may_request(
    outstanding: usize,
    outstanding_numel: usize,
    next_numel: usize,
    in_use: usize,
    limits: Limits,
) -> bool {
    let ahead = outstanding_numel + next_numel;
    outstanding == 0 || (ahead <= limits.bucket && in_use + ahead <= limits.max_live)
}

/// A unit to gather: its in-memory shard, or None to read it from the parameter store.
pub struct Request {
    pub unit: usize,
    pub shard: Option<LowParams>,
}

pub type Response = Result<(usize, LowParams), EngineError>;

/// What the worker needs, owned or shared for the run (never the engine itself).
pub struct Worker<'a, C: Collective> {
    pub comm: C,
    pub rank: usize,
    pub store: Option<&'a SwapStore>,
    pub precision: Precision,
    pub parts: Vec<Partition>,
    pub track: Track,
}

impl<C: Collective> Worker<'_, C> {
    /// Serves requests until the compute thread hangs up.
    pub fn serve(self, requests: Receiver<Request>, responses: Sender<Response>) {
        for request in requests {
            let result = self.gather(request);
            let failed = result.is_err();
            if responses.send(result).is_err() || failed {
                return;
            }
        }
    }

    fn gather(&self, request: Request) -> Response {
        let part = self.parts[request.unit];
        let shard = match request.shard {
            Some(shard) => shard,
            None => {
                let bytes = (part.shard * self.precision.bytes()) as u64;
                self.track
                    .span(TimedPhase::NvmeRead, Some(request.unit), bytes, || {
                        self.read(request.unit, part.shard)
                    })?
            }
        };
        let start = Instant::now();
        let full = match &shard {
            LowParams::F32(s) => {
                let mut out = vec![0f32; part.padded];
                self.comm.all_gather(s, &mut out)?;
                LowParams::F32(out)
            }
            LowParams::U16(s) => {
                let mut out = vec![0u16; part.padded];
                self.comm.all_gather(s, &mut out)?;
                LowParams::U16(out)
            }
        };
        let bytes = (part.padded * self.precision.bytes()) as u64;
        self.track
            .record(TimedPhase::AllGather, Some(request.unit), start, bytes);
        Ok((request.unit, full))
    }

    fn read(&self, unit: usize, len: usize) -> Result<LowParams, EngineError> {
        read_param_shard(self.store, self.rank, unit, len, &self.precision)
    }
}

/// The compute thread's side: requests ahead, receives in order, and holds the device
/// memory of each gathered unit from request to release.
pub struct Prefetcher {
    schedule: Vec<(usize, Phase)>,
    numels: Vec<usize>,
    padded_bytes: Vec<u64>,
    /// Units that stay gathered once fetched (not counted as in use).
    persistent: Vec<bool>,
    limits: Limits,
    /// Elements of the units the compute thread holds (the one it computes with, and
    /// the final unit while the tied embedding joins it).
    in_use: usize,
    requests: Option<Sender<Request>>,
    responses: Receiver<Response>,
    requested: usize,
    received: usize,
    holds: VecDeque<Reservation>,
    device: Arc<CpuDevice>,
    /// The compute thread's track: time waiting for the worker.
    track: Track,
}

impl Prefetcher {
    pub fn new(
        schedule: Vec<(usize, Phase)>,
        parts: &[Partition],
        elem_bytes: usize,
        limits: Limits,
        device: Arc<CpuDevice>,
        (requests, responses): (Sender<Request>, Receiver<Response>),
        track: Track,
    ) -> Prefetcher {
        Prefetcher {
            schedule,
            numels: parts.iter().map(|p| p.numel).collect(),
            padded_bytes: parts.iter().map(|p| (p.padded * elem_bytes) as u64).collect(),
            persistent: parts
                .iter()
                .map(|p| p.numel <= limits.persistence_threshold)
                .collect(),
            limits,
            in_use: 0,
            requests: Some(requests),
            responses,
            requested: 0,
            received: 0,
            holds: VecDeque::new(),
            device,
            track,
        }
    }

    /// Issues every request the bucket allows; `shard` gives the in-memory shard of a
    /// unit (None when it lives on NVMe), after installing any pending update of it.
    fn fill(
        &mut self,
        shard: &mut dyn FnMut(usize) -> Result<Option<LowParams>, EngineError>,
    ) -> Result<(), EngineError> {
        loop {
            let outstanding = self.requested - self.received;
            let Some(&(unit, _)) = self.schedule.get(self.requested) else {
                return Ok(());
            };
            let outstanding_numel: usize = self.schedule[self.received..self.requested]
                .iter()
                .map(|&(u, _)| self.numels[u])
                .sum();
            if !may_request(
                outstanding,
                outstanding_numel,
                self.numels[unit],
                self.in_use,
                self.limits,
            ) {
                return Ok(());
            }
            // installing a pending update first drops the unit's old gathered copy
            let in_memory = shard(unit)?;
            self.holds.push_back(
                self.device
                    .reserve(self.padded_bytes[unit], &format!("gathered unit {unit}"))?,
            );
            let sender = self.requests.as_ref().ok_or_else(|| EngineError::Other {
                rank: 0,
                message: "prefetch closed".into(),
            })?;
            if sender
                .send(Request {
                    unit,
                    shard: in_memory,
                })
                .is_err()
            {
                return Err(self.stopped());
            }
            self.requested += 1;
        }
    }

    /// The next scheduled unit, gathered, with its device memory.
    pub fn next(
        &mut self,
        expected: usize,
        shard: &mut dyn FnMut(usize) -> Result<Option<LowParams>, EngineError>,
    ) -> Result<(LowParams, Reservation), EngineError> {
        // the compute thread released the previous unit, except the final one while the
        // tied embedding joins it
        if self.schedule.get(self.received).map(|s| s.1) != Some(Phase::Tied) {
            self.in_use = 0;
        }
        self.fill(shard)?;
        let start = Instant::now();
        let response = self.responses.recv().map_err(|_| self.stopped())?;
        self.track.waited(TimedPhase::AllGather, Some(expected), start);
        let (unit, full) = response?;
        if unit != expected || self.schedule.get(self.received).map(|s| s.0) != Some(expected) {
            return Err(EngineError::Other {
                rank: 0,
                message: format!("prefetch order: got unit {unit}, expected {expected}"),
            });
        }
        self.received += 1;
        let hold = self.holds.pop_front().ok_or_else(|| EngineError::Other {
            rank: 0,
            message: "prefetch accounting".into(),
        })?;
        if !self.persistent[unit] {
            self.in_use += self.numels[unit];
        }
        // keep the pipeline full while this unit computes
        self.fill(shard)?;
        Ok((full, hold))
    }

    /// Why the worker is gone: it stops right after sending its error, which may still
    /// be queued behind gathered units (so an aborted collective is reported as such,
    /// not as a failure of this rank).
    fn stopped(&self) -> EngineError {
        while let Ok(response) = self.responses.try_recv() {
            if let Err(e) = response {
                return e;
            }
        }
        EngineError::Other {
            rank: 0,
            message: "the prefetch worker stopped".into(),
        }
    }

    /// Hangs up on the worker (it finishes the request in hand and exits).
    pub fn close(&mut self) {
        self.requests = None;
    }
}

/// Reads rank `rank`'s stored parameters of `unit` (`len` elements) from the NVMe
/// parameter store.
pub fn read_param_shard(
    store: Option<&SwapStore>,
    rank: usize,
    unit: usize,
    len: usize,
    precision: &Precision,
) -> Result<LowParams, EngineError> {
    let other = |message: String| EngineError::Other { rank, message };
    let store = store.ok_or_else(|| other("parameters on nvme without a swap store".into()))?;
    let mut params = LowParams::zeros(len, precision);
    let key = TensorKey {
        unit: unit as u32,
        rank: rank as u32,
        state: State::Param,
    };
    let scratch = IoBuf::new(store.chunk_bytes(params.elem_bytes())).map_err(|e| other(e.to_string()))?;
    store
        .read_tensor(key, params.bytes_mut(), scratch)
        .map_err(|source| EngineError::Io { rank, source })?;
    Ok(params)
}
