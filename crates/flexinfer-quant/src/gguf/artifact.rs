//! A GGUF artifact directory, the way the GPTQ checkpoint is one: the `.gguf` file and
//! `.save-complete` (its size and sha256, and the digest of everything that determines its bytes),
//! staged beside `out_dir` (`.<name>.partial`) and exchanged into place whole. A finished artifact
//! with the same digest is reused.

use super::error::GgufError;
use super::export::{plan_gguf, write_planned, GgufJob};
use super::types::FileType;
use crate::error::{QuantError, Result};
use crate::events::{fields, EventSink};
use crate::fsutil::{now_rfc3339, sha256_file, sha256_hex, write_json_atomic};
use crate::job::digest::input_digest;
use crate::job::writer::verify_save_complete;
use crate::model::config::ModelConfig;
use crate::model::tensors::TensorStore;
use flexinfer_contract::events as names;
use flexinfer_contract::files::{self, SaveComplete, SaveShard};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What to make.
pub struct GgufArtifactJob<'a> {
    pub model_dir: &'a Path,
    /// The artifact directory (the worker contract's `OUT_DIR`).
    pub out_dir: &'a Path,
    pub file_type: FileType,
    pub importance: Option<&'a HashMap<String, Vec<f32>>>,
    /// Tensors already quantized (GGUF name → bytes of the planned type): the GPTQ-feedback tensors
    /// of the calibration pass ([`super::importance::Importance::feedback`]).
    pub prequantized: Option<&'a HashMap<String, Vec<u8>>>,
    pub script_version: &'a str,
    /// Re-hash the file of an existing `.save-complete` before reusing it (else its size only).
    pub verify_save_sha256: bool,
}

/// What a finished (or reused) artifact is.
#[derive(Clone, Debug)]
pub struct GgufOutcome {
    pub output_dir: PathBuf,
    /// The `.gguf` file's name inside `output_dir`.
    pub file_name: String,
    pub original_size_bytes: u64,
    pub compressed_size_bytes: u64,
    pub seconds: f64,
    pub cached: bool,
    pub config_digest: String,
}

/// The file's name in the artifact: `model-<TYPE>.gguf`.
pub fn gguf_file_name(ft: FileType) -> String {
    format!("model-{}.gguf", ft.name())
}

/// sha256 of the importance vectors (sorted by tensor name), or `none`.
fn importance_digest(importance: Option<&HashMap<String, Vec<f32>>>) -> String {
    let Some(m) = importance else {
        return "none".into();
    };
    let mut names: Vec<&String> = m.keys().collect();
    names.sort();
    let mut bytes = Vec::new();
    for n in names {
        bytes.extend(n.as_bytes());
        bytes.push(0);
        if let Some(v) = m.get(n) {
            v.iter().for_each(|x| bytes.extend(x.to_le_bytes()));
        }
    }
    sha256_hex(&bytes)
}

/// sha256 of the prequantized tensors (sorted by name, with their bytes), or `none`.
fn prequantized_digest(pre: Option<&HashMap<String, Vec<u8>>>) -> String {
    let Some(m) = pre else {
        return "none".into();
    };
    let mut names: Vec<&String> = m.keys().collect();
    names.sort();
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for n in names {
        h.update(n.as_bytes());
        h.update([0u8]);
        if let Some(b) = m.get(n) {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        }
    }
    hex::encode(h.finalize())
}

fn staging_dir(out_dir: &Path) -> PathBuf {
    let name = out_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "gguf".into());
    out_dir.with_file_name(format!(".{name}.partial"))
}

fn progress(events: &dyn EventSink, percent: f64, detail: String) {
    events.emit(
        names::PROGRESS,
        fields([
            ("phase", json!("gguf")),
            ("percent", json!((percent * 10.0).round() / 10.0)),
            ("detail", json!(detail)),
        ]),
    );
}

/// Makes (or reuses) the GGUF artifact of `job`. Bad input is found before anything is created.
pub fn write_gguf_artifact(
    job: &GgufArtifactJob<'_>,
    events: &dyn EventSink,
) -> Result<GgufOutcome> {
    let started = Instant::now();
    let cfg = ModelConfig::load(job.model_dir)?;
    let store = TensorStore::open_dir(job.model_dir)?;
    let mut inputs = json!({
        "format": "gguf", "type": job.file_type.name(),
        "model": input_digest(job.model_dir, &store)?,
        "importance": importance_digest(job.importance),
        "script_version": job.script_version, "engine": env!("CARGO_PKG_VERSION"),
    });
    if job.prequantized.is_some() {
        inputs["prequantized"] = json!(prequantized_digest(job.prequantized));
    }
    let digest = sha256_hex(inputs.to_string().as_bytes());
    let file_name = gguf_file_name(job.file_type);
    let original = store.total_bytes();
    if let Some(sc) = verify_save_complete(job.out_dir, job.verify_save_sha256) {
        if sc.config_digest.as_deref() == Some(digest.as_str())
            && sc.shards.iter().any(|s| s.name == file_name)
        {
            let size = sc.shards.iter().map(|s| s.size_bytes).sum();
            progress(events, 100.0, format!("reusing {}", job.out_dir.display()));
            return Ok(GgufOutcome {
                output_dir: job.out_dir.to_path_buf(),
                file_name,
                original_size_bytes: original,
                compressed_size_bytes: size,
                seconds: started.elapsed().as_secs_f64(),
                cached: true,
                config_digest: digest,
            });
        }
    }
    let name = job
        .model_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let plan = plan_gguf(
        &GgufJob {
            model_dir: job.model_dir,
            out_path: job.out_dir,
            file_type: job.file_type,
            importance: job.importance,
            name: &name,
        },
        &cfg,
        &store,
    )?;
    let staging = staging_dir(job.out_dir);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| QuantError::io(&staging, e))?;
    }
    std::fs::create_dir_all(&staging).map_err(|e| QuantError::io(&staging, e))?;
    let path = staging.join(&file_name);
    let summary = write_planned(
        &plan,
        &store,
        &path,
        job.importance,
        job.prequantized,
        &mut |done, total| {
            progress(
                events,
                95.0 * done as f64 / total.max(1) as f64,
                format!("tensor {done}/{total}"),
            )
        },
    )?;
    let sha = sha256_file(&path)?;
    let sc = SaveComplete {
        version: 1,
        script_version: job.script_version.to_string(),
        completed_at: now_rfc3339(),
        shards: vec![SaveShard {
            name: file_name.clone(),
            size_bytes: summary.bytes,
            sha256: sha,
        }],
        has_index: false,
        has_config: false,
        has_quantize_config: false,
        config_digest: Some(digest.clone()),
    };
    let v = serde_json::to_value(&sc).map_err(|e| QuantError::Json {
        path: staging.join(files::SAVE_COMPLETE),
        source: e,
    })?;
    write_json_atomic(&staging.join(files::SAVE_COMPLETE), &v)?;
    flexinfer_fsutil::replace_dir(&staging, job.out_dir)
        .map_err(|e| QuantError::from(GgufError::io(job.out_dir, e)))?;
    progress(
        events,
        100.0,
        format!("wrote {}", job.out_dir.join(&file_name).display()),
    );
    Ok(GgufOutcome {
        output_dir: job.out_dir.to_path_buf(),
        file_name,
        original_size_bytes: original,
        compressed_size_bytes: summary.bytes,
        seconds: started.elapsed().as_secs_f64(),
        cached: false,
        config_digest: digest,
    })
}
