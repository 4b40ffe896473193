//! The GGUF v3 container, written streaming and atomically.
//!
//! Layout (all little-endian): magic `GGUF`, version `u32 = 3`, tensor count `u64`, metadata count
//! `u64`; the metadata `(key, type u32, value)` with strings as `u64 length + bytes` and arrays as
//! `item type u32, count u64, items`; one tensor info per tensor (`name`, `n_dims u32`, dims `u64`
//! with ne[0] — the contiguous row length — first, type `u32`, offset `u64` from the data section);
//! padding to `general.alignment` (32 unless set); then each tensor's bytes, each padded to the
//! alignment.
//!
//! All sizes are known up front, so the header is written first and the tensors follow one at a time
//! ([`GgufWriter::write_tensor`]): the model is never in memory at once. The file is a temporary in
//! the target's directory until [`GgufWriter::finish`] renames it; dropped early, it is removed.
// Sizes and counts come from model files: overflow must be an error, never wrap.
#![deny(clippy::arithmetic_side_effects)]

use super::error::GgufError;
use super::types::GgmlType;
use std::collections::HashSet;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_NAME` is 64 bytes including the terminating NUL.
pub const MAX_TENSOR_NAME: usize = 63;

/// A metadata value (`enum gguf_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(MetaArray),
}

/// A metadata array (one item type).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    I32(Vec<i32>),
    U32(Vec<u32>),
    F32(Vec<f32>),
    Str(Vec<String>),
}

impl MetaValue {
    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            MetaValue::U8(v) => out.push(*v),
            MetaValue::I8(v) => out.extend(v.to_le_bytes()),
            MetaValue::U16(v) => out.extend(v.to_le_bytes()),
            MetaValue::I16(v) => out.extend(v.to_le_bytes()),
            MetaValue::U32(v) => out.extend(v.to_le_bytes()),
            MetaValue::I32(v) => out.extend(v.to_le_bytes()),
            MetaValue::F32(v) => out.extend(v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(u8::from(*v)),
            MetaValue::Str(s) => put_str(out, s),
            MetaValue::U64(v) => out.extend(v.to_le_bytes()),
            MetaValue::I64(v) => out.extend(v.to_le_bytes()),
            MetaValue::F64(v) => out.extend(v.to_le_bytes()),
            MetaValue::Array(a) => {
                let (item, n) = match a {
                    MetaArray::I32(v) => (5u32, v.len()),
                    MetaArray::U32(v) => (4, v.len()),
                    MetaArray::F32(v) => (6, v.len()),
                    MetaArray::Str(v) => (8, v.len()),
                };
                out.extend(item.to_le_bytes());
                out.extend((n as u64).to_le_bytes());
                match a {
                    MetaArray::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
                    MetaArray::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
                    MetaArray::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
                    MetaArray::Str(v) => v.iter().for_each(|s| put_str(out, s)),
                }
            }
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// One tensor's info: `dims` in ggml order (ne[0], the row length, first).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    /// The tensor's bytes, or the error naming it when the shape does not fit the type.
    pub fn byte_size(&self) -> Result<u64, GgufError> {
        let dims_err = || GgufError::Dims {
            tensor: self.name.clone(),
            dims: self.dims.clone(),
        };
        if self.dims.is_empty() || self.dims.len() > 4 || self.dims.contains(&0) {
            return Err(dims_err());
        }
        let cols = self.dims[0];
        let block = self.ty.block_len() as u64;
        if !cols.is_multiple_of(block) {
            return Err(GgufError::RowNotBlockMultiple {
                tensor: self.name.clone(),
                ty: self.ty.name(),
                cols,
                block: self.ty.block_len(),
            });
        }
        let rows = self.dims[1..]
            .iter()
            .try_fold(1u64, |a, d| a.checked_mul(*d))
            .ok_or_else(dims_err)?;
        cols.checked_div(block)
            .and_then(|blocks| blocks.checked_mul(self.ty.block_bytes() as u64))
            .and_then(|r| r.checked_mul(rows))
            .filter(|n| usize::try_from(*n).is_ok())
            .ok_or_else(dims_err)
    }
}

fn align_up(v: u64, alignment: u64) -> Option<u64> {
    // alignment is a power of two (checked in `create`)
    let mask = alignment.checked_sub(1)?;
    v.checked_add(mask).map(|x| x & !mask)
}

/// The metadata's alignment (`general.alignment`, a u32 power of two) or the default.
fn alignment_of(metadata: &[(String, MetaValue)]) -> Result<u64, GgufError> {
    match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, MetaValue::U32(a))) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some((_, MetaValue::U32(a))) => Err(GgufError::Alignment {
            value: u64::from(*a),
        }),
        Some((_, _)) => Err(GgufError::Alignment { value: 0 }),
    }
}

/// Checks a GGUF's declared content and returns each tensor's byte size and data offset, and the
/// alignment. No file is touched: the caller's bad input is found before any output exists.
pub fn plan(
    metadata: &[(String, MetaValue)],
    tensors: &[TensorSpec],
) -> Result<(Vec<(u64, u64)>, u64), GgufError> {
    let alignment = alignment_of(metadata)?;
    let mut keys = HashSet::new();
    for (k, _) in metadata {
        if k.is_empty() || !keys.insert(k.as_str()) {
            return Err(GgufError::DuplicateKey { key: k.clone() });
        }
    }
    let mut names = HashSet::new();
    let mut offset = 0u64;
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.name.is_empty() || t.name.len() > MAX_TENSOR_NAME {
            return Err(GgufError::TensorName {
                name: t.name.clone(),
            });
        }
        if !names.insert(t.name.as_str()) {
            return Err(GgufError::DuplicateTensor {
                name: t.name.clone(),
            });
        }
        let size = t.byte_size()?;
        out.push((size, offset));
        offset = offset
            .checked_add(size)
            .and_then(|e| align_up(e, alignment))
            .ok_or_else(|| GgufError::Dims {
                tensor: t.name.clone(),
                dims: t.dims.clone(),
            })?;
    }
    Ok((out, alignment))
}

/// A GGUF file being written: header done, tensors written in declared order.
pub struct GgufWriter {
    path: PathBuf,
    out: BufWriter<tempfile::NamedTempFile>,
    tensors: Vec<TensorSpec>,
    sizes: Vec<(u64, u64)>,
    alignment: u64,
    next: usize,
    /// Bytes of the data section written so far.
    data_pos: u64,
}

impl GgufWriter {
    /// Checks the content ([`plan`]), then writes the header, metadata and tensor infos to a
    /// temporary file beside `path`.
    pub fn create(
        path: &Path,
        metadata: &[(String, MetaValue)],
        tensors: Vec<TensorSpec>,
    ) -> Result<Self, GgufError> {
        let (sizes, alignment) = plan(metadata, &tensors)?;
        let dir = path.parent().unwrap_or_else(|| Path::new("."));
        let io = |e| GgufError::io(path, e);
        std::fs::create_dir_all(dir).map_err(io)?;
        let tmp = flexinfer_fsutil::temp_file_in(dir).map_err(io)?;
        let mut head = Vec::with_capacity(1 << 16);
        head.extend(MAGIC);
        head.extend(VERSION.to_le_bytes());
        head.extend((tensors.len() as u64).to_le_bytes());
        head.extend((metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend(v.type_id().to_le_bytes());
            v.encode(&mut head);
        }
        for (t, (_, offset)) in tensors.iter().zip(&sizes) {
            put_str(&mut head, &t.name);
            head.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| head.extend(d.to_le_bytes()));
            head.extend(t.ty.id().to_le_bytes());
            head.extend(offset.to_le_bytes());
        }
        let padded = align_up(head.len() as u64, alignment)
            .ok_or(GgufError::Alignment { value: alignment })?;
        head.resize(usize::try_from(padded).unwrap_or(head.len()), 0);
        let mut out = BufWriter::with_capacity(1 << 22, tmp);
        out.write_all(&head).map_err(io)?;
        Ok(GgufWriter {
            path: path.to_path_buf(),
            out,
            tensors,
            sizes,
            alignment,
            next: 0,
            data_pos: 0,
        })
    }

    /// The tensor the next [`write_tensor`](Self::write_tensor) must be, if any.
    pub fn next_tensor(&self) -> Option<&TensorSpec> {
        self.tensors.get(self.next)
    }

    /// Writes the next tensor's bytes (`name` must be the next declared tensor, `bytes` its size).
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<(), GgufError> {
        let (Some(spec), Some(&(size, offset))) =
            (self.tensors.get(self.next), self.sizes.get(self.next))
        else {
            return Err(GgufError::Order {
                expected: "no more tensors".into(),
                got: name.to_string(),
            });
        };
        if spec.name != name {
            return Err(GgufError::Order {
                expected: spec.name.clone(),
                got: name.to_string(),
            });
        }
        if bytes.len() as u64 != size {
            return Err(GgufError::Size {
                tensor: name.to_string(),
                expected: size,
                got: bytes.len() as u64,
            });
        }
        let io = |e| GgufError::io(&self.path, e);
        // Padding up to this tensor's offset (the previous one's alignment).
        let pad = offset.saturating_sub(self.data_pos);
        self.out
            .write_all(&vec![0u8; usize::try_from(pad).unwrap_or(0)])
            .map_err(io)?;
        self.out.write_all(bytes).map_err(io)?;
        self.data_pos = offset.saturating_add(size);
        self.next = self.next.saturating_add(1);
        Ok(())
    }

    /// Pads the last tensor, syncs and renames the file into place; returns its size.
    pub fn finish(mut self) -> Result<u64, GgufError> {
        if self.next != self.tensors.len() {
            return Err(GgufError::Incomplete {
                written: self.next,
                declared: self.tensors.len(),
            });
        }
        let path = self.path.clone();
        let io = |e| GgufError::io(&path, e);
        let end = align_up(self.data_pos, self.alignment).unwrap_or(self.data_pos);
        let pad = usize::try_from(end.saturating_sub(self.data_pos)).unwrap_or(0);
        self.out.write_all(&vec![0u8; pad]).map_err(io)?;
        let tmp = self.out.into_inner().map_err(|e| io(e.into_error()))?;
        tmp.as_file().sync_all().map_err(io)?;
        let len = tmp.as_file().metadata().map_err(io)?.len();
        tmp.persist(&path).map_err(|e| io(e.error))?;
        let dir = path.parent().unwrap_or_else(|| Path::new("."));
        flexinfer_fsutil::fsync_dir(dir).map_err(io)?;
        Ok(len)
    }
}
