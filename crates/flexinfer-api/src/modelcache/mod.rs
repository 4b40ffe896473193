//! `ModelCache` (`ai.flexinfer/v1alpha1`): a model downloaded into a PVC, optionally abliterated,
//! quantized and published as an OCI artifact.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod abliteration;
mod publish;
mod status;
pub use abliteration::*;
pub use publish::*;
pub use status::*;

/// Desired state of a ModelCache: where the weights come from, how they are stored, and which
/// pipeline phases (abliteration, quantization, publish) run after the download.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "ai.flexinfer",
    version = "v1alpha1",
    kind = "ModelCache",
    plural = "modelcaches",
    shortname = "mc",
    doc = "A model downloaded into a PVC, optionally abliterated, quantized and published as an OCI artifact.",
    namespaced,
    status = "ModelCacheStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Current","type":"string","jsonPath":".status.currentPhase"}"#,
    printcolumn = r#"{"name":"Progress","type":"integer","jsonPath":".status.progress"}"#,
    printcolumn = r#"{"name":"Format","type":"string","jsonPath":".spec.quantization.format"}"#,
    printcolumn = r#"{"name":"Ratio","type":"number","jsonPath":".status.quantization.compressionRatio"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Path","type":"string","priority":1,"jsonPath":".status.path"}"#,
    printcolumn = r#"{"name":"Retries","type":"integer","priority":1,"jsonPath":".status.retryCount"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.existingClaimName) || !has(self.clusterStorageClassName)",
     "message": "spec.existingClaimName and spec.clusterStorageClassName are mutually exclusive: an existing claim already has a storage class",
     "fieldPath": ".existingClaimName"},
    {"rule": "!has(self.existingClaimName) || !has(self.claimAccessMode)",
     "message": "spec.claimAccessMode only applies to the PVC the controller creates; an existing claim (spec.existingClaimName) already has its access mode",
     "fieldPath": ".claimAccessMode"},
    {"rule": "!has(self.storageStrategy) || self.storageStrategy != 'NodeLocal' || has(self.publish)",
     "message": "spec.publish is required with storageStrategy NodeLocal: the copies on the nodes are filled from the published OCI artifact",
     "fieldPath": ".publish"},
    {"rule": "!has(self.nodeLocal) || (has(self.storageStrategy) && self.storageStrategy == 'NodeLocal')",
     "message": "spec.nodeLocal is only valid with storageStrategy NodeLocal",
     "fieldPath": ".nodeLocal"},
    {"rule": "!has(self.storageStrategy) || self.storageStrategy != 'NodeLocal' || has(self.nodeSelector) || (has(self.nodeLocal) && has(self.nodeLocal.nodeSelector))",
     "message": "spec.nodeLocal.nodeSelector is required with storageStrategy NodeLocal when spec.nodeSelector is unset: a copy on every node of the cluster is never chosen by default",
     "fieldPath": ".nodeLocal"}
]))]
pub struct ModelCacheSpec {
    /// Where the weights come from: `HF://org/model`, `huggingface://org/model`, a bare `org/model`
    /// (Hugging Face Hub), `oci://registry/repo:tag`, `oci://registry/repo@sha256:<digest>`, or
    /// `local://<path>` (a directory under the controller's configured local root).
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^((HF|hf|huggingface)://)?[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$') || self.matches('^oci://[a-zA-Z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127}|@sha256:[a-f0-9]{64})$') || self.matches('^local://[^.][^\\\\s]*$') && !self.contains('..')",
         "message": "spec.source must be HF://org/model, huggingface://org/model, org/model, oci://registry/repo:tag, oci://registry/repo@sha256:<64 hex>, or local://path (no '..')"}
    ]))]
    #[schemars(length(min = 3, max = 512))]
    pub source: String,

    /// Hugging Face revision to download: a branch, tag or commit sha.
    #[serde(default = "default_revision")]
    #[schemars(length(min = 1, max = 255))]
    pub revision: String,

    /// How the cache is stored. `Auto` currently means `SharedPVC` (one PVC per cache, ReadWriteOnce
    /// unless `claimAccessMode` or the existing claim says ReadWriteMany). `NodeLocal` (requires
    /// `publish`) also keeps a verified copy of the published artifact on each node `nodeLocal`
    /// selects; Models of the cache serve from those copies, on any of those nodes.
    #[serde(default)]
    pub storage_strategy: StorageStrategy,

    /// Which nodes get a copy with `storageStrategy: NodeLocal` (only valid with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_local: Option<NodeLocalSpec>,

    /// Size of the PVC the controller creates (ignored with `existingClaimName`).
    #[serde(default = "default_storage_size")]
    pub storage_size: Quantity,

    /// Access mode of the PVC the controller creates (ignored with `existingClaimName`): `ReadWriteOnce`
    /// (unset), or `ReadWriteMany` with a StorageClass that provides it (NFS, CephFS, Longhorn RWX), so
    /// that Models serving the cache run on any node. Read when the claim is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_access_mode: Option<ClaimAccessMode>,

    /// StorageClass for the PVC the controller creates; cluster default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub cluster_storage_class_name: Option<String>,

    /// Use this existing PVC instead of creating one. FlexInfer never deletes a PVC it did not create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub existing_claim_name: Option<String>,

    /// Directory inside the PVC for this cache; defaults to the cache name. Relative, no `..`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "!self.startsWith('/') && !self.contains('..') && self.matches('^[A-Za-z0-9._/-]+$')",
         "message": "spec.modelPath must be a relative path of letters, digits, '.', '_', '-', '/' without '..'"}
    ]))]
    #[schemars(length(min = 1, max = 253))]
    pub model_path: Option<String>,

    /// Name of a Secret in the cache's namespace holding `HF_TOKEN` and optionally
    /// `OCI_USERNAME`/`OCI_PASSWORD`. Passed to workers only through `secretKeyRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub secret_ref: Option<String>,

    /// Node selector applied to every pipeline Job (a phase's own `nodeSelector` wins).
    /// `flexinfer.ai/gpu.arch: <arch>` selects the GPUProfile for GPU phases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// Tolerations appended to the default GPU toleration `dedicated=gpu:NoSchedule`, which every
    /// Job pinned to GPU nodes gets (GPU phases, and phases whose node selector names a GPU
    /// architecture or a GPUProfile's selector); other phases use them as-is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub tolerations: Option<Vec<Toleration>>,

    /// Controller-level retries per phase after a Job has failed (each Job also has backoffLimit 2).
    #[serde(default = "default_max_retries")]
    #[schemars(range(min = 0, max = 10))]
    pub max_retries: i32,

    /// Download phase settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download: Option<DownloadSpec>,

    /// Optional abliteration (refusal-direction removal) phase between download and quantization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abliteration: Option<AbliterationSpec>,

    /// Optional quantization phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<QuantizationSpec>,

    /// Optional publish phase: push the final artifact to an OCI registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish: Option<PublishSpec>,
}

/// Storage strategy of a ModelCache.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum StorageStrategy {
    /// Currently the same as `SharedPVC`.
    #[default]
    Auto,
    /// One PVC per cache, shared by the pipeline Jobs and the serving Deployments.
    #[serde(rename = "SharedPVC")]
    SharedPvc,
    /// The pipeline runs on the cache's PVC; each selected node gets its own copy of the published
    /// artifact, and the cache's Models serve from those copies.
    NodeLocal,
}

/// Access mode of the PVC the controller creates (not valid with `existingClaimName`, read when the
/// claim is created): `ReadWriteOnce` (unset), or `ReadWriteMany` with a StorageClass that offers it
/// (NFS, CephFS, Longhorn RWX), so that the Models serving the cache run on any node.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ClaimAccessMode {
    /// Mounted by the pods of one node at a time (what most block and local-path storage offers).
    #[default]
    ReadWriteOnce,
    /// Mounted by pods on many nodes at once.
    ReadWriteMany,
}

impl ClaimAccessMode {
    /// The Kubernetes access mode.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimAccessMode::ReadWriteOnce => "ReadWriteOnce",
            ClaimAccessMode::ReadWriteMany => "ReadWriteMany",
        }
    }
}

/// Node-local copies of a ModelCache (`storageStrategy: NodeLocal`).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocalSpec {
    /// Nodes whose labels match all of these get a copy. Unset: `spec.nodeSelector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("minProperties" = 1, "maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: Option<BTreeMap<String, String>>,
}

/// Download phase settings.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DownloadSpec {
    /// activeDeadlineSeconds of the download Job (default 21600 = 6h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 300, max = 86400))]
    pub timeout_seconds: Option<i64>,

    /// Memory request and limit of the download Job, in GiB.
    #[serde(default = "default_download_memory")]
    #[schemars(range(min = 1, max = 128))]
    #[serde(rename = "maxMemoryGB")]
    pub max_memory_gb: i32,

    /// Only files matching one of these glob patterns are downloaded (e.g. `*.safetensors`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[schemars(inner(length(max = 256)))]
    pub allow_patterns: Vec<String>,

    /// Files matching one of these glob patterns are skipped (e.g. `*.bin`, `original/*`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[schemars(inner(length(max = 256)))]
    pub ignore_patterns: Vec<String>,
}

impl Default for DownloadSpec {
    fn default() -> Self {
        Self {
            timeout_seconds: None,
            max_memory_gb: default_download_memory(),
            allow_patterns: Vec::new(),
            ignore_patterns: Vec::new(),
        }
    }
}

/// Quantization format. `GPTQ`, `GGUF`, `FP8` and `COMPRESSED_TENSORS` have a built-in engine today; the others are accepted and
/// fail the phase with an `UnsupportedFormat` condition.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum QuantFormat {
    #[serde(rename = "GGUF")]
    Gguf,
    #[serde(rename = "AWQ")]
    Awq,
    #[serde(rename = "GPTQ")]
    Gptq,
    #[serde(rename = "EXL2")]
    Exl2,
    #[serde(rename = "FP8")]
    Fp8,
    #[serde(rename = "COMPRESSED_TENSORS")]
    CompressedTensors,
}

/// Which modules stay in full precision.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DynamicExclusion {
    /// Detect hybrid architectures and keep attention, shared experts, vision and MTP in full precision.
    #[default]
    Auto,
    /// Keep GatedDeltaNet `linear_attn.*` modules in full precision; quantize the rest.
    Gdn,
    /// Quantize every linear module.
    None,
}

impl DynamicExclusion {
    pub fn as_str(self) -> &'static str {
        match self {
            DynamicExclusion::Auto => "auto",
            DynamicExclusion::Gdn => "gdn",
            DynamicExclusion::None => "none",
        }
    }
}

/// Quantization phase settings.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.format != 'EXL2'",
     "message": "spec.quantization.format EXL2 has no quantization engine in this FlexInfer version (it makes GGUF, AWQ, GPTQ, FP8, COMPRESSED_TENSORS); an EXL2 model made elsewhere is served from a pvc:// source by a Model with backend exllamav2",
     "fieldPath": ".format"},
    {"rule": "!has(self.bits) || self.format != 'GPTQ' || self.bits in [2, 3, 4, 8]",
     "message": "spec.quantization.bits must be 2, 3, 4 or 8 for GPTQ", "fieldPath": ".bits"},
    {"rule": "!has(self.bits) || self.format != 'FP8' || self.bits == 8",
     "message": "spec.quantization.bits must be 8 for FP8", "fieldPath": ".bits"},
    {"rule": "!has(self.bits) || self.format != 'AWQ' || self.bits == 4",
     "message": "spec.quantization.bits must be 4 for AWQ", "fieldPath": ".bits"},
    {"rule": "!has(self.ggufType) || self.format == 'GGUF'",
     "message": "spec.quantization.ggufType is only valid with format GGUF", "fieldPath": ".ggufType"},
    {"rule": "!has(self.actGroupAware) || self.format == 'GPTQ'",
     "message": "spec.quantization.actGroupAware is only valid with format GPTQ", "fieldPath": ".actGroupAware"},
    {"rule": "!has(self.clipSearch) || self.format == 'GPTQ'",
     "message": "spec.quantization.clipSearch is only valid with format GPTQ", "fieldPath": ".clipSearch"},
    {"rule": "!has(self.refineScales) || self.format == 'GPTQ'",
     "message": "spec.quantization.refineScales is only valid with format GPTQ", "fieldPath": ".refineScales"},
    {"rule": "!has(self.dampPercent) || self.format == 'GPTQ'",
     "message": "spec.quantization.dampPercent is only valid with format GPTQ", "fieldPath": ".dampPercent"}
]))]
pub struct QuantizationSpec {
    /// Target format.
    pub format: QuantFormat,

    /// Bits per weight. GPTQ: 2, 3, 4 or 8 (default 4); AWQ: 4; FP8: 8; EXL2: average bits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = 8))]
    pub bits: Option<i32>,

    /// Input columns sharing one scale/zero: -1 (per output channel) or a power of two (32, 64, 128…).
    #[serde(default = "default_group_size")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == -1 || self in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]",
         "message": "spec.quantization.groupSize must be -1 or a positive power of two (32, 64, 128, ...)"}
    ]))]
    pub group_size: i32,

    /// Symmetric quantization (zero fixed at the middle of the range). Required for the ExLlama/Marlin
    /// kernels, the fast path on ROCm gfx1100.
    #[serde(default = "default_true")]
    pub sym: bool,

    /// Activation-order column permutation (`g_idx`). Slightly better quality, slower inference.
    #[serde(default)]
    pub desc_act: bool,

    /// GPTQ: group-aware column order. Inside each group the columns are quantized by descending Hessian
    /// diagonal (the most sensitive first) and the groups by their largest diagonal entry; every column keeps
    /// its own group, so the checkpoint layout is unchanged (no `g_idx` permutation). Unset: on. Ignored with
    /// `descAct`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_group_aware: Option<bool>,

    /// GPTQ: clipping search for the group scales (each row's range shrunk by the factor of a small grid with
    /// the least Hessian-weighted error). Unset: the engine's measured default, off at every width today (it
    /// raised the error in our measurements); `true` to try it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_search: Option<bool>,

    /// GPTQ: scale refinement. After the sweep each row's group scales are refitted by least squares to the
    /// layer's output error on the calibration data with the codes fixed, and the sweep runs again with them
    /// (seven rounds). Unset: the engine's measured default, on at 2 and 3 bits, off at 4 and 8 (it lowered
    /// the error most at low widths in our measurements). The refinement runs in the CPU sweep: on a GPU,
    /// modules with it on are solved on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refine_scales: Option<bool>,

    /// GPTQ: Hessian damping as a fraction of the mean diagonal (decimal string in (0, 1), e.g. `"0.05"`).
    /// A factorisation that fails retries with the damping raised by the cluster's auto-increment. Unset:
    /// the cluster's default (0.05).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^0\\\\.[0-9]+$') && double(self) > 0.0 && double(self) < 1.0",
         "message": "spec.quantization.dampPercent must be a decimal in (0, 1) such as \"0.05\""}
    ]))]
    #[schemars(length(max = 16))]
    pub damp_percent: Option<String>,

    /// Which modules stay full precision.
    #[serde(default)]
    pub dynamic_exclusion: DynamicExclusion,

    /// Fraction of GPU VRAM the quantizer may use (decimal string in (0, 1]).
    #[serde(default = "default_gpu_memory_fraction")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^(0(\\\\.[0-9]+)?|1(\\\\.0+)?)$') && double(self) > 0.0",
         "message": "spec.quantization.gpuMemoryFraction must be a decimal in (0, 1] such as \"0.80\""}
    ]))]
    #[schemars(length(max = 32))]
    pub gpu_memory_fraction: String,

    /// Run on a GPU node (adds the GPU resource and the default GPU toleration).
    #[serde(default, rename = "useGPU")]
    pub use_gpu: bool,

    /// Memory request and limit of the quantize Job in GiB (the GPUProfile's `gpuDriverMemoryMB` is added).
    #[serde(default = "default_quant_memory")]
    #[schemars(range(min = 1, max = 1024))]
    #[serde(rename = "maxMemoryGB")]
    pub max_memory_gb: i32,

    /// activeDeadlineSeconds of the quantize Job (default 86400 = 24h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 300, max = 172800))]
    pub timeout_seconds: Option<i64>,

    /// Node selector for this phase only (overrides `spec.nodeSelector`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// GGUF quantization type (GGUF only; default `Q4_K_M`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^(Q[2-8]_[0-9A-Z_]+|IQ[1-4]_[A-Z_]+|F16|BF16|F32)$')",
         "message": "spec.quantization.ggufType must be a llama.cpp type such as Q4_K_M, Q5_K_S, Q8_0 or F16"}
    ]))]
    #[schemars(length(max = 32))]
    pub gguf_type: Option<String>,

    /// Calibration data settings (AWQ, GPTQ).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationSpec>,
}

/// Calibration data used by AWQ and GPTQ.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CalibrationSpec {
    /// Maximum token length per calibration sample (128–32768).
    #[serde(default = "default_max_seq_len")]
    #[schemars(range(min = 128, max = 32768))]
    pub max_seq_len: i32,

    /// Number of calibration samples taken from the dataset (8–2048).
    #[serde(default = "default_max_samples")]
    #[schemars(range(min = 8, max = 2048))]
    pub max_samples: i32,

    /// Samples processed at once (1–256). Lower values reduce peak memory. Unset lets the engine choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub n_parallel_calib_samples: Option<i32>,

    /// Hugging Face dataset id (fetched by the download phase) or a path under the cache directory.
    #[serde(default = "default_dataset")]
    #[schemars(length(min = 1, max = 512))]
    pub dataset: String,
}

impl Default for CalibrationSpec {
    fn default() -> Self {
        Self {
            max_seq_len: default_max_seq_len(),
            max_samples: default_max_samples(),
            n_parallel_calib_samples: None,
            dataset: default_dataset(),
        }
    }
}

fn default_revision() -> String {
    "main".into()
}
fn default_storage_size() -> Quantity {
    Quantity("50Gi".into())
}
fn default_max_retries() -> i32 {
    3
}
fn default_download_memory() -> i32 {
    16
}
fn default_true() -> bool {
    true
}
fn default_group_size() -> i32 {
    128
}
fn default_gpu_memory_fraction() -> String {
    "0.80".into()
}
fn default_quant_memory() -> i32 {
    48
}
fn default_max_seq_len() -> i32 {
    4096
}
fn default_max_samples() -> i32 {
    256
}
fn default_dataset() -> String {
    "mit-han-lab/pile-val-backup".into()
}

/// Defaults the controller applies for values the CRD leaves unset.
pub mod defaults {
    /// Download Job deadline when `spec.download.timeoutSeconds` is unset.
    pub const DOWNLOAD_TIMEOUT_SECONDS: i64 = 21600;
    /// Quantize Job deadline when `spec.quantization.timeoutSeconds` is unset.
    pub const QUANTIZE_TIMEOUT_SECONDS: i64 = 86400;
    /// GPTQ bits when unset.
    pub const GPTQ_BITS: i32 = 4;
    /// GGUF type when unset.
    pub const GGUF_TYPE: &str = "Q4_K_M";
}

impl QuantizationSpec {
    /// The GGUF type with the default applied (`Q4_K_M`), as written in the spec.
    pub fn effective_gguf_type(&self) -> &str {
        self.gguf_type
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .unwrap_or(defaults::GGUF_TYPE)
    }
}

impl QuantizationSpec {
    /// Bits with the per-format default applied.
    pub fn effective_bits(&self) -> i32 {
        self.bits.unwrap_or(match self.format {
            QuantFormat::Fp8 => 8,
            _ => defaults::GPTQ_BITS,
        })
    }

    /// Calibration settings with defaults applied.
    pub fn effective_calibration(&self) -> CalibrationSpec {
        self.calibration.clone().unwrap_or_default()
    }

    /// Output subdirectory of the artifact, e.g. `gptq-w4-g128` (`-gdn` with `dynamicExclusion: gdn`).
    pub fn output_subdir(&self) -> String {
        let base = match self.format {
            QuantFormat::Gptq => format!("gptq-w{}-g{}", self.effective_bits(), self.group_size),
            QuantFormat::Awq => format!("awq-w{}-g{}", self.effective_bits(), self.group_size),
            QuantFormat::Gguf => format!("gguf-{}", self.effective_gguf_type().to_lowercase()),
            QuantFormat::Exl2 => format!("exl2-w{}", self.effective_bits()),
            QuantFormat::Fp8 => "fp8".to_string(),
            QuantFormat::CompressedTensors => {
                format!("ct-w{}-g{}", self.effective_bits(), self.group_size)
            }
        };
        if self.dynamic_exclusion == DynamicExclusion::Gdn {
            format!("{base}-gdn")
        } else {
            base
        }
    }
}

impl ModelCacheSpec {
    /// Directory of this cache inside the PVC (`modelPath`, else the cache name).
    pub fn model_dir_name<'a>(&'a self, cache_name: &'a str) -> &'a str {
        self.model_path.as_deref().unwrap_or(cache_name)
    }

    /// The nodes that get a copy with `storageStrategy: NodeLocal`: `nodeLocal.nodeSelector`, else
    /// `nodeSelector`; `None` when neither is set.
    pub fn node_local_selector(&self) -> Option<&BTreeMap<String, String>> {
        self.node_local
            .as_ref()
            .and_then(|n| n.node_selector.as_ref())
            .or(self.node_selector.as_ref())
    }
}
