//! Text data: `.txt` or `.jsonl` (`{"text": ...}` per line) tokenized with a Hugging
//! Face `tokenizer.json`, cached as a u32 token file next to the text.
//!
//! The cache name carries a hash of the tokenizer file and the text's size and mtime,
//! so editing either re-tokenizes; a stale cache is never used. Documents are separated
//! by the tokenizer's end-of-text token when it has one (`<|endoftext|>`,
//! `<|end_of_text|>`, `</s>`, `<eos>`).

use super::encode::EOS_CANDIDATES;
use super::samples::{file_stamp, fnv1a, FNV_OFFSET};
use super::DataError;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

/// Tokenizes `text` with `tokenizer` unless an up-to-date cache exists; returns the
/// cache path (u32 tokens).
pub fn tokenize_cached(text: &Path, tokenizer: &Path) -> Result<PathBuf, DataError> {
    let read_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Read {
            path: path.clone(),
            source,
        }
    };
    let invalid = |path: &Path, message: String| DataError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    let tokenizer_bytes = std::fs::read(tokenizer).map_err(read_err(tokenizer))?;
    let meta = std::fs::metadata(text).map_err(read_err(text))?;
    let key = fnv1a(&tokenizer_bytes, file_stamp(&meta, FNV_OFFSET));
    let cache = text.with_extension(format!("{key:016x}.tokens.bin"));
    if cache.exists() {
        return Ok(cache);
    }
    let tok = tokenizers::Tokenizer::from_bytes(&tokenizer_bytes)
        .map_err(|e| invalid(tokenizer, format!("not a tokenizer.json: {e}")))?;
    let eos = EOS_CANDIDATES.iter().find_map(|t| tok.token_to_id(t));
    let jsonl = text.extension().and_then(|e| e.to_str()) == Some("jsonl");
    let file = std::fs::File::open(text).map_err(read_err(text))?;
    let tmp = cache.with_extension("partial");
    let out = std::fs::File::create(&tmp).map_err(read_err(&tmp))?;
    let mut out = std::io::BufWriter::new(out);
    let mut document = String::new();
    let flush = |doc: &str, out: &mut std::io::BufWriter<std::fs::File>| -> Result<(), DataError> {
        if doc.is_empty() {
            return Ok(());
        }
        let encoding = tok
            .encode(doc, false)
            .map_err(|e| invalid(text, format!("cannot tokenize: {e}")))?;
        for &id in encoding.get_ids().iter().chain(eos.as_ref()) {
            out.write_all(&id.to_le_bytes()).map_err(read_err(&tmp))?;
        }
        Ok(())
    };
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(read_err(text))?;
        if jsonl {
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| invalid(text, format!("line {}: not JSON: {e}", number + 1)))?;
            let doc = value["text"]
                .as_str()
                .ok_or_else(|| invalid(text, format!("line {}: no string field \"text\"", number + 1)))?;
            flush(doc, &mut out)?;
        } else if line.trim().is_empty() {
            // blank lines separate documents in plain text
            flush(&document, &mut out)?;
            document.clear();
        } else {
            document.push_str(&line);
            document.push('\n');
        }
    }
    flush(&document, &mut out)?;
    out.flush().map_err(read_err(&tmp))?;
    drop(out);
    std::fs::rename(&tmp, &cache).map_err(read_err(&cache))?;
    Ok(cache)
}
