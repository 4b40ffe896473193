//! The model's own files of a directory, told apart from what the pipeline derives beside them.

use std::path::{Path, PathBuf};

use flexinfer_contract as contract;

/// Internal record of the source a download is fetching (so `.part` files of another source are
/// never resumed). Not part of the controller contract.
pub const IN_PROGRESS_FILE: &str = ".download-in-progress.json";

/// Whether a directory under a model directory holds derived or in-progress artifacts (abliterated
/// model, GPTQ outputs and resume cache, hub datasets, `*.partial`/`*.old` staging) rather than the
/// model's own files.
pub fn is_derived_dir(name: &str) -> bool {
    name == contract::ABLITERATED_SUBDIR
        || name.starts_with(&format!("{}.", contract::ABLITERATED_SUBDIR))
        || name == contract::files::GPTQ_CACHE_DIR
        || name == contract::DATASETS_SUBDIR
        || name.starts_with("gptq-")
        || contract::files::is_generation_of(name, contract::SOURCE_SUBDIR)
        || name.ends_with(".partial")
        || name.ends_with(".old")
}

/// One regular file of a model directory: path relative to the root (with `/`), full path, size.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ModelFile {
    pub rel: String,
    pub path: PathBuf,
    pub size: u64,
}

/// The model's own files under `root`, sorted by relative path: derived directories
/// ([`is_derived_dir`]), `*.part` files and the download's in-progress marker are skipped.
pub fn model_files(root: &Path) -> std::io::Result<Vec<ModelFile>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<ModelFile>) -> std::io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().to_string();
            let t = e.file_type()?;
            if t.is_dir() {
                if !is_derived_dir(&name) {
                    walk(root, &e.path(), out)?;
                }
                continue;
            }
            if !t.is_file() || name.ends_with(".part") || name == IN_PROGRESS_FILE {
                continue;
            }
            // The writer lock of a derived directory beside the model's files (`abliterated.<gen>.lock`).
            if name
                .strip_prefix('.')
                .and_then(|n| n.strip_suffix(flexinfer_fsutil::LOCK_SUFFIX))
                .is_some_and(is_derived_dir)
            {
                continue;
            }
            let rel = e
                .path()
                .strip_prefix(root)
                .map_err(std::io::Error::other)?
                .to_string_lossy()
                .replace('\\', "/");
            out.push(ModelFile {
                rel,
                path: e.path(),
                size: e.metadata()?.len(),
            });
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, root, &mut out)?;
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexinfer_fsutil::write_atomic;

    #[test]
    fn model_files_skip_derived_and_partial() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "config.json",
            "sub/model.safetensors",
            "x.part",
            "abliterated/model.safetensors",
            "abliterated.partial/a",
            ".gptq-w4-g128.partial/a",
            "gptq-w4-g128/model.safetensors",
            ".flexinfer-gptq-cache/checkpoint.json",
            ".datasets/d/train.jsonl",
            "source.0a1b2c3d-20261201000000/config.json",
        ] {
            let p = d.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"x").unwrap();
        }
        let rels: Vec<String> = model_files(d.path())
            .unwrap()
            .into_iter()
            .map(|f| f.rel)
            .collect();
        assert_eq!(rels, ["config.json", "sub/model.safetensors"]);
    }

    #[test]
    fn atomic_write_replaces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x/y.json");
        write_atomic(&p, b"1").unwrap();
        write_atomic(&p, b"2").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"2");
    }
}
