//! A GGUF header reader for our own checks (tests, artifact validation): the metadata, the tensor
//! infos and where the data section starts. Every length is bounds-checked; a malformed file is an
//! error, never a panic. The arrays it decodes are the kinds [`super::writer`] writes.
#![deny(clippy::arithmetic_side_effects)]

use super::types::GgmlType;
use super::writer::{MetaArray, MetaValue, TensorSpec, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};

#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    /// Each tensor with its offset from the data section.
    pub tensors: Vec<(TensorSpec, u64)>,
    /// File offset of the data section.
    pub data_start: u64,
}

impl GgufHeader {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("malformed GGUF at byte {at}: {what}")]
pub struct ReadError {
    pub at: usize,
    pub what: String,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> ReadError {
        ReadError {
            at: self.at,
            what: what.into(),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(|| self.err(format!("{n} bytes past the end")))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, ReadError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, ReadError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn len(&mut self) -> Result<usize, ReadError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= self.b.len())
            .ok_or_else(|| self.err(format!("length {n}")))
    }
    fn string(&mut self) -> Result<String, ReadError> {
        let n = self.len()?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }
    fn value(&mut self, ty: u32) -> Result<MetaValue, ReadError> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>()?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.arr()?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => MetaValue::Bool(self.arr::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr()?)),
            9 => {
                let item = self.u32()?;
                let n = self.len()?;
                MetaValue::Array(match item {
                    4 => MetaArray::U32((0..n).map(|_| self.u32()).collect::<Result<_, _>>()?),
                    5 => MetaArray::I32(
                        (0..n)
                            .map(|_| Ok(i32::from_le_bytes(self.arr()?)))
                            .collect::<Result<_, _>>()?,
                    ),
                    6 => MetaArray::F32(
                        (0..n)
                            .map(|_| Ok(f32::from_le_bytes(self.arr()?)))
                            .collect::<Result<_, _>>()?,
                    ),
                    8 => MetaArray::Str((0..n).map(|_| self.string()).collect::<Result<_, _>>()?),
                    other => return Err(self.err(format!("array item type {other}"))),
                })
            }
            other => return Err(self.err(format!("value type {other}"))),
        })
    }
}

/// Parses the header of a GGUF file held in `bytes`.
pub fn read_header(bytes: &[u8]) -> Result<GgufHeader, ReadError> {
    let mut c = Cursor { b: bytes, at: 0 };
    if c.take(4)? != MAGIC {
        return Err(c.err("no GGUF magic"));
    }
    let version = c.u32()?;
    let n_tensors = c.len()?;
    let n_kv = c.len()?;
    let mut metadata = Vec::new();
    for _ in 0..n_kv {
        let k = c.string()?;
        let ty = c.u32()?;
        metadata.push((k, c.value(ty)?));
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = c.string()?;
        let nd = c.u32()?;
        if nd > 4 {
            return Err(c.err(format!("tensor {name}: {nd} dims")));
        }
        let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
        let id = c.u32()?;
        let ty = GgmlType::ALL
            .into_iter()
            .find(|t| t.id() == id)
            .ok_or_else(|| c.err(format!("tensor {name}: type {id}")))?;
        let offset = c.u64()?;
        tensors.push((TensorSpec { name, dims, ty }, offset));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        Some((_, MetaValue::U32(a))) => u64::from(*a),
        _ => DEFAULT_ALIGNMENT,
    };
    let at = c.at as u64;
    let data_start = at
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| c.err("alignment"))?;
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        data_start,
    })
}
