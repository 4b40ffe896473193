//! The tensor infos of one GGUF file the way llama.cpp's `gguf_init_from_file` judges them: a known
//! ggml type, a row length that is a multiple of the type's block, an element count and byte size
//! that do not overflow, a name ggml can hold, each name once, and the data laid out in declaration
//! order, each tensor at the running offset padded to `general.alignment`, inside the file.
#![deny(clippy::arithmetic_side_effects)]

use std::collections::{BTreeMap, BTreeSet};

use super::ggml::{ggml_type, is_quantized, MAX_NAME};
use super::parse::{GgufFile, TensorInfo};

/// What the tensors of a file add up to.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct TensorTally {
    pub(crate) by_type: BTreeMap<String, usize>,
    pub(crate) quantized: usize,
    pub(crate) data_bytes: u64,
}

/// Bytes of a tensor of `dims` (ggml order: `dims[0]` is the row length) of a type with
/// `block_len` values in `block_bytes`; the error says what is wrong.
pub(crate) fn tensor_bytes(
    dims: &[u64],
    type_name: &str,
    block_len: u64,
    block_bytes: u64,
) -> Result<u64, String> {
    let mut elements: u64 = 1;
    for (i, d) in dims.iter().enumerate() {
        if i64::try_from(*d).is_err() {
            return Err(format!("dimension {i} is {d}, negative as ggml's int64"));
        }
        elements = elements
            .checked_mul(*d)
            .filter(|e| i64::try_from(*e).is_ok())
            .ok_or_else(|| format!("shape {dims:?} overflows ggml's element count"))?;
    }
    let row = dims.first().copied().unwrap_or(1);
    if block_len == 0 || !row.is_multiple_of(block_len) {
        return Err(format!(
            "row length {row} is not a multiple of {type_name}'s block of {block_len} values"
        ));
    }
    // elements is a multiple of the row length, hence of block_len
    elements
        .checked_div(block_len)
        .and_then(|blocks| blocks.checked_mul(block_bytes))
        .ok_or_else(|| format!("shape {dims:?} of {type_name} overflows a 64-bit size"))
}

/// Checks the tensors of `f` (named `file` in the messages); `names` collects every name across the
/// files of a split model (a name twice is a defect).
pub(crate) fn check_tensors(
    file: &str,
    f: &GgufFile,
    names: &mut BTreeSet<String>,
    defect: &mut dyn FnMut(String),
) -> TensorTally {
    let mut tally = TensorTally::default();
    // llama.cpp expects each tensor at the running size of the data section.
    let mut expected: Option<u64> = Some(0);
    for t in &f.tensors {
        let size = check_one(file, f, t, expected, defect, &mut tally);
        if !names.insert(t.name.clone()) {
            defect(format!("{file}: tensor {} is declared twice", t.name));
        }
        expected = match (expected, size) {
            (Some(e), Some(s)) => s
                .checked_next_multiple_of(f.alignment)
                .and_then(|p| e.checked_add(p)),
            _ => None,
        };
    }
    tally
}

/// One tensor; returns its byte size when it has one.
fn check_one(
    file: &str,
    f: &GgufFile,
    t: &TensorInfo,
    expected: Option<u64>,
    defect: &mut dyn FnMut(String),
    tally: &mut TensorTally,
) -> Option<u64> {
    let name = &t.name;
    if name.len() >= MAX_NAME {
        defect(format!(
            "{file}: tensor {name}: name is {} bytes, ggml holds at most {}",
            name.len(),
            MAX_NAME.saturating_sub(1)
        ));
    }
    let ty = match ggml_type(t.type_id) {
        Ok(ty) => ty,
        Err(e) => {
            defect(format!("{file}: tensor {name}: {e}"));
            return None;
        }
    };
    let entry = tally.by_type.entry(ty.name.to_string()).or_insert(0);
    *entry = entry.saturating_add(1);
    if is_quantized(ty) {
        tally.quantized = tally.quantized.saturating_add(1);
    }
    let size = match tensor_bytes(&t.dims, ty.name, ty.block_len, ty.block_bytes) {
        Ok(s) => s,
        Err(e) => {
            defect(format!(
                "{file}: tensor {name} ({} {:?}): {e}",
                ty.name, t.dims
            ));
            return None;
        }
    };
    tally.data_bytes = tally.data_bytes.saturating_add(size);
    if !t.offset.is_multiple_of(f.alignment) {
        defect(format!(
            "{file}: tensor {name}: offset {} is not a multiple of general.alignment {}",
            t.offset, f.alignment
        ));
    } else if let Some(e) = expected.filter(|e| *e != t.offset) {
        defect(format!(
            "{file}: tensor {name}: offset {} but llama.cpp expects {e} (the tensors' data in declaration order, each padded to {} bytes)",
            t.offset, f.alignment
        ));
    }
    let end = f
        .data_start
        .checked_add(t.offset)
        .and_then(|s| s.checked_add(size));
    match end {
        Some(end) if end <= f.file_len => {}
        _ => defect(format!(
            "{file}: tensor {name} ({} {:?}, {size} bytes at data offset {}) lies past the end of the file ({} bytes): truncated?",
            ty.name, t.dims, t.offset, f.file_len
        )),
    }
    Some(size)
}
