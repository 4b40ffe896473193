//! The abliterated model directory: the source's shards mirrored (same files, headers, tensor names
//! and dtypes; only the edited tensors' bytes differ), config/tokenizer files copied, written
//! through a staging directory with a manifest so a killed run resumes shard by shard.

use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use flexinfer_contract::{self as contract, files, ProgressEvent};
use flexinfer_fsutil::limits;
use flexinfer_quant::tensors::TensorStore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::edit::Plan;
use super::io_err;
use super::ortho::edited_tensor;
use crate::common::{self, AbliterateError, Events, ExitKind, WorkerError};

/// What the direction search and the gate measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunResult {
    /// Layer whose direction was used.
    pub layer: usize,
    /// Unit refusal direction.
    pub direction: Vec<f32>,
    /// Norm of the raw (unnormalized) difference of means.
    pub refusal_dir_norm: f64,
    pub score: f64,
    pub perplexity_before: f64,
    pub perplexity_after: f64,
    pub layers_modified: Vec<usize>,
    /// The projection check at the direction's layer: `⟨mean(refusal) − mean(harmless), r⟩` of the check prompts'
    /// last-token residuals with the source weights, and with the edited weights (as written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_projection_before: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_projection_after: Option<f64>,
}

/// One written shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardRecord {
    pub name: String,
    pub size_bytes: u64,
    pub sha256: String,
}

/// `.abliteration-manifest.json` (staging and final directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub version: u32,
    pub fingerprint: String,
    pub script_version: String,
    pub result: RunResult,
    /// Tensors that were modified.
    pub edits: Vec<String>,
    pub shards: Vec<ShardRecord>,
    pub complete: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
}

/// `config.json` of the source.
pub fn read_config(model_dir: &Path) -> Result<serde_json::Value, WorkerError> {
    let p = model_dir.join("config.json");
    let text = flexinfer_fsutil::read_string_within(model_dir, "config.json", limits::CONFIG_JSON)
        .map_err(WorkerError::io(
            ExitKind::BadInput,
            format!("cannot read {}", p.display()),
        ))?;
    serde_json::from_str(&text).map_err(WorkerError::json(
        ExitKind::BadInput,
        format!("{}: invalid JSON", p.display()),
    ))
}

fn sha256_file(path: &Path) -> Result<String, WorkerError> {
    flexinfer_fsutil::sha256_file(path).map_err(|e| io_err(path, e))
}

/// Identity of a run: source files (name, size, mtime), config, datasets, settings, contract version.
pub fn fingerprint(
    store: &TensorStore,
    model_dir: &Path,
    datasets: &[&Path],
    settings: &serde_json::Value,
) -> Result<String, WorkerError> {
    let mut h = Sha256::new();
    h.update(contract::SCRIPT_VERSION.as_bytes());
    for f in &store.files {
        let meta = std::fs::metadata(f).map_err(|e| io_err(f, e))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.update(format!("|{}|{}|{mtime}", rel_name(model_dir, f), meta.len()).as_bytes());
    }
    h.update(b"|config|");
    h.update(sha256_file(&model_dir.join("config.json"))?.as_bytes());
    for d in datasets {
        h.update(b"|dataset|");
        h.update(sha256_file(d)?.as_bytes());
    }
    h.update(b"|settings|");
    h.update(settings.to_string().as_bytes());
    Ok(hex::encode(h.finalize()))
}

fn rel_name(model_dir: &Path, f: &Path) -> String {
    f.strip_prefix(model_dir)
        .unwrap_or(f)
        .to_string_lossy()
        .replace('\\', "/")
}

/// `<OUT_DIR>.partial`, next to the output directory.
pub fn staging_dir(out_dir: &Path) -> PathBuf {
    let name = out_dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "abliterated".into());
    out_dir.with_file_name(format!("{name}{}", files::STAGING_SUFFIX))
}

fn read_manifest(dir: &Path) -> Option<Manifest> {
    let bytes = flexinfer_fsutil::read_regular(
        &dir.join(files::ABLITERATION_MANIFEST),
        limits::CONFIG_JSON,
    )
    .ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), WorkerError> {
    let bytes = serde_json::to_vec_pretty(m).map_err(WorkerError::json(
        ExitKind::Failure,
        "encoding the manifest",
    ))?;
    let p = dir.join(files::ABLITERATION_MANIFEST);
    common::write_atomic(&p, &bytes).map_err(|e| io_err(&p, e))
}

fn shard_ok(dir: &Path, s: &ShardRecord) -> bool {
    let p = dir.join(&s.name);
    std::fs::metadata(&p).is_ok_and(|m| m.len() == s.size_bytes)
        && sha256_file(&p).is_ok_and(|h| h == s.sha256)
}

/// The finished output of this exact run, if `out_dir` holds it intact.
pub fn verify_complete(out_dir: &Path, fingerprint: &str) -> Option<Manifest> {
    let m = read_manifest(out_dir)?;
    (m.complete && m.fingerprint == fingerprint && m.shards.iter().all(|s| shard_ok(out_dir, s)))
        .then_some(m)
}

/// The staging manifest of an interrupted run with the same fingerprint.
pub fn load_staging(staging: &Path, fingerprint: &str) -> Option<Manifest> {
    read_manifest(staging).filter(|m| m.fingerprint == fingerprint)
}

/// Files of the source that are not copied: weights in other formats (they would carry the
/// unedited weights), hidden markers and caches.
fn is_copied_aux(name: &str) -> bool {
    const WEIGHT_EXT: [&str; 9] = [
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".gguf",
        ".h5",
        ".msgpack",
        ".ckpt",
        ".onnx",
    ];
    !name.starts_with('.') && !WEIGHT_EXT.iter().any(|x| name.ends_with(x))
}

/// A progress event of the shard loop: `done` of `total` files.
fn file_progress(percent: f64, detail: String, done: usize, total: usize) -> ProgressEvent {
    ProgressEvent {
        percent,
        detail: Some(detail),
        unit: Some("files".into()),
        done: Some(done as f64),
        total: Some(total as f64),
        ..Default::default()
    }
}

/// Writes every shard (skipping those an interrupted run already wrote) and the other files into
/// `staging`. Returns the number of shards.
#[allow(clippy::too_many_arguments)]
pub fn write_output(
    store: &TensorStore,
    model_dir: &Path,
    staging: &Path,
    plan: &Plan,
    result: &RunResult,
    fingerprint: &str,
    resumed: Option<&Manifest>,
    abort_after_shards: Option<usize>,
    ev: &Events,
) -> Result<usize, WorkerError> {
    let mut manifest = start_manifest(staging, plan, result, fingerprint, resumed)?;
    let by_file = edits_by_file(store, plan)?;
    let n = store.files.len();
    let mut written_now = 0usize;
    for (fi, src) in store.files.iter().enumerate() {
        let rel = rel_name(model_dir, src);
        contract::check_relative_path(&rel).map_err(WorkerError::caused(
            ExitKind::BadInput,
            format!("weight file {}", src.display()),
        ))?;
        let done = manifest
            .shards
            .iter()
            .find(|s| s.name == rel)
            .is_some_and(|s| shard_ok(staging, s));
        let percent = 70.0 + 28.0 * (fi + 1) as f64 / n as f64;
        if done {
            ev.progress(file_progress(
                percent,
                format!("shard {rel} already written (sha256 verified)"),
                fi + 1,
                n,
            ));
            continue;
        }
        let dst = staging.join(&rel);
        let edits = by_file.get(&fi).map(Vec::as_slice).unwrap_or_default();
        write_shard(store, src, &dst, edits, result)?;
        let size = std::fs::metadata(&dst).map_err(|e| io_err(&dst, e))?.len();
        let rec = ShardRecord {
            name: rel.clone(),
            size_bytes: size,
            sha256: sha256_file(&dst)?,
        };
        manifest.shards.retain(|s| s.name != rel);
        manifest.shards.push(rec);
        write_manifest(staging, &manifest)?;
        ev.progress(file_progress(
            percent,
            format!("wrote shard {rel}"),
            fi + 1,
            n,
        ));
        written_now += 1;
        shard_written(abort_after_shards, written_now, ev);
    }
    copy_aux_files(model_dir, staging)?;
    remove_tmp_leftovers(staging);
    manifest.complete = true;
    manifest.completed_at = Some(common::now_rfc3339());
    write_manifest(staging, &manifest)?;
    Ok(n)
}

/// The manifest the shards are recorded in: the interrupted run's when resuming, else a fresh one
/// in an emptied staging directory. It is written before any shard.
fn start_manifest(
    staging: &Path,
    plan: &Plan,
    result: &RunResult,
    fingerprint: &str,
    resumed: Option<&Manifest>,
) -> Result<Manifest, WorkerError> {
    let manifest = match resumed {
        Some(m) => m.clone(),
        None => {
            if staging.exists() {
                std::fs::remove_dir_all(staging).map_err(|e| io_err(staging, e))?;
            }
            Manifest {
                version: 1,
                fingerprint: fingerprint.to_string(),
                script_version: contract::SCRIPT_VERSION.to_string(),
                result: result.clone(),
                edits: plan.edits.iter().map(|e| e.tensor.clone()).collect(),
                shards: Vec::new(),
                complete: false,
                completed_at: None,
            }
        }
    };
    std::fs::create_dir_all(staging).map_err(|e| io_err(staging, e))?;
    write_manifest(staging, &manifest)?;
    Ok(manifest)
}

/// The plan's edits grouped by the index of the weight file that holds each tensor.
fn edits_by_file<'p>(
    store: &TensorStore,
    plan: &'p Plan,
) -> Result<BTreeMap<usize, Vec<&'p super::edit::Edit>>, WorkerError> {
    let mut by_file: BTreeMap<usize, Vec<&super::edit::Edit>> = BTreeMap::new();
    for e in &plan.edits {
        let entry = store.entry(&e.tensor).map_err(super::quant_err)?;
        by_file.entry(entry.file).or_default().push(e);
    }
    Ok(by_file)
}

/// Writes `dst` as a copy of `src` with the edited tensors overwritten in place: into a temporary
/// file beside it, synced, then renamed. An edited tensor whose size differs from the source's
/// fails the write.
fn write_shard(
    store: &TensorStore,
    src: &Path,
    dst: &Path,
    edits: &[&super::edit::Edit],
    result: &RunResult,
) -> Result<(), WorkerError> {
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
    }
    let tmp = dst.with_file_name(format!(
        "{}.{}",
        flexinfer_fsutil::WRITE_TMP_PREFIX,
        dst.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default()
    ));
    std::fs::copy(src, &tmp).map_err(|e| io_err(&tmp, e))?;
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .map_err(|e| io_err(&tmp, e))?;
        for e in edits {
            let entry = store.entry(&e.tensor).map_err(super::quant_err)?;
            let (bytes, _) = edited_tensor(store, e, &result.direction)?;
            if bytes.len() != entry.end - entry.start {
                return Err(AbliterateError::EditedSize {
                    tensor: e.tensor.clone(),
                    edited: bytes.len(),
                    source_size: entry.end - entry.start,
                }
                .into());
            }
            f.seek(SeekFrom::Start(entry.start as u64))
                .map_err(|e| io_err(&tmp, e))?;
            f.write_all(&bytes).map_err(|e| io_err(&tmp, e))?;
        }
        f.sync_all().map_err(|e| io_err(&tmp, e))?;
    }
    std::fs::rename(&tmp, dst).map_err(|e| io_err(dst, e))
}

/// Copies config, tokenizer and the other small files of the model directory unchanged. A
/// symlink is copied only if it resolves to a regular file inside the model directory.
fn copy_aux_files(model_dir: &Path, staging: &Path) -> Result<(), WorkerError> {
    // Config, tokenizer and the other small files, unchanged.
    let rd = std::fs::read_dir(model_dir).map_err(|e| io_err(model_dir, e))?;
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let p = entry.path();
        // Everything but a directory: a symlink is copied only if it resolves to a regular file
        // inside the model directory; read_within refuses the rest (FIFOs too), naming the file.
        let listed = entry.file_type().is_ok_and(|t| !t.is_dir());
        if listed && is_copied_aux(&name) {
            let dst = staging.join(&name);
            let bytes = flexinfer_fsutil::read_within(model_dir, &name, limits::TOKENIZER)
                .map_err(|e| {
                    if flexinfer_fsutil::is_refused(&e) {
                        WorkerError::wrap(ExitKind::BadInput)(e)
                    } else {
                        io_err(&p, e)
                    }
                })?;
            common::write_atomic(&dst, &bytes).map_err(|e| io_err(&dst, e))?;
        }
    }
    Ok(())
}

/// Removes temporary files a write interrupted by a kill left in `staging` (best effort).
fn remove_tmp_leftovers(staging: &Path) {
    // Leftovers of a write interrupted by a kill (temporary files) do not belong in the output.
    let _ = flexinfer_fsutil::remove_write_leftovers(staging);
    // Releases before this one named a shard's temporary file `.<shard>.tmp`.
    if let Ok(rd) = std::fs::read_dir(staging) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with('.') && name.ends_with(".safetensors.tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Moves the finished staging directory into place (replacing an older output).
pub fn commit(staging: &Path, out_dir: &Path) -> Result<(), WorkerError> {
    // Durable and atomic: the staging directory's entries, then an exchange with any older output.
    flexinfer_fsutil::fsync_dir(staging).map_err(|e| io_err(staging, e))?;
    flexinfer_fsutil::replace_dir(staging, out_dir).map_err(|e| io_err(out_dir, e))
}

/// The test hook: end the process (code 137, like a SIGKILL) once `written` shards reach
/// `abort_after_shards`. Only with feature `test-hooks`; a no-op without.
fn shard_written(abort_after_shards: Option<usize>, written: usize, ev: &Events) {
    #[cfg(feature = "test-hooks")]
    if abort_after_shards.is_some_and(|k| written >= k) {
        ev.log("test hook: aborting after a written shard");
        std::process::exit(137);
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (abort_after_shards, written, ev);
}
