//! The engine's file helpers: `flexinfer-fsutil` with [`QuantError`]s, and JSON files.

use crate::error::{FileError, QuantError, Result};
use std::path::Path;

/// [`flexinfer_fsutil::write_atomic`] with the path in the error.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    flexinfer_fsutil::write_atomic(path, bytes).map_err(|e| QuantError::io(path, e))
}

pub fn write_json_atomic(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(value).map_err(|e| QuantError::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    write_atomic(path, &text)
}

pub use flexinfer_fsutil::{now_rfc3339, sha256_hex};

/// [`flexinfer_fsutil::sha256_file`] with the path in the error.
pub fn sha256_file(path: &Path) -> Result<String> {
    flexinfer_fsutil::sha256_file(path).map_err(|e| QuantError::io(path, e))
}

/// Bad input unless `model_dir/name` exists (a link counts: what it points at is checked when read).
pub fn require_in_model_dir(model_dir: &Path, name: &str) -> Result<()> {
    if model_dir.join(name).symlink_metadata().is_err() {
        return Err(FileError::Missing {
            name: name.to_string(),
            dir: model_dir.to_path_buf(),
        }
        .into());
    }
    Ok(())
}

/// A JSON file the engine wrote itself (a marker), read whole within
/// [`limits::CONFIG_JSON`](flexinfer_fsutil::limits::CONFIG_JSON).
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let bytes = flexinfer_fsutil::read_regular(path, flexinfer_fsutil::limits::CONFIG_JSON)
        .map_err(|e| untrusted_err(path, e))?;
    parse_json(path, &bytes)
}

/// `dir/rel` (a name from a downloaded model) parsed as JSON, after the containment, regular-file
/// and size checks of [`flexinfer_fsutil::read_within`].
pub fn read_json_within(
    dir: &Path,
    rel: &str,
    limit: flexinfer_fsutil::Limit,
) -> Result<serde_json::Value> {
    let path = dir.join(rel);
    let bytes =
        flexinfer_fsutil::read_within(dir, rel, limit).map_err(|e| untrusted_err(&path, e))?;
    parse_json(&path, &bytes)
}

/// `dir/rel` (a name from a downloaded model, copied as-is) whole, checked like
/// [`read_json_within`], within [`limits::TOKENIZER`](flexinfer_fsutil::limits::TOKENIZER).
pub fn read_within(dir: &Path, rel: &str) -> Result<Vec<u8>> {
    flexinfer_fsutil::read_within(dir, rel, flexinfer_fsutil::limits::TOKENIZER)
        .map_err(|e| untrusted_err(&dir.join(rel), e))
}

fn parse_json(path: &Path, bytes: &[u8]) -> Result<serde_json::Value> {
    serde_json::from_slice(bytes).map_err(|e| QuantError::Json {
        path: path.to_path_buf(),
        source: e,
    })
}

/// An error of the untrusted-file helpers: a refused file (escape, not regular, too large) is bad
/// input (exit 2) and names the file; anything else is an I/O error on `path`.
pub fn untrusted_err(path: &Path, e: std::io::Error) -> QuantError {
    if flexinfer_fsutil::is_refused(&e) {
        FileError::Refused { source: e }.into()
    } else {
        QuantError::io(path, e)
    }
}
