//! A bounded GGUF header reader for hostile files: it streams the header (magic, version, metadata,
//! tensor infos) from the file, never allocates more than the bytes that remain in the file (and
//! never a string over [`MAX_STRING`]), keeps arrays as their item type and length only, and does
//! all arithmetic checked. What it cannot read is an error naming the byte, the key or the tensor;
//! what it reads is judged by [`super::tensors`] and [`super::metadata`].
#![deny(clippy::arithmetic_side_effects)]

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use super::ggml::{DEFAULT_ALIGNMENT, MAX_DIMS};

/// The longest string value or key read (a chat template is kilobytes; a token a few bytes).
pub(crate) const MAX_STRING: u64 = 16 << 20;
const MAGIC: &[u8; 4] = b"GGUF";

/// A metadata value; arrays keep their item type and length.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Uint(u64, &'static str),
    Int(i64, &'static str),
    Float(f64, &'static str),
    Bool(bool),
    Str(String),
    Array { item: &'static str, len: u64 },
}

impl Value {
    /// The GGUF type's name (`u32`, `f32`, `string`, `array[string]`, ...).
    pub(crate) fn type_name(&self) -> String {
        match self {
            Value::Uint(_, t) | Value::Int(_, t) | Value::Float(_, t) => (*t).to_string(),
            Value::Bool(_) => "bool".into(),
            Value::Str(_) => "string".into(),
            Value::Array { item, .. } => format!("array[{item}]"),
        }
    }
}

/// One tensor info, as declared.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TensorInfo {
    pub(crate) name: String,
    pub(crate) dims: Vec<u64>,
    pub(crate) type_id: u32,
    /// Offset from the data section.
    pub(crate) offset: u64,
}

/// A parsed header.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GgufFile {
    pub(crate) version: u32,
    pub(crate) metadata: Vec<(String, Value)>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) alignment: u64,
    /// File offset of the data section.
    pub(crate) data_start: u64,
    pub(crate) file_len: u64,
}

impl GgufFile {
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// Why a header cannot be read (the text names the byte and the key or tensor).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at byte {at}: {what}")]
pub(crate) struct ParseError {
    pub(crate) at: u64,
    pub(crate) what: String,
}

struct Reader<R> {
    r: R,
    at: u64,
    len: u64,
}

impl<R: Read> Reader<R> {
    fn err(&self, what: impl Into<String>) -> ParseError {
        ParseError {
            at: self.at,
            what: what.into(),
        }
    }
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.at)
    }
    fn fill(&mut self, buf: &mut [u8], what: &dyn Fn() -> String) -> Result<(), ParseError> {
        let n = buf.len() as u64;
        if n > self.left() {
            return Err(self.err(format!(
                "{}: {n} bytes needed, the file ends {} bytes later (truncated?)",
                what(),
                self.left()
            )));
        }
        self.r
            .read_exact(buf)
            .map_err(|e| self.err(format!("{}: {e}", what())))?;
        self.at = self.at.saturating_add(n);
        Ok(())
    }
    fn arr<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], ParseError> {
        let mut a = [0u8; N];
        self.fill(&mut a, what)?;
        Ok(a)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// A length-prefixed string, at most [`MAX_STRING`] and what the file still holds.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, ParseError> {
        let n = self.u64(what)?;
        if n > MAX_STRING || n > self.left() {
            return Err(self.err(format!(
                "{}: string length {n} is larger than {} (the limit, or what is left of the file)",
                what(),
                MAX_STRING.min(self.left())
            )));
        }
        let mut buf = vec![0u8; usize::try_from(n).map_err(|_| self.err("string length"))?];
        self.fill(&mut buf, what)?;
        String::from_utf8(buf).map_err(|_| self.err(format!("{}: string is not UTF-8", what())))
    }
    /// Skips `n` bytes without keeping them.
    fn skip(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<(), ParseError> {
        if n > self.left() {
            return Err(self.err(format!(
                "{}: {n} bytes needed, the file ends {} bytes later (truncated?)",
                what(),
                self.left()
            )));
        }
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| self.err(format!("{}: {e}", what())))?;
        if copied != n {
            return Err(self.err(format!("{}: the file ended early", what())));
        }
        self.at = self.at.saturating_add(n);
        Ok(())
    }
    fn value(&mut self, ty: u32, what: &dyn Fn() -> String) -> Result<Value, ParseError> {
        Ok(match ty {
            0 => Value::Uint(u64::from(self.arr::<1>(what)?[0]), "u8"),
            1 => Value::Int(i64::from(i8::from_le_bytes(self.arr(what)?)), "i8"),
            2 => Value::Uint(u64::from(u16::from_le_bytes(self.arr(what)?)), "u16"),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.arr(what)?)), "i16"),
            4 => Value::Uint(u64::from(self.u32(what)?), "u32"),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.arr(what)?)), "i32"),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.arr(what)?)), "f32"),
            7 => Value::Bool(self.arr::<1>(what)?[0] != 0),
            8 => Value::Str(self.string(what)?),
            10 => Value::Uint(self.u64(what)?, "u64"),
            11 => Value::Int(i64::from_le_bytes(self.arr(what)?), "i64"),
            12 => Value::Float(f64::from_le_bytes(self.arr(what)?), "f64"),
            9 => self.array(what)?,
            other => return Err(self.err(format!("{}: unknown GGUF value type {other}", what()))),
        })
    }
    /// An array: its items are read (strings) or skipped (numbers), not kept.
    fn array(&mut self, what: &dyn Fn() -> String) -> Result<Value, ParseError> {
        let item = self.u32(what)?;
        let len = self.u64(what)?;
        let (name, size): (&'static str, u64) = match item {
            0 => ("u8", 1),
            1 => ("i8", 1),
            2 => ("u16", 2),
            3 => ("i16", 2),
            4 => ("u32", 4),
            5 => ("i32", 4),
            6 => ("f32", 4),
            7 => ("bool", 1),
            8 => ("string", 8),
            10 => ("u64", 8),
            11 => ("i64", 8),
            12 => ("f64", 8),
            9 => {
                return Err(self.err(format!(
                    "{}: arrays of arrays are not GGUF llama.cpp reads",
                    what()
                )))
            }
            other => return Err(self.err(format!("{}: unknown array item type {other}", what()))),
        };
        // Each item takes at least `size` bytes: a length beyond the file is found before reading.
        if len.checked_mul(size).is_none_or(|b| b > self.left()) {
            return Err(self.err(format!(
                "{}: array of {len} {name} items does not fit in the {} bytes left in the file",
                what(),
                self.left()
            )));
        }
        if item == 8 {
            for i in 0..len {
                let n = self.u64(&|| format!("{} item {i}", what()))?;
                if n > MAX_STRING {
                    return Err(self.err(format!("{} item {i}: string length {n}", what())));
                }
                self.skip(n, &|| format!("{} item {i}", what()))?;
            }
        } else {
            // len * size <= left, checked above
            self.skip(len.saturating_mul(size), what)?;
        }
        Ok(Value::Array { item: name, len })
    }
}

/// Reads the header of the GGUF file at `path`.
pub(crate) fn read_gguf(path: &Path) -> Result<GgufFile, ParseError> {
    let f = File::open(path).map_err(|e| ParseError {
        at: 0,
        what: format!("cannot open: {e}"),
    })?;
    let len = f
        .metadata()
        .map_err(|e| ParseError {
            at: 0,
            what: format!("cannot stat: {e}"),
        })?
        .len();
    parse(BufReader::with_capacity(1 << 20, f), len)
}

/// Parses a header from `r`, a file of `len` bytes.
pub(crate) fn parse<R: Read>(r: R, len: u64) -> Result<GgufFile, ParseError> {
    let mut c = Reader { r, at: 0, len };
    let magic: [u8; 4] = c.arr(&|| "magic".into())?;
    if &magic != MAGIC {
        return Err(c.err(format!("no GGUF magic (found {magic:02x?})")));
    }
    let version = c.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(c.err(format!(
            "GGUF version {version}: llama.cpp reads versions 2 and 3"
        )));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    // A key/value takes at least 13 bytes (8 key length, 4 type, 1 value), a tensor info 24.
    if n_kv.checked_mul(13).is_none_or(|b| b > c.left()) {
        return Err(c.err(format!(
            "the header declares {n_kv} metadata keys; the {} bytes left in the file hold at most {} (truncated, or a corrupt count)",
            c.left(),
            c.left() / 13
        )));
    }
    if n_tensors.checked_mul(24).is_none_or(|b| b > c.left()) {
        return Err(c.err(format!(
            "the header declares {n_tensors} tensors; the {} bytes left in the file hold at most {} (truncated, or a corrupt count)",
            c.left(),
            c.left() / 24
        )));
    }
    let mut metadata: Vec<(String, Value)> = Vec::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key {i}"))?;
        if metadata.iter().any(|(k, _)| *k == key) {
            return Err(c.err(format!("metadata key {key} is declared twice")));
        }
        let ty = c.u32(&|| format!("key {key}"))?;
        let v = c.value(ty, &|| format!("key {key}"))?;
        metadata.push((key, v));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::Uint(a, "u32"))) if *a != 0 && a.is_power_of_two() => *a,
        Some((_, v)) => {
            return Err(c.err(format!(
            "key general.alignment: {v:?} is not a u32 power of two (llama.cpp refuses the file)"
        )))
        }
    };
    let mut tensors: Vec<TensorInfo> = Vec::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor {i} name"))?;
        let nd = c.u32(&|| format!("tensor {name}"))?;
        if nd > MAX_DIMS {
            return Err(c.err(format!(
                "tensor {name}: {nd} dimensions, ggml allows at most {MAX_DIMS}"
            )));
        }
        let mut dims = Vec::new();
        for _ in 0..nd {
            dims.push(c.u64(&|| format!("tensor {name} dims"))?);
        }
        let type_id = c.u32(&|| format!("tensor {name} type"))?;
        let offset = c.u64(&|| format!("tensor {name} offset"))?;
        tensors.push(TensorInfo {
            name,
            dims,
            type_id,
            offset,
        });
    }
    let data_start =
        c.at.checked_next_multiple_of(alignment)
            .ok_or_else(|| c.err("the data section's start overflows"))?;
    Ok(GgufFile {
        version,
        metadata,
        tensors,
        alignment,
        data_start,
        file_len: len,
    })
}
