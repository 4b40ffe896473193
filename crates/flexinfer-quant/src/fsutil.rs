//! The engine's file helpers: `flexinfer-fsutil` with [`QuantError`]s, and JSON files.

use crate::error::{QuantError, Result};
use std::path::Path;

/// [`flexinfer_fsutil::write_atomic`] with the path in the error.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    flexinfer_fsutil::write_atomic(path, bytes).map_err(|e| QuantError::io(path, e))
}

pub fn write_json_atomic(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(value).map_err(|e| QuantError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    write_atomic(path, &text)
}

pub use flexinfer_fsutil::{now_rfc3339, sha256_hex};

/// [`flexinfer_fsutil::sha256_file`] with the path in the error.
pub fn sha256_file(path: &Path) -> Result<String> {
    flexinfer_fsutil::sha256_file(path).map_err(|e| QuantError::io(path, e))
}

pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| QuantError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| QuantError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
