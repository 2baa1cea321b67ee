//! Hugging Face model directories: `config.json` plus safetensors weights.
//!
//! Save writes `config.json` and `model.safetensors` (or shards of at most
//! `shard_bytes` with `model.safetensors.index.json`), tensor by tensor from the unit
//! buffers, under `LlamaForCausalLM` / `GPT2LMHeadModel` names. Load memory-maps the
//! files (single or sharded) and copies each tensor straight into its place in the unit
//! buffers, converting bf16/fp16 to fp32; no second full copy of the model is made.
//! GPT-2 names are accepted with or without the `transformer.` prefix, and a tied
//! `lm_head.weight` is ignored. The safetensors format: an 8-byte little-endian header
//! length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw data.

pub use super::companions::Companions;
use super::layout::{units, UnitLayout};
use super::safetensors;
use crate::config::model::{Architecture, Family, ModelConfig};
use memmap2::Mmap;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

pub(super) fn io(path: &Path) -> impl Fn(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn format_err(path: &Path, message: impl Into<String>) -> HfError {
    HfError::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Stored element type of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveDtype {
    F32,
    Bf16,
    F16,
}

impl SaveDtype {
    fn name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "F32",
            SaveDtype::Bf16 => "BF16",
            SaveDtype::F16 => "F16",
        }
    }
    fn bytes(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::Bf16 | SaveDtype::F16 => 2,
        }
    }
}

/// The Hugging Face `config.json` for a model.
pub fn config_json(config: &ModelConfig, dtype: SaveDtype) -> Value {
    let torch_dtype = match dtype {
        SaveDtype::F32 => "float32",
        SaveDtype::Bf16 => "bfloat16",
        SaveDtype::F16 => "float16",
    };
    match config.architecture {
        Architecture::Llama => {
            let (model_type, class) = match config.family {
                Family::Llama => ("llama", "LlamaForCausalLM"),
                Family::Mistral => ("mistral", "MistralForCausalLM"),
                Family::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
                Family::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            };
            let mut c = json!({
                "architectures": [class],
                "model_type": model_type,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_hidden_layers": config.num_hidden_layers,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "head_dim": config.head_dim(),
                "vocab_size": config.vocab_size,
                "max_position_embeddings": config.max_position_embeddings,
                "rms_norm_eps": config.norm_eps,
                "rope_theta": config.rope_theta,
                "rope_scaling": config.rope_scaling.map(|s| json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                })),
                "tie_word_embeddings": config.tie_word_embeddings,
                "hidden_act": "silu",
                "torch_dtype": torch_dtype,
            });
            match config.family {
                Family::Llama | Family::Qwen3 => {
                    c["attention_bias"] = json!(config.attention_bias);
                    if config.family == Family::Llama {
                        c["mlp_bias"] = json!(false);
                    }
                }
                Family::Mistral => c["sliding_window"] = json!(config.sliding_window),
                Family::Qwen2 => {
                    c["use_sliding_window"] = json!(config.sliding_window.is_some());
                    c["sliding_window"] = json!(config.sliding_window);
                }
            }
            c
        }
        Architecture::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": config.hidden_size,
            "n_inner": config.intermediate_size,
            "n_layer": config.num_hidden_layers,
            "n_head": config.num_attention_heads,
            "n_positions": config.max_position_embeddings,
            "vocab_size": config.vocab_size,
            "layer_norm_epsilon": config.norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": true,
            "torch_dtype": torch_dtype,
        }),
    }
}

/// Writes a Hugging Face directory from per-unit fp32 buffers.
pub fn save(
    dir: &Path,
    config: &ModelConfig,
    weights: &[Vec<f32>],
    dtype: SaveDtype,
    shard_bytes: usize,
) -> Result<(), HfError> {
    save_streaming(dir, config, dtype, shard_bytes, &mut |u| Ok(weights[u].clone()))
}

/// Writes a Hugging Face directory asking `unit(u)` for each unit's fp32 buffer in
/// order, one at a time: at most one unit is held (export from a checkpoint streams).
pub fn save_streaming(
    dir: &Path,
    config: &ModelConfig,
    dtype: SaveDtype,
    shard_bytes: usize,
    unit: &mut dyn FnMut(usize) -> Result<Vec<f32>, HfError>,
) -> Result<(), HfError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let layouts = units(config);
    // group tensors into shards in state-dict order
    let mut shards: Vec<Vec<(usize, usize)>> = vec![Vec::new()];
    let mut size = 0;
    for (u, layout) in layouts.iter().enumerate() {
        for (p, spec) in layout.params.iter().enumerate() {
            let bytes = spec.numel * dtype.bytes();
            if size > 0 && size + bytes > shard_bytes {
                shards.push(Vec::new());
                size = 0;
            }
            if let Some(last) = shards.last_mut() {
                last.push((u, p));
            }
            size += bytes;
        }
    }
    let count = shards.len();
    let mut weight_map = Map::new();
    let mut total = 0usize;
    let mut current: Option<(usize, Vec<f32>)> = None;
    for (i, shard) in shards.iter().enumerate() {
        let name = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let path = dir.join(&name);
        let entries = safetensors::layout(shard.iter().map(|&(u, p)| {
            let spec = &layouts[u].params[p];
            (spec.name.clone(), dtype.name(), spec.shape.clone())
        }));
        for e in &entries {
            weight_map.insert(e.name.clone(), json!(name));
        }
        total += entries.last().map_or(0, |e| e.end);
        let file = std::fs::File::create(&path).map_err(io(&path))?;
        let mut out = std::io::BufWriter::new(file);
        out.write_all(&safetensors::header(&entries, &[("format", "pt".into())]))
            .map_err(io(&path))?;
        for &(u, p) in shard {
            if current.as_ref().is_none_or(|(held, _)| *held != u) {
                drop(current.take()); // release the previous unit before loading the next
                current = Some((u, unit(u)?));
            }
            let Some((_, weights)) = &current else { continue };
            let spec = &layouts[u].params[p];
            let values = &weights[spec.offset..spec.offset + spec.numel];
            for &x in values {
                match dtype {
                    SaveDtype::F32 => out.write_all(&x.to_le_bytes()),
                    SaveDtype::Bf16 => {
                        out.write_all(&tierzero_offload::convert::f32_to_bf16(x).to_le_bytes())
                    }
                    SaveDtype::F16 => out.write_all(&tierzero_offload::convert::f32_to_f16(x).to_le_bytes()),
                }
                .map_err(io(&path))?;
            }
        }
        out.flush().map_err(io(&path))?;
    }
    if count > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&index).unwrap_or_default()).map_err(io(&path))?;
    }
    let path = dir.join("config.json");
    let text = serde_json::to_vec_pretty(&config_json(config, dtype)).unwrap_or_default();
    std::fs::write(&path, text).map_err(io(&path))
}

/// One memory-mapped safetensors file.
struct SafeTensors {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    header: Map<String, Value>,
}

impl SafeTensors {
    fn open(path: &Path) -> Result<SafeTensors, HfError> {
        let file = std::fs::File::open(path).map_err(io(path))?;
        // SAFETY: read-only map of a weights file; concurrent truncation is the usual
        // memmap caveat, accepted as the safetensors library does.
        let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
        if map.len() < 8 {
            return Err(format_err(path, "too short for a safetensors header"));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&map[..8]);
        let header_len = u64::from_le_bytes(len) as usize;
        let header_end = 8usize
            .checked_add(header_len)
            .filter(|&e| e <= map.len())
            .ok_or_else(|| {
                format_err(
                    path,
                    format!("header length {header_len} runs past the end of the file"),
                )
            })?;
        let header: Value = serde_json::from_slice(&map[8..header_end])
            .map_err(|e| format_err(path, format!("header is not JSON: {e}")))?;
        let Value::Object(header) = header else {
            return Err(format_err(path, "header is not a JSON object"));
        };
        Ok(SafeTensors {
            path: path.to_path_buf(),
            map,
            data_start: header_end,
            header,
        })
    }

    /// Copies elements `elems` of tensor `name` into `out` as fp32, checking dtype,
    /// shape and bounds. Only those elements' pages are touched.
    fn read_into(
        &self,
        name: &str,
        shape: &[i64],
        elems: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), HfError> {
        let entry = self
            .header
            .get(name)
            .ok_or_else(|| format_err(&self.path, format!("no tensor {name}")))?;
        let got_shape: Vec<i64> = entry["shape"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default();
        if got_shape != shape {
            return Err(format_err(
                &self.path,
                format!("{name} has shape {got_shape:?}, the config implies {shape:?}"),
            ));
        }
        let offsets: Vec<usize> = entry["data_offsets"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64().map(|x| x as usize)).collect())
            .unwrap_or_default();
        let (start, end) = match offsets.as_slice() {
            [s, e] if s <= e && self.data_start + e <= self.map.len() => {
                (self.data_start + s, self.data_start + e)
            }
            _ => {
                return Err(format_err(
                    &self.path,
                    format!("{name} has invalid data_offsets {offsets:?}"),
                ))
            }
        };
        let data = &self.map[start..end];
        let dtype = entry["dtype"].as_str().unwrap_or("");
        let width = match dtype {
            "F32" => 4,
            "BF16" | "F16" => 2,
            other => {
                return Err(format_err(
                    &self.path,
                    format!("{name} has dtype {other}; supported: F32, BF16, F16"),
                ))
            }
        };
        let numel = shape.iter().product::<i64>().max(0) as usize;
        if data.len() != numel * width {
            return Err(format_err(
                &self.path,
                format!("{name}: {} bytes for {numel} elements of {dtype}", data.len()),
            ));
        }
        let data = &data[elems.start * width..elems.end * width];
        for (i, o) in out.iter_mut().enumerate() {
            let b = &data[i * width..(i + 1) * width];
            *o = match dtype {
                "F32" => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                "BF16" => tierzero_offload::convert::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
                _ => tierzero_offload::convert::f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            };
        }
        Ok(())
    }
}

/// Where each tensor name lives: one file or the shards of an index.
fn tensor_files(dir: &Path) -> Result<(Vec<SafeTensors>, HashMap<String, usize>), HfError> {
    let index_path = dir.join("model.safetensors.index.json");
    let names: Vec<PathBuf> = if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
        let index: Value = serde_json::from_str(&text).map_err(|e| format_err(&index_path, e.to_string()))?;
        let map = index["weight_map"]
            .as_object()
            .ok_or_else(|| format_err(&index_path, "no weight_map"))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        files.into_iter().map(|f| dir.join(f)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let files: Vec<SafeTensors> = names
        .iter()
        .map(|p| SafeTensors::open(p))
        .collect::<Result<_, _>>()?;
    let mut where_is = HashMap::new();
    for (i, f) in files.iter().enumerate() {
        for name in f.header.keys() {
            where_is.insert(name.clone(), i);
        }
    }
    Ok((files, where_is))
}

/// A Hugging Face directory, memory-mapped, read by unit and element range: a rank
/// touches only the pages of the slices it keeps.
pub struct HfWeights {
    dir: PathBuf,
    files: Vec<SafeTensors>,
    where_is: HashMap<String, usize>,
    layouts: Vec<UnitLayout>,
}

impl HfWeights {
    pub fn open(dir: &Path, config: &ModelConfig) -> Result<HfWeights, HfError> {
        let (files, where_is) = tensor_files(dir)?;
        let weights = HfWeights {
            dir: dir.to_path_buf(),
            files,
            where_is,
            layouts: units(config),
        };
        // every tensor present with the right shape before any rank starts
        for layout in &weights.layouts {
            for spec in &layout.params {
                let (name, file) = weights.locate(&spec.name)?;
                weights.files[file].read_into(name, &spec.shape, 0..0, &mut [])?;
            }
        }
        Ok(weights)
    }

    fn locate<'n>(&'n self, wanted: &'n str) -> Result<(&'n str, usize), HfError> {
        let bare = wanted.trim_start_matches("transformer.");
        [wanted, bare]
            .into_iter()
            .find_map(|n| self.where_is.get(n).map(|&f| (n, f)))
            .ok_or_else(|| format_err(&self.dir, format!("no tensor {wanted} in the safetensors files")))
    }

    /// Elements `range` of unit `u`'s flat buffer, as fp32, into `out`.
    pub fn read(&self, u: usize, range: std::ops::Range<usize>, out: &mut [f32]) -> Result<(), HfError> {
        for spec in &self.layouts[u].params {
            let lo = range.start.max(spec.offset);
            let hi = range.end.min(spec.offset + spec.numel);
            if lo >= hi {
                continue;
            }
            let (name, file) = self.locate(&spec.name)?;
            self.files[file].read_into(
                name,
                &spec.shape,
                lo - spec.offset..hi - spec.offset,
                &mut out[lo - range.start..hi - range.start],
            )?;
        }
        Ok(())
    }

    /// Drops the mapped files' pages from this process's resident set (they stay in the
    /// page cache; a later read faults them in again from the file). Once every rank
    /// holds its state the weights are not read again, and a model's pages held mapped
    /// through the steps counted its file's size in the process's RSS (268 MB for the
    /// side-by-side's 134M model in bf16).
    pub fn release_pages(&self) {
        for file in &self.files {
            // SAFETY: a read-only private mapping that is never written: MADV_DONTNEED
            // only discards clean pages, and the next access reads the same bytes back
            // from the file. Failure only leaves the pages resident.
            let _ = unsafe { file.map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }
}

/// Reads a Hugging Face directory into per-unit fp32 buffers laid out for `config`.
pub fn load(dir: &Path, config: &ModelConfig) -> Result<Vec<Vec<f32>>, HfError> {
    let weights = HfWeights::open(dir, config)?;
    weights
        .layouts
        .iter()
        .enumerate()
        .map(|(u, layout)| {
            let mut flat = vec![0f32; layout.numel];
            weights.read(u, 0..layout.numel, &mut flat)?;
            Ok(flat)
        })
        .collect()
}
