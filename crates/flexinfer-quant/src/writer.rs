//! The `gptq` checkpoint writer: sharded safetensors + index, configs, tokenizer files, `.save-complete`.
//! Shards are written into a staging directory that survives restarts (a shard whose size and sha256 already
//! match is not rewritten), and the directory is renamed into place at the end.

use crate::error::{QuantError, Result};
use crate::fsutil::{now_rfc3339, read_json, sha256_file, sha256_hex, write_atomic, write_json_atomic};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

pub const SAVE_COMPLETE: &str = ".save-complete";
pub const QUALITY_FILE: &str = ".quantization-quality.json";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tokenizer and generation files copied next to the weights when present.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// One output tensor.
pub struct OutTensor<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShardRecord {
    pub name: String,
    pub size_bytes: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SaveComplete {
    pub version: u32,
    pub script_version: String,
    pub completed_at: String,
    pub shards: Vec<ShardRecord>,
    pub has_index: bool,
    pub has_config: bool,
    pub has_quantize_config: bool,
}

/// Checks an output directory's `.save-complete`: every shard present with its exact size (and sha256 if asked).
pub fn verify_save_complete(dir: &Path, check_sha: bool) -> Option<SaveComplete> {
    let v = read_json(&dir.join(SAVE_COMPLETE)).ok()?;
    let sc: SaveComplete = serde_json::from_value(v).ok()?;
    if sc.shards.is_empty() {
        return None;
    }
    for s in &sc.shards {
        let p = dir.join(&s.name);
        let meta = std::fs::metadata(&p).ok()?;
        if meta.len() != s.size_bytes {
            return None;
        }
        if check_sha && sha256_file(&p).ok()? != s.sha256 {
            return None;
        }
    }
    let present = |n: &str| dir.join(n).exists();
    if (sc.has_index && !present(INDEX_FILE)) || (sc.has_config && !present("config.json")) {
        return None;
    }
    Some(sc)
}

/// Everything that goes next to the shards.
pub struct Extras<'a> {
    pub config_json: serde_json::Value,
    pub quantize_config: serde_json::Value,
    pub quality: serde_json::Value,
    pub source_dir: &'a Path,
    pub script_version: &'a str,
}

/// Writes the checkpoint into `staging`, then renames it to `final_dir`. Returns the shard records.
pub fn write_checkpoint(
    staging: &Path,
    final_dir: &Path,
    mut tensors: Vec<OutTensor<'_>>,
    max_shard_bytes: u64,
    extras: &Extras<'_>,
    mut on_shard: impl FnMut(usize, usize),
) -> Result<Vec<ShardRecord>> {
    std::fs::create_dir_all(staging).map_err(|e| QuantError::io(staging, e))?;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    // Greedy shard plan in name order.
    let mut plan: Vec<Vec<usize>> = vec![Vec::new()];
    let mut cur = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let sz = t.data.len() as u64;
        if cur > 0 && cur + sz > max_shard_bytes {
            plan.push(Vec::new());
            cur = 0;
        }
        if let Some(last) = plan.last_mut() {
            last.push(i);
        }
        cur += sz;
    }
    let n = plan.len();
    let mut records = Vec::with_capacity(n);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (si, idxs) in plan.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", si + 1, n);
        let mut views = Vec::with_capacity(idxs.len());
        for &i in idxs {
            let t = &tensors[i];
            let view = TensorView::new(t.dtype, t.shape.clone(), &t.data).map_err(|e| QuantError::Safetensors {
                path: staging.join(&name),
                message: format!("{}: {e:?}", t.name),
            })?;
            views.push((t.name.clone(), view));
            weight_map.insert(t.name.clone(), json!(name));
            total += t.data.len() as u64;
        }
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into_iter().collect();
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| QuantError::Safetensors { path: staging.join(&name), message: format!("{e:?}") })?;
        let sha = sha256_hex(&bytes);
        let path = staging.join(&name);
        let reuse = std::fs::metadata(&path).map(|m| m.len() == bytes.len() as u64).unwrap_or(false)
            && sha256_file(&path).map(|h| h == sha).unwrap_or(false);
        if !reuse {
            write_atomic(&path, &bytes)?;
        }
        records.push(ShardRecord { name, size_bytes: bytes.len() as u64, sha256: sha });
        on_shard(si + 1, n);
    }
    // Remove shards of an older plan left in the staging directory.
    if let Ok(rd) = std::fs::read_dir(staging) {
        for e in rd.flatten() {
            let fname = e.file_name().to_string_lossy().to_string();
            if fname.ends_with(".safetensors") && !records.iter().any(|r| r.name == fname) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    write_json_atomic(&staging.join(INDEX_FILE), &json!({"metadata": {"total_size": total}, "weight_map": weight_map}))?;
    write_json_atomic(&staging.join("config.json"), &extras.config_json)?;
    write_json_atomic(&staging.join("quantize_config.json"), &extras.quantize_config)?;
    write_json_atomic(&staging.join(QUALITY_FILE), &extras.quality)?;
    for f in TOKENIZER_FILES {
        let src = extras.source_dir.join(f);
        if src.is_file() {
            let bytes = std::fs::read(&src).map_err(|e| QuantError::io(&src, e))?;
            write_atomic(&staging.join(f), &bytes)?;
        }
    }
    let sc = SaveComplete {
        version: 1,
        script_version: extras.script_version.to_string(),
        completed_at: now_rfc3339(),
        shards: records.clone(),
        has_index: true,
        has_config: true,
        has_quantize_config: true,
    };
    let v = serde_json::to_value(&sc).map_err(|e| QuantError::Json { path: staging.join(SAVE_COMPLETE), message: e.to_string() })?;
    write_json_atomic(&staging.join(SAVE_COMPLETE), &v)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(final_dir).map_err(|e| QuantError::io(final_dir, e))?;
    }
    std::fs::rename(staging, final_dir).map_err(|e| QuantError::io(final_dir, e))?;
    Ok(records)
}
