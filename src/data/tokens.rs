//! nanoGPT-style token files: a flat array of u16 or u32 token ids, memory-mapped.
//!
//! A sample is a window of `seq_len + 1` tokens starting at a position drawn from the
//! sample key; inputs are the first `seq_len`, targets the last `seq_len`.

use super::DataError;
use crate::config::plan::TokenDtype;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    dtype: TokenDtype,
    tokens: usize,
}

impl TokenFile {
    pub fn open(
        path: &Path,
        dtype: TokenDtype,
        seq_len: usize,
        vocab: usize,
    ) -> Result<TokenFile, DataError> {
        let file = std::fs::File::open(path).map_err(|source| DataError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only; a concurrent writer truncating the file is the
        // usual memmap caveat, accepted for training data as nanoGPT does.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| DataError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let width = match dtype {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        };
        let invalid = |message: String| DataError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        if map.len() % width != 0 {
            return Err(invalid(format!(
                "{} bytes is not a whole number of {width}-byte tokens; check data.dtype",
                map.len()
            )));
        }
        let tokens = map.len() / width;
        if tokens < seq_len + 2 {
            return Err(invalid(format!(
                "{tokens} tokens is fewer than one sample of data.seq_len + 1 = {}",
                seq_len + 1
            )));
        }
        let f = TokenFile {
            path: path.to_path_buf(),
            map,
            dtype,
            tokens,
        };
        // a cheap guard against the wrong dtype or vocabulary: scan the first MiB
        let probe = tokens.min(1 << 18);
        if let Some(bad) = (0..probe).map(|i| f.token(i)).find(|&t| t as usize >= vocab) {
            return Err(invalid(format!(
                "token id {bad} is outside the model's vocabulary ({vocab}); check data.dtype and model.vocab_size"
            )));
        }
        Ok(f)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    fn token(&self, i: usize) -> i64 {
        match self.dtype {
            TokenDtype::U16 => i64::from(u16::from_le_bytes([self.map[2 * i], self.map[2 * i + 1]])),
            TokenDtype::U32 => {
                let b = &self.map[4 * i..4 * i + 4];
                i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
        }
    }

    pub fn sample(&self, key: u64, seq_len: usize) -> (Vec<i64>, Vec<i64>) {
        let start = (key % (self.tokens - seq_len) as u64) as usize;
        let window: Vec<i64> = (start..start + seq_len + 1).map(|i| self.token(i)).collect();
        (window[..seq_len].to_vec(), window[1..].to_vec())
    }
}
