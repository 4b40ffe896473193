//! The CNCF ModelPack side of `publish` (model-spec v0.0.7): each file's raw layer media type and
//! annotations, and the model config (`application/vnd.cncf.model.config.v1+json`) derived from the
//! files being published. Every file is read as untrusted: JSON files within
//! [`flexinfer_fsutil::limits::CONFIG_JSON`], safetensors headers within
//! [`flexinfer_fsutil::limits::SAFETENSORS_HEADER`], GGUF headers streamed with every length checked
//! against the file's size (values we do not need are skipped, not held); a file that cannot be read
//! is an error naming it (exit 2), never a guess. Types the readers do not know (a new safetensors
//! dtype, a GGUF tensor type) are not errors: only the structure is checked.
//!
//! What goes where (docs/user/download-and-publish.md, "The artifact"):
//! - `config.format`: the weight files' format (`safetensors`, `gguf`, `onnx`, `pt`);
//! - `config.architecture` and `descriptor.family`: `config.json`'s `architectures[0]` and `model_type`,
//!   or the GGUF `general.architecture` (both);
//! - `config.precision`: `config.json`'s `torch_dtype` (or `dtype`) plus the FP8 types the safetensors
//!   headers hold, else the floating types the headers hold; a GGUF F32/F16/BF16 file type;
//! - `config.quantization`: `quantization_config.quant_method`, or the GGUF file type (`Q4_K_M`);
//! - `config.paramSize`: the parameters counted from the tensor headers (GPTQ/AWQ/compressed-tensors
//!   packed weights counted unpacked); left out when a quantization method's packing is unknown;
//! - `descriptor.createdAt`: `.save-complete`'s `completed_at`; `descriptor.sourceURL`/`revision`:
//!   `.source-integrity.json`; `descriptor.name`: the GGUF `general.name`;
//! - what the config has no field for goes into manifest annotations: bits, group size, the quality
//!   gate's verdict ([`oci_artifact::BITS_ANNOTATION`] and the two after it).
//!
//! Nothing here depends on the time, the machine or the push target, so the same tree gives the same
//! config and manifest digests.

use std::collections::BTreeMap;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use flexinfer_contract::{files, oci_artifact as oa};
use serde::Serialize;
use serde_json::Value;

use super::LocalFile;
use crate::common::{ModelPackProblem, PublishError, WorkerError};

/// The model config blob (`application/vnd.cncf.model.config.v1+json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelPackConfig {
    pub descriptor: ModelDescriptor,
    pub config: ModelConfig,
    pub modelfs: ModelFs,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelDescriptor {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(rename = "sourceURL", skip_serializing_if = "Option::is_none")]
    pub source_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub param_size: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelFs {
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(rename = "diffIds")]
    pub diff_ids: Vec<String>,
}

/// What [`describe`] found: the config (without `modelfs`, which the layers give) and the manifest
/// annotations of FlexInfer's own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Described {
    pub descriptor: ModelDescriptor,
    pub config: ModelConfig,
    pub annotations: BTreeMap<String, String>,
}

impl Described {
    /// The config blob for these layers (a raw layer's DiffID is its digest), as JSON bytes.
    pub fn config_blob(&self, layer_digests: Vec<String>) -> Result<Vec<u8>, WorkerError> {
        let c = ModelPackConfig {
            descriptor: self.descriptor.clone(),
            config: self.config.clone(),
            modelfs: ModelFs {
                kind: oa::MODELPACK_MODELFS_TYPE,
                diff_ids: layer_digests,
            },
        };
        serde_json::to_vec(&c).map_err(WorkerError::json(
            crate::common::ExitKind::Failure,
            "encoding the ModelPack config",
        ))
    }
}

/// The raw layer media type of the file at `rel`, and whether it was guessed (no rule matched its
/// name; the layer is then annotated [`oa::MODELPACK_MEDIATYPE_UNTESTED_ANNOTATION`]).
pub fn layer_media_type(rel: &str) -> (&'static str, bool) {
    let base = rel.rsplit('/').next().unwrap_or(rel);
    let name = base.to_ascii_lowercase();
    let ext = name.rsplit_once('.').map_or("", |(_, e)| e);
    let is = |exts: &[&str]| exts.contains(&ext);
    // The pipeline's records of the weights (sizes, hashes, the quality gate).
    let ours = [
        files::SAVE_COMPLETE,
        files::SOURCE_INTEGRITY,
        files::DOWNLOAD_COMPLETE,
        files::QUANTIZATION_QUALITY,
        files::ABLITERATION_STATUS,
    ];
    let mt = if ours.contains(&base) {
        oa::MODELPACK_WEIGHT_CONFIG_RAW
    } else if crate::download::is_weight_file(&name) {
        oa::MODELPACK_WEIGHT_RAW
    } else if is(&[
        "py", "sh", "ipynb", "cu", "cuh", "c", "cc", "cpp", "h", "hpp", "rs", "go", "js", "ts",
    ]) || (name.starts_with("requirements") && ext == "txt")
    {
        oa::MODELPACK_CODE_RAW
    } else if is(&[
        "json", "yaml", "yml", "toml", "jinja", "model", "tiktoken", "vocab", "spm",
    ]) || ["vocab.txt", "merges.txt", "added_tokens.txt"].contains(&name.as_str())
    {
        oa::MODELPACK_WEIGHT_CONFIG_RAW
    } else if [
        "readme",
        "license",
        "licence",
        "notice",
        "copying",
        "use_policy",
    ]
    .iter()
    .any(|p| name.starts_with(p))
        || is(&[
            "md", "rst", "txt", "pdf", "html", "png", "jpg", "jpeg", "gif", "svg", "webp",
        ])
    {
        oa::MODELPACK_DOC_RAW
    } else if is(&["parquet", "arrow", "csv", "tsv", "jsonl"]) {
        oa::MODELPACK_DATASET_RAW
    } else {
        return (oa::MODELPACK_WEIGHT_CONFIG_RAW, true);
    };
    (mt, false)
}

/// The value of [`oa::MODELPACK_FILE_METADATA_ANNOTATION`] for a file: constant mode, owner and
/// time (the spec's reproducibility guidance), so it depends on the file's name and size only.
pub fn file_metadata(rel: &str, size: u64) -> String {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    serde_json::json!({
        "name": name, "mode": 0o644, "uid": 0, "gid": 0, "size": size,
        "mtime": "1970-01-01T00:00:00Z", "typeflag": b'0',
    })
    .to_string()
}

/// The longest string taken from a file into the config or an annotation.
const MAX_FIELD: usize = 1024;

fn bad(dir: &Path, rel: &str, problem: ModelPackProblem) -> WorkerError {
    PublishError::ModelPack {
        dir: dir.to_path_buf(),
        rel: rel.to_string(),
        problem,
    }
    .into()
}

fn field(dir: &Path, rel: &str, key: &str, v: &str) -> Result<Option<String>, WorkerError> {
    if v.len() > MAX_FIELD {
        return Err(bad(
            dir,
            rel,
            ModelPackProblem::FieldTooLong {
                key: key.to_string(),
                len: v.len(),
                max: MAX_FIELD,
            },
        ));
    }
    Ok(Some(v.to_string()).filter(|s| !s.trim().is_empty()))
}

/// A JSON object read from `rel` (bounded), or `None` when the file is not published.
fn read_json(dir: &Path, files: &[LocalFile], rel: &str) -> Result<Option<Value>, WorkerError> {
    let Some(f) = files.iter().find(|f| f.rel == rel) else {
        return Ok(None);
    };
    let bytes = flexinfer_fsutil::read_regular(&f.path, flexinfer_fsutil::limits::CONFIG_JSON)
        .map_err(|e| bad(dir, rel, ModelPackProblem::Read(e)))?;
    let v: Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(dir, rel, ModelPackProblem::Json(e)))?;
    if !v.is_object() {
        return Err(bad(dir, rel, ModelPackProblem::NotObject));
    }
    Ok(Some(v))
}

/// The weight format of the tree: the first of safetensors, gguf, onnx, pt that a weight file has.
fn weight_format(files: &[LocalFile]) -> Option<&'static str> {
    let has = |exts: &[&str]| {
        files.iter().any(|f| {
            let n = f.rel.to_ascii_lowercase();
            exts.iter().any(|e| n.ends_with(e))
        })
    };
    [
        ("safetensors", &[".safetensors"][..]),
        ("gguf", &[".gguf"][..]),
        ("onnx", &[".onnx"][..]),
        ("pt", &[".bin", ".pt", ".pth"][..]),
    ]
    .into_iter()
    .find(|(_, exts)| has(exts))
    .map(|(f, _)| f)
}

/// The ModelPack precision name of a `torch_dtype` / `dtype` value.
fn precision_of_dtype(s: &str) -> Option<&'static str> {
    Some(match s.trim().trim_start_matches("torch.") {
        "float32" | "fp32" | "float" => "float32",
        "float64" | "fp64" | "double" => "float64",
        "float16" | "fp16" | "half" => "float16",
        "bfloat16" | "bf16" => "bfloat16",
        "float8_e4m3fn" | "float8_e4m3" => "float8_e4m3",
        "float8_e5m2" => "float8_e5m2",
        _ => return None,
    })
}

/// The spec's order of precision names (`config.md`), for a stable comma list.
const PRECISIONS: [&str; 6] = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3",
    "float8_e5m2",
];

/// How the quantization of a safetensors checkpoint packs its weights, for counting parameters.
#[derive(Debug, Clone, Default, PartialEq)]
struct Quant {
    method: String,
    bits: Option<u64>,
}

/// What `config.json` says.
#[derive(Debug, Default)]
struct HfConfig {
    architecture: Option<String>,
    family: Option<String>,
    precision: Option<&'static str>,
    quant: Option<Quant>,
    group_size: Option<i64>,
}

fn hf_config(dir: &Path, v: &Value) -> Result<HfConfig, WorkerError> {
    const REL: &str = "config.json";
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(String::from);
    let mut c = HfConfig::default();
    if let Some(a) = v
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
    {
        c.architecture = field(dir, REL, "architectures[0]", a)?;
    }
    if let Some(t) = s(v, "model_type") {
        c.family = field(dir, REL, "model_type", &t)?;
    }
    let text = v.get("text_config");
    c.precision = ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| {
            v.get(*k)
                .or_else(|| text.and_then(|t| t.get(*k)))
                .and_then(Value::as_str)
        })
        .and_then(precision_of_dtype);
    if let Some(q) = v.get("quantization_config").filter(|q| q.is_object()) {
        let method = s(q, "quant_method").map(|m| m.to_ascii_lowercase());
        // GPTQ/AWQ: bits and group_size at the top; compressed-tensors: per config group.
        let groups: Vec<&Value> = q
            .get("config_groups")
            .and_then(Value::as_object)
            .map(|g| g.values().filter_map(|g| g.get("weights")).collect())
            .unwrap_or_default();
        let same = |k: &str| -> Option<&Value> {
            let first = groups.first().and_then(|w| w.get(k))?;
            groups
                .iter()
                .all(|w| w.get(k) == Some(first))
                .then_some(first)
        };
        let bits = q
            .get("bits")
            .or_else(|| same("num_bits"))
            .and_then(Value::as_u64)
            .filter(|b| (1..=64).contains(b));
        c.group_size = q
            .get("group_size")
            .or_else(|| same("group_size"))
            .and_then(Value::as_i64);
        if let Some(m) = method {
            c.quant = Some(Quant {
                method: field(dir, REL, "quantization_config.quant_method", &m)?
                    .unwrap_or_default(),
                bits,
            });
        } else if bits.is_some() {
            c.quant = Some(Quant {
                method: String::new(),
                bits,
            });
        }
    }
    Ok(c)
}

/// Tensors of a quantized checkpoint that are not parameters (scales, zero points, indices).
const QUANT_AUX_SUFFIXES: &[&str] = &[
    "qzeros",
    "scales",
    "g_idx",
    "weight_scale",
    "weight_scale_inv",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "output_scale",
    "k_scale",
    "v_scale",
];

/// The parameters one tensor holds, or `None` when a quantized checkpoint packs it in a way we do
/// not know (the count is then left out).
fn tensor_params(name: &str, numel: u128, quant: Option<&Quant>) -> Option<u128> {
    let Some(q) = quant else {
        return Some(numel);
    };
    let last = name.rsplit('.').next().unwrap_or(name);
    let known = ["gptq", "awq", "compressed-tensors", "fp8"];
    if !known.contains(&q.method.as_str()) {
        return None;
    }
    if QUANT_AUX_SUFFIXES.contains(&last) {
        return Some(0);
    }
    if last == "qweight" || last == "weight_packed" {
        // 32-bit words holding 32/bits values each (3 bits: 32 values in 3 words).
        let bits = u128::from(q.bits.filter(|b| (1..=8).contains(b))?);
        let values = numel.checked_mul(32)?;
        return (values.checked_rem(bits)? == 0).then(|| values.checked_div(bits))?;
    }
    Some(numel)
}

/// `7.6B`, `494M`, `1.5K`: the count with at most one decimal and the largest scale letter that
/// keeps it at 1 or more (`config.md`, `paramSize`); `None` below 50 parameters.
pub fn param_size(n: u128) -> Option<String> {
    const SCALES: [(f64, char); 5] = [(1e15, 'Q'), (1e12, 'T'), (1e9, 'B'), (1e6, 'M'), (1e3, 'K')];
    let n = n as f64;
    let round1 = |x: f64| (x * 10.0).round() / 10.0;
    let (r, p) = SCALES
        .iter()
        .map(|(s, p)| (round1(n / s), *p))
        .find(|(r, _)| *r >= 1.0)
        .or_else(|| Some((round1(n / 1e3), 'K')).filter(|(r, _)| *r > 0.0))?;
    Some(if r.fract() == 0.0 {
        format!("{r:.0}{p}")
    } else {
        format!("{r:.1}{p}")
    })
}

/// The tensors of a safetensors header: (name, dtype, shape). Only the header is read (its length
/// within [`flexinfer_fsutil::limits::SAFETENSORS_HEADER`] and the file); the dtype is kept as
/// written, so a type this reader does not know is not an error.
pub fn safetensors_header(
    mut r: impl Read,
    len: u64,
) -> Result<Vec<(String, String, Vec<u64>)>, String> {
    let mut n = [0u8; 8];
    r.read_exact(&mut n)
        .map_err(|_| format!("{len} bytes, shorter than the 8-byte header length"))?;
    let n = u64::from_le_bytes(n);
    let limit = flexinfer_fsutil::limits::SAFETENSORS_HEADER.bytes;
    if n > limit || n > len.saturating_sub(8) {
        return Err(format!(
            "a header of {n} bytes (the file has {len}, at most {limit} are allowed)"
        ));
    }
    let mut h = Vec::new();
    r.take(n)
        .read_to_end(&mut h)
        .map_err(|e| format!("reading the header: {e}"))?;
    let v: serde_json::Map<String, Value> =
        serde_json::from_slice(&h).map_err(|e| format!("the header is not a JSON object: {e}"))?;
    let mut out = Vec::with_capacity(v.len());
    for (name, t) in v {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t.get("dtype").and_then(Value::as_str);
        let shape: Option<Vec<u64>> = t
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect());
        let (Some(dtype), Some(shape)) = (dtype, shape) else {
            return Err(format!("tensor {name}: no dtype or shape"));
        };
        out.push((name, dtype.to_string(), shape));
    }
    Ok(out)
}

/// What the safetensors headers say: parameters (if countable) and the floating types present.
fn safetensors_meta(
    dir: &Path,
    files: &[LocalFile],
    quant: Option<&Quant>,
) -> Result<(Option<u128>, Vec<&'static str>), WorkerError> {
    let mut params: Option<u128> = Some(0);
    let mut seen: Vec<&'static str> = Vec::new();
    for f in files
        .iter()
        .filter(|f| f.rel.to_ascii_lowercase().ends_with(".safetensors"))
    {
        let file = flexinfer_fsutil::open_regular(&f.path)
            .map_err(|e| bad(dir, &f.rel, ModelPackProblem::Read(e)))?;
        let tensors = safetensors_header(BufReader::new(file), f.size)
            .map_err(|reason| bad(dir, &f.rel, ModelPackProblem::Safetensors { reason }))?;
        for (name, dtype, shape) in &tensors {
            let numel = shape
                .iter()
                .try_fold(1u128, |a, d| a.checked_mul(u128::from(*d)));
            params = match (params, numel) {
                (Some(p), Some(n)) => tensor_params(name, n, quant).and_then(|t| p.checked_add(t)),
                _ => None,
            };
            let p = match dtype.as_str() {
                "F64" => "float64",
                "F32" => "float32",
                "F16" => "float16",
                "BF16" => "bfloat16",
                "F8_E4M3" => "float8_e4m3",
                "F8_E5M2" => "float8_e5m2",
                _ => continue,
            };
            if !seen.contains(&p) {
                seen.push(p);
            }
        }
    }
    Ok((params, seen))
}

/// What one GGUF header says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GgufInfo {
    pub architecture: Option<String>,
    pub name: Option<String>,
    pub file_type: Option<u32>,
    /// Elements of all tensors (the logical shapes, whatever the block type).
    pub params: u128,
}

/// Why a GGUF header is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GgufProblem {
    #[error("not a GGUF file (no GGUF magic)")]
    NoMagic,
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("the header is cut off at byte {0} (the file is {1} bytes)")]
    Truncated(u64, u64),
    #[error("at byte {at}: {what}")]
    Malformed { at: u64, what: String },
    #[error("reading the header: {0}")]
    Io(String),
}

/// A reader that counts its position and never goes past `len`.
struct Scan<R> {
    r: R,
    at: u64,
    len: u64,
}

impl<R: Read + Seek> Scan<R> {
    fn need(&self, n: u64) -> Result<(), GgufProblem> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(GgufProblem::Truncated(self.at, self.len)),
        }
    }
    fn advance(&mut self, n: u64) {
        self.at = self.at.saturating_add(n);
    }
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufProblem> {
        self.need(N as u64)?;
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|e| GgufProblem::Io(e.to_string()))?;
        self.advance(N as u64);
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, GgufProblem> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, GgufProblem> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn skip(&mut self, n: u64) -> Result<(), GgufProblem> {
        self.need(n)?;
        let off = i64::try_from(n).map_err(|_| GgufProblem::Truncated(self.at, self.len))?;
        self.r
            .seek(std::io::SeekFrom::Current(off))
            .map_err(|e| GgufProblem::Io(e.to_string()))?;
        self.advance(n);
        Ok(())
    }
    fn malformed(&self, what: impl Into<String>) -> GgufProblem {
        GgufProblem::Malformed {
            at: self.at,
            what: what.into(),
        }
    }
    /// A string of at most `max` bytes (longer ones are an error: keys and the values we keep).
    fn string(&mut self, max: u64) -> Result<String, GgufProblem> {
        let n = self.u64()?;
        if n > max {
            return Err(self.malformed(format!("a {n}-byte string where at most {max} fit")));
        }
        self.need(n)?;
        let mut b = vec![0u8; usize::try_from(n).map_err(|_| self.malformed("string length"))?];
        self.r
            .read_exact(&mut b)
            .map_err(|e| GgufProblem::Io(e.to_string()))?;
        self.advance(n);
        String::from_utf8(b).map_err(|_| self.malformed("a string that is not UTF-8"))
    }
    /// Skips a value of type `ty` (arrays nest at most 4 deep).
    fn skip_value(&mut self, ty: u32, depth: u32) -> Result<(), GgufProblem> {
        match gguf_fixed_size(ty) {
            Some(n) => self.skip(n),
            None if ty == 8 => {
                let n = self.u64()?;
                self.skip(n)
            }
            None if ty == 9 && depth < 4 => {
                let item = self.u32()?;
                let count = self.u64()?;
                if let Some(size) = gguf_fixed_size(item) {
                    let n = count
                        .checked_mul(size)
                        .ok_or_else(|| self.malformed("array size overflows"))?;
                    return self.skip(n);
                }
                // Strings and arrays take at least 8 bytes each: a count past the file is refused
                // before the loop.
                self.need(count.saturating_mul(8))?;
                for _ in 0..count {
                    self.skip_value(item, depth.saturating_add(1))?;
                }
                Ok(())
            }
            None => Err(self.malformed(format!("value type {ty}"))),
        }
    }
}

/// The size of a fixed-size GGUF value type (`gguf_type`), `None` for strings, arrays and unknown.
fn gguf_fixed_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        _ => return None,
    })
}

/// Reads the header of a GGUF file of `len` bytes: the metadata it needs (skipping every other
/// value without holding it) and the tensor infos, every length checked against `len`. Never panics.
pub fn scan_gguf(r: impl Read + Seek, len: u64) -> Result<GgufInfo, GgufProblem> {
    let mut s = Scan { r, at: 0, len };
    if s.bytes::<4>().map_err(|_| GgufProblem::NoMagic)? != *b"GGUF" {
        return Err(GgufProblem::NoMagic);
    }
    let version = s.u32()?;
    if !(2..=3).contains(&version) {
        return Err(GgufProblem::Version(version));
    }
    let n_tensors = s.u64()?;
    let n_kv = s.u64()?;
    // Each key/value takes at least 13 bytes, each tensor info at least 24: counts past the file
    // are refused before any loop.
    s.need(
        n_kv.saturating_mul(13)
            .saturating_add(n_tensors.saturating_mul(24)),
    )?;
    let mut info = GgufInfo::default();
    for _ in 0..n_kv {
        let key = s.string(1 << 16)?;
        let ty = s.u32()?;
        match (key.as_str(), ty) {
            ("general.architecture", 8) => info.architecture = Some(s.string(MAX_FIELD as u64)?),
            ("general.name", 8) => info.name = Some(s.string(MAX_FIELD as u64)?),
            ("general.file_type", 4) => info.file_type = Some(s.u32()?),
            ("general.file_type", 5) => {
                info.file_type = u32::try_from(i32::from_le_bytes(s.bytes()?)).ok()
            }
            _ => s.skip_value(ty, 0)?,
        }
    }
    for _ in 0..n_tensors {
        let _name = s.string(1 << 16)?;
        let dims = s.u32()?;
        if dims > 8 {
            return Err(s.malformed(format!("a tensor with {dims} dimensions")));
        }
        let mut numel: u128 = 1;
        for _ in 0..dims {
            numel = numel
                .checked_mul(u128::from(s.u64()?))
                .ok_or_else(|| s.malformed("a tensor's size overflows"))?;
        }
        let _type = s.u32()?;
        let _offset = s.u64()?;
        info.params = info
            .params
            .checked_add(numel)
            .ok_or_else(|| s.malformed("the parameter count overflows"))?;
    }
    Ok(info)
}

/// `general.file_type` as llama.cpp names it (the file types FlexInfer writes, and all-F32).
fn gguf_file_type_name(id: u32) -> Option<&'static str> {
    if id == 0 {
        return Some("F32");
    }
    flexinfer_quant::gguf::FileType::ALL
        .into_iter()
        .find(|t| t.id() == id)
        .map(|t| t.name())
}

/// The nominal bits of a GGUF quantization name (`Q4_K_M` → 4, `IQ4_XS` → 4); `None` for float types.
fn gguf_bits(name: &str) -> Option<u64> {
    let rest = name.strip_prefix('I').unwrap_or(name).strip_prefix('Q')?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// `name-00001-of-00003.gguf`: one part of a split GGUF.
fn is_split_part(rel: &str) -> bool {
    let Some(stem) = rel
        .to_ascii_lowercase()
        .strip_suffix(".gguf")
        .map(String::from)
    else {
        return false;
    };
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    matches!(parts.as_slice(), [total, "of", part, _] if [total, part].iter().all(|p| p.len() == 5 && p.bytes().all(|b| b.is_ascii_digit())))
}

fn gguf_meta(dir: &Path, files: &[LocalFile], d: &mut Described) -> Result<(), WorkerError> {
    let ggufs: Vec<&LocalFile> = files
        .iter()
        .filter(|f| f.rel.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let mut infos = Vec::with_capacity(ggufs.len());
    for f in &ggufs {
        let file = flexinfer_fsutil::open_regular(&f.path)
            .map_err(|e| bad(dir, &f.rel, ModelPackProblem::Read(e)))?;
        let info = scan_gguf(BufReader::with_capacity(1 << 16, file), f.size).map_err(|e| {
            bad(
                dir,
                &f.rel,
                ModelPackProblem::Gguf {
                    problem: Box::new(e),
                },
            )
        })?;
        infos.push(info);
    }
    // One value for the artifact when every file agrees (a split GGUF's later parts carry less).
    let agreed = |get: &dyn Fn(&GgufInfo) -> Option<String>| -> Option<String> {
        let mut vals = infos.iter().filter_map(get);
        let first = vals.next()?;
        vals.all(|v| v == first).then_some(first)
    };
    let arch = agreed(&|i| i.architecture.clone());
    d.config.architecture = arch.clone();
    d.descriptor.family = arch;
    d.descriptor.name = agreed(&|i| i.name.clone()).filter(|n| !n.trim().is_empty());
    if let Some(ft) = agreed(&|i| i.file_type.map(|t| t.to_string()))
        .and_then(|t| t.parse::<u32>().ok())
        .and_then(gguf_file_type_name)
    {
        match ft {
            "F32" => d.config.precision = Some("float32".into()),
            "F16" => d.config.precision = Some("float16".into()),
            "BF16" => d.config.precision = Some("bfloat16".into()),
            q => {
                d.config.quantization = Some(q.into());
                if let Some(b) = gguf_bits(q) {
                    d.annotations
                        .insert(oa::BITS_ANNOTATION.into(), b.to_string());
                }
            }
        }
    }
    // The parts of one split model add up; separate files (two quantizations) count once each, so
    // only a count they all share is the model's.
    let params = if ggufs.iter().all(|f| is_split_part(&f.rel)) {
        infos.iter().try_fold(0u128, |a, i| a.checked_add(i.params))
    } else {
        infos
            .first()
            .map(|i| i.params)
            .filter(|p| infos.iter().all(|i| i.params == *p))
    };
    d.config.param_size = params.and_then(param_size);
    Ok(())
}

/// Reads what the files say about the model (see the module doc). `files` are the files published.
pub(super) fn describe(dir: &Path, files: &[LocalFile]) -> Result<Described, WorkerError> {
    let mut d = Described::default();
    let format = weight_format(files);
    d.config.format = format.map(String::from);

    let hf = match read_json(dir, files, "config.json")? {
        Some(v) => hf_config(dir, &v)?,
        None => HfConfig::default(),
    };
    d.config.architecture = hf.architecture.clone();
    d.descriptor.family = hf.family.clone();
    if let Some(q) = &hf.quant {
        if !q.method.is_empty() {
            d.config.quantization = Some(q.method.clone());
        }
        if let Some(b) = q.bits {
            d.annotations
                .insert(oa::BITS_ANNOTATION.into(), b.to_string());
        }
    }
    if let Some(g) = hf.group_size {
        d.annotations
            .insert(oa::GROUP_SIZE_ANNOTATION.into(), g.to_string());
    }

    match format {
        Some("safetensors") => {
            let (params, seen) = safetensors_meta(dir, files, hf.quant.as_ref())?;
            d.config.param_size = params.and_then(param_size);
            // The compute type the config names, then the FP8 types the weights are stored in;
            // without a config type, every floating type the headers hold.
            let mut precisions: Vec<&str> = Vec::new();
            if let Some(p) = hf.precision {
                precisions.push(p);
                precisions.extend(seen.iter().filter(|s| s.starts_with("float8") && **s != p));
            } else {
                precisions.extend(PRECISIONS.iter().filter(|p| seen.contains(p)));
            }
            d.config.precision = Some(precisions.join(",")).filter(|p| !p.is_empty());
        }
        Some("gguf") => gguf_meta(dir, files, &mut d)?,
        _ => d.config.precision = hf.precision.map(String::from),
    }

    if let Some(v) = read_json(dir, files, files::SAVE_COMPLETE)? {
        if let Some(t) = v.get("completed_at").and_then(Value::as_str) {
            let ts: jiff::Timestamp = t.parse().map_err(|e| {
                bad(
                    dir,
                    files::SAVE_COMPLETE,
                    ModelPackProblem::CompletedAt {
                        value: t.to_string(),
                        error: e,
                    },
                )
            })?;
            d.descriptor.created_at = Some(ts.to_string());
        }
    }
    if let Some(v) = read_json(dir, files, files::SOURCE_INTEGRITY)? {
        let s = |k: &str| v.get(k).and_then(Value::as_str);
        if let Some(src) = s("source") {
            d.descriptor.source_url = field(dir, files::SOURCE_INTEGRITY, "source", src)?;
        }
        if let Some(rev) = s("revision") {
            d.descriptor.revision = field(dir, files::SOURCE_INTEGRITY, "revision", rev)?;
        }
    }
    if let Some(v) = read_json(dir, files, files::QUANTIZATION_QUALITY)? {
        if let Some(g) = v.get("gate").and_then(Value::as_str) {
            if let Some(g) = field(dir, files::QUANTIZATION_QUALITY, "gate", g)? {
                d.annotations.insert(oa::QUALITY_GATE_ANNOTATION.into(), g);
            }
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn local(dir: &Path, rel: &str) -> LocalFile {
        let path = dir.join(rel);
        let size = std::fs::metadata(&path).unwrap().len();
        LocalFile {
            rel: rel.into(),
            path,
            size,
            digest: String::new(),
        }
    }

    fn write(dir: &Path, rel: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        p
    }

    /// A safetensors file with these (name, dtype, shape) tensors, zero-filled.
    fn safetensors(tensors: &[(&str, &str, &[usize])]) -> Vec<u8> {
        let size = |d: &str| match d {
            "F32" | "I32" => 4,
            "BF16" | "F16" => 2,
            _ => 1,
        };
        let mut header = serde_json::Map::new();
        let mut off = 0usize;
        for (name, dtype, shape) in tensors {
            let n = shape.iter().product::<usize>() * size(dtype);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}),
            );
            off += n;
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(vec![0u8; off]);
        out
    }

    fn describe_tree(tree: &[(&str, Vec<u8>)]) -> Result<Described, WorkerError> {
        let d = tempfile::tempdir().unwrap();
        for (rel, b) in tree {
            write(d.path(), rel, b);
        }
        let files: Vec<LocalFile> = tree.iter().map(|(rel, _)| local(d.path(), rel)).collect();
        describe(d.path(), &files)
    }

    #[test]
    fn layer_media_types_follow_the_file_names() {
        for (rel, mt, guessed) in [
            (
                "model-00001-of-00002.safetensors",
                oa::MODELPACK_WEIGHT_RAW,
                false,
            ),
            ("model-Q4_K_M.gguf", oa::MODELPACK_WEIGHT_RAW, false),
            ("pytorch_model.bin", oa::MODELPACK_WEIGHT_RAW, false),
            ("config.json", oa::MODELPACK_WEIGHT_CONFIG_RAW, false),
            (
                "tokenizer/tokenizer.json",
                oa::MODELPACK_WEIGHT_CONFIG_RAW,
                false,
            ),
            ("tokenizer.model", oa::MODELPACK_WEIGHT_CONFIG_RAW, false),
            ("merges.txt", oa::MODELPACK_WEIGHT_CONFIG_RAW, false),
            (
                "chat_template.jinja",
                oa::MODELPACK_WEIGHT_CONFIG_RAW,
                false,
            ),
            (".save-complete", oa::MODELPACK_WEIGHT_CONFIG_RAW, false),
            (
                ".quantization-quality.json",
                oa::MODELPACK_WEIGHT_CONFIG_RAW,
                false,
            ),
            ("README.md", oa::MODELPACK_DOC_RAW, false),
            ("LICENSE", oa::MODELPACK_DOC_RAW, false),
            ("notes.txt", oa::MODELPACK_DOC_RAW, false),
            ("requirements.txt", oa::MODELPACK_CODE_RAW, false),
            ("modeling_x.py", oa::MODELPACK_CODE_RAW, false),
            ("calib.parquet", oa::MODELPACK_DATASET_RAW, false),
            ("imatrix.dat", oa::MODELPACK_WEIGHT_CONFIG_RAW, true),
            ("empty", oa::MODELPACK_WEIGHT_CONFIG_RAW, true),
        ] {
            assert_eq!(layer_media_type(rel), (mt, guessed), "{rel}");
        }
        assert_eq!(
            file_metadata("tok/t.json", 12),
            r#"{"gid":0,"mode":420,"mtime":"1970-01-01T00:00:00Z","name":"t.json","size":12,"typeflag":48,"uid":0}"#
        );
    }

    #[test]
    fn param_sizes_use_the_largest_scale_and_one_decimal() {
        for (n, want) in [
            (7_615_616_512u128, Some("7.6B")),
            (494_032_768, Some("494M")),
            (999_960_000, Some("1B")),
            (1_500, Some("1.5K")),
            (120, Some("0.1K")),
            (40, None),
            (1_000_000_000_000, Some("1T")),
        ] {
            assert_eq!(param_size(n).as_deref(), want, "{n}");
        }
    }

    #[test]
    fn a_gptq_checkpoint_is_described_from_its_config_and_headers() {
        let cfg = serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "float16",
            "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false},
        });
        // One 4-bit linear of 64×32 (packed 8 per int32 along the input), an embedding of 100×32.
        let st = safetensors(&[
            ("model.embed_tokens.weight", "F16", &[100, 32]),
            ("model.layers.0.mlp.down_proj.qweight", "I32", &[8, 32]),
            ("model.layers.0.mlp.down_proj.qzeros", "I32", &[1, 4]),
            ("model.layers.0.mlp.down_proj.scales", "F16", &[1, 32]),
            ("model.layers.0.mlp.down_proj.g_idx", "I32", &[64]),
        ]);
        let save = serde_json::json!({"completed_at": "2026-12-01T10:20:30Z", "shards": []});
        let quality = serde_json::json!({"gate": "passed", "gptqModules": 7});
        let d = describe_tree(&[
            ("config.json", cfg.to_string().into_bytes()),
            ("model.safetensors", st),
            (".save-complete", save.to_string().into_bytes()),
            (
                ".quantization-quality.json",
                quality.to_string().into_bytes(),
            ),
            ("tokenizer.json", b"{}".to_vec()),
        ])
        .unwrap();
        assert_eq!(
            d.config,
            ModelConfig {
                architecture: Some("Qwen2ForCausalLM".into()),
                format: Some("safetensors".into()),
                param_size: Some("5.2K".into()), // 100×32 + 64×32
                precision: Some("float16".into()),
                quantization: Some("gptq".into()),
            }
        );
        assert_eq!(d.descriptor.family.as_deref(), Some("qwen2"));
        assert_eq!(
            d.descriptor.created_at.as_deref(),
            Some("2026-12-01T10:20:30Z")
        );
        assert_eq!(
            d.annotations,
            [
                (oa::BITS_ANNOTATION, "4"),
                (oa::GROUP_SIZE_ANNOTATION, "128"),
                (oa::QUALITY_GATE_ANNOTATION, "passed")
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into()
        );
        let blob = d.config_blob(vec!["sha256:ab".into()]).unwrap();
        let v: Value = serde_json::from_slice(&blob).unwrap();
        assert_eq!(
            v["modelfs"],
            serde_json::json!({"type": "layers", "diffIds": ["sha256:ab"]})
        );
        assert_eq!(v["descriptor"]["createdAt"], "2026-12-01T10:20:30Z");
        assert!(v["config"].get("bits").is_none());
    }

    #[test]
    fn fp8_and_unquantized_precisions_come_from_config_and_headers() {
        let cfg = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
            "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "group_size": null}}}},
        });
        let st = safetensors(&[
            ("a.weight", "F8_E4M3", &[16, 16]),
            ("a.weight_scale", "BF16", &[16, 1]),
            ("norm.weight", "BF16", &[16]),
        ]);
        let d = describe_tree(&[
            ("config.json", cfg.to_string().into_bytes()),
            ("m.safetensors", st),
        ])
        .unwrap();
        assert_eq!(d.config.precision.as_deref(), Some("bfloat16,float8_e4m3"));
        assert_eq!(d.config.quantization.as_deref(), Some("compressed-tensors"));
        assert_eq!(d.config.param_size.as_deref(), Some("0.3K"));
        assert_eq!(
            d.annotations.get(oa::BITS_ANNOTATION).map(String::as_str),
            Some("8")
        );
        // No config type: the floating types of the headers, in the spec's order.
        let st = safetensors(&[("a", "BF16", &[4]), ("b", "F32", &[4])]);
        let d = describe_tree(&[("config.json", b"{}".to_vec()), ("m.safetensors", st)]).unwrap();
        assert_eq!(d.config.precision.as_deref(), Some("float32,bfloat16"));
        assert_eq!(d.config.architecture, None);
        // An unknown packing: no parameter count rather than a wrong one.
        let cfg =
            serde_json::json!({"quantization_config": {"quant_method": "bitsandbytes", "bits": 4}});
        let st = safetensors(&[("a.weight", "U8", &[64])]);
        let d = describe_tree(&[
            ("config.json", cfg.to_string().into_bytes()),
            ("m.safetensors", st),
        ])
        .unwrap();
        assert_eq!(d.config.param_size, None);
        assert_eq!(d.config.quantization.as_deref(), Some("bitsandbytes"));
    }

    #[test]
    fn unreadable_files_are_errors_naming_the_file() {
        for (tree, want) in [
            (vec![("config.json", b"{not json".to_vec())], "config.json"),
            (
                vec![("config.json", b"[1]".to_vec())],
                "config.json: not a JSON object",
            ),
            (
                vec![("w.safetensors", b"garbage!".to_vec())],
                "w.safetensors: not a readable safetensors",
            ),
            (
                vec![("m.gguf", b"GGUF\x01\0\0\0".to_vec())],
                "m.gguf: not a readable GGUF file: GGUF version 1",
            ),
            (
                vec![(
                    ".save-complete",
                    br#"{"completed_at":"yesterday"}"#.to_vec(),
                )],
                ".save-complete: completed_at \"yesterday\"",
            ),
            (
                vec![(
                    "config.json",
                    format!(r#"{{"model_type":"{}"}}"#, "x".repeat(2000)).into_bytes(),
                )],
                "model_type is 2000 bytes long",
            ),
        ] {
            let e = describe_tree(&tree).unwrap_err();
            assert_eq!(e.kind(), crate::common::ExitKind::BadInput, "{e}");
            assert!(
                flexinfer_contract::error::chain(&e).contains(want),
                "{e} should contain {want}"
            );
        }
    }

    fn gguf_bytes(md: Vec<(&str, flexinfer_quant::gguf::writer::MetaValue)>) -> Vec<u8> {
        use flexinfer_quant::gguf::writer::{GgufWriter, TensorSpec};
        use flexinfer_quant::gguf::GgmlType;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.gguf");
        let md: Vec<(String, _)> = md.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let t = TensorSpec {
            name: "tok_embd.weight".into(),
            dims: vec![32, 8],
            ty: GgmlType::F32,
        };
        let mut w = GgufWriter::create(&p, &md, vec![t]).unwrap();
        w.write_tensor("tok_embd.weight", &vec![0u8; 32 * 8 * 4])
            .unwrap();
        w.finish().unwrap();
        std::fs::read(&p).unwrap()
    }

    #[test]
    fn a_gguf_is_described_from_its_header() {
        use flexinfer_quant::gguf::writer::{MetaArray, MetaValue};
        let b = gguf_bytes(vec![
            ("general.architecture", MetaValue::Str("qwen2".into())),
            ("general.name", MetaValue::Str("Tiny Qwen".into())),
            ("general.file_type", MetaValue::U32(15)),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array(MetaArray::Str(vec!["a".into(); 50])),
            ),
            (
                "tokenizer.ggml.scores",
                MetaValue::Array(MetaArray::F32(vec![0.5; 50])),
            ),
        ]);
        let info = scan_gguf(std::io::Cursor::new(&b), b.len() as u64).unwrap();
        assert_eq!(info.params, 256);
        let d = describe_tree(&[
            ("model-Q4_K_M.gguf", b.clone()),
            (".save-complete", b"{}".to_vec()),
        ])
        .unwrap();
        assert_eq!(
            d.config,
            ModelConfig {
                architecture: Some("qwen2".into()),
                format: Some("gguf".into()),
                param_size: Some("0.3K".into()),
                precision: None,
                quantization: Some("Q4_K_M".into()),
            }
        );
        assert_eq!(d.descriptor.family.as_deref(), Some("qwen2"));
        assert_eq!(d.descriptor.name.as_deref(), Some("Tiny Qwen"));
        assert_eq!(
            d.annotations.get(oa::BITS_ANNOTATION).map(String::as_str),
            Some("4")
        );
        // Every cut of the header is an error, never a panic or a guess.
        for cut in 0..b.len().min(600) {
            assert!(
                scan_gguf(std::io::Cursor::new(&b[..cut]), cut as u64).is_err(),
                "{cut}"
            );
        }
        let f16 = gguf_bytes(vec![("general.file_type", MetaValue::U32(1))]);
        let d = describe_tree(&[("m.gguf", f16)]).unwrap();
        assert_eq!(d.config.precision.as_deref(), Some("float16"));
        assert_eq!(d.config.quantization, None);
        assert_eq!(gguf_bits("IQ4_XS"), Some(4));
        assert_eq!(gguf_bits("Q8_0"), Some(8));
        assert_eq!(gguf_bits("BF16"), None);
        assert!(is_split_part("m-00001-of-00003.gguf"));
        assert!(!is_split_part("m-Q4_K_M.gguf"));
    }
}
