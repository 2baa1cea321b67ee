//! The state files of a checkpoint: which tensors, in which dtype, at which offsets.
//!
//! File `<state>.safetensors` holds one tensor per unit, named after the unit
//! (`embedding`, `layers.3`, `final`), of shape `[numel]`: the unit's flat buffer
//! without the padding ZeRO adds for the world size. The layout is a pure function of
//! the model and the parameter dtype, so save and load compute it the same way and the
//! manifest only needs a checksum of the header.

use crate::model::layout::{UnitKind, UnitLayout};
use crate::model::safetensors::{self, Entry};
use tierzero_offload::nvme::swap::State;

/// The name a unit's tensors carry in checkpoint files.
pub fn unit_name(layout: &UnitLayout) -> String {
    match layout.kind {
        UnitKind::Embedding => "embedding".into(),
        UnitKind::Block(i) => format!("layers.{i}"),
        UnitKind::Final => "final".into(),
    }
}

/// One state file's layout.
#[derive(Clone, Debug)]
pub struct StateFile {
    pub state: State,
    pub dtype: &'static str,
    pub header: Vec<u8>,
    pub entries: Vec<Entry>,
}

impl StateFile {
    pub fn new(state: State, dtype: &'static str, units: &[UnitLayout]) -> StateFile {
        let entries = safetensors::layout(units.iter().map(|u| (unit_name(u), dtype, vec![u.numel as i64])));
        let metadata = [
            ("format", "tierzero-checkpoint".to_string()),
            ("state", state.name().to_string()),
        ];
        StateFile {
            state,
            dtype,
            header: safetensors::header(&entries, &metadata),
            entries,
        }
    }

    pub fn file_name(&self) -> String {
        format!("{}.safetensors", self.state.name())
    }

    pub fn elem_bytes(&self) -> usize {
        safetensors::dtype_bytes(self.dtype)
    }

    /// Total file length.
    pub fn len(&self) -> u64 {
        (self.header.len() + self.entries.last().map_or(0, |e| e.end)) as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == self.header.len() as u64
    }

    /// File offset of element `elem` of unit `u`.
    pub fn offset(&self, u: usize, elem: usize) -> u64 {
        (self.header.len() + self.entries[u].start + elem * self.elem_bytes()) as u64
    }
}

/// The dtype name of stored parameters for a precision name (`fp32`, `bf16`, `fp16`).
pub fn param_dtype(precision: &str) -> &'static str {
    match precision {
        "fp32" => "F32",
        "fp16" => "F16",
        _ => "BF16",
    }
}

/// The four state files of a model whose parameters are stored as `param_dtype`.
pub fn state_files(units: &[UnitLayout], param_dtype: &'static str) -> Vec<StateFile> {
    State::ALL
        .iter()
        .map(|&state| {
            let dtype = if state == State::Param { param_dtype } else { "F32" };
            StateFile::new(state, dtype, units)
        })
        .collect()
}
