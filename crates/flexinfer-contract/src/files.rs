//! Files the workers write and the controller and CLI read: the cache layout, marker files and
//! their serde types. Every marker file is written atomically (temp file + rename).

use serde::{Deserialize, Serialize};

/// Mount point of the cache PVC in every pipeline Job.
pub const CACHE_MOUNT: &str = "/cache";
/// Subdirectory (under the model dir) of the abliterated model.
pub const ABLITERATED_SUBDIR: &str = "abliterated";
/// Base name (under the model dir) of the download phase's generations: `<modelPath>/source.<generation>`
/// holds the model's files. A cache downloaded before generations existed has them in `<modelPath>`.
pub const SOURCE_SUBDIR: &str = "source";
/// Subdirectory (under the model dir) where the download phase puts hub datasets.
pub const DATASETS_SUBDIR: &str = ".datasets";

pub const DOWNLOAD_COMPLETE: &str = ".download_complete";
pub const SOURCE_INTEGRITY: &str = ".source-integrity.json";
pub const ABLITERATION_STATUS: &str = ".abliteration-status.json";
pub const GPTQ_CACHE_DIR: &str = ".flexinfer-gptq-cache";
pub const GPTQ_CHECKPOINT: &str = ".flexinfer-gptq-cache/checkpoint.json";
pub const GPTQ_LAYERS_DIR: &str = ".flexinfer-gptq-cache/layers";
pub const GPTQ_LAYERS_MANIFEST: &str = ".flexinfer-gptq-cache/layers/manifest.json";
pub const SAVE_COMPLETE: &str = ".save-complete";
pub const QUANTIZATION_QUALITY: &str = ".quantization-quality.json";
pub const DEFAULT_TERMINATION_LOG: &str = "/dev/termination-log";
/// Kubernetes caps termination messages at 4096 bytes.
pub const TERMINATION_MESSAGE_MAX_BYTES: usize = 4096;
/// Resume manifest of the abliteration phase, inside the output (and its staging) directory.
pub const ABLITERATION_MANIFEST: &str = ".abliteration-manifest.json";
/// Names a pipeline phase writes inside the cache. A source (hub repository, OCI artifact, local
/// directory) that contains one of them is rejected: otherwise it could pre-seed a completion marker, a
/// passed quality gate or a layer cache, and skip quantization and the gate.
pub const RESERVED_NAMES: &[&str] = &[
    DOWNLOAD_COMPLETE,
    SOURCE_INTEGRITY,
    ABLITERATION_STATUS,
    ABLITERATION_MANIFEST,
    GPTQ_CACHE_DIR,
    SAVE_COMPLETE,
    QUANTIZATION_QUALITY,
    DATASETS_SUBDIR,
    ".download-in-progress.json",
];

/// Whether a relative path received from a source names (or lies under) a file the pipeline writes:
/// any component equal to a reserved name, a `gptq-*` or `abliterated` output directory, a staging
/// (`*.partial`) or lock (`*.lock`) entry.
pub fn is_reserved_path(rel: &str) -> Option<&'static str> {
    let comps: Vec<&str> = rel.split('/').filter(|c| !c.is_empty()).collect();
    for (i, c) in comps.iter().enumerate() {
        if let Some(r) = RESERVED_NAMES.iter().find(|r| **r == *c) {
            return Some(r);
        }
        let top = i == 0;
        if top
            && (c.starts_with("gptq-")
                || c.starts_with(ABLITERATED_SUBDIR)
                || is_generation_of(c, SOURCE_SUBDIR))
        {
            return Some("a pipeline output directory");
        }
        if c.ends_with(STAGING_SUFFIX) || c.ends_with(".lock") {
            return Some("a staging or lock entry");
        }
    }
    None
}

/// Separator of a phase output directory and its generation: `<modelPath>/gptq-w4-g128.<generation>`.
/// Every run of a phase writes a new generation; `status.path` moves to it only when it is complete.
pub const GENERATION_SEPARATOR: char = '.';

/// `<subdir>.<generation>` (or `<subdir>` for an output written before generations existed).
pub fn generation_dir(subdir: &str, generation: Option<&str>) -> String {
    match generation.filter(|g| !g.is_empty()) {
        Some(g) => format!("{subdir}{GENERATION_SEPARATOR}{g}"),
        None => subdir.to_string(),
    }
}

/// A generation id, `<first 8 hex of the spec hash>-<UTC yyyymmddhhmmss>`: unique per run start,
/// sortable by time, naming the configuration it was made for. [`is_generation_of`] reads it back.
pub fn generation_id(spec_hash: &str, utc_stamp: &str) -> String {
    let h: String = spec_hash
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .take(8)
        .collect();
    format!("{h}-{utc_stamp}")
}

/// Whether `name` is a generation directory of `base` exactly as the controller names them:
/// `<base>.<8 hex>-<14 digits>` (see [`generation_dir`]). Strict, so a model file such as `source.spm`
/// is never taken for one.
pub fn is_generation_of(name: &str, base: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(base)
        .and_then(|r| r.strip_prefix(GENERATION_SEPARATOR))
    else {
        return false;
    };
    let Some((hash, time)) = rest.split_once('-') else {
        return false;
    };
    hash.len() == 8
        && hash.chars().all(|c| c.is_ascii_hexdigit())
        && time.len() == 14
        && time.chars().all(|c| c.is_ascii_digit())
}

/// Suffix of the abliteration staging directory next to `OUT_DIR` (renamed into place when complete).
pub const STAGING_SUFFIX: &str = ".partial";

/// Quality summary of the RTN-fallback gate (`$OUT_DIR/.quantization-quality.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QualitySummary {
    pub gptq_modules: u64,
    pub rtn_fallback_modules: u64,
    pub rtn_fallback_percent: f64,
    pub max_rtn_fallback_percent: f64,
    pub minimum_modules: u64,
    /// `passed`, `failed` or `insufficient-sample`.
    pub gate: String,
}

impl QualitySummary {
    /// The gate verdict is `failed`.
    pub fn failed(&self) -> bool {
        self.gate == "failed"
    }
}

/// The quality sidecar of an FP8 artifact (`$OUT_DIR/.quantization-quality.json`): FP8 is a rounding of
/// every weight with no solve and no RTN fallback, so instead of the gate it records how far the
/// dequantized weights are from the source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fp8Quality {
    /// `FP8`.
    pub format: String,
    /// `channel` or `tensor`.
    pub strategy: String,
    pub quantized_modules: u64,
    /// Candidate linears kept in full precision (`DYNAMIC_EXCLUSION`, routers, towers).
    pub kept_modules: u64,
    /// The largest `‖W − deq(W)‖ / ‖W‖` over the quantized modules, and its module.
    pub max_relative_error: f64,
    pub worst_module: String,
    pub mean_relative_error: f64,
    /// `static` when every quantized linear carries a calibrated `input_scale` (`FP8_ACTIVATIONS=static`);
    /// absent for dynamic activation scales (the default, whose sidecar is as before).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub activations: String,
    /// The calibration tokens the static input scales were measured on (absent with dynamic scales).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub calibration_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The quality sidecar of an AWQ artifact ([`QUANTIZATION_QUALITY`]): what the scale and clipping searches
/// chose and how far the dequantized weights are from the (scaled) source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AwqQuality {
    /// `AWQ`.
    pub format: String,
    pub bits: u32,
    pub group_size: u32,
    pub quantized_modules: u64,
    /// Shared-input module groups whose searched scales beat plain rounding, and those where rounding won.
    pub scaled_groups: u64,
    pub unscaled_groups: u64,
    /// Mean over the module groups of (output error with the chosen scales) / (with plain rounding) on the
    /// calibration tokens: below 1 where the scales helped.
    pub mean_loss_ratio: f64,
    /// Groups of weights whose range the clipping search narrowed, of all searched.
    pub clipped_groups: u64,
    pub searched_clip_groups: u64,
    /// The largest `‖W − deq(W)‖ / ‖W‖` (W after the scales) over the quantized modules, and its module.
    pub max_relative_error: f64,
    pub worst_module: String,
    pub mean_relative_error: f64,
    /// The gate's figure: mean over the quantized modules of (mean squared output error of the artifact's
    /// weights) / (that of plain rounding of the source weight) on the calibration tokens. Sidecars written
    /// before the gate have none (0).
    #[serde(default)]
    pub output_error_ratio: f64,
    /// The largest per-module ratio, and its module.
    #[serde(default)]
    pub worst_output_error_ratio: f64,
    #[serde(default)]
    pub worst_output_error_module: String,
    /// The limit on [`Self::output_error_ratio`] (`AWQ_MAX_OUTPUT_ERROR_RATIO`).
    #[serde(default)]
    pub max_output_error_ratio: f64,
    /// `passed` or `failed`; empty in sidecars written before the gate.
    #[serde(default)]
    pub gate: String,
}

impl AwqQuality {
    /// The gate verdict is `failed`.
    pub fn failed(&self) -> bool {
        self.gate == "failed"
    }
}

/// `.source-integrity.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceIntegrity {
    pub files: Vec<IntegrityFile>,
    pub weight_bytes: u64,
    pub revision: String,
    /// Source URI the files came from (a different source resets derived artifacts).
    #[serde(default)]
    pub source: String,
}

/// One file of `.source-integrity.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IntegrityFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// `.abliteration-status.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AbliterationStatusFile {
    pub status: String,
    pub layers_modified: u64,
    pub refusal_dir_norm: f64,
    pub layer: u64,
    pub weight_matrices: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_before: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_after: Option<f64>,
    pub completed_at: String,
}

/// `$OUT_DIR/.save-complete`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SaveComplete {
    pub version: u32,
    pub script_version: String,
    pub completed_at: String,
    pub shards: Vec<SaveShard>,
    pub has_index: bool,
    pub has_config: bool,
    pub has_quantize_config: bool,
    /// sha256 of everything that determines the bytes (input digest, GPTQ and recovery parameters,
    /// calibration data and settings, exclusions, engine version). An artifact is reused only by a run
    /// whose digest is the same; one without a digest (older engines) is never reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_digest: Option<String>,
}

/// One shard of `.save-complete`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SaveShard {
    pub name: String,
    pub size_bytes: u64,
    pub sha256: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_names_follow_the_controller_grammar() {
        assert!(is_generation_of(
            "source.0a1b2c3d-20261201203000",
            SOURCE_SUBDIR
        ));
        assert!(is_generation_of(
            &generation_dir("gptq-w4-g128", Some("deadbeef-20260101000000")),
            "gptq-w4-g128"
        ));
        for n in [
            "source.spm",
            "source",
            "source.0a1b2c3d",
            "source.0a1b2c3g-20261201203000",
            "source.0a1b2c3d-2026120120300",
            "source.0a1b2c3d-2026120120300x",
            "sources.0a1b2c3d-20261201203000",
        ] {
            assert!(!is_generation_of(n, SOURCE_SUBDIR), "{n}");
        }
    }

    #[test]
    fn reserved_paths_are_recognised() {
        for p in [
            ".save-complete",
            "gptq-w4-g128/.save-complete",
            "gptq-w4-g128.abc/model.safetensors",
            "abliterated/config.json",
            "sub/.quantization-quality.json",
            ".flexinfer-gptq-cache/layers/manifest.json",
            ".datasets/x/data.jsonl",
            ".download_complete",
            "x.partial/a",
            ".gptq-w4-g128.abc.lock",
            "source.0a1b2c3d-20261201203000/config.json",
        ] {
            assert!(is_reserved_path(p).is_some(), "{p} must be reserved");
        }
        for p in [
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "sub/gptq-notes.txt",
            "original/consolidated.safetensors",
            "source.spm",
        ] {
            assert_eq!(is_reserved_path(p), None, "{p} is an ordinary file");
        }
        assert_eq!(
            generation_dir("gptq-w4-g128", Some("ab12")),
            "gptq-w4-g128.ab12"
        );
        assert_eq!(generation_dir("gptq-w4-g128", None), "gptq-w4-g128");
    }
}
