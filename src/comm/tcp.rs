//! `Tcp`: ranks in several processes (or machines), exchanging through a hub.
//!
//! The process of node rank 0 runs the [`Hub`] on the master address; every rank
//! connects to it (retrying until the timeout, so start order does not matter) and says
//! which rank it is. Each round the hub collects one deposit from every rank and sends
//! the whole set back to each; the collectives are then computed on every rank from the
//! same bytes in rank order (`exchange.rs`), exactly as `Local` does, so a run split over
//! processes gives the bits of the same run in one process. A rank that fails sends an
//! abort and a rank whose connection drops mid-run is reported: the hub forwards the
//! cause to every rank, so nobody hangs. Traffic goes through one hub, which suits CPU
//! ranks and tests; GPUs use NCCL.

use super::exchange::{Contribution, Exchange};
use super::CommError;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"TZTC";
const VERSION: u32 = 1;
const DATA: u8 = b'D';
const ABORT: u8 = b'A';

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr} resolves to nothing"))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let len = read_u64(r)? as usize;
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// A rank's deposit, or an abort: tag, length, bytes.
fn send_one(w: &mut impl Write, tag: u8, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(&[tag])?;
    w.write_all(&(bytes.len() as u64).to_le_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

/// The hub's answer to a round: every rank's deposit, in rank order.
fn send_set(w: &mut impl Write, set: &[Vec<u8>]) -> std::io::Result<()> {
    w.write_all(&[DATA])?;
    w.write_all(&(set.len() as u32).to_le_bytes())?;
    for p in set {
        w.write_all(&(p.len() as u64).to_le_bytes())?;
        w.write_all(p)?;
    }
    w.flush()
}

/// What a connection's reader thread hands the hub.
enum Event {
    Data(usize, Vec<u8>),
    Abort(String),
    Closed(usize),
}

/// The exchange point of one communicator; runs on a thread of node 0's process.
pub struct Hub {
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Hub {
    /// Listens on `addr` and serves `world` ranks until they all disconnect.
    pub fn start(addr: &str, world: usize, timeout: Duration) -> Result<Hub, String> {
        let listener = TcpListener::bind(resolve(addr)?).map_err(|e| {
            format!("cannot listen on {addr}: {e}; pick a free train.master_port (--master-port)")
        })?;
        let thread = std::thread::Builder::new()
            .name("tierzero-hub".into())
            .spawn(move || serve(listener, world, timeout))
            .map_err(|e| e.to_string())?;
        Ok(Hub { thread: Some(thread) })
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: TcpListener, world: usize, timeout: Duration) {
    let mut conns: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut refused: Option<String> = None;
    let deadline = Instant::now() + timeout;
    let _ = listener.set_nonblocking(true);
    while conns.iter().any(Option::is_none) && refused.is_none() {
        match listener.accept() {
            Ok((mut s, from)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let mut h = [0u8; 16];
                if s.read_exact(&mut h).is_err() || &h[..4] != MAGIC {
                    continue;
                }
                let field = |i: usize| {
                    u32::from_le_bytes([h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]]) as usize
                };
                let (version, their_world, rank) = (field(1), field(2), field(3));
                let _ = s.set_read_timeout(None);
                let problem = if version != VERSION as usize {
                    Some(format!("{from} speaks collective protocol {version}, this build {VERSION}; run the same tierzero on every node"))
                } else if their_world != world {
                    Some(format!("rank {rank} at {from} expects a world of {their_world}, node 0 has {world}; give every node the same --nnodes and --devices"))
                } else if rank >= world || conns[rank].is_some() {
                    Some(format!("rank {rank} (from {from}) is claimed twice or out of range; give each node a distinct --node-rank"))
                } else {
                    None
                };
                match problem {
                    Some(p) => {
                        let _ = send_one(&mut s, ABORT, p.as_bytes());
                        refused = Some(p);
                    }
                    None => conns[rank] = Some(s),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                let missing: Vec<String> = (0..world)
                    .filter(|&r| conns[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                refused = Some(if e.kind() == std::io::ErrorKind::WouldBlock {
                    format!(
                        "timed out after {:.0} s waiting for rank(s) {} to connect",
                        timeout.as_secs_f64(),
                        missing.join(", ")
                    )
                } else {
                    format!("accept failed: {e}")
                });
            }
        }
    }
    if let Some(reason) = refused {
        for s in conns.iter_mut().flatten() {
            let _ = send_one(s, ABORT, reason.as_bytes());
        }
        return;
    }
    let conns: Vec<TcpStream> = conns.into_iter().flatten().collect();
    exchange_rounds(conns);
}

fn exchange_rounds(conns: Vec<TcpStream>) {
    let world = conns.len();
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut writers = Vec::new();
    for (rank, conn) in conns.into_iter().enumerate() {
        let Ok(read_half) = conn.try_clone() else {
            return;
        };
        writers.push(BufWriter::with_capacity(1 << 20, conn));
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::with_capacity(1 << 20, read_half);
            loop {
                let mut tag = [0u8; 1];
                let event = match r.read_exact(&mut tag).and_then(|()| read_bytes(&mut r)) {
                    Ok(bytes) if tag[0] == DATA => Event::Data(rank, bytes),
                    Ok(bytes) => Event::Abort(String::from_utf8_lossy(&bytes).into_owned()),
                    Err(_) => Event::Closed(rank),
                };
                let last = matches!(event, Event::Closed(_));
                if tx.send(event).is_err() || last {
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut pending: Vec<Option<Vec<u8>>> = vec![None; world];
    let mut closed = vec![false; world];
    let abort_all = |writers: &mut Vec<BufWriter<TcpStream>>, reason: &str| {
        for w in writers.iter_mut() {
            let _ = send_one(w, ABORT, reason.as_bytes());
        }
    };
    while let Ok(event) = rx.recv() {
        match event {
            Event::Data(rank, bytes) => {
                if let Some(gone) = closed.iter().position(|&c| c) {
                    abort_all(
                        &mut writers,
                        &format!("rank {gone} has left the group (its process exited)"),
                    );
                    return;
                }
                pending[rank] = Some(bytes);
                if pending.iter().all(Option::is_some) {
                    let set: Vec<Vec<u8>> =
                        pending.iter_mut().map(|p| p.take().unwrap_or_default()).collect();
                    for w in writers.iter_mut() {
                        let _ = send_set(w, &set);
                    }
                }
            }
            Event::Abort(reason) => {
                abort_all(&mut writers, &reason);
                return;
            }
            Event::Closed(rank) => {
                closed[rank] = true;
                if pending.iter().any(Option::is_some) {
                    abort_all(
                        &mut writers,
                        &format!("rank {rank}'s connection closed mid-collective (its process exited?)"),
                    );
                    return;
                }
                if closed.iter().all(|&c| c) {
                    return;
                }
            }
        }
    }
}

/// One rank's connection to a hub.
pub struct Tcp {
    rank: usize,
    world: usize,
    reader: Mutex<BufReader<TcpStream>>,
    writer: Mutex<BufWriter<TcpStream>>,
    failed: Mutex<Option<String>>,
}

impl Tcp {
    /// Connects rank `rank` of `world` to the hub at `addr`, retrying until `timeout`.
    pub fn connect(addr: &str, world: usize, rank: usize, timeout: Duration) -> Result<Arc<Tcp>, CommError> {
        let fail = |reason: String| CommError::Aborted { rank, reason };
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let attempt = resolve(addr).and_then(|a| {
                TcpStream::connect_timeout(&a, Duration::from_secs(2)).map_err(|e| e.to_string())
            });
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(fail(format!(
                        "cannot reach the hub at {addr} within {:.0} s ({e}); is node rank 0 running, and is --master-addr its address?",
                        timeout.as_secs_f64()
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut h = MAGIC.to_vec();
        for v in [VERSION, world as u32, rank as u32] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        let io = |e: std::io::Error| fail(format!("hub at {addr}: {e}"));
        (&stream).write_all(&h).map_err(io)?;
        let read_half = stream.try_clone().map_err(io)?;
        Ok(Arc::new(Tcp {
            rank,
            world,
            reader: Mutex::new(BufReader::with_capacity(1 << 20, read_half)),
            writer: Mutex::new(BufWriter::with_capacity(1 << 20, stream)),
            failed: Mutex::new(None),
        }))
    }

    fn aborted(&self, reason: String) -> CommError {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        let reason = failed.get_or_insert(reason).clone();
        CommError::Aborted {
            rank: self.rank,
            reason,
        }
    }

    /// Reads the hub's answer to this round.
    fn receive(&self) -> Result<Arc<Vec<Contribution>>, CommError> {
        let mut r = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        let lost = |e: std::io::Error| {
            format!("lost the connection to the hub on node 0 (did its process exit?): {e}")
        };
        let mut tag = [0u8; 1];
        r.read_exact(&mut tag).map_err(|e| self.aborted(lost(e)))?;
        if tag[0] == ABORT {
            let reason = read_bytes(&mut *r).map_err(|e| self.aborted(lost(e)))?;
            return Err(self.aborted(String::from_utf8_lossy(&reason).into_owned()));
        }
        let mut count = [0u8; 4];
        r.read_exact(&mut count).map_err(|e| self.aborted(lost(e)))?;
        let count = u32::from_le_bytes(count) as usize;
        let mut all = Vec::with_capacity(count);
        for _ in 0..count {
            all.push(Arc::new(read_bytes(&mut *r).map_err(|e| self.aborted(lost(e)))?));
        }
        Ok(Arc::new(all))
    }
}

impl Exchange for Arc<Tcp> {
    fn index(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world
    }

    fn exchange(&self, data: Vec<u8>) -> Result<Arc<Vec<Contribution>>, CommError> {
        if let Some(reason) = self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(CommError::Aborted {
                rank: self.rank,
                reason,
            });
        }
        let sent = {
            let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            send_one(&mut *w, DATA, &data)
        };
        // a failed write still reads: the hub's abort may be waiting in the socket
        match (sent, self.receive()) {
            (_, Err(e)) => Err(e),
            (Ok(()), Ok(all)) => Ok(all),
            (Err(e), Ok(_)) => Err(self.aborted(format!(
                "lost the connection to the hub on node 0 (did its process exit?): {e}"
            ))),
        }
    }

    fn cancel(&self, reason: &str) {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| reason.to_string());
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let _ = send_one(&mut *w, ABORT, reason.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::Local;
    use crate::comm::{Collective, ReduceOp};

    fn addr() -> String {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("127.0.0.1:{port}")
    }

    fn ops<C: Collective>(c: &C) -> (Vec<f32>, Vec<f32>, f64, Vec<u16>) {
        let (r, world) = (c.rank() as f32, c.world());
        let mut gathered = vec![0f32; 3 * world];
        c.all_gather(&[r, r + 0.1, r * 1e-3], &mut gathered).unwrap();
        let full: Vec<f32> = (0..3 * world).map(|i| (i as f32 + r).sin()).collect();
        let mut mine = vec![0f32; 3];
        c.reduce_scatter(&full, &mut mine, ReduceOp::Avg).unwrap();
        let mut sum = [f64::from(r).exp()];
        c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        let mut b = vec![c.rank() as u16 * 7; 5];
        c.broadcast(&mut b, world - 1).unwrap();
        c.barrier().unwrap();
        (gathered, mine, sum[0], b)
    }

    #[test]
    fn tcp_ranks_compute_the_bits_local_ranks_do() {
        for world in 1..=4 {
            let addr = addr();
            let _hub = Hub::start(&addr, world, Duration::from_secs(20)).unwrap();
            let tcp: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..world)
                    .map(|r| {
                        let addr = &addr;
                        s.spawn(move || ops(&Tcp::connect(addr, world, r, Duration::from_secs(20)).unwrap()))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let local: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = Local::group(world)
                    .into_iter()
                    .map(|c| s.spawn(move || ops(&c)))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(tcp, local, "world {world}");
        }
    }

    #[test]
    fn an_abort_or_a_vanished_rank_reaches_every_rank() {
        let addr = addr();
        let _hub = Hub::start(&addr, 3, Duration::from_secs(20)).unwrap();
        let errors: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let addr = &addr;
                    s.spawn(move || {
                        let c = Tcp::connect(addr, 3, r, Duration::from_secs(20)).unwrap();
                        c.barrier().unwrap();
                        if r == 1 {
                            Collective::abort(&c, "rank 1 failed: out of memory");
                        }
                        let mut x = [1f32];
                        c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in errors {
            assert!(e.contains("rank 1 failed: out of memory"), "{e}");
        }
        // a rank that disconnects while the others wait in a collective
        let addr = self::addr();
        let _hub = Hub::start(&addr, 2, Duration::from_secs(20)).unwrap();
        let e = std::thread::scope(|s| {
            let a = s.spawn(|| {
                let c = Tcp::connect(&addr, 2, 0, Duration::from_secs(20)).unwrap();
                let mut x = [1f32];
                c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
            });
            s.spawn(|| drop(Tcp::connect(&addr, 2, 1, Duration::from_secs(20)).unwrap()));
            a.join().unwrap()
        });
        assert!(e.contains("rank 1"), "{e}");
    }

    #[test]
    fn a_duplicate_rank_or_a_missing_one_is_refused_with_the_cause() {
        let addr = addr();
        let _hub = Hub::start(&addr, 2, Duration::from_secs(20)).unwrap();
        let errors: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let addr = &addr;
                    s.spawn(move || {
                        let c = Tcp::connect(addr, 2, 0, Duration::from_secs(20)).unwrap();
                        c.barrier().unwrap_err().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(errors.iter().all(|e| e.contains("claimed twice")), "{errors:?}");
        let addr = self::addr();
        let _hub = Hub::start(&addr, 3, Duration::from_millis(500)).unwrap();
        let c = Tcp::connect(&addr, 3, 2, Duration::from_secs(5)).unwrap();
        let e = c.barrier().unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("rank(s) 0, 1"), "{e}");
        let e = Tcp::connect(&self::addr(), 1, 0, Duration::from_millis(200))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot reach the hub"), "{e}");
    }
}
