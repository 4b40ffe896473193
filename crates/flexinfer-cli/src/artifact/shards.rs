//! The shards and the index: every `*.safetensors` header readable and consistent, no tensor in two
//! shards, and `model.safetensors.index.json` mapping exactly the tensors the shards hold.

use std::collections::BTreeMap;
use std::path::Path;

use flexinfer_api::contract::SaveComplete;
use flexinfer_fsutil::limits;
use serde_json::Value;

use super::read::{read_bytes, read_header, read_json, TensorInfo};
use super::Report;
use flexinfer_api::contract::error::chain;

/// The shard file names (sorted) and every tensor of their headers.
pub(super) fn read_shards(
    r: &mut Report,
    dir: &Path,
) -> (Vec<String>, BTreeMap<String, TensorInfo>) {
    let mut shard_files: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.ends_with(".safetensors"))
            .collect(),
        Err(e) => {
            r.defect("shards", format!("cannot list {}: {e}", dir.display()));
            Vec::new()
        }
    };
    shard_files.sort();
    if shard_files.is_empty() {
        r.defect("shards", "no *.safetensors files");
    }
    r.shards = shard_files.len();
    let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
    for s in &shard_files {
        match read_header(dir, s) {
            Ok(list) => {
                for (name, t) in list {
                    if let Some(prev) = tensors.get(&name) {
                        r.defect(
                            "shards",
                            format!("tensor {name} is in both {} and {s}", prev.shard),
                        );
                    }
                    tensors.insert(name, t);
                }
            }
            Err(e) => r.defect("shards", chain(&e)),
        }
    }
    r.tensors = tensors.len();
    (shard_files, tensors)
}

/// The quantized linears: the modules with a `<module><suffix>` tensor (e.g. `.qweight`), sorted; none
/// is a defect.
pub(super) fn quantized_modules(
    r: &mut Report,
    tensors: &BTreeMap<String, TensorInfo>,
    suffix: &str,
) -> Vec<String> {
    let modules: Vec<String> = tensors
        .keys()
        .filter_map(|n| n.strip_suffix(suffix))
        .map(str::to_string)
        .collect();
    if modules.is_empty() {
        r.defect(
            "linear",
            format!("no quantized linear (no *{suffix} tensor)"),
        );
    }
    modules
}

/// The scale tensor `t` (called `name` in defects) holds only finite positive values, as `decode` reads its
/// bytes; the first that is not, or a tensor that cannot be read, is a `linear` defect.
pub(super) fn check_scales(
    r: &mut Report,
    dir: &Path,
    t: &TensorInfo,
    name: &str,
    decode: impl FnOnce(&[u8]) -> Vec<f64>,
) {
    match read_bytes(dir, t) {
        Ok(b) => {
            if let Some(i) = decode(&b).iter().position(|v| !(v.is_finite() && *v > 0.0)) {
                r.defect(
                    "linear",
                    format!("{name}[{i}] is not a finite positive scale"),
                );
            }
        }
        Err(e) => r.defect("linear", chain(&e)),
    }
}

/// `model.safetensors.index.json` against the tensors the shards hold; required with several shards
/// or when `.save-complete` records it.
pub(super) fn check_index(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    shard_files: &[String],
    save_complete: Option<&SaveComplete>,
) {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.symlink_metadata().is_ok() {
        match read_json(dir, "model.safetensors.index.json", limits::INDEX_JSON) {
            Ok(idx) => match idx.get("weight_map").and_then(Value::as_object) {
                Some(map) => {
                    for (name, t) in tensors {
                        match map.get(name).and_then(Value::as_str) {
                            Some(f) if f == t.shard => {}
                            Some(f) => r.defect(
                                "index",
                                format!("model.safetensors.index.json maps {name} to {f}, but it is in {}", t.shard),
                            ),
                            None => r.defect(
                                "index",
                                format!("model.safetensors.index.json does not cover tensor {name} (in {})", t.shard),
                            ),
                        }
                    }
                    for (name, f) in map {
                        if !tensors.contains_key(name) {
                            r.defect(
                                "index",
                                format!(
                                    "model.safetensors.index.json lists {name} in {} but no shard contains it",
                                    f.as_str().unwrap_or("?")
                                ),
                            );
                        }
                    }
                }
                None => r.defect("index", "model.safetensors.index.json has no weight_map"),
            },
            Err(e) => r.defect("index", chain(&e)),
        }
    } else if shard_files.len() > 1 {
        r.defect(
            "index",
            format!(
                "{} shards but no model.safetensors.index.json",
                shard_files.len()
            ),
        );
    } else if save_complete.is_some_and(|s| s.has_index) {
        r.defect(
            "index",
            "model.safetensors.index.json is missing but .save-complete records has_index",
        );
    }
}
