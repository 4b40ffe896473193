//! The typed failures of each worker subcommand, by area: each variant carries the values its text
//! names, and [`super::WorkerError`] maps each to its exit class. They live here, beside
//! `WorkerError`, so that `common` names no subcommand module.

use std::path::PathBuf;

use flexinfer_contract::{env, files, source};
use flexinfer_quant::gguf::FileType;
use flexinfer_quant::QuantError;

use super::ExitKind;

fn gguf_type_names() -> String {
    FileType::ALL.map(FileType::name).join(", ")
}

/// `node-copy fill` and `clean`: a source, digest or artifact that cannot be copied (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum NodeCopyError {
    #[error("{}: a node copy is pulled from the published artifact, oci://registry/repo@sha256:…; got {raw:?}", env::SOURCE)]
    NotOci { raw: String },
    #[error("{}: {raw:?} names no digest; a node copy is always of one published digest (…@sha256:<hex>)", env::SOURCE)]
    NoDigest { raw: String },
    #[error("{}: bad digest {digest:?}", env::SOURCE)]
    BadDigest { digest: String },
    #[error("the registry served manifest {served} for {raw}")]
    ManifestMismatch { served: String, raw: String },
    #[error("{} exists and is not a directory", .dest.display())]
    NotADirectory { dest: PathBuf },
    #[error(
        "{} names shard {shard:?}, which the artifact does not contain",
        files::SAVE_COMPLETE
    )]
    MissingShard { shard: String },
    #[error(
        "shard {shard:?}: the artifact has {size} bytes, sha256 {}; {} records {recorded_size} bytes, sha256 {recorded_sha256}",
        .sha256.as_deref().unwrap_or("(none)"),
        files::SAVE_COMPLETE
    )]
    ShardMismatch {
        shard: String,
        size: u64,
        sha256: Option<String>,
        recorded_size: u64,
        recorded_sha256: String,
    },
    #[error("{}: {keep:?} is not a sha256:<hex> digest", env::NODE_COPY_KEEP)]
    BadKeep { keep: String },
}

impl NodeCopyError {
    pub fn kind(&self) -> ExitKind {
        ExitKind::BadInput
    }
}

/// `download`: settings or a source that cannot be fetched (exit 2), or a disk too small (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    #[error(
        "{}: concurrency must be at least 1",
        env::transfer::DOWNLOAD_CONCURRENCY
    )]
    NoConcurrency,
    #[error("{} must be model or dataset, got {repo_type:?}", env::REPO_TYPE)]
    RepoType { repo_type: String },
    #[error("oci://{reference} lists no files to fetch")]
    NoOciFiles { reference: String },
    #[error(
        "the source contains {path:?}, which is {what} that FlexInfer's pipeline writes itself; \
         remove it from the source or exclude it with spec.download.ignorePatterns"
    )]
    Reserved { path: String, what: &'static str },
    #[error("no files to download: the source lists {listed} file(s) and none match the allow/ignore patterns")]
    NoneMatch { listed: usize },
    #[error(
        "local:// sources need {} (the directory local sources must stay inside)",
        flexinfer_contract::env::controller::LOCAL_SOURCE_ROOT
    )]
    NoLocalRoot,
    #[error("local source {path:?} resolves outside the allowed root {}", .root.display())]
    LocalOutsideRoot { path: String, root: PathBuf },
    #[error("local source {path:?} is not a directory")]
    LocalNotADirectory { path: String },
    #[error(
        "invalid source {source_uri:?}: unknown scheme (use {})",
        source::SCHEMES
    )]
    UnknownScheme { source_uri: String },
    #[error(
        "not enough free space in {}: need {needed} bytes ({:.2} GiB) more, {available} bytes ({:.2} GiB) available",
        .dir.display(),
        *.needed as f64 / 1073741824.0,
        *.available as f64 / 1073741824.0
    )]
    NoSpace {
        dir: PathBuf,
        needed: u64,
        available: u64,
    },
}

impl DownloadError {
    pub fn kind(&self) -> ExitKind {
        match self {
            DownloadError::NoSpace { .. } => ExitKind::Failure,
            _ => ExitKind::BadInput,
        }
    }
}

/// `publish`: settings or a directory that cannot be published (exit 2), or a registry that stored
/// something else (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(
        "{} must be overwrite, timestamp or digest-suffix, got {policy:?}",
        env::OCI_TAG_POLICY
    )]
    TagPolicy { policy: String },
    #[error("set {} (the directory to publish)", env::MODEL_DIR)]
    NoModelDir,
    #[error("{} must name a tag, not a digest: {reference}", env::OCI_REF)]
    DigestReference { reference: String },
    #[error(
        "{}: concurrency must be at least 1",
        env::transfer::PUBLISH_CONCURRENCY
    )]
    NoConcurrency,
    #[error("{} is not a directory", .dir.display())]
    NotADirectory { dir: PathBuf },
    #[error("{} has no files to publish", .dir.display())]
    NoFiles { dir: PathBuf },
    #[error("registry stored tag {tag} with digest {got}, expected {expected}")]
    TagDigest {
        tag: String,
        got: String,
        expected: String,
    },
    #[error(
        "refusing to publish {}: {name} does not match its {record} record \
         ({size} bytes, {recorded} recorded; {disk_size} bytes, {disk_digest} on disk); the artifact must be made again",
        .dir.display()
    )]
    RecordMismatch {
        dir: PathBuf,
        name: String,
        record: &'static str,
        size: u64,
        recorded: String,
        disk_size: u64,
        disk_digest: String,
    },
    #[error("refusing to publish {}: {name}, which {record} records, is missing", .dir.display())]
    RecordedMissing {
        dir: PathBuf,
        name: String,
        record: &'static str,
    },
    #[error("cannot describe {} as a ModelPack artifact: {rel}: {problem}", .dir.display())]
    ModelPack {
        dir: PathBuf,
        rel: String,
        problem: ModelPackProblem,
    },
}

impl PublishError {
    pub fn kind(&self) -> ExitKind {
        match self {
            PublishError::TagDigest { .. } => ExitKind::Failure,
            _ => ExitKind::BadInput,
        }
    }
}

/// Why a file of the tree cannot be described in the ModelPack config. The text includes the
/// reader's own text: it is the problem, not a cause behind it.
#[derive(Debug, thiserror::Error)]
pub enum ModelPackProblem {
    #[error("{key} is {len} bytes long, over {max}")]
    FieldTooLong { key: String, len: usize, max: usize },
    #[error("{0}")]
    Read(std::io::Error),
    #[error("{0}")]
    Json(serde_json::Error),
    #[error("not a JSON object")]
    NotObject,
    /// The safetensors header reader's refusal.
    #[error("not a readable safetensors file: {reason}")]
    Safetensors { reason: String },
    #[error("not a readable GGUF file: {problem}")]
    Gguf {
        problem: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("completed_at {value:?}: {error}")]
    CompletedAt { value: String, error: jiff::Error },
}

/// `abliterate`: settings or a model it cannot edit (exit 2), a failed quality gate (exit 3), or an
/// edit that went wrong (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum AbliterateError {
    #[error(
        "{name} must be a {} decimal number, got {value:?}",
        if *.zero_ok { "non-negative" } else { "positive" }
    )]
    NotPositive {
        name: String,
        value: String,
        zero_ok: bool,
    },
    #[error("{} must be at least 1", env::NUM_SAMPLES)]
    NoSamples,
    #[error("model directory {} does not exist", .dir.display())]
    NoModelDir { dir: PathBuf },
    #[error(
        "{} must not be {} or a directory above it: the source is never modified in place",
        env::OUT_DIR,
        env::MODEL_DIR
    )]
    OutInsideSource,
    #[error(
        "abliteration quality gate failed: refusal direction norm {norm} at layer {layer} is {} the normThreshold {threshold} \
         (a corrupted source or a bad layer choice); the source model is untouched",
        if .norm.is_finite() { "above" } else { "not finite, not within" }
    )]
    NormGate {
        norm: f64,
        layer: usize,
        threshold: f64,
    },
    #[error(
        "abliteration quality gate failed: perplexity on harmless text rose from {before:.4} to {after:.4} \
         ({:+.2}%, limit +{limit}%); the source model is untouched",
        (*.after / *.before - 1.0) * 100.0
    )]
    PerplexityGate { before: f64, after: f64, limit: f64 },
    #[error("{tensor}: edited size {edited} differs from the source's {source_size}")]
    EditedSize {
        tensor: String,
        edited: usize,
        source_size: usize,
    },
    #[error(
        "targetLayers must be 'auto', a range like '10-55' or a list like '0,1,5', got {value:?}"
    )]
    TargetLayers { value: String },
    #[error(
        "weightMatrices: {name:?} is not a matrix that writes into the residual stream \
         (supported: o_proj, down_proj)"
    )]
    UnknownMatrix { name: String },
    #[error("weightMatrices is empty (use o_proj and/or down_proj)")]
    NoMatrices,
    #[error("config.json has no hidden_size (nor text_config.hidden_size)")]
    NoHiddenSize,
    #[error("the model has no decoder layers")]
    NoLayers,
    #[error(
        "targetLayers auto: no full-attention layer between 20% and 80% depth of {layers} layers"
    )]
    NoAutoLayer { layers: usize },
    #[error(
        "targetLayers names layer {layer} but the model has {layers} decoder layers (0-{})",
        .layers.saturating_sub(1)
    )]
    LayerOutOfRange { layer: usize, layers: usize },
    #[error("every targeted layer is a linear-attention layer skipped by skipGDNLayers")]
    AllLayersSkipped,
    #[error("nothing to modify: no requested matrix exists in the targeted layers")]
    NothingToModify,
    #[error("{name} has shape {shape:?}; a residual-writing matrix must have {hidden} rows")]
    WriterShape {
        name: String,
        shape: Vec<usize>,
        hidden: usize,
    },
    #[error(
        "the model has no {matrix} tensors (…layers.N.….{matrix}.weight); weightMatrices must name matrices the model has"
    )]
    NoSuchMatrix { matrix: &'static str },
    #[error("{name} does not have shape [vocab, {hidden}]")]
    LmHeadShape { name: String, hidden: usize },
    #[error("{tensor}: not a tensor of the text stack's layer {layer} ({prefix}…)")]
    NotInLayer {
        tensor: String,
        layer: usize,
        prefix: String,
    },
    #[error(
        "{tensor}: {module} is not a Gemma residual writer whose output norm is known \
         (self_attn.o_proj, mlp.down_proj)"
    )]
    UnknownGemmaWriter { tensor: String, module: String },
    #[error(
        "{name}: expected {expected} finite values, found {found} ({})",
        if .expected == .found { "not all finite" } else { "wrong length" }
    )]
    NormWeight {
        name: String,
        expected: usize,
        found: usize,
    },
    #[error("{name} has dtype {dtype}; abliteration edits BF16, F16 and F32 weights")]
    Dtype { name: String, dtype: String },
    #[error("the source is a quantized (gptq) checkpoint; abliterate the full-precision model")]
    QuantizedSource,
    #[error("config.json hidden_size {config} differs from the text model's {text}")]
    HiddenSize { config: usize, text: usize },
    #[error("{tensor} has shape {shape:?}, which does not fit a direction of length {len}")]
    DirectionShape {
        tensor: String,
        shape: Vec<usize>,
        len: usize,
    },
    #[error("{tensor}: the forward has no such module, so the perplexity gate cannot evaluate this edit")]
    NoForwardModule { tensor: String },
    #[error("the harmless texts are too short to measure perplexity (need at least 2 tokens)")]
    ShortHarmless,
    #[error("no target layer to take the direction from")]
    NoTargetLayer,
    #[error(
        "the prompt dataset {} holds no prompts (empty, or no field among {fields:?})",
        .path.display()
    )]
    NoPrompts {
        path: PathBuf,
        fields: &'static [&'static str],
    },
}

impl AbliterateError {
    pub fn kind(&self) -> ExitKind {
        match self {
            AbliterateError::NormGate { .. } | AbliterateError::PerplexityGate { .. } => {
                ExitKind::QualityGate
            }
            AbliterateError::EditedSize { .. } => ExitKind::Failure,
            _ => ExitKind::BadInput,
        }
    }
}

/// `quantize`: settings it refuses (exit 2), or a failed quality gate (exit 3).
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(
        "{}={format:?}: expected {}, {}, {}, {} or {}",
        env::FORMAT,
        env::FORMAT_GPTQ,
        env::FORMAT_GGUF,
        env::FORMAT_FP8,
        env::FORMAT_COMPRESSED_TENSORS,
        env::FORMAT_AWQ
    )]
    Format { format: String },
    #[error("{}={bits}: {} has 8 bits only", env::BITS, env::FORMAT_FP8)]
    Fp8Bits { bits: u32 },
    #[error(
        "{}: {} needs calibration text (the scale search runs on its activations)",
        env::DATASET,
        env::FORMAT_AWQ
    )]
    AwqNeedsDataset,
    #[error(
        "{}: {}={} needs calibration text (the input scales are measured on its activations)",
        env::DATASET,
        env::FP8_ACTIVATIONS,
        "static"
    )]
    Fp8StaticNeedsDataset,
    #[error(
        "{}={name:?} is not a GGUF type this engine writes; one of {}",
        env::GGUF_TYPE,
        gguf_type_names()
    )]
    GgufType { name: String },
    #[error(
        "{}={value:?} needs {}: the feedback uses the Hessians of the calibration pass",
        env::GGUF_GPTQ,
        env::DATASET
    )]
    FeedbackNeedsDataset { value: String },
    #[error("{}={value:?} is not one of auto, 1, 0", env::GGUF_GPTQ)]
    Feedback { value: String },
    /// The engine's gate (`QuantError::GateFailed` or `AwqGateFailed`) rejected this run.
    #[error(
        "{gate}; nothing was written to {} (the previous artifact, if any, is untouched)",
        .out_dir.display()
    )]
    GateFailed { gate: QuantError, out_dir: PathBuf },
    /// A reused artifact whose sidecar records a failed gate (`gate` is the engine's gate error).
    #[error("{gate} (recorded in {})", .dir.display())]
    GateRecorded { gate: QuantError, dir: PathBuf },
}

impl QuantizeError {
    pub fn kind(&self) -> ExitKind {
        match self {
            QuantizeError::GateFailed { .. } | QuantizeError::GateRecorded { .. } => {
                ExitKind::QualityGate
            }
            _ => ExitKind::BadInput,
        }
    }
}

/// A dataset setting that names no usable file (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("the {what} dataset is not set")]
    NotSet { what: String },
    #[error(
        "the {what} dataset directory {} holds no .jsonl, .json, .csv, .txt or .parquet file (optionally .zst)",
        .dir.display()
    )]
    NoDataFile { what: String, dir: PathBuf },
    #[error(
        "the {what} dataset {spec:?} was not found: not a local file or directory, and not fetched under {}",
        .looked_in.display()
    )]
    NotFound {
        what: String,
        spec: String,
        looked_in: PathBuf,
    },
}

impl DatasetError {
    pub fn kind(&self) -> ExitKind {
        ExitKind::BadInput
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::WorkerError;

    /// The texts with computed parts read as they always have, and each keeps its exit class.
    #[test]
    fn texts_and_exit_codes() {
        let e = WorkerError::from(AbliterateError::NormGate {
            norm: f64::NAN,
            layer: 7,
            threshold: 100.0,
        });
        assert_eq!(e.exit_code(), 3);
        assert_eq!(
            e.to_string(),
            "abliteration quality gate failed: refusal direction norm NaN at layer 7 is not finite, not within \
             the normThreshold 100 (a corrupted source or a bad layer choice); the source model is untouched"
        );
        let e = WorkerError::from(AbliterateError::PerplexityGate {
            before: 10.0,
            after: 12.5,
            limit: 15.0,
        });
        assert_eq!(
            e.to_string(),
            "abliteration quality gate failed: perplexity on harmless text rose from 10.0000 to 12.5000 \
             (+25.00%, limit +15%); the source model is untouched"
        );
        let e = WorkerError::from(AbliterateError::NotPositive {
            name: "normThreshold".into(),
            value: "-1".into(),
            zero_ok: true,
        });
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            "normThreshold must be a non-negative decimal number, got \"-1\""
        );
        let e = WorkerError::from(AbliterateError::NormWeight {
            name: "n.weight".into(),
            expected: 4,
            found: 4,
        });
        assert_eq!(
            e.to_string(),
            "n.weight: expected 4 finite values, found 4 (not all finite)"
        );
        let e = WorkerError::from(AbliterateError::EditedSize {
            tensor: "t".into(),
            edited: 1,
            source_size: 2,
        });
        assert_eq!(e.exit_code(), 1);
        let e = WorkerError::from(DownloadError::NoSpace {
            dir: "/m".into(),
            needed: 1073741824,
            available: 536870912,
        });
        assert_eq!(e.exit_code(), 1);
        assert_eq!(
            e.to_string(),
            "not enough free space in /m: need 1073741824 bytes (1.00 GiB) more, 536870912 bytes (0.50 GiB) available"
        );
        let e = WorkerError::from(NodeCopyError::ShardMismatch {
            shard: "a".into(),
            size: 1,
            sha256: None,
            recorded_size: 2,
            recorded_sha256: "sha256:ab".into(),
        });
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            format!(
                "shard \"a\": the artifact has 1 bytes, sha256 (none); {} records 2 bytes, sha256 sha256:ab",
                files::SAVE_COMPLETE
            )
        );
        let e = WorkerError::from(AbliterateError::LayerOutOfRange {
            layer: 40,
            layers: 32,
        });
        assert_eq!(
            e.to_string(),
            "targetLayers names layer 40 but the model has 32 decoder layers (0-31)"
        );
        let e = WorkerError::from(PublishError::TagDigest {
            tag: "v1".into(),
            got: "sha256:a".into(),
            expected: "sha256:b".into(),
        });
        assert_eq!(e.exit_code(), 1);
        let e = WorkerError::VersionMismatch {
            image: "v9".into(),
            controller: "v1".into(),
        };
        assert_eq!(e.exit_code(), 4);
        assert_eq!(
            e.to_string(),
            "FATAL: Script version mismatch (image=v9 controller=v1). Rebuild or re-pin the worker image."
        );
        let e = WorkerError::from(QuantizeError::GgufType { name: "x".into() });
        assert_eq!(
            e.to_string(),
            format!(
                "{}=\"x\" is not a GGUF type this engine writes; one of {}",
                env::GGUF_TYPE,
                FileType::ALL.map(FileType::name).join(", ")
            )
        );
    }

    /// A scrubbed error keeps its exit class.
    #[test]
    fn scrubbing_keeps_the_class() {
        let e = WorkerError::from(PublishError::DigestReference {
            reference: "r/s3cret@sha256:1".into(),
        })
        .map_message(|m| m.replace("s3cret", "<redacted>"));
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("r/<redacted>@"), "{e}");
    }
}
