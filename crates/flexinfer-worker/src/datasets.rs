//! Where a phase finds a dataset it was given by name: the calibration text of `quantize` and the
//! prompt sets of `abliterate` are resolved by the same rules (their contents are read by the engine's
//! one dataset reader, `flexinfer_quant::model::dataset`).
//!
//! A dataset is a local file, a directory holding one, or a hub dataset id the download phase fetched
//! to `<modelPath>/.datasets/<id>`. Every phase's input directory lies directly under `<modelPath>`
//! (the download generation `source.<generation>`, `abliterated.<generation>`), or is `<modelPath>`
//! itself (caches downloaded before generations), so an id is looked up under `<MODEL_DIR>/.datasets`,
//! `<parent of MODEL_DIR>/.datasets`, then `/cache/.datasets`.

use std::path::{Path, PathBuf};

use flexinfer_contract as contract;

use crate::common::{DatasetError, WorkerError};

/// File extensions the dataset reader knows (each also with a `.zst` suffix).
const DATA_EXTENSIONS: [&str; 5] = ["jsonl", "json", "csv", "txt", "parquet"];

/// The file a dataset setting names; `what` (`calibration`, `refusal`, `harmless`) names it in errors.
pub fn resolve(spec: &str, model_dir: &Path, what: &str) -> Result<PathBuf, WorkerError> {
    let s = spec.trim();
    if s.is_empty() {
        return Err(DatasetError::NotSet {
            what: what.to_string(),
        }
        .into());
    }
    let mut candidates = vec![PathBuf::from(s)];
    if contract::check_relative_path(s).is_ok() {
        candidates.push(model_dir.join(contract::DATASETS_SUBDIR).join(s));
        if let Some(parent) = model_dir.parent() {
            candidates.push(parent.join(contract::DATASETS_SUBDIR).join(s));
        }
        candidates.push(
            Path::new(contract::CACHE_MOUNT)
                .join(contract::DATASETS_SUBDIR)
                .join(s),
        );
    }
    for c in &candidates {
        if c.is_file() {
            return Ok(c.clone());
        }
        if c.is_dir() {
            return find_data_file(c).ok_or_else(|| {
                DatasetError::NoDataFile {
                    what: what.to_string(),
                    dir: c.clone(),
                }
                .into()
            });
        }
    }
    Err(DatasetError::NotFound {
        what: what.to_string(),
        spec: s.to_string(),
        looked_in: model_dir.join(contract::DATASETS_SUBDIR).join(s),
    }
    .into())
}

/// Whether a file name has a dataset extension (after an optional `.zst`).
fn is_data_file(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    let base = name.strip_suffix(".zst").unwrap_or(&name);
    Path::new(base)
        .extension()
        .and_then(|x| x.to_str())
        .is_some_and(|x| DATA_EXTENSIONS.contains(&x))
}

/// The data file of a dataset directory: regular files inside it (hidden entries and symlinked
/// directories skipped, names that would leave it refused), a training split preferred, else the first
/// by name.
fn find_data_file(dir: &Path) -> Option<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            // The file type of the entry itself: a symlinked directory is not walked.
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(p);
            } else if is_data_file(&name) {
                // Names come from the hub: only files that stay inside the dataset.
                let inside = p
                    .strip_prefix(dir)
                    .is_ok_and(|rel| flexinfer_fsutil::resolve_within(dir, rel).is_ok());
                if inside {
                    found.push(p);
                }
            }
        }
    }
    found.sort();
    found
        .iter()
        .find(|p| p.to_string_lossy().contains("train"))
        .or(found.first())
        .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_set_of_rules_for_every_phase() {
        let t = tempfile::tempdir().expect("tmp");
        let root = t.path().join("m");
        let ds = root.join(".datasets/org/set/data");
        std::fs::create_dir_all(&ds).expect("mkdir");
        std::fs::write(ds.join("validation.jsonl"), "\"v\"\n").expect("write");
        std::fs::write(ds.join("train.jsonl.zst"), "x").expect("write");
        std::fs::write(ds.join(".hidden.jsonl"), "x").expect("write");
        std::fs::write(ds.join("README.md"), "x").expect("write");
        let want = ds.join("train.jsonl.zst");
        // From `<modelPath>` itself, a download generation and an abliterated generation.
        for input in [
            root.clone(),
            root.join("source.0a1b2c3d-20261201000000"),
            root.join("abliterated.0a1b2c3d-20261201000000"),
        ] {
            assert_eq!(resolve("org/set", &input, "refusal").expect("found"), want);
        }
        // A file path is taken as it is.
        let f = ds.join("validation.jsonl");
        assert_eq!(
            resolve(&f.display().to_string(), &root, "calibration").expect("file"),
            f
        );
        // Errors name the use and the id; never a path outside through `..`.
        let e = resolve("org/missing", &root, "harmless").expect_err("missing");
        assert_eq!(e.exit_code(), 2);
        assert!(
            flexinfer_contract::error::chain(&e).contains("harmless dataset \"org/missing\""),
            "{e}"
        );
        let e = resolve("../m/.datasets/org/set", &root.join("x"), "refusal").expect_err("..");
        assert!(
            flexinfer_contract::error::chain(&e).contains("not found"),
            "{e}"
        );
        assert!(resolve("  ", &root, "calibration").is_err());
        // A directory without a data file.
        std::fs::create_dir_all(root.join(".datasets/org/empty")).expect("mkdir");
        let e = resolve("org/empty", &root, "calibration").expect_err("empty");
        assert!(
            flexinfer_contract::error::chain(&e).contains("holds no"),
            "{e}"
        );
    }
}
