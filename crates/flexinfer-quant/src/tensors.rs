//! Memory-mapped safetensors reading (single file or sharded with an index).

use crate::error::{QuantError, Result};
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

fn st_err(path: &Path, e: impl std::fmt::Display) -> QuantError {
    QuantError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The `.safetensors` files of a model directory: those named by the index, else every one in the directory.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| QuantError::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| QuantError::Json {
            path: index.clone(),
            message: e.to_string(),
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| QuantError::Json {
                path: index.clone(),
                message: "missing weight_map".into(),
            })?;
        let mut names: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        names.sort();
        names.dedup();
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let mut files = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| QuantError::io(dir, e))?;
    for entry in rd {
        let entry = entry.map_err(|e| QuantError::io(dir, e))?;
        let p = entry.path();
        if p.extension().and_then(|e| e.to_str()) == Some("safetensors") {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(QuantError::Input(format!(
            "no .safetensors weight files in {}",
            dir.display()
        )));
    }
    Ok(files)
}

impl TensorStore {
    pub fn open_dir(dir: &Path) -> Result<Self> {
        Self::open_files(weight_files(dir)?)
    }

    pub fn open_files(files: Vec<PathBuf>) -> Result<Self> {
        let mut maps = Vec::with_capacity(files.len());
        let mut entries = BTreeMap::new();
        for (fi, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| QuantError::io(path, e))?;
            // SAFETY: the model files are not modified while we run; a truncation would be caught by the length
            // checks below for the header, and the pipeline never writes into MODEL_DIR's weight files.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| QuantError::io(path, e))?;
            let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                st_err(
                    path,
                    format!("{e:?} (the file may be truncated or not a safetensors file)"),
                )
            })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let entry = TensorEntry {
                    file: fi,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(st_err(
                        path,
                        format!("tensor {name} appears in more than one file"),
                    ));
                }
            }
            maps.push(map);
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
        self.entries
            .get(name)
            .ok_or_else(|| QuantError::Input(format!("tensor {name} not found in the model")))
    }

    pub fn raw(&self, name: &str) -> Result<&[u8]> {
        let e = self.entry(name)?;
        Ok(&self.maps[e.file][e.start..e.end])
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
                return Err(QuantError::Input(format!(
                    "tensor {name} has shape {other:?}; expected 2 dimensions"
                )))
            }
        };
        let size = match e.dtype {
            Dtype::F32 => 4,
            _ => 2,
        };
        if row >= rows {
            return Err(QuantError::Input(format!(
                "row {row} is outside tensor {name} ({rows} rows)"
            )));
        }
        let raw = self.raw(name)?;
        let bytes = raw
            .get(row * width * size..(row + 1) * width * size)
            .ok_or_else(|| QuantError::Input(format!("tensor {name} is truncated")))?;
        let out = convert_f32(name, e.dtype, bytes)?;
        check_finite(name, &out, row * width)?;
        Ok(out)
    }

    /// I32 tensor (gptq packed data).
    pub fn i32(&self, name: &str) -> Result<Vec<i32>> {
        let e = self.entry(name)?;
        if e.dtype != Dtype::I32 {
            return Err(QuantError::Input(format!(
                "tensor {name} has dtype {:?}; expected I32",
                e.dtype
            )));
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
        SafeTensors::read_metadata(&self.maps[file])
            .ok()
            .and_then(|(_, m)| m.metadata().clone())
            .unwrap_or_default()
    }
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
            return Err(QuantError::Input(format!(
                "tensor {name} has dtype {other:?}; expected BF16, F16 or F32"
            )))
        }
    })
}

/// Rejects NaN/Inf weights; `offset` is the index of `values[0]` in the tensor.
fn check_finite(name: &str, values: &[f32], offset: usize) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(pos) => Err(QuantError::Input(format!(
            "tensor {name} contains a non-finite value (NaN/Inf) at element {}; the source weights are corrupt",
            offset + pos
        ))),
        None => Ok(()),
    }
}
