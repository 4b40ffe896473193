//! OCI artifact layout of a published model: what `publish` writes and `download` of an
//! `oci://` source reads.
//!
//! `publish` writes a CNCF ModelPack artifact (github.com/modelpack/model-spec, v0.0.7: `docs/spec.md`,
//! `docs/config.md`, `docs/annotations.md`) with raw layers, one per file. `download` of an `oci://`
//! source also reads the transitional `vnd.cnai` spelling of ModelPack (what modctl writes), plain ORAS
//! artifacts (titled layers) and the artifacts FlexInfer published before ModelPack
//! ([`LEGACY_ARTIFACT_TYPE`]).

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// Layer annotation holding the file's relative path (what `oras pull` uses as the file name).
pub const TITLE_ANNOTATION: &str = "org.opencontainers.image.title";
/// Manifest annotation with the source the artifact was built from.
pub const SOURCE_ANNOTATION: &str = "org.opencontainers.image.source";

// ModelPack (model-spec v0.0.7).
/// Manifest `artifactType` of a ModelPack artifact.
pub const MODELPACK_ARTIFACT_TYPE: &str = "application/vnd.cncf.model.manifest.v1+json";
/// Config descriptor media type: the model config (`descriptor`, `config`, `modelfs`).
pub const MODELPACK_CONFIG_MEDIA_TYPE: &str = "application/vnd.cncf.model.config.v1+json";
/// Raw (untarred, uncompressed) layer media types, by what the file is.
pub const MODELPACK_WEIGHT_RAW: &str = "application/vnd.cncf.model.weight.v1.raw";
pub const MODELPACK_WEIGHT_CONFIG_RAW: &str = "application/vnd.cncf.model.weight.config.v1.raw";
pub const MODELPACK_DOC_RAW: &str = "application/vnd.cncf.model.doc.v1.raw";
pub const MODELPACK_CODE_RAW: &str = "application/vnd.cncf.model.code.v1.raw";
pub const MODELPACK_DATASET_RAW: &str = "application/vnd.cncf.model.dataset.v1.raw";
/// Layer annotation: the file's path in the model directory.
pub const MODELPACK_FILEPATH_ANNOTATION: &str = "org.cncf.model.filepath";
/// Layer annotation: the file's metadata (name, mode, uid, gid, size, mtime, typeflag) as JSON.
pub const MODELPACK_FILE_METADATA_ANNOTATION: &str = "org.cncf.model.file.metadata+json";
/// Layer annotation `"true"`: the layer's media type was guessed (the file name matched no rule).
pub const MODELPACK_MEDIATYPE_UNTESTED_ANNOTATION: &str = "org.cncf.model.file.mediatype.untested";
/// `modelfs.type` of the config.
pub const MODELPACK_MODELFS_TYPE: &str = "layers";
/// The prefixes of ModelPack media types: the spec's, and the transitional `vnd.cnai` spelling
/// (github.com/dragonflyoss/model-spec, still written by modctl) that `download` also reads.
pub const MODELPACK_MEDIA_TYPE_PREFIXES: &[&str] =
    &["application/vnd.cncf.model.", "application/vnd.cnai.model."];
/// ModelPack manifest artifact types `download` recognises (spec, transitional).
pub const MODELPACK_ARTIFACT_TYPES: &[&str] = &[
    MODELPACK_ARTIFACT_TYPE,
    "application/vnd.cnai.model.manifest.v1+json",
];
/// ModelPack config media types `download` recognises (spec, transitional).
pub const MODELPACK_CONFIG_MEDIA_TYPES: &[&str] = &[
    MODELPACK_CONFIG_MEDIA_TYPE,
    "application/vnd.cnai.model.config.v1+json",
];
/// File path annotations `download` reads, first found wins (spec, transitional).
pub const MODELPACK_FILEPATH_ANNOTATIONS: &[&str] =
    &[MODELPACK_FILEPATH_ANNOTATION, "org.cnai.model.filepath"];
/// What follows a ModelPack prefix in a raw layer media type `download` writes out as a file.
pub const MODELPACK_RAW_LAYER_KINDS: &[&str] = &[
    "weight.v1.raw",
    "weight.config.v1.raw",
    "doc.v1.raw",
    "code.v1.raw",
    "dataset.v1.raw",
];
/// Endings of the archive layer media types (`…weight.v1.tar+gzip`): `download` does not unpack them.
pub const MODELPACK_ARCHIVE_SUFFIXES: &[&str] = &[".tar", ".tar+gzip", ".tar+zstd"];

// Manifest annotations of FlexInfer's own (what the ModelPack config has no field for).
/// Bits per weight of a quantized artifact (`quantization_config.bits`, the compressed-tensors
/// `num_bits`, or the nominal bits of a GGUF file type).
pub const BITS_ANNOTATION: &str = "ai.flexinfer.model.quantization.bits";
/// Group size of a quantized artifact (`quantization_config.group_size`).
pub const GROUP_SIZE_ANNOTATION: &str = "ai.flexinfer.model.quantization.group-size";
/// The quality gate's verdict in `.quantization-quality.json` (`passed`, `failed`, `insufficient-sample`).
pub const QUALITY_GATE_ANNOTATION: &str = "ai.flexinfer.model.quality.gate";

// Plain ORAS artifacts.
/// Layer annotation `"true"` of a directory `oras push` tarred (and `oras pull` unpacks); `download`
/// does not unpack it.
pub const ORAS_UNPACK_ANNOTATION: &str = "io.deis.oras.content.unpack";

// What FlexInfer published before ModelPack (read by `download`, no longer written).
/// Manifest `artifactType` of the earlier layout (empty config, one titled layer per file).
pub const LEGACY_ARTIFACT_TYPE: &str = "application/vnd.flexinfer.model.v1";
/// Media type of each file layer of the earlier layout.
pub const LEGACY_FILE_LAYER_MEDIA_TYPE: &str = "application/vnd.flexinfer.model.file.v1";
/// Config descriptor media type of the earlier layout (the empty JSON `{}`).
pub const EMPTY_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";

/// Tag policies of `spec.publish.tagPolicy`.
pub const TAG_POLICY_OVERWRITE: &str = "overwrite";
pub const TAG_POLICY_TIMESTAMP: &str = "timestamp";
pub const TAG_POLICY_DIGEST_SUFFIX: &str = "digest-suffix";
