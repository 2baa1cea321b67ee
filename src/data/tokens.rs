//! nanoGPT-style token files: a flat array of u16 or u32 token ids, memory-mapped.
//!
//! A sample is a window of `seq_len + 1` tokens starting at a position drawn from the
//! sample key; inputs are the first `seq_len`, targets the last `seq_len`.

use super::DataError;
use crate::plan::TokenDtype;
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
        // one window of seq_len + 1 tokens is a valid data set
        if tokens < seq_len + 1 {
            return Err(invalid(format!(
                "{tokens} tokens is fewer than one sample of data.seq_len + 1 = {}; lower data.seq_len or add data",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tokens: &[u16]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(f.path(), bytes).unwrap();
        f
    }

    #[test]
    fn exactly_one_window_is_a_data_set_and_one_token_less_is_refused() {
        let tokens: Vec<u16> = (0..65).collect();
        let f = file(&tokens);
        let data = TokenFile::open(f.path(), TokenDtype::U16, 64, 100).unwrap();
        for key in [0, 1, 12345] {
            let (inputs, targets) = data.sample(key, 64);
            assert_eq!(inputs, (0..64).collect::<Vec<i64>>());
            assert_eq!(targets, (1..65).collect::<Vec<i64>>());
        }
        let short = file(&tokens[..64]);
        let e = TokenFile::open(short.path(), TokenDtype::U16, 64, 100)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("64 tokens is fewer than one sample of data.seq_len + 1 = 65"),
            "{e}"
        );
    }
}
