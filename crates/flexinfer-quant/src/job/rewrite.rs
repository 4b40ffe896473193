//! Writing a checkpoint that rewrites some of its source's tensors (FP8, AWQ): the rewritten tensors come from
//! per-layer work files, every other tensor is the source's, and the checkpoint goes through the same staging,
//! `.save-complete` and quality summary as the GPTQ one.

use crate::error::{NumericError, QuantError, Result};
use crate::events::{fields, EventSink};
use crate::fsutil::read_json;
use crate::job::writer::{verify_save_complete, write_checkpoint, Extras, OutTensor};
use crate::model::tensors::TensorStore;
use flexinfer_contract::events as names;
use flexinfer_contract::files;
use safetensors::{tensor::TensorView, Dtype};
use serde_json::json;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What a finished (or reused) rewritten artifact is (`Q`: its format's quality summary).
#[derive(Clone, Debug)]
pub struct RewriteOutcome<Q> {
    pub output_dir: PathBuf,
    pub original_size_bytes: u64,
    pub compressed_size_bytes: u64,
    pub seconds: f64,
    pub cached: bool,
    pub config_digest: String,
    /// `None` only for a reused artifact whose sidecar cannot be read.
    pub quality: Option<Q>,
}

/// The run of a rewritten artifact: its format (`phase` of its progress events, and its work directory's
/// name), directory, source store, config digest and start.
pub struct ArtifactRun<'a> {
    phase: &'static str,
    out_dir: &'a Path,
    store: &'a TensorStore,
    digest: &'a str,
    started: Instant,
}

impl<'a> ArtifactRun<'a> {
    pub fn new(
        phase: &'static str,
        out_dir: &'a Path,
        store: &'a TensorStore,
        digest: &'a str,
        started: Instant,
    ) -> Self {
        ArtifactRun {
            phase,
            out_dir,
            store,
            digest,
            started,
        }
    }

    /// The artifact already in `out_dir` when its `.save-complete` (shards re-hashed with `check_sha256`)
    /// names the digest: emits `reusing` to `events` and returns it (its quality summary read from the sidecar).
    pub fn reuse<Q: serde::de::DeserializeOwned>(
        &self,
        check_sha256: bool,
        events: &dyn EventSink,
    ) -> Option<RewriteOutcome<Q>> {
        let sc = verify_save_complete(self.out_dir, check_sha256)?;
        if sc.config_digest.as_deref() != Some(self.digest) {
            return None;
        }
        progress(
            events,
            self.phase,
            100.0,
            format!("reusing {}", self.out_dir.display()),
        );
        let quality = read_json(&self.out_dir.join(files::QUANTIZATION_QUALITY))
            .ok()
            .and_then(|v| serde_json::from_value::<Q>(v).ok());
        Some(RewriteOutcome {
            output_dir: self.out_dir.to_path_buf(),
            original_size_bytes: self.store.total_bytes(),
            compressed_size_bytes: sc.shards.iter().map(|s| s.size_bytes).sum(),
            seconds: self.started.elapsed().as_secs_f64(),
            cached: true,
            config_digest: self.digest.to_string(),
            quality,
        })
    }

    /// Writes the artifact with `save` (given the work directory `.<name of out_dir>.<phase>-work`, discarded
    /// afterwards whatever the result; it returns the shards' bytes and the quality summary), then emits
    /// `wrote`.
    pub fn rewrite<Q>(
        &self,
        events: &dyn EventSink,
        save: impl FnOnce(&Path) -> Result<(u64, Q)>,
    ) -> Result<RewriteOutcome<Q>> {
        let work = sibling(self.out_dir, self.phase, &format!(".{}-work", self.phase));
        let result = save(&work);
        discard_work_dir(&work);
        let (compressed, quality) = result?;
        progress(
            events,
            self.phase,
            100.0,
            format!("wrote {}", self.out_dir.display()),
        );
        Ok(RewriteOutcome {
            output_dir: self.out_dir.to_path_buf(),
            original_size_bytes: self.store.total_bytes(),
            compressed_size_bytes: compressed,
            seconds: self.started.elapsed().as_secs_f64(),
            cached: false,
            config_digest: self.digest.to_string(),
            quality: Some(quality),
        })
    }
}

/// One tensor of a work file: name, bytes, dtype, shape.
pub type WorkTensor = (String, Vec<u8>, Dtype, Vec<usize>);

/// Writes one layer's rewritten tensors to the work file `path` (safetensors).
pub fn write_work_file(path: &Path, tensors: &[WorkTensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(n, data, dtype, shape)| {
            TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (n.clone(), v))
                .map_err(|e| QuantError::Safetensors {
                    path: path.to_path_buf(),
                    tensor: Some(n.clone()),
                    source: e.into(),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| QuantError::Safetensors {
        path: path.to_path_buf(),
        tensor: None,
        source: e.into(),
    })
}

/// `.<name of out_dir><suffix>` beside `out_dir` (`fallback` when it has no name): its work and staging
/// directories.
pub fn sibling(out_dir: &Path, fallback: &str, suffix: &str) -> PathBuf {
    let name = out_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| fallback.into());
    out_dir.with_file_name(format!(".{name}{suffix}"))
}

/// Remove the work directory of a run (its files are inputs of the save only; a failed run leaves no partial
/// state worth keeping); a failure to remove it is logged, not fatal.
pub fn discard_work_dir(work: &Path) {
    if work.exists() {
        if let Err(e) = std::fs::remove_dir_all(work) {
            tracing::warn!(path = %work.display(), error = %e, "could not remove the work directory");
        }
    }
}

/// A `progress` event of the run (`phase` names the format), percent rounded to a tenth.
pub fn progress(events: &dyn EventSink, phase: &str, percent: f64, detail: String) {
    events.emit(
        names::PROGRESS,
        fields([
            ("phase", json!(phase)),
            ("percent", json!((percent * 10.0).round() / 10.0)),
            ("detail", json!(detail)),
        ]),
    );
}

/// The tensors of the checkpoint: every tensor of `rewritten`, and every tensor of `source` that `replaced`
/// does not name.
pub fn merged_tensors<'a>(
    source: &'a TensorStore,
    rewritten: &'a TensorStore,
    replaced: impl Fn(&str) -> bool,
) -> Result<Vec<OutTensor<'a>>> {
    let mut tensors = Vec::new();
    push_stored(source, replaced, &mut tensors)?;
    push_stored(rewritten, |_| false, &mut tensors)?;
    Ok(tensors)
}

/// Appends every tensor of `store` that `skip` does not name to `tensors`, in the store's order, with the
/// bytes as stored.
pub fn push_stored<'a>(
    store: &'a TensorStore,
    skip: impl Fn(&str) -> bool,
    tensors: &mut Vec<OutTensor<'a>>,
) -> Result<()> {
    for (name, e) in &store.entries {
        if skip(name) {
            continue;
        }
        tensors.push(OutTensor {
            name: name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            data: Cow::Borrowed(store.raw(name)?),
        });
    }
    Ok(())
}

/// Where and from what a rewritten checkpoint is written.
pub struct Rewritten<'a> {
    /// `phase` of its progress events (`fp8`, `awq`); also names its quality summary in errors.
    pub phase: &'static str,
    pub out_dir: &'a Path,
    pub max_shard_bytes: u64,
    pub source: &'a TensorStore,
    pub rewritten: &'a TensorStore,
    /// `config.json` with its `quantization_config` (a rewritten format has no `quantize_config.json`).
    pub config_json: serde_json::Value,
    /// The source model directory, the contract version and the config digest of `.save-complete`.
    pub source_dir: &'a Path,
    pub script_version: &'a str,
    pub config_digest: &'a str,
}

impl Rewritten<'_> {
    /// Write `tensors` (from [`merged_tensors`]) with the quality summary through the staging sibling into
    /// `out_dir`, reporting 90-100 % by shard and releasing both stores' pages as it reads; then emit the
    /// summary. Returns the bytes of the shards.
    pub fn write<Q: serde::Serialize>(
        self,
        tensors: Vec<OutTensor<'_>>,
        quality: &Q,
        events: &dyn EventSink,
    ) -> Result<u64> {
        let quality_json =
            serde_json::to_value(quality).map_err(|source| NumericError::Encode {
                what: "the quality summary",
                source,
            })?;
        let extras = Extras {
            config_json: self.config_json,
            quantize_config: None,
            quality: quality_json.clone(),
            source_dir: self.source_dir,
            script_version: self.script_version,
            config_digest: self.config_digest,
        };
        let records = write_checkpoint(
            &sibling(self.out_dir, self.phase, files::STAGING_SUFFIX),
            self.out_dir,
            tensors,
            self.max_shard_bytes,
            &extras,
            &|| {
                self.source.release_pages();
                self.rewritten.release_pages();
            },
            |done, n| {
                progress(
                    events,
                    self.phase,
                    90.0 + 10.0 * done as f64 / n.max(1) as f64,
                    format!("shard {done}/{n}"),
                )
            },
        )?;
        events.emit(
            names::QUANTIZATION_QUALITY,
            quality_json.as_object().cloned().unwrap_or_default(),
        );
        Ok(records.iter().map(|r| r.size_bytes).sum())
    }
}
