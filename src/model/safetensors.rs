//! The safetensors container, written: an 8-byte little-endian header length, a JSON
//! header `{name: {dtype, shape, data_offsets}}` (plus optional `__metadata__` strings),
//! padded with spaces so the data starts 8-byte aligned, then the raw tensors back to
//! back. Hugging Face exports and checkpoint files both lay themselves out here, before
//! any data is written, so writers can place each tensor (or a rank its slice of one)
//! at a known offset. Reading lives with each user (`hf.rs` memory-maps).

use serde_json::{json, Map, Value};

/// One tensor of a file: where its bytes go, relative to the start of the data.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub name: String,
    /// `F32`, `BF16`, `F16`.
    pub dtype: &'static str,
    pub shape: Vec<i64>,
    pub start: usize,
    pub end: usize,
}

/// Bytes of one element of a safetensors dtype name.
pub fn dtype_bytes(dtype: &str) -> usize {
    match dtype {
        "F32" => 4,
        _ => 2,
    }
}

/// Lays `tensors` (name, dtype, shape) out back to back.
pub fn layout(tensors: impl IntoIterator<Item = (String, &'static str, Vec<i64>)>) -> Vec<Entry> {
    let mut offset = 0;
    tensors
        .into_iter()
        .map(|(name, dtype, shape)| {
            let bytes = shape.iter().product::<i64>().max(0) as usize * dtype_bytes(dtype);
            let entry = Entry {
                name,
                dtype,
                shape,
                start: offset,
                end: offset + bytes,
            };
            offset += bytes;
            entry
        })
        .collect()
}

/// The file's first bytes: length prefix and padded JSON header. The data starts right
/// after them.
pub fn header(entries: &[Entry], metadata: &[(&str, String)]) -> Vec<u8> {
    let mut map = Map::new();
    if !metadata.is_empty() {
        let meta: Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| ((*k).to_string(), Value::String(v.clone())))
            .collect();
        map.insert("__metadata__".into(), Value::Object(meta));
    }
    for e in entries {
        map.insert(
            e.name.clone(),
            json!({ "dtype": e.dtype, "shape": e.shape, "data_offsets": [e.start, e.end] }),
        );
    }
    let mut text = Value::Object(map).to_string().into_bytes();
    while !(text.len() + 8).is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_offsets_are_contiguous() {
        let entries = layout([
            ("a".to_string(), "F32", vec![3, 2]),
            ("b".to_string(), "BF16", vec![5]),
        ]);
        assert_eq!((entries[0].start, entries[0].end), (0, 24));
        assert_eq!((entries[1].start, entries[1].end), (24, 34));
        let h = header(&entries, &[("format", "x".into())]);
        assert_eq!(h.len() % 8, 0);
        let len = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(len + 8, h.len());
        let v: Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["b"]["data_offsets"], json!([24, 34]));
        assert_eq!(v["__metadata__"]["format"], json!("x"));
    }
}
