//! Writing a checkpoint that rewrites some of its source's tensors (FP8, AWQ): the rewritten tensors come from
//! per-layer work files, every other tensor is the source's, and the checkpoint goes through the same staging,
//! `.save-complete` and quality summary as the GPTQ one.

use crate::error::{NumericError, Result};
use crate::events::{fields, EventSink};
use crate::job::writer::{write_checkpoint, Extras, OutTensor};
use crate::model::tensors::TensorStore;
use flexinfer_contract::events as names;
use flexinfer_contract::files;
use serde_json::json;
use std::borrow::Cow;
use std::path::{Path, PathBuf};

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
    for (store, keep) in [(source, true), (rewritten, false)] {
        for (name, e) in &store.entries {
            if keep && replaced(name) {
                continue;
            }
            tensors.push(OutTensor {
                name: name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                data: Cow::Borrowed(store.raw(name)?),
            });
        }
    }
    Ok(tensors)
}

/// Where and from what a rewritten checkpoint is written.
pub struct Rewritten<'a> {
    /// `phase` of its progress events (`fp8`, `awq`); also names its quality summary in errors.
    pub phase: &'static str,
    pub out_dir: &'a Path,
    pub max_shard_bytes: u64,
    pub source: &'a TensorStore,
    pub rewritten: &'a TensorStore,
    /// Everything of `.save-complete` and the config but the quality summary, which [`Rewritten::write`] sets.
    pub extras: Extras<'a>,
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
            quality: quality_json.clone(),
            ..self.extras
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
