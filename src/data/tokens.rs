//! nanoGPT-style token files: a flat array of u16 or u32 token ids, memory-mapped.
//!
//! A sample is a window of `seq_len + 1` tokens starting at a position drawn from the
//! sample key; inputs are the first `seq_len`, targets the last `seq_len`.

use super::DataError;
use crate::plan::TokenDtype;
use memmap2::Mmap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone)]
pub struct TokenFile {
    path: PathBuf,
    map: Arc<Mmap>,
    dtype: TokenDtype,
    /// Tokens in the file.
    tokens: usize,
    /// The tokens windows are drawn from (a held-out split takes the tail).
    range: std::ops::Range<usize>,
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
            map: Arc::new(map),
            dtype,
            tokens,
            range: 0..tokens,
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

    /// The file split into training tokens and the last `fraction` held out, each
    /// holding at least one window of `seq_len + 1` tokens.
    pub fn split(&self, fraction: f64, seq_len: usize) -> Result<(TokenFile, TokenFile), DataError> {
        let cut = ((self.tokens as f64) * (1.0 - fraction)) as usize;
        if cut < seq_len + 1 || self.tokens - cut < seq_len + 1 {
            return Err(DataError::Invalid {
                path: self.path.clone(),
                message: format!(
                    "{} tokens cannot be split {:.0}/{:.0} % with a window of data.seq_len + 1 = {} on each side; \
                     change data.eval_fraction or add data",
                    self.tokens,
                    100.0 * (1.0 - fraction),
                    100.0 * fraction,
                    seq_len + 1
                ),
            });
        }
        let mut train = self.clone();
        let mut eval = self.clone();
        train.range = 0..cut;
        eval.range = cut..self.tokens;
        Ok((train, eval))
    }

    pub fn sample(&self, key: u64, seq_len: usize) -> (Vec<i64>, Vec<i64>) {
        let start = self.range.start + (key % (self.range.len() - seq_len) as u64) as usize;
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
