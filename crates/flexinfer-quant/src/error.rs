//! Typed errors of the quantization engine.
//!
//! [`QuantError`] is what the engine returns. What the caller handed us and we cannot use is one of
//! the grouped enums below, each naming the file, field or tensor at fault as a typed field:
//! [`ConfigError`] (`config.json`), [`TensorError`] (the weights), [`DatasetError`] (calibration and
//! prompt datasets), [`SpecError`] (the job's settings), [`FileError`] (the model directory's files)
//! and [`TokenizerError`] (`tokenizer.json`). [`NumericError`] is a failure of the engine itself.
//! An underlying error (serde_json, the tokenizer library, parquet, I/O) is kept as the `#[source]`
//! and left out of the message: render these errors with `flexinfer_contract::error::chain`.

use std::path::PathBuf;

use serde_json::Value;

pub(crate) mod device;
mod gguf;

use self::device::{DeviceError, DeviceKind, ProbeError};
pub use self::gguf::GgufError;

/// Everything that can go wrong in the engine. The `Config`, `Tensor`, `Dataset`, `Spec` and `File`
/// variants mean the caller handed us something we cannot quantize (bad model, bad config, bad
/// dataset): the worker maps them to exit code 2 ([`QuantError::is_bad_input`]).
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("invalid input")]
    Config(#[from] ConfigError),
    #[error("invalid input")]
    Tensor(#[from] TensorError),
    #[error("invalid input")]
    Dataset(#[from] DatasetError),
    #[error("invalid input")]
    Spec(#[from] SpecError),
    #[error("invalid input")]
    File(#[from] FileError),
    #[error("I/O error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file that cannot be read or written; `tensor` names the tensor at fault, if one is.
    #[error("safetensors error in {path}{}", tensor_suffix(.tensor))]
    Safetensors {
        path: PathBuf,
        tensor: Option<String>,
        #[source]
        source: BoxError,
    },
    /// A JSON document that does not parse, or does not encode.
    #[error("JSON error in {path}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A `model.safetensors.index.json` that parses but does not name the weight files.
    #[error("JSON error in {path}: {problem}")]
    Index {
        path: PathBuf,
        problem: IndexProblem,
    },
    #[error("tokenizer error")]
    Tokenizer(#[from] TokenizerError),
    #[error("numerical failure")]
    Numeric(#[from] NumericError),
    /// The RTN-fallback gate rejected the run; nothing was written to the output directory.
    #[error("RTN fallback gate failed: {} of {} modules ({:.1}%) fell back to RTN, limit {:.1}%", .0.rtn_fallback_modules, .0.gptq_modules + .0.rtn_fallback_modules, .0.rtn_fallback_percent, .0.max_rtn_fallback_percent)]
    GateFailed(flexinfer_contract::files::QualitySummary),
    /// AWQ's gate rejected the run: its output error was worse than allowed against plain rounding; nothing
    /// was written to the output directory.
    #[error("AWQ output-error gate failed: mean output error ratio to plain rounding {:.4} > limit {:.4} (worst {} at {:.4})", .0.output_error_ratio, .0.max_output_error_ratio, .0.worst_output_error_module, .0.worst_output_error_ratio)]
    AwqGateFailed(Box<flexinfer_contract::files::AwqQuality>),
    /// The requested GPTQ device cannot be used (`GPTQ_DEVICE`); configuration, so the worker exits 2.
    #[error(
        "GPTQ device unavailable: GPTQ_DEVICE={}: no {} device this build can use (set GPTQ_DEVICE=cpu or auto to run on the CPU)",
        .kind.as_str(),
        if *.kind == DeviceKind::Hip { "AMD (HIP)" } else { "NVIDIA (CUDA)" }
    )]
    DeviceUnavailable {
        kind: DeviceKind,
        #[source]
        reason: ProbeError,
    },
    /// A device operation failed where no CPU fallback was possible.
    #[error("GPTQ device failure")]
    Device(#[from] DeviceError),
    /// A device operation failed after the Hessian's host copy was gone: the module cannot finish
    /// on the CPU.
    #[error("GPTQ device failure: {module}: no host copy of the Hessian to finish on the CPU")]
    DeviceLost {
        module: String,
        #[source]
        source: DeviceError,
    },
    #[cfg(feature = "test-hooks")]
    #[error("aborted by test hook after layer {0}")]
    TestAbort(usize),
    /// The GGUF output: bad input (architecture, tokenizer, row sizes) or an I/O failure.
    #[error("GGUF")]
    Gguf(#[from] GgufError),
}

/// The error type of the tokenizer library (a boxed error).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

fn tensor_suffix(tensor: &Option<String>) -> String {
    tensor
        .as_ref()
        .map(|t| format!(": {t}"))
        .unwrap_or_default()
}

/// What is wrong with a `model.safetensors.index.json` that parses.
#[derive(Debug, thiserror::Error)]
pub enum IndexProblem {
    #[error("missing weight_map")]
    MissingWeightMap,
    #[error("weight_map[{tensor:?}] is not a file name")]
    NotAFileName { tensor: String },
    #[error("weight_map names no file")]
    NoFile,
}

/// A `config.json` the engine cannot use. `field` is the field's path in the (text) config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("unsupported architecture {arch:?} in config.json; supported: {}", .supported.join(", "))]
    Architecture {
        arch: String,
        supported: &'static [&'static str],
    },
    #[error("config.json: {arch} has no text_config object")]
    NoTextConfig { arch: String },
    #[error("config.json: missing or invalid integer field {field:?}")]
    MissingInteger { field: String },
    /// A field of the wrong JSON type; `expected` says what it must be ("a positive integer").
    #[error("config.json: {field} must be {expected}{}", found_suffix(.found))]
    WrongType {
        field: String,
        expected: &'static str,
        found: Option<Value>,
    },
    /// A product of sizes (or a size) that does not fit in memory arithmetic.
    #[error("config.json: {field} is too large")]
    TooLarge { field: String },
    /// `range` is written as in the message, e.g. `(1..=512)` or `(0, 1]`.
    #[error("config.json: {field} {value} is out of range {range}")]
    OutOfRange {
        field: String,
        value: String,
        range: String,
    },
    #[error("config.json: num_hidden_layers {layers} is larger than {max}")]
    TooManyLayers { layers: usize, max: usize },
    /// A value the forward does not implement; `model` names the model family when the value is
    /// fine elsewhere, `supported` lists what is.
    #[error("config.json: {field} {value} is not supported{} ({supported})", model_suffix(.model))]
    Unsupported {
        field: String,
        value: String,
        model: Option<String>,
        supported: &'static str,
    },
    /// A feature of the architecture the calibration forward does not implement.
    #[error(
        "config.json: {field} {value} ({feature}) is not supported by the calibration forward"
    )]
    UnsupportedFeature {
        field: String,
        value: String,
        feature: String,
    },
    /// The attention shape of the model, or of layer `layer`.
    #[error(
        "config.json: {}inconsistent attention shape (heads {heads}, kv heads {kv_heads}, head_dim {head_dim})",
        layer_prefix(.layer)
    )]
    AttentionShape {
        layer: Option<usize>,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    },
    #[error("config.json: the {kind} layers have different head_dim values {dims:?}")]
    MixedHeadDims {
        kind: &'static str,
        dims: Vec<usize>,
    },
    #[error(
        "config.json: partial_rotary_factor {factor} × head_dim {head_dim} gives {dims} rotating \
         dimensions; a positive even number is needed"
    )]
    RotaryDims {
        factor: f32,
        head_dim: usize,
        dims: usize,
    },
    #[error("config.json: layer_types has {entries} entries, num_hidden_layers is {layers}")]
    LayerTypesCount { entries: usize, layers: usize },
    #[error("config.json: layer_types entry {found:?} is not {other} or full_attention")]
    LayerTypesEntry {
        found: Option<String>,
        other: String,
    },
    #[error(
        "config.json: {experts_field} {experts} / {top_k_field} {top_k} is not a valid routing \
         (1 ≤ top-k ≤ experts ≤ {max})"
    )]
    Routing {
        experts_field: String,
        experts: usize,
        top_k_field: &'static str,
        top_k: usize,
        max: usize,
    },
    #[error(
        "config.json: linear_num_value_heads {value_heads} must be a positive multiple of \
         linear_num_key_heads {key_heads} (at most {max})"
    )]
    LinearHeads {
        value_heads: usize,
        key_heads: usize,
        max: usize,
    },
    /// A field whose value is out of the range the forward accepts, shown as found.
    #[error("config.json: {field} {value} is out of range")]
    Invalid { field: String, value: String },
}

fn found_suffix(found: &Option<Value>) -> String {
    found
        .as_ref()
        .map(|v| format!(", found {v}"))
        .unwrap_or_default()
}

fn model_suffix(model: &Option<String>) -> String {
    model
        .as_ref()
        .map(|m| format!(" for {m}"))
        .unwrap_or_default()
}

fn layer_prefix(layer: &Option<usize>) -> String {
    layer.map(|l| format!("layer {l}: ")).unwrap_or_default()
}

/// A tensor of the model that is missing, malformed, or not the shape `config.json` implies.
/// `name` is the tensor's name.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("tensor {name} not found in the model")]
    NotFound { name: String },
    #[error("tensor {name} lies outside its file")]
    OutsideFile { name: String },
    #[error("tensor {name} is truncated")]
    Truncated { name: String },
    #[error("tensor {name} has shape {shape:?}; expected {dims} dimensions")]
    Rank {
        name: String,
        shape: Vec<usize>,
        dims: usize,
    },
    #[error("row {row} is outside tensor {name} ({rows} rows)")]
    RowOutside {
        name: String,
        row: usize,
        rows: usize,
    },
    #[error("rows {row0}..{row0}+{nrows} of slice {index} are outside tensor {name} {shape:?}")]
    BlockOutside {
        name: String,
        index: usize,
        row0: usize,
        nrows: usize,
        shape: Vec<usize>,
    },
    #[error("tensor {name} has dtype {dtype:?}; expected {expected}")]
    Dtype {
        name: String,
        dtype: safetensors::Dtype,
        expected: &'static str,
    },
    /// `element` is the index of the first non-finite value in the tensor.
    #[error(
        "tensor {name} contains a non-finite value (NaN/Inf) at element {element}; the source weights are corrupt"
    )]
    NonFinite { name: String, element: usize },
    /// The calibration inputs of linear `module` reach `absmax` (zero, NaN or infinite): no static FP8
    /// `input_scale` (`absmax / 448`) can be made from them.
    #[error(
        "{module}: the largest magnitude of its calibration inputs is {absmax}; a static FP8 input_scale needs a finite positive one (FP8_ACTIVATIONS=dynamic needs none)"
    )]
    ActivationScale { module: String, absmax: f32 },
    /// The shape `config.json` implies is `expected`.
    #[error("{name} has shape {shape:?}, config.json implies {expected:?}")]
    Shape {
        name: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{name} has {len} values, config.json implies {expected}")]
    Length {
        name: String,
        len: usize,
        expected: usize,
    },
    #[error("{name} has {len} values; expected {expected}")]
    Count {
        name: String,
        len: usize,
        expected: usize,
    },
    #[error("{name} rows have {len} values, config.json hidden_size is {hidden_size}")]
    RowWidth {
        name: String,
        len: usize,
        hidden_size: usize,
    },
    #[error("{name}: expert {expert} has {len} values where config.json implies {rows} × {cols}")]
    ExpertSize {
        name: String,
        expert: usize,
        len: usize,
        rows: usize,
        cols: usize,
    },
    /// `module` is the linear whose `g_idx` names groups its scales do not have.
    #[error("{module}.g_idx is inconsistent with its scales")]
    GroupIndex { module: String },
    /// Linear `module`'s solve cannot be written in compressed-tensors' `pack-quantized` layout (`why`).
    #[error("{module} cannot be written as compressed-tensors pack-quantized: {why}")]
    PackQuantized { module: String, why: String },
}

/// A calibration or prompt dataset the engine cannot read. `what` says which
/// ("calibration dataset", "prompt dataset"), `path` is the file.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{what} {} does not exist or is not a regular file", .path.display())]
    NotAFile { what: &'static str, path: PathBuf },
    #[error("{what} {} cannot be opened", .path.display())]
    Open {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A read refused by the size limits; the source's text names the file.
    #[error(transparent)]
    Read { source: std::io::Error },
    /// Line `line` (from 1) of a JSON-lines file could not be read.
    #[error("{what} {}", .path.display())]
    Line {
        what: &'static str,
        path: PathBuf,
        line: usize,
        #[source]
        source: std::io::Error,
    },
    /// The file (`line` None) or one of its lines is not JSON.
    #[error("{what} {}{}: invalid JSON", .path.display(), line_suffix(.line))]
    Json {
        what: &'static str,
        path: PathBuf,
        line: Option<usize>,
        #[source]
        source: serde_json::Error,
    },
    #[error("{what} {} is not UTF-8 text", .path.display())]
    NotUtf8 {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::string::FromUtf8Error,
    },
    #[error("{what} {}: the CSV header has none of the columns {fields:?}", .path.display())]
    CsvHeader {
        what: &'static str,
        path: PathBuf,
        fields: &'static [&'static str],
    },
    #[error("dataset {}: not a readable parquet file", .path.display())]
    Parquet {
        path: PathBuf,
        #[source]
        source: parquet::errors::ParquetError,
    },
    #[error(
        "calibration dataset {} yielded no usable samples (empty, or no text field among {fields:?})",
        .path.display()
    )]
    NoSamples {
        path: PathBuf,
        fields: &'static [&'static str],
    },
    /// Every sample needs a byte the tokenizer's byte-level vocabulary lacks; `sample` (from 1) is the first.
    #[error(
        "calibration dataset {}: no sample can be encoded; sample {sample} needs bytes {} that \
         tokenizer.json's byte-level vocabulary lacks ({skipped} samples skipped)",
        .path.display(),
        hex_bytes(.bytes)
    )]
    Unencodable {
        path: PathBuf,
        sample: usize,
        bytes: Vec<u8>,
        skipped: usize,
    },
}

fn line_suffix(line: &Option<usize>) -> String {
    line.map(|l| format!(" line {l}")).unwrap_or_default()
}

fn hex_bytes(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("0x{b:02x}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A setting of the job (its parameters, or the `GPTQ_*` / `MAX_*` / `DYNAMIC_EXCLUSION` env) that
/// cannot be used, or cannot be used with this model.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("bits must be one of 2, 3, 4, 8 (got {bits})")]
    Bits { bits: u32 },
    #[error("group size must be -1 or positive (got {group_size})")]
    GroupSize { group_size: i32 },
    #[error("block size must be positive")]
    BlockSize,
    #[error("GPTQ recovery tunables must be finite and non-negative")]
    Recovery,
    #[error("MAX_SAMPLES must be ≥ 1 and MAX_SEQ_LEN ≥ 2")]
    Samples {
        max_samples: usize,
        max_seq_len: usize,
    },
    #[error("GPTQ_HESSIAN_DIAG_FLOOR_MODE must be mean or abs_max, got {got:?}")]
    FloorMode { got: String },
    #[error("CLIP_SEARCH must be auto, on or off, got {got:?}")]
    ClipSearch { got: String },
    #[error("REFINE_SCALES must be auto, on, off or a number of rounds from 0 to 64, got {got:?}")]
    RefineScales { got: String },
    #[error("GPTQ_DEVICE={got:?}: expected auto, cpu, hip or cuda")]
    Device { got: String },
    /// A setting named `field` (env or flag) has a value the engine does not take.
    #[error("{field}={value:?}: expected {expected}")]
    Value {
        field: String,
        value: String,
        expected: String,
    },
    #[error(
        "DYNAMIC_EXCLUSION: {item:?} is a mode and cannot be part of a module list ({list:?})"
    )]
    ExclusionMode { item: String, list: String },
    /// The group size does not divide the input dimension of linear `module`.
    #[error("group size {group_size} does not divide the input dimension {cols} of {module}")]
    GroupDivides {
        module: String,
        group_size: i32,
        cols: usize,
    },
    /// Linear `module` cannot be packed at `bits` bits.
    #[error(
        "{module} has shape [{rows}, {cols}]; {bits}-bit packing needs both dimensions to be multiples of {pack}"
    )]
    Packing {
        module: String,
        rows: usize,
        cols: usize,
        bits: u32,
        pack: usize,
    },
}

/// A file of the model directory that is missing or that the checked reads refuse.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{name} not found in model directory {}", .dir.display())]
    Missing { name: String, dir: PathBuf },
    /// Refused by the untrusted-file checks (escape, not a regular file, too large); the source's
    /// text names the file.
    #[error(transparent)]
    Refused { source: std::io::Error },
    #[error("no .safetensors weight files in {}", .dir.display())]
    NoWeightFiles { dir: PathBuf },
    /// An entry of `model.safetensors.index.json` (`path`) names a file outside the model directory.
    #[error("{}: weight_map[{tensor:?}]", .path.display())]
    IndexEntry {
        path: PathBuf,
        tensor: String,
        #[source]
        source: std::io::Error,
    },
}

/// A `tokenizer.json` (`path`) that cannot be loaded, or a text it cannot encode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}", .path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    /// Loading failed (`first`), and so did converting the file to the current format.
    #[error("{}: {first}; conversion failed", .path.display())]
    Convert {
        path: PathBuf,
        first: BoxError,
        #[source]
        source: tokenizers::ConvertError,
    },
    /// Loading failed (`first`), and so did loading it with the missing byte symbols added.
    #[error("{}: {first}; with the missing byte symbols added", .path.display())]
    ByteSymbols {
        path: PathBuf,
        first: Box<QuantError>,
        #[source]
        source: BoxError,
    },
    #[error("encoding {what}")]
    Encode {
        what: String,
        #[source]
        source: BoxError,
    },
}

/// A failure of the engine itself (an invariant broken, an encoding that cannot fail): not the
/// caller's fault, the worker exits 1.
#[derive(Debug, thiserror::Error)]
pub enum NumericError {
    #[error("{layer_prefix}: not a hybrid model")]
    NotHybrid { layer_prefix: String },
    #[error("{layer_prefix}: MoE weights not loaded")]
    MoeNotLoaded { layer_prefix: String },
    #[error("layer {layer}: expert list shorter than its config")]
    ExpertListShort { layer: usize },
    #[error("{layer_prefix}: expert {expert}")]
    ExpertMissing { layer_prefix: String, expert: usize },
    /// Module `index` of a layer's module list is missing; `group` names the modules solved together.
    #[error("module index {index}{}", group_suffix(.group))]
    ModuleMissing { index: usize, group: Option<String> },
    #[error("layer {layer} missing from cache")]
    LayerNotCached { layer: usize },
    #[error("{name}: {bytes} bytes for shape {shape:?}")]
    TensorBytes {
        name: String,
        bytes: usize,
        shape: Vec<usize>,
    },
    #[error("encoding {what}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

fn group_suffix(group: &Option<String>) -> String {
    group
        .as_ref()
        .map(|g| format!(" of {g}"))
        .unwrap_or_default()
}

impl QuantError {
    /// True when the error is the caller's fault (bad model, config, or dataset).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            QuantError::Config(_)
                | QuantError::Tensor(_)
                | QuantError::Dataset(_)
                | QuantError::Spec(_)
                | QuantError::File(_)
                | QuantError::Safetensors { .. }
                | QuantError::Json { .. }
                | QuantError::Index { .. }
                | QuantError::Tokenizer(_)
                | QuantError::DeviceUnavailable { .. }
        ) || matches!(self, QuantError::Gguf(e) if e.is_bad_input())
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        QuantError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, QuantError>;

#[cfg(test)]
mod tests;
