//! The swap store: optimizer state (and offloaded parameters) in NVMe files.
//!
//! Each (rank, state) has one preallocated file; each tensor (unit, rank, state) is an
//! extent of it, cut into chunks of `chunk_elems` elements (the optimizer's sub-groups),
//! each padded to the O_DIRECT alignment. Every chunk write records a crc32c of the bytes
//! written; every read verifies it, so a corrupted or truncated file is an error naming
//! the file and offset, never silent garbage. A chunk that was never written cannot be
//! read. Where the caller passes the bytes anyway (the optimizer pipeline's AdamW, the
//! copies of [`SwapStore::read_tensor_ahead`] and [`SwapStore::write_tensor_ahead`], a
//! gradient chunk's Σ g²), it sums them there (`write_async_summed`,
//! `StoreRead::wait_unverified`): the same checksums without a pass of their own.
//!
//! Files live in `<nvme_path>/<name>/`, next to an `OWNER` marker that this process holds
//! an exclusive `flock` on. A restart that finds the directory with a marker nobody holds
//! removes the stale files it recognises by name (and only those); a live owner, or a
//! directory without a marker, is an error that leaves everything in place. The store
//! removes its files when dropped.

use super::{BlockFile, BlockIo, IoError, Op, Pending, DIRECT_ALIGN};
use crate::crc::Running;
use crate::pool::IoBuf;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Which state a tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    Master,
    ExpAvg,
    ExpAvgSq,
    /// The low-precision parameter shard (offload_param to nvme).
    Param,
    /// A gradient partition beside the optimizer state on NVMe (bf16 or fp32): written
    /// by the gradient reduction, read by the optimizer pipeline; never checkpointed.
    Grad,
}

impl State {
    /// The states a checkpoint holds.
    pub const ALL: [State; 4] = [State::Master, State::ExpAvg, State::ExpAvgSq, State::Param];
    /// Every state the store keeps a file for.
    pub const STORED: [State; 5] = [
        State::Master,
        State::ExpAvg,
        State::ExpAvgSq,
        State::Param,
        State::Grad,
    ];
    /// The three fp32 optimizer states, in the order the pipeline reads them.
    pub const OPTIMIZER: [State; 3] = [State::Master, State::ExpAvg, State::ExpAvgSq];

    pub fn name(self) -> &'static str {
        match self {
            State::Master => "master",
            State::ExpAvg => "exp_avg",
            State::ExpAvgSq => "exp_avg_sq",
            State::Param => "param",
            State::Grad => "grad",
        }
    }
}

/// A tensor in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorKey {
    pub unit: u32,
    pub rank: u32,
    pub state: State,
}

/// A tensor to lay out: its key, element count and bytes per element.
#[derive(Clone, Copy, Debug)]
pub struct TensorSpec {
    pub key: TensorKey,
    pub numel: usize,
    pub elem_bytes: usize,
}

impl TensorSpec {
    /// The fp32 optimizer states ([`State::OPTIMIZER`]) of `numel` elements each of
    /// (`unit`, `rank`).
    pub fn optimizer(unit: u32, rank: u32, numel: usize) -> impl Iterator<Item = TensorSpec> {
        State::OPTIMIZER.into_iter().map(move |state| TensorSpec {
            key: TensorKey { unit, rank, state },
            numel,
            elem_bytes: 4,
        })
    }
}

#[derive(Debug)]
struct Extent {
    file: Arc<BlockFile>,
    offset: u64,
    numel: usize,
    elem_bytes: usize,
    /// crc32c of each chunk as last written; None until written.
    checksums: Mutex<Vec<Option<u32>>>,
}

const MARKER: &str = "OWNER";
const MARKER_MAGIC: &str = "tierzero swap directory v1";

/// Whether `name` is a file this store creates (`r<rank>.<state>.swp`).
fn is_store_file(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('r') else {
        return false;
    };
    let Some((rank, tail)) = rest.split_once('.') else {
        return false;
    };
    !rank.is_empty()
        && rank.bytes().all(|b| b.is_ascii_digit())
        && State::STORED.iter().any(|s| tail == format!("{}.swp", s.name()))
}

fn io_at(path: &Path, message: impl Into<String>) -> IoError {
    IoError::Store {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

pub struct SwapStore {
    dir: PathBuf,
    engine: Arc<dyn BlockIo>,
    chunk_elems: usize,
    extents: HashMap<TensorKey, Extent>,
    files: Vec<PathBuf>,
    /// Chunk buffers for the store's long-lived users ([`SwapStore::scratch`]), made and
    /// registered with the engine at the first lease.
    scratch: std::sync::OnceLock<Option<crate::pool::BufferPool>>,
    /// Holds the flock for the store's lifetime.
    _marker: File,
}

/// Buffers of [`SwapStore::scratch`]: a parameter store's reads (the h2d lane) and its
/// writes (the optimizer's updates) hold two each for the run (two chunks in flight).
const SCRATCH_BUFFERS: usize = 4;

impl SwapStore {
    /// Creates `<nvme_path>/<name>/` and preallocates room for every tensor.
    /// `chunk_elems` is rounded up so that a chunk of any element size is aligned.
    pub fn create(
        nvme_path: &Path,
        name: &str,
        engine: Arc<dyn BlockIo>,
        tensors: &[TensorSpec],
        chunk_elems: usize,
    ) -> Result<SwapStore, IoError> {
        let dir = nvme_path.join(name);
        let marker = claim_directory(&dir)?;
        let chunk_elems = chunk_elems.max(1).div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize;
        let mut sizes: HashMap<(u32, State), u64> = HashMap::new();
        let mut layout = Vec::new();
        for spec in tensors {
            let end = sizes.entry((spec.key.rank, spec.key.state)).or_insert(0);
            layout.push((spec, *end));
            *end += padded_bytes(spec.numel, spec.elem_bytes, chunk_elems);
        }
        let mut files: HashMap<(u32, State), Arc<BlockFile>> = HashMap::new();
        let mut paths = Vec::new();
        let mut file_keys: Vec<_> = sizes.keys().copied().collect();
        file_keys.sort();
        for (rank, state) in file_keys {
            let path = file_name(&dir, rank, state);
            let file = BlockFile::open(&path, true, engine.direct())?;
            paths.push(path);
            file.preallocate(sizes[&(rank, state)])?;
            files.insert((rank, state), file);
        }
        let extents = layout
            .into_iter()
            .map(|(spec, offset)| {
                let chunks = spec.numel.div_ceil(chunk_elems);
                let extent = Extent {
                    file: files[&(spec.key.rank, spec.key.state)].clone(),
                    offset,
                    numel: spec.numel,
                    elem_bytes: spec.elem_bytes,
                    checksums: Mutex::new(vec![None; chunks]),
                };
                (spec.key, extent)
            })
            .collect();
        Ok(SwapStore {
            dir,
            engine,
            chunk_elems,
            extents,
            files: paths,
            scratch: std::sync::OnceLock::new(),
            _marker: marker,
        })
    }

    /// A buffer of at least `bytes` for a user that keeps it (a chunk of fp32 or less):
    /// one of the store's buffers registered with its engine (transfers skip pinning
    /// their pages), while one is free; else a plain one.
    pub fn scratch(&self, bytes: usize) -> Result<crate::pool::IoBuf, crate::host::AllocError> {
        let pool = self
            .scratch
            .get_or_init(|| self.pool(SCRATCH_BUFFERS, self.chunk_bytes(4)).ok());
        match pool
            .as_ref()
            .filter(|p| p.buffer_bytes() >= bytes)
            .and_then(|p| p.try_lease())
        {
            Some(buf) => Ok(buf),
            None => crate::pool::IoBuf::new(bytes),
        }
    }

    /// The two scratch buffers of a transfer two chunks ahead ([`Self::read_tensor_ahead`],
    /// [`Self::write_tensor_ahead`]), each as [`Self::scratch`] gives it.
    pub fn scratch_pair(&self, bytes: usize) -> Result<[crate::pool::IoBuf; 2], crate::host::AllocError> {
        Ok([self.scratch(bytes)?, self.scratch(bytes)?])
    }

    /// `count` buffers of `bytes` for this store's transfers, registered with its engine:
    /// transfers through them skip pinning their pages where the engine can (it keeps the
    /// pool until it is dropped).
    pub fn pool(
        &self,
        count: usize,
        bytes: usize,
    ) -> Result<crate::pool::BufferPool, crate::host::AllocError> {
        let pool = crate::pool::BufferPool::new(count, bytes)?;
        self.engine.register_pool(&pool);
        Ok(pool)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn engine(&self) -> &Arc<dyn BlockIo> {
        &self.engine
    }

    /// Elements per chunk (the optimizer's sub-group size, rounded up to alignment).
    pub fn chunk_elems(&self) -> usize {
        self.chunk_elems
    }

    /// Number of chunks of a tensor.
    pub fn chunks(&self, key: TensorKey) -> Result<usize, IoError> {
        Ok(self.extent(key)?.numel.div_ceil(self.chunk_elems))
    }

    /// Elements in chunk `chunk` of `key`.
    pub fn chunk_numel(&self, key: TensorKey, chunk: usize) -> Result<usize, IoError> {
        let extent = self.extent(key)?;
        Ok(self
            .chunk_elems
            .min(extent.numel.saturating_sub(chunk * self.chunk_elems)))
    }

    /// Bytes a read or a write of chunk `chunk` of `key` moves: its elements, padded to
    /// the O_DIRECT alignment (a short chunk moves less than [`Self::chunk_bytes`]).
    pub fn chunk_io_bytes(&self, key: TensorKey, chunk: usize) -> Result<usize, IoError> {
        self.locate(key, chunk).map(|(_, _, padded, _)| padded)
    }

    /// Bytes one chunk occupies on disk and in a buffer (for sizing pools).
    pub fn chunk_bytes(&self, elem_bytes: usize) -> usize {
        (self.chunk_elems * elem_bytes).div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize
    }

    fn extent(&self, key: TensorKey) -> Result<&Extent, IoError> {
        self.extents
            .get(&key)
            .ok_or_else(|| io_at(&self.dir, format!("no tensor {key:?} in this swap store")))
    }

    /// (file, offset, padded length, valid length) of a chunk.
    fn locate(&self, key: TensorKey, chunk: usize) -> Result<(&Extent, u64, usize, usize), IoError> {
        let extent = self.extent(key)?;
        let chunks = extent.numel.div_ceil(self.chunk_elems);
        if chunk >= chunks {
            return Err(io_at(
                extent.file.path(),
                format!("{key:?} has {chunks} chunks; chunk {chunk} does not exist"),
            ));
        }
        let stride = self.chunk_bytes(extent.elem_bytes);
        let valid = self.chunk_elems.min(extent.numel - chunk * self.chunk_elems) * extent.elem_bytes;
        let padded = valid.div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize;
        Ok((extent, extent.offset + (chunk * stride) as u64, padded, valid))
    }

    /// Starts writing chunk `chunk` of `key` from `buf` (its first valid bytes; the
    /// padding up to the alignment is written too and covered by the checksum).
    pub fn write_async(
        &self,
        key: TensorKey,
        chunk: usize,
        buf: IoBuf,
    ) -> Result<StoreWrite<'_>, (IoError, IoBuf)> {
        self.write_summed(key, chunk, buf, None)
    }

    /// [`Self::write_async`] of a buffer whose valid bytes the caller summed as it wrote
    /// them (`valid`: their crc32c, [`crate::adam::step_summed`]): the store sums only the
    /// padding after them. Debug builds check the sum against a pass over the buffer.
    pub fn write_async_summed(
        &self,
        key: TensorKey,
        chunk: usize,
        buf: IoBuf,
        valid: Running,
    ) -> Result<StoreWrite<'_>, (IoError, IoBuf)> {
        self.write_summed(key, chunk, buf, Some(valid))
    }

    fn write_summed(
        &self,
        key: TensorKey,
        chunk: usize,
        buf: IoBuf,
        summed: Option<Running>,
    ) -> Result<StoreWrite<'_>, (IoError, IoBuf)> {
        let (extent, offset, padded, valid) = match self.locate(key, chunk) {
            Ok(found) => found,
            Err(e) => return Err((e, buf)),
        };
        if buf.capacity() < padded {
            let error = IoError::BufferTooSmall {
                op: "write",
                path: extent.file.path().to_path_buf(),
                len: padded,
                capacity: buf.capacity(),
            };
            return Err((error, buf));
        }
        let bytes = &buf.as_bytes()[..padded];
        let checksum = match summed {
            None => crc32c::crc32c(bytes),
            Some(sum) if sum.len == valid => {
                let checksum = crc32c::crc32c_append(sum.crc, &bytes[valid..]);
                debug_assert_eq!(
                    checksum,
                    crc32c::crc32c(bytes),
                    "{key:?} chunk {chunk}: a wrong sum"
                );
                checksum
            }
            Some(sum) => {
                let message = format!(
                    "chunk {chunk} of {key:?} at offset {offset}: {} bytes were summed for its {valid}",
                    sum.len
                );
                return Err((io_at(extent.file.path(), message), buf));
            }
        };
        let pending = self.engine.submit(Op::write(&extent.file, offset, padded, buf));
        Ok(StoreWrite {
            pending,
            extent,
            chunk,
            checksum,
        })
    }

    /// Starts reading chunk `chunk` of `key` into `buf`.
    pub fn read_async(
        &self,
        key: TensorKey,
        chunk: usize,
        buf: IoBuf,
    ) -> Result<StoreRead, (IoError, IoBuf)> {
        let (extent, offset, padded, valid) = match self.locate(key, chunk) {
            Ok(found) => found,
            Err(e) => return Err((e, buf)),
        };
        let expected = extent.checksums.lock().unwrap_or_else(|e| e.into_inner())[chunk];
        let Some(expected) = expected else {
            let error = io_at(
                extent.file.path(),
                format!("chunk {chunk} of {key:?} at offset {offset} was never written"),
            );
            return Err((error, buf));
        };
        let pending = self.engine.submit(Op::read(&extent.file, offset, padded, buf));
        Ok(StoreRead {
            pending,
            check: Unverified {
                path: extent.file.path().to_path_buf(),
                offset,
                valid,
                padded,
                expected,
            },
        })
    }

    /// Writes a whole tensor from `data` (initialisation, checkpoint restore), one chunk
    /// at a time: the reference of [`Self::write_tensor_ahead`].
    pub fn write_tensor(&self, key: TensorKey, data: &[u8], scratch: IoBuf) -> Result<IoBuf, IoError> {
        let mut buf = scratch;
        for chunk in 0..self.chunks(key)? {
            self.fill_chunk(key, chunk, data, &mut buf, false)?;
            buf = self.write_async(key, chunk, buf).map_err(|(e, _)| e)?.wait()?;
        }
        Ok(buf)
    }

    /// Writes a whole tensor as [`Self::write_tensor`] does, two chunks in flight: the
    /// next chunk is copied into its buffer, summed as it lands ([`crate::crc::copy_summed`]),
    /// while the one before is on its way to the disk (the optimizer's parameter writes,
    /// initialisation). The same bytes and checksums; on an error the writes in flight are
    /// waited for before it is returned.
    pub fn write_tensor_ahead(
        &self,
        key: TensorKey,
        data: &[u8],
        scratch: [IoBuf; 2],
    ) -> Result<[IoBuf; 2], IoError> {
        let chunks = self.chunks(key)?;
        let mut free = Vec::from(scratch);
        let mut in_flight = std::collections::VecDeque::with_capacity(2);
        let mut failed = None;
        for chunk in 0..chunks {
            let buf = match free.pop() {
                Some(buf) => Ok(buf),
                // both are out: the older write's buffer, once it is on the disk
                None => match in_flight.pop_front() {
                    Some(write) => StoreWrite::wait(write),
                    None => Err(io_at(&self.dir, "no scratch buffer for a write")),
                },
            };
            let written = buf.and_then(|mut buf| {
                let sum = self.fill_chunk(key, chunk, data, &mut buf, true)?;
                self.write_async_summed(key, chunk, buf, sum).map_err(|(e, _)| e)
            });
            match written {
                Ok(write) => in_flight.push_back(write),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        for write in in_flight {
            match write.wait() {
                Ok(buf) => free.push(buf),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        self.both_back(free, failed)
    }

    /// The two scratch buffers of a transfer two chunks ahead once every chunk is in, or
    /// its first error.
    fn both_back(&self, free: Vec<IoBuf>, failed: Option<IoError>) -> Result<[IoBuf; 2], IoError> {
        if let Some(e) = failed {
            return Err(e);
        }
        <[IoBuf; 2]>::try_from(free)
            .map_err(|_| io_at(&self.dir, "a scratch buffer was lost without an error"))
    }

    /// Chunk `chunk` of `data` (the whole tensor `key`'s bytes) into `buf`, its padding
    /// up to the alignment zeroed; where `summed`, the crc32c of its valid bytes taken as
    /// they land (else an empty sum).
    fn fill_chunk(
        &self,
        key: TensorKey,
        chunk: usize,
        data: &[u8],
        buf: &mut IoBuf,
        summed: bool,
    ) -> Result<Running, IoError> {
        let (start, valid, padded) = self.span(key, chunk)?;
        let bytes = buf.as_bytes_mut();
        if bytes.len() < padded {
            return Err(io_at(&self.dir, "scratch buffer smaller than one chunk"));
        }
        let (to, from) = (&mut bytes[..valid], &data[start..start + valid]);
        let sum = if summed {
            crate::crc::copy_summed(to, from)
        } else {
            to.copy_from_slice(from);
            Running::default()
        };
        bytes[valid..padded].fill(0);
        Ok(sum)
    }

    /// Where chunk `chunk` of `key` lies in the whole tensor's bytes: its first byte, its
    /// valid length, and its length padded to the alignment as the file holds it.
    fn span(&self, key: TensorKey, chunk: usize) -> Result<(usize, usize, usize), IoError> {
        let (extent, _, padded, valid) = self.locate(key, chunk)?;
        Ok((chunk * self.chunk_elems * extent.elem_bytes, valid, padded))
    }

    /// Reads a whole tensor into `out` (checkpoint save, tests), one chunk at a time: the
    /// reference of [`Self::read_tensor_ahead`].
    pub fn read_tensor(&self, key: TensorKey, out: &mut [u8], scratch: IoBuf) -> Result<IoBuf, IoError> {
        let mut buf = scratch;
        for chunk in 0..self.chunks(key)? {
            let (start, valid, _) = self.span(key, chunk)?;
            buf = self.read_async(key, chunk, buf).map_err(|(e, _)| e)?.wait()?;
            out[start..start + valid].copy_from_slice(&buf.as_bytes()[..valid]);
        }
        Ok(buf)
    }

    /// Reads a whole tensor into `out` as [`Self::read_tensor`] does, two chunks in
    /// flight: the next chunk is on the disk while this one's bytes are copied out, its
    /// checksum verified from their sum as they land ([`crate::crc::copy_summed`]; the h2d
    /// lane's parameter fetches; one chunk at a time left the disk idle for every copy).
    /// The same bytes as `read_tensor`; on an error the reads in flight are waited for
    /// before it is returned, and `out` holds nothing to use.
    pub fn read_tensor_ahead(
        &self,
        key: TensorKey,
        out: &mut [u8],
        scratch: [IoBuf; 2],
    ) -> Result<[IoBuf; 2], IoError> {
        let chunks = self.chunks(key)?;
        let mut free = Vec::from(scratch);
        let mut in_flight = std::collections::VecDeque::with_capacity(2);
        let (mut next, mut failed) = (0, None);
        loop {
            while failed.is_none() && next < chunks {
                let Some(buf) = free.pop() else { break };
                let read = match self.span(key, next) {
                    Ok(span) => self.read_async(key, next, buf).map(|read| (span, read)),
                    Err(e) => Err((e, buf)),
                };
                match read {
                    Ok(read) => in_flight.push_back(read),
                    Err((e, buf)) => {
                        free.push(buf);
                        failed = Some(e);
                    }
                }
                next += 1;
            }
            let Some(((start, valid, _), read)) = in_flight.pop_front() else {
                break;
            };
            match read.wait_unverified() {
                Ok((buf, _, check)) => {
                    if failed.is_none() {
                        let sum =
                            crate::crc::copy_summed(&mut out[start..start + valid], &buf.as_bytes()[..valid]);
                        failed = check.verify(&buf, sum).err();
                    }
                    free.push(buf);
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        self.both_back(free, failed)
    }

    /// Bytes the store's files occupy.
    /// The file holding `key`'s tensor and the byte offset of its first element: a
    /// tensor's elements lie back to back from there (its chunks are whole multiples of
    /// the alignment; only the last is padded), so a file moved elsewhere still holds
    /// them at that offset (a checkpoint's final save takes the files as they are).
    pub fn placement(&self, key: TensorKey) -> Result<(PathBuf, u64), IoError> {
        let extent = self.extent(key)?;
        Ok((self.file_path(key.rank, key.state), extent.offset))
    }

    /// The path of the file of `rank`'s `state` tensors.
    pub fn file_path(&self, rank: u32, state: State) -> PathBuf {
        file_name(&self.dir, rank, state)
    }

    /// Frees the disk space of `rank`'s `state` file, whose tensors are dead (a run's
    /// final save drops the last step's gradients before it writes the checkpoint);
    /// reading them fails afterwards. Returns the bytes freed (0: the store has no such file).
    pub fn discard(&self, rank: u32, state: State) -> Result<u64, IoError> {
        let path = self.file_path(rank, state);
        if !self.files.contains(&path) {
            return Ok(0);
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|source| IoError::Open {
                path: path.clone(),
                source,
            })?;
        let freed = file.metadata().map(|m| m.len()).unwrap_or(0);
        file.set_len(0).map_err(|e| {
            io_at(
                &path,
                format!("cannot truncate the dead {} file: {e}", state.name()),
            )
        })?;
        Ok(freed)
    }

    pub fn disk_bytes(&self) -> u64 {
        self.files
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    }
}

fn file_name(dir: &Path, rank: u32, state: State) -> PathBuf {
    dir.join(format!("r{rank}.{}.swp", state.name()))
}

fn padded_bytes(numel: usize, elem_bytes: usize, chunk_elems: usize) -> u64 {
    let chunk_bytes = (chunk_elems * elem_bytes).div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize;
    let full = numel / chunk_elems;
    let tail = (numel % chunk_elems * elem_bytes).div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize;
    (full * chunk_bytes + tail) as u64
}

/// Takes ownership of `dir`: creates it with a locked marker, or cleans a stale one.
fn claim_directory(dir: &Path) -> Result<File, IoError> {
    let marker_path = dir.join(MARKER);
    let existed = dir.exists();
    if existed && !marker_path.exists() {
        return Err(io_at(
            dir,
            "exists but was not created by tierzero (no OWNER marker); remove it or choose another nvme_path",
        ));
    }
    std::fs::create_dir_all(dir).map_err(|source| IoError::Open {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut marker = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&marker_path)
        .map_err(|source| IoError::Open {
            path: marker_path.clone(),
            source,
        })?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(marker.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut owner = String::new();
        let _ = marker.read_to_string(&mut owner);
        return Err(io_at(
            dir,
            format!(
                "is in use by another tierzero run ({}); give each run its own nvme_path",
                owner.trim()
            ),
        ));
    }
    if existed {
        let mut content = String::new();
        let _ = marker.read_to_string(&mut content);
        // empty: a run killed between creating the marker and writing it
        if !content.is_empty() && !content.starts_with(MARKER_MAGIC) {
            return Err(io_at(
                &marker_path,
                "is not a tierzero marker; remove the directory or choose another nvme_path",
            ));
        }
        let entries = std::fs::read_dir(dir).map_err(|source| IoError::Open {
            path: dir.to_path_buf(),
            source,
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_store_file(&name) {
                tracing::info!("removing stale swap file {}", entry.path().display());
                let _ = std::fs::remove_file(entry.path());
            } else if name != MARKER {
                tracing::warn!(
                    "leaving {} in the swap directory: tierzero did not create it",
                    entry.path().display()
                );
            }
        }
    }
    // overwrite in place, then trim: the marker never loses its magic line
    let line = format!("{MARKER_MAGIC} pid={}\n", std::process::id());
    marker
        .write_all_at(line.as_bytes(), 0)
        .and_then(|()| marker.set_len(line.len() as u64))
        .map_err(|e| io_at(&marker_path, format!("cannot write the marker: {e}")))?;
    Ok(marker)
}

impl Drop for SwapStore {
    fn drop(&mut self) {
        for path in &self.files {
            let _ = std::fs::remove_file(path);
        }
        let _ = std::fs::remove_file(self.dir.join(MARKER));
        // only succeeds if the directory is now empty: foreign files stay
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A chunk write in flight; `wait` records its checksum once it is on disk.
#[must_use = "wait() returns the buffer and records the checksum"]
pub struct StoreWrite<'a> {
    pending: Pending,
    extent: &'a Extent,
    chunk: usize,
    checksum: u32,
}

impl StoreWrite<'_> {
    pub fn wait(self) -> Result<IoBuf, IoError> {
        let buf = self.pending.wait()?.into_result()?;
        self.extent.checksums.lock().unwrap_or_else(|e| e.into_inner())[self.chunk] = Some(self.checksum);
        Ok(buf)
    }
}

/// A chunk read in flight; `wait` verifies its checksum.
#[must_use = "wait() returns the buffer and verifies the checksum"]
pub struct StoreRead {
    pending: Pending,
    check: Unverified,
}

impl StoreRead {
    pub fn wait(self) -> Result<IoBuf, IoError> {
        self.wait_timed().map(|(buf, _)| buf)
    }

    /// [`Self::wait`], with when the engine had the chunk (before its checksum here).
    pub fn wait_timed(self) -> Result<(IoBuf, std::time::Instant), IoError> {
        let (buf, at, check) = self.wait_unverified()?;
        check.verify_here(&buf)?;
        Ok((buf, at))
    }

    /// The chunk as the disk gave it, with when the engine had it and what its checksum
    /// must be: the caller verifies it as it passes the bytes anyway, before anything
    /// computed from them leaves the process ([`Unverified::verify`]).
    pub fn wait_unverified(self) -> Result<(IoBuf, std::time::Instant, Unverified), IoError> {
        let done = self.pending.wait()?;
        let at = done.at;
        Ok((done.into_result()?, at, self.check))
    }
}

/// A chunk read whose checksum is still to be verified.
#[must_use = "verify() reports a corrupted chunk"]
#[derive(Debug)]
pub struct Unverified {
    path: PathBuf,
    offset: u64,
    /// The chunk's elements' bytes, then its padding up to `padded`.
    valid: usize,
    padded: usize,
    expected: u32,
}

impl Unverified {
    /// Verifies the chunk in `buf` from the crc32c of its valid bytes, `summed` by the
    /// caller as it read them: the padding after them is summed here.
    pub fn verify(self, buf: &IoBuf, summed: Running) -> Result<(), IoError> {
        if summed.len != self.valid {
            return Err(io_at(
                &self.path,
                format!(
                    "chunk at offset {}: {} bytes were summed for its {}",
                    self.offset, summed.len, self.valid
                ),
            ));
        }
        let got = crc32c::crc32c_append(summed.crc, &buf.as_bytes()[self.valid..self.padded]);
        if got != self.expected {
            return Err(IoError::Checksum {
                path: self.path,
                offset: self.offset,
                len: self.padded,
                expected: self.expected,
                got,
            });
        }
        Ok(())
    }

    /// Verifies the chunk in `buf` with a pass over it.
    pub fn verify_here(self, buf: &IoBuf) -> Result<(), IoError> {
        let summed = Running::default().append(&buf.as_bytes()[..self.valid]);
        self.verify(buf, summed)
    }
}
