//! Memory-mapped safetensors reading (single file or sharded with an index).
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use crate::error::{BoxError, FileError, IndexProblem, QuantError, Result, TensorError};
use crate::fsutil::{read_json_within, untrusted_err};
use flexinfer_fsutil::limits;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

/// All tensors of a model directory, mapped, never copied until asked.
pub struct TensorStore {
    pub files: Vec<PathBuf>,
    maps: Vec<Mmap>,
    pub entries: BTreeMap<String, TensorEntry>,
}

fn st_err(path: &Path, e: impl Into<BoxError>) -> QuantError {
    QuantError::Safetensors {
        path: path.to_path_buf(),
        tensor: None,
        source: e.into(),
    }
}

/// A tensor name that two weight files both hold.
#[derive(Debug, thiserror::Error)]
#[error("tensor {name} appears in more than one file")]
struct DuplicateTensor {
    name: String,
}

/// The name of the sharded-checkpoint index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The `.safetensors` files of a model directory, relative to it: those named by the index, else
/// every one in the directory. Names from the index are checked ([`flexinfer_fsutil::check_relative`]);
/// that each stays inside `dir` and is a regular file is checked when it is opened.
pub fn weight_names(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join(INDEX_FILE);
    if index.symlink_metadata().is_ok() {
        let v = read_json_within(dir, INDEX_FILE, limits::INDEX_JSON)?;
        return index_names(&index, &v);
    }
    let mut names = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| QuantError::io(dir, e))?;
    for entry in rd {
        let entry = entry.map_err(|e| QuantError::io(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if Path::new(name).extension().and_then(|e| e.to_str()) == Some("safetensors") {
            names.push(name.to_string());
        }
    }
    names.sort();
    if names.is_empty() {
        return Err(FileError::NoWeightFiles {
            dir: dir.to_path_buf(),
        }
        .into());
    }
    Ok(names)
}

/// The file names of a parsed `model.safetensors.index.json` (`path` names it in errors): sorted,
/// deduplicated, each a plain relative name. Never panics, whatever the JSON.
pub fn index_names(path: &Path, v: &serde_json::Value) -> Result<Vec<String>> {
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| QuantError::Index {
            path: path.to_path_buf(),
            problem: IndexProblem::MissingWeightMap,
        })?;
    let mut names = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let name = file.as_str().ok_or_else(|| QuantError::Index {
            path: path.to_path_buf(),
            problem: IndexProblem::NotAFileName {
                tensor: tensor.clone(),
            },
        })?;
        flexinfer_fsutil::check_relative(Path::new(name)).map_err(|source| {
            FileError::IndexEntry {
                path: path.to_path_buf(),
                tensor: tensor.clone(),
                source,
            }
        })?;
        names.push(name.to_string());
    }
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(QuantError::Index {
            path: path.to_path_buf(),
            problem: IndexProblem::NoFile,
        });
    }
    Ok(names)
}

/// [`weight_names`] as paths under `dir`, each checked to stay inside it and to be a regular file.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    weight_names(dir)?
        .into_iter()
        .map(|n| {
            let p = dir.join(&n);
            flexinfer_fsutil::resolve_within(dir, &n).map_err(|e| untrusted_err(&p, e))?;
            Ok(p)
        })
        .collect()
}

impl TensorStore {
    /// The weight files of a model directory ([`weight_names`]), each opened with
    /// [`flexinfer_fsutil::open_regular_within`]: no name escapes `dir`, only regular files are mapped.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let mut opened = Vec::new();
        for n in weight_names(dir)? {
            let p = dir.join(&n);
            let file =
                flexinfer_fsutil::open_regular_within(dir, &n).map_err(|e| untrusted_err(&p, e))?;
            opened.push((p, file));
        }
        Self::map_files(opened)
    }

    /// Files the caller chose (the engine's own layer cache); each must be a regular file.
    pub fn open_files(files: Vec<PathBuf>) -> Result<Self> {
        let mut opened = Vec::with_capacity(files.len());
        for p in files {
            let file = flexinfer_fsutil::open_regular(&p).map_err(|e| untrusted_err(&p, e))?;
            opened.push((p, file));
        }
        Self::map_files(opened)
    }

    fn map_files(opened: Vec<(PathBuf, File)>) -> Result<Self> {
        let mut files = Vec::with_capacity(opened.len());
        let mut maps = Vec::with_capacity(opened.len());
        let mut entries = BTreeMap::new();
        for (fi, (path, file)) in opened.into_iter().enumerate() {
            // SAFETY: the model files are not modified while we run; a truncation would be caught by the length
            // checks below for the header, and the pipeline never writes into MODEL_DIR's weight files.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| QuantError::io(&path, e))?;
            for (name, entry) in parse_header(&map, fi).map_err(|m| st_err(&path, m))? {
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(st_err(&path, DuplicateTensor { name }));
                }
            }
            maps.push(map);
            files.push(path);
        }
        Ok(TensorStore {
            files,
            maps,
            entries,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.entries.get(name).ok_or_else(|| {
            TensorError::NotFound {
                name: name.to_string(),
            }
            .into()
        })
    }

    pub fn raw(&self, name: &str) -> Result<&[u8]> {
        let e = self.entry(name)?;
        self.maps
            .get(e.file)
            .and_then(|m| m.get(e.start..e.end))
            .ok_or_else(|| {
                TensorError::OutsideFile {
                    name: name.to_string(),
                }
                .into()
            })
    }

    /// The tensor converted to f32 (BF16, F16, F32 sources); non-finite values are rejected.
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        let out = convert_f32(name, e.dtype, self.raw(name)?)?;
        check_finite(name, &out, 0)?;
        Ok(out)
    }

    /// Row `row` of a 2-D tensor converted to f32, read from the mapping without converting the rest (an
    /// embedding lookup). Non-finite values are rejected like [`TensorStore::f32`].
    pub fn f32_row(&self, name: &str, row: usize) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        let (rows, width) = match e.shape.as_slice() {
            [r, w] => (*r, *w),
            other => {
                return Err(TensorError::Rank {
                    name: name.to_string(),
                    shape: other.to_vec(),
                    dims: 2,
                }
                .into())
            }
        };
        let size = match e.dtype {
            Dtype::F32 => 4,
            _ => 2,
        };
        if row >= rows {
            return Err(TensorError::RowOutside {
                name: name.to_string(),
                row,
                rows,
            }
            .into());
        }
        let raw = self.raw(name)?;
        let truncated = || TensorError::Truncated {
            name: name.to_string(),
        };
        let row_bytes = width.checked_mul(size).ok_or_else(truncated)?;
        let start = row.checked_mul(row_bytes).ok_or_else(truncated)?;
        let end = start.checked_add(row_bytes).ok_or_else(truncated)?;
        let bytes = raw.get(start..end).ok_or_else(truncated)?;
        let out = convert_f32(name, e.dtype, bytes)?;
        check_finite(name, &out, row.saturating_mul(width))?;
        Ok(out)
    }

    /// Rows `row0 .. row0 + nrows` of slice `index` of a 3-D tensor `[n, rows, cols]` (one expert of a fused
    /// expert tensor), as its raw little-endian bytes (the tensor's own dtype), with `cols`.
    pub fn raw_block(
        &self,
        name: &str,
        index: usize,
        row0: usize,
        nrows: usize,
    ) -> Result<(&[u8], usize)> {
        let e = self.entry(name)?;
        let (n, rows, cols) = match e.shape.as_slice() {
            [n, r, c] => (*n, *r, *c),
            other => {
                return Err(TensorError::Rank {
                    name: name.to_string(),
                    shape: other.to_vec(),
                    dims: 3,
                }
                .into())
            }
        };
        let end_row = row0.checked_add(nrows);
        if index >= n || end_row.is_none_or(|r| r > rows) {
            return Err(TensorError::BlockOutside {
                name: name.to_string(),
                index,
                row0,
                nrows,
                shape: e.shape.clone(),
            }
            .into());
        }
        let size = dtype_size(e.dtype);
        let bad = || TensorError::Truncated {
            name: name.to_string(),
        };
        let row_bytes = cols.checked_mul(size).ok_or_else(bad)?;
        let start = index
            .checked_mul(rows)
            .and_then(|v| v.checked_add(row0))
            .and_then(|v| v.checked_mul(row_bytes))
            .ok_or_else(bad)?;
        let len = nrows.checked_mul(row_bytes).ok_or_else(bad)?;
        let end = start.checked_add(len).ok_or_else(bad)?;
        let raw = self.raw(name)?;
        Ok((raw.get(start..end).ok_or_else(bad)?, cols))
    }

    /// [`TensorStore::raw_block`] converted to f32 (row-major `nrows × cols`); non-finite values are rejected.
    pub fn f32_block(
        &self,
        name: &str,
        index: usize,
        row0: usize,
        nrows: usize,
    ) -> Result<Vec<f32>> {
        let dtype = self.entry(name)?.dtype;
        let (bytes, _) = self.raw_block(name, index, row0, nrows)?;
        let out = convert_f32(name, dtype, bytes)?;
        check_finite(name, &out, 0)?;
        Ok(out)
    }

    /// I32 tensor (gptq packed data).
    pub fn i32(&self, name: &str) -> Result<Vec<i32>> {
        let e = self.entry(name)?;
        if e.dtype != Dtype::I32 {
            return Err(TensorError::Dtype {
                name: name.to_string(),
                dtype: e.dtype,
                expected: "I32",
            }
            .into());
        }
        Ok(self
            .raw(name)?
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Drops the mapped pages from this process's resident set (they stay in the page cache), so that only
    /// the layer being worked on counts against the Job's memory.
    pub fn release_pages(&self) {
        for m in &self.maps {
            // SAFETY: the maps are read-only, shared file mappings; after MADV_DONTNEED the next access reads the
            // same bytes back from the file, and no reference into the mapping is held across this call by
            // callers that use owned copies of the data (the pipeline converts tensors to f32 before calling it).
            let _ = unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// Total size of the mapped files.
    pub fn total_bytes(&self) -> u64 {
        self.maps.iter().map(|m| m.len() as u64).sum()
    }

    /// Safetensors metadata map of a file (string → string), if any.
    pub fn file_metadata(&self, file: usize) -> HashMap<String, String> {
        self.maps
            .get(file)
            .and_then(|m| SafeTensors::read_metadata(m).ok())
            .and_then(|(_, m)| m.metadata().clone())
            .unwrap_or_default()
    }
}

/// Why a safetensors header is refused.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("the header cannot be read (the file may be truncated or not a safetensors file)")]
    Unreadable(#[source] safetensors::SafeTensorError),
    #[error("header length {0} overflows")]
    LengthOverflow(usize),
    #[error("tensor {tensor}: data_offsets {start}..{end} lie outside the file")]
    OutsideFile {
        tensor: String,
        start: usize,
        end: usize,
    },
    #[error("tensor {tensor}: shape {shape:?} overflows")]
    ShapeOverflow { tensor: String, shape: Vec<usize> },
    #[error("tensor {tensor}: shape {shape:?} × {dtype:?} needs {needs} bytes, data_offsets span {span}")]
    Span {
        tensor: String,
        shape: Vec<usize>,
        dtype: Dtype,
        needs: usize,
        span: usize,
    },
}

/// The tensors of one safetensors file (`bytes` is the whole file, `file` its index in the store):
/// the header length and JSON are bounded and validated by the safetensors crate (offsets
/// contiguous, `shape × dtype size` equal to the byte span, data inside the file), and every
/// absolute offset is computed with checked arithmetic. Never panics, whatever the bytes.
pub fn parse_header(
    bytes: &[u8],
    file: usize,
) -> std::result::Result<Vec<(String, TensorEntry)>, HeaderError> {
    let (n, meta) = SafeTensors::read_metadata(bytes).map_err(HeaderError::Unreadable)?;
    let base = n.checked_add(8).ok_or(HeaderError::LengthOverflow(n))?;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let bad = || HeaderError::OutsideFile {
            tensor: name.clone(),
            start: s,
            end: e,
        };
        let start = base.checked_add(s).ok_or_else(bad)?;
        let end = base.checked_add(e).ok_or_else(bad)?;
        if start > end || end > bytes.len() {
            return Err(bad());
        }
        let numel = info
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()))
            .map(|bits| bits.div_ceil(8))
            .ok_or_else(|| HeaderError::ShapeOverflow {
                tensor: name.clone(),
                shape: info.shape.clone(),
            })?;
        // start <= end was checked above.
        let span = end.saturating_sub(start);
        if numel != span {
            return Err(HeaderError::Span {
                tensor: name.clone(),
                shape: info.shape.clone(),
                dtype: info.dtype,
                needs: numel,
                span,
            });
        }
        out.push((
            name.clone(),
            TensorEntry {
                file,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start,
                end,
            },
        ));
    }
    Ok(out)
}

/// Element size in bytes of the dtypes we write.
pub fn dtype_size(d: Dtype) -> usize {
    d.bitsize() / 8
}

/// Little-endian BF16/F16/F32 bytes as f32.
fn convert_f32(name: &str, dtype: Dtype, raw: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => raw
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(TensorError::Dtype {
                name: name.to_string(),
                dtype: other,
                expected: "BF16, F16 or F32",
            }
            .into())
        }
    })
}

/// Rejects NaN/Inf weights; `offset` is the index of `values[0]` in the tensor.
fn check_finite(name: &str, values: &[f32], offset: usize) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(pos) => Err(TensorError::NonFinite {
            name: name.to_string(),
            element: offset.saturating_add(pos),
        }
        .into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(path: &Path, name: &str) {
        let data = vec![0u8; 8];
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &data).expect("view");
        safetensors::serialize_to_file([(name, view)], None, path).expect("write");
    }

    fn index(dir: &Path, files: &[(&str, &str)]) {
        let map: serde_json::Map<String, serde_json::Value> = files
            .iter()
            .map(|(t, f)| (t.to_string(), serde_json::Value::from(*f)))
            .collect();
        let v = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.join(INDEX_FILE), v.to_string()).expect("index");
    }

    #[test]
    fn index_names_must_stay_inside_the_model_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        let model = root.path().join("model");
        std::fs::create_dir_all(&model).expect("mkdir");
        shard(&root.path().join("outside.safetensors"), "b");
        shard(&model.join("a.safetensors"), "a");
        index(&model, &[("a", "a.safetensors")]);
        assert!(TensorStore::open_dir(&model).is_ok());

        let abs = root.path().join("outside.safetensors");
        let abs = abs.to_str().expect("utf-8");
        std::os::unix::fs::symlink(
            root.path().join("outside.safetensors"),
            model.join("link.safetensors"),
        )
        .expect("symlink");
        for bad in ["../outside.safetensors", abs, "link.safetensors"] {
            index(&model, &[("a", "a.safetensors"), ("b", bad)]);
            let e = TensorStore::open_dir(&model).err().expect(bad);
            assert!(e.is_bad_input(), "{bad}: {e}");
            let name = Path::new(bad)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or(bad);
            assert!(
                flexinfer_contract::error::chain(&e).contains(name),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_fifo_or_a_symlink_out_is_not_mapped_without_an_index() {
        let root = tempfile::tempdir().expect("tempdir");
        let model = root.path().join("model");
        std::fs::create_dir_all(&model).expect("mkdir");
        shard(&root.path().join("outside.safetensors"), "b");
        std::os::unix::fs::symlink(
            root.path().join("outside.safetensors"),
            model.join("b.safetensors"),
        )
        .expect("symlink");
        let e = TensorStore::open_dir(&model).err().expect("symlink out");
        assert!(
            e.is_bad_input() && flexinfer_contract::error::chain(&e).contains("b.safetensors"),
            "{e}"
        );
        std::fs::remove_file(model.join("b.safetensors")).expect("rm");
        let fifo = model.join("c.safetensors");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("cstring");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = TensorStore::open_dir(&model).err().expect("fifo");
        assert!(
            e.is_bad_input() && flexinfer_contract::error::chain(&e).contains("FIFO"),
            "{e}"
        );
    }

    extern "C" {
        fn mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }

    #[test]
    fn an_oversized_index_is_refused_naming_the_limit() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = std::fs::File::create(d.path().join(INDEX_FILE)).expect("create");
        f.set_len(limits::INDEX_JSON.bytes + 1).expect("grow");
        let e = TensorStore::open_dir(d.path()).err().expect("too large");
        assert!(
            flexinfer_contract::error::chain(&e).contains("safetensors index"),
            "{e}"
        );
    }
}
