//! The `gptq` checkpoint writer: sharded safetensors + index, configs, tokenizer files, `.save-complete`.
//! Shards are written into a staging directory that survives restarts (a shard whose size and sha256 already
//! match is not rewritten), and the directory is renamed into place at the end.

use crate::error::{NumericError, QuantError, Result};
use crate::fsutil::{now_rfc3339, read_json, sha256_file, write_atomic, write_json_atomic};
use flexinfer_contract::files::{self, SaveComplete, SaveShard};
use safetensors::Dtype;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::path::Path;

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

/// Checks an output directory's `.save-complete`: every shard present with its exact size (and sha256 if asked).
pub fn verify_save_complete(dir: &Path, check_sha: bool) -> Option<SaveComplete> {
    let v = read_json(&dir.join(files::SAVE_COMPLETE)).ok()?;
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
    /// `quantize_config.json` (GPTQ); `None`: the format has none (its `config.json` says everything).
    pub quantize_config: Option<serde_json::Value>,
    pub quality: serde_json::Value,
    pub source_dir: &'a Path,
    pub script_version: &'a str,
    /// Recorded in `.save-complete` (see [`crate::job::config_digest`]).
    pub config_digest: &'a str,
}

/// Safetensors header of one shard and the order its tensors' data follows (largest element size first, then
/// name, so every tensor starts aligned to its element size).
fn shard_layout(tensors: &[OutTensor<'_>], idxs: &[usize]) -> Result<(Vec<u8>, Vec<usize>)> {
    let mut order = idxs.to_vec();
    order.sort_by(|&a, &b| {
        let (ta, tb) = (&tensors[a], &tensors[b]);
        tb.dtype
            .bitsize()
            .cmp(&ta.dtype.bitsize())
            .then_with(|| ta.name.cmp(&tb.name))
    });
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for &i in &order {
        let t = &tensors[i];
        let expected = t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8;
        if expected != t.data.len() {
            return Err(NumericError::TensorBytes {
                name: t.name.clone(),
                bytes: t.data.len(),
                shape: t.shape.clone(),
            }
            .into());
        }
        header.insert(
            t.name.clone(),
            json!({"dtype": format!("{:?}", t.dtype), "shape": t.shape, "data_offsets": [offset, offset + t.data.len()]}),
        );
        offset += t.data.len();
    }
    let mut text = serde_json::to_string(&header).map_err(|source| NumericError::Encode {
        what: "the safetensors header",
        source,
    })?;
    while (8 + text.len()) % 8 != 0 {
        text.push(' ');
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    Ok((bytes, order))
}

/// Bytes read from mapped tensors between two calls of the caller's page-release hook while saving: the
/// source and cache mappings are read once for the digest and once for the write, and without the hook every
/// page read would stay in the resident set until the shard is done.
const RELEASE_EVERY: usize = 16 << 20;
/// Large tensors are hashed and written in pieces of this size, so that the hook runs inside them too.
const PIECE: usize = 8 << 20;

/// Calls `release` whenever another [`RELEASE_EVERY`] bytes have been read.
struct ReleaseTicker<'a> {
    release: &'a dyn Fn(),
    since: usize,
}

impl ReleaseTicker<'_> {
    fn read(&mut self, bytes: usize) {
        self.since += bytes;
        if self.since >= RELEASE_EVERY {
            (self.release)();
            self.since = 0;
        }
    }
}

fn shard_digest(
    header: &[u8],
    tensors: &[OutTensor<'_>],
    order: &[usize],
    ticker: &mut ReleaseTicker<'_>,
) -> (u64, String) {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(header);
    let mut size = header.len() as u64;
    for &i in order {
        for piece in tensors[i].data.chunks(PIECE) {
            h.update(piece);
            ticker.read(piece.len());
        }
        size += tensors[i].data.len() as u64;
    }
    (size, hex::encode(h.finalize()))
}

/// Streams a shard to a temp file next to `path` and renames it into place (no in-memory copy of the shard).
fn write_shard(
    path: &Path,
    header: &[u8],
    tensors: &[OutTensor<'_>],
    order: &[usize],
    ticker: &mut ReleaseTicker<'_>,
) -> Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = flexinfer_fsutil::temp_file_in(dir).map_err(|e| QuantError::io(dir, e))?;
    {
        let mut w = std::io::BufWriter::with_capacity(8 << 20, tmp.as_file());
        w.write_all(header).map_err(|e| QuantError::io(path, e))?;
        for &i in order {
            for piece in tensors[i].data.chunks(PIECE) {
                w.write_all(piece).map_err(|e| QuantError::io(path, e))?;
                ticker.read(piece.len());
            }
        }
        w.flush().map_err(|e| QuantError::io(path, e))?;
    }
    tmp.as_file()
        .sync_all()
        .map_err(|e| QuantError::io(path, e))?;
    tmp.persist(path)
        .map_err(|e| QuantError::io(path, e.error))?;
    Ok(())
}

/// Writes the checkpoint into `staging`, then puts it at `final_dir` ([`flexinfer_fsutil::replace_dir`]). Returns the shard records.
/// `release_pages` is called every few tens of MiB read from `tensors` (drop mapped pages from the resident
/// set there); `on_shard(done, total)` after each shard.
pub fn write_checkpoint(
    staging: &Path,
    final_dir: &Path,
    mut tensors: Vec<OutTensor<'_>>,
    max_shard_bytes: u64,
    extras: &Extras<'_>,
    release_pages: &dyn Fn(),
    mut on_shard: impl FnMut(usize, usize),
) -> Result<Vec<SaveShard>> {
    let mut ticker = ReleaseTicker {
        release: release_pages,
        since: 0,
    };
    std::fs::create_dir_all(staging).map_err(|e| QuantError::io(staging, e))?;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let plan = shard_plan(&tensors, max_shard_bytes);
    let n = plan.len();
    let mut records = Vec::with_capacity(n);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (si, idxs) in plan.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", si + 1, n);
        for &i in idxs {
            weight_map.insert(tensors[i].name.clone(), json!(name));
            total += tensors[i].data.len() as u64;
        }
        let (header, order) = shard_layout(&tensors, idxs)?;
        let (size, sha) = shard_digest(&header, &tensors, &order, &mut ticker);
        let path = staging.join(&name);
        let reuse = std::fs::metadata(&path)
            .map(|m| m.len() == size)
            .unwrap_or(false)
            && sha256_file(&path).map(|h| h == sha).unwrap_or(false);
        if !reuse {
            write_shard(&path, &header, &tensors, &order, &mut ticker)?;
        }
        let bytes_len = size;
        records.push(SaveShard {
            name,
            size_bytes: bytes_len,
            sha256: sha,
        });
        on_shard(si + 1, n);
    }
    remove_stale(staging, &records);
    write_side_files(staging, extras, total, weight_map, &records)?;
    // An existing directory at `final_dir` is exchanged atomically: it names a complete artifact at
    // every instant.
    flexinfer_fsutil::replace_dir(staging, final_dir).map_err(|e| QuantError::io(final_dir, e))?;
    Ok(records)
}

/// Greedy shard plan in name order: tensor indices per shard, each shard within `max_shard_bytes`
/// unless one tensor alone is larger.
fn shard_plan(tensors: &[OutTensor<'_>], max_shard_bytes: u64) -> Vec<Vec<usize>> {
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
    plan
}

/// Removes what does not belong in the artifact from the staging directory: shards of an older plan
/// and the temporary files of a write a kill interrupted.
fn remove_stale(staging: &Path, records: &[SaveShard]) {
    if let Ok(rd) = std::fs::read_dir(staging) {
        for e in rd.flatten() {
            let fname = e.file_name().to_string_lossy().to_string();
            if fname.ends_with(".safetensors") && !records.iter().any(|r| r.name == fname) {
                let _ = std::fs::remove_file(e.path());
            }
            // Temporary files of a write a kill interrupted do not belong in the artifact.
            if flexinfer_fsutil::is_write_leftover(&fname) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Everything beside the shards: the index, the configs, the quality sidecar, the tokenizer files,
/// and last `.save-complete`.
fn write_side_files(
    staging: &Path,
    extras: &Extras<'_>,
    total: u64,
    weight_map: serde_json::Map<String, Value>,
    records: &[SaveShard],
) -> Result<()> {
    write_json_atomic(
        &staging.join(INDEX_FILE),
        &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
    )?;
    write_json_atomic(&staging.join("config.json"), &extras.config_json)?;
    if let Some(qc) = &extras.quantize_config {
        write_json_atomic(&staging.join("quantize_config.json"), qc)?;
    }
    write_json_atomic(&staging.join(files::QUANTIZATION_QUALITY), &extras.quality)?;
    for f in TOKENIZER_FILES {
        let src = extras.source_dir.join(f);
        if src.symlink_metadata().is_ok() {
            let bytes = crate::fsutil::read_within(extras.source_dir, f)?;
            write_atomic(&staging.join(f), &bytes)?;
        }
    }
    let sc = SaveComplete {
        version: 1,
        script_version: extras.script_version.to_string(),
        completed_at: now_rfc3339(),
        shards: records.to_vec(),
        has_index: true,
        has_config: true,
        has_quantize_config: extras.quantize_config.is_some(),
        config_digest: Some(extras.config_digest.to_string()),
    };
    let v = serde_json::to_value(&sc).map_err(|e| QuantError::Json {
        path: staging.join(files::SAVE_COMPLETE),
        source: e,
    })?;
    write_json_atomic(&staging.join(files::SAVE_COMPLETE), &v)?;
    Ok(())
}
