//! Tokenized samples of a record data set, cached beside the data and memory-mapped.
//!
//! The cache file: `TZSAMPL1`, the sample count n (u64), n + 1 token offsets (u64), then
//! every sample's tokens as u32, bit 31 set where the token counts as a target. Its name
//! carries a hash of the tokenizer, the template, the options and each data file's name,
//! size and modification time, so a change to any re-tokenizes; it is written to a
//! `.partial` file and renamed, so a stale or torn cache is never read.

use super::encode::Encoder;
use super::records::{self, Record};
use super::DataError;
use memmap2::Mmap;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"TZSAMPL1";
const COUNTED: u32 = 1 << 31;

pub struct Samples {
    path: PathBuf,
    map: Mmap,
    count: usize,
}

/// FNV-1a's starting value.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Hashes a file's size and modification time onto `key` (a cache made from the file
/// is named by it, so an edit makes a new one).
pub fn file_stamp(meta: &std::fs::Metadata, key: u64) -> u64 {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    fnv1a(&meta.len().to_le_bytes(), fnv1a(&mtime.to_le_bytes(), key))
}

/// FNV-1a over `bytes`, continuing from `h`.
pub fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cache path of a data set (`data` a file or a directory) for a key.
fn cache_path(data: &Path, key: u64) -> PathBuf {
    if data.is_dir() {
        data.join(format!(".{key:016x}.samples.bin"))
    } else {
        data.with_extension(format!("{key:016x}.samples.bin"))
    }
}

/// Hashes each data file's name, size and modification time onto `key`.
pub fn files_key(files: &[PathBuf], mut key: u64) -> Result<u64, DataError> {
    for f in files {
        let meta = std::fs::metadata(f).map_err(|source| DataError::Read {
            path: f.clone(),
            source,
        })?;
        key = file_stamp(&meta, fnv1a(f.as_os_str().as_encoded_bytes(), key));
    }
    Ok(key)
}

impl Samples {
    /// The samples of `data`, tokenized by `encoder` unless the cache for `key` (which
    /// covers the encoder's inputs) is there.
    pub fn cached(data: &Path, key: u64, encoder: &Encoder) -> Result<Samples, DataError> {
        let files = records::files(data)?;
        let cache = cache_path(data, files_key(&files, key)?);
        if !cache.exists() {
            write_cache(&files, &cache, encoder)?;
        }
        Samples::open(&cache)
    }

    pub fn open(path: &Path) -> Result<Samples, DataError> {
        let read = |source| DataError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read)?;
        // SAFETY: the map is read-only and the cache is written once and renamed into
        // place, never modified after.
        let map = unsafe { Mmap::map(&file) }.map_err(read)?;
        let invalid = || DataError::Invalid {
            path: path.to_path_buf(),
            message: "not a tierzero samples cache; delete it to rebuild".into(),
        };
        if map.len() < 16 || &map[..8] != MAGIC {
            return Err(invalid());
        }
        let count = u64::from_le_bytes(map[8..16].try_into().map_err(|_| invalid())?) as usize;
        let s = Samples {
            path: path.to_path_buf(),
            map,
            count,
        };
        let tokens_at = 16 + 8 * (count + 1);
        if s.map.len() < tokens_at || s.map.len() != tokens_at + 4 * s.offset(count) {
            return Err(invalid());
        }
        Ok(s)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn offset(&self, i: usize) -> usize {
        let at = 16 + 8 * i;
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.map[at..at + 8]);
        u64::from_le_bytes(b) as usize
    }

    /// Tokens in sample `i`.
    pub fn tokens(&self, i: usize) -> usize {
        self.offset(i + 1) - self.offset(i)
    }

    /// Token `j` of sample `i` and whether it counts.
    pub fn token(&self, i: usize, j: usize) -> (i64, bool) {
        let at = 16 + 8 * (self.count + 1) + 4 * (self.offset(i) + j);
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.map[at..at + 4]);
        let word = u32::from_le_bytes(b);
        (i64::from(word & !COUNTED), word & COUNTED != 0)
    }
}

fn write_cache(files: &[PathBuf], cache: &Path, encoder: &Encoder) -> Result<(), DataError> {
    let tmp = cache.with_extension("partial");
    let write_err = |source| DataError::Read {
        path: tmp.clone(),
        source,
    };
    let mut offsets = vec![0u64];
    let mut words: Vec<u32> = Vec::new();
    records::for_each(files, |record: Record| {
        let e = encoder.encode(&record)?;
        if let Some(&big) = e.ids.iter().find(|&&id| id & COUNTED != 0) {
            return Err(format!("token id {big} does not fit 31 bits"));
        }
        words.extend(
            e.ids
                .iter()
                .zip(&e.counted)
                .map(|(&id, &c)| if c { id | COUNTED } else { id }),
        );
        offsets.push(words.len() as u64);
        Ok(())
    })?;
    let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(write_err)?);
    out.write_all(MAGIC).map_err(write_err)?;
    out.write_all(&((offsets.len() - 1) as u64).to_le_bytes())
        .map_err(write_err)?;
    for o in &offsets {
        out.write_all(&o.to_le_bytes()).map_err(write_err)?;
    }
    for w in &words {
        out.write_all(&w.to_le_bytes()).map_err(write_err)?;
    }
    out.flush().map_err(write_err)?;
    drop(out);
    std::fs::rename(&tmp, cache).map_err(|source| DataError::Read {
        path: cache.to_path_buf(),
        source,
    })
}
