//! Markers of a download, the "is it still valid" check, the reset of derived artifacts when the
//! source changes, and the free-space check.

use std::path::Path;

use flexinfer_contract::{self as contract, files, SourceIntegrity};

use super::fetch::git_blob_sha1;
use super::RemoteFile;
use crate::common::{write_atomic, DownloadError, Events, ExitKind, WorkerError};

pub use crate::common::IN_PROGRESS_FILE as IN_PROGRESS;

#[derive(serde::Serialize, serde::Deserialize)]
struct InProgress {
    source: String,
    revision: String,
    /// Files the interrupted run was fetching (removed if the next run's source lacks them).
    #[serde(default)]
    files: Vec<String>,
}

/// The previous `.source-integrity.json`, if readable.
pub fn read_previous(dir: &Path) -> Option<SourceIntegrity> {
    let text = std::fs::read_to_string(dir.join(files::SOURCE_INTEGRITY)).ok()?;
    serde_json::from_str(&text).ok()
}

pub fn is_complete(dir: &Path) -> bool {
    dir.join(files::DOWNLOAD_COMPLETE).is_file()
}

/// Same source and revision, the same files (names, sizes, published hashes), all on disk with
/// their sizes (git blob ids of small non-LFS files re-checked).
pub async fn still_valid(
    dir: &Path,
    prev: &SourceIntegrity,
    source: &str,
    revision: &str,
    remote: &[RemoteFile],
) -> bool {
    if prev.source != source || prev.revision != revision || !same_files(prev, remote) {
        return false;
    }
    for f in remote {
        let p = dir.join(&f.path);
        match std::fs::metadata(&p) {
            Ok(m) if m.is_file() && m.len() == f.size => {}
            _ => return false,
        }
        if let Some(want) = &f.git_sha1 {
            let p2 = p.clone();
            let got = tokio::task::spawn_blocking(move || git_blob_sha1(&p2)).await;
            if !matches!(got, Ok(Ok(g)) if g == *want) {
                return false;
            }
        }
    }
    true
}

/// The listing names the same files as the marker, with the same sizes and published hashes.
fn same_files(prev: &SourceIntegrity, remote: &[RemoteFile]) -> bool {
    prev.files.len() == remote.len()
        && remote.iter().all(|f| {
            prev.files.iter().any(|p| {
                p.name == f.path
                    && p.size == f.size
                    && f.sha256.as_ref().is_none_or(|s| *s == p.sha256)
            })
        })
}

/// Before fetching: if the source, revision or content changed since the last complete download,
/// remove derived artifacts (abliterated weights, GPTQ cache and outputs) and files the new
/// source no longer has; then remove the completion markers so nothing stale looks complete.
pub fn invalidate(
    dir: &Path,
    prev: Option<&SourceIntegrity>,
    source: &str,
    revision: &str,
    remote: &[RemoteFile],
    events: &Events,
) -> std::io::Result<()> {
    let now = InProgress {
        source: source.into(),
        revision: revision.into(),
        files: remote.iter().map(|f| f.path.clone()).collect(),
    };
    // A kill inside a marker's write leaves its temporary file; it is not part of the download.
    flexinfer_fsutil::remove_write_leftovers(dir)?;
    let in_progress: Option<InProgress> = std::fs::read_to_string(dir.join(IN_PROGRESS))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    if let Some(p) = in_progress.filter(|p| p.source != source || p.revision != revision) {
        events.log(&format!(
            "an interrupted download of {}@{} is replaced by {source}@{revision}; discarding its files",
            p.source, p.revision
        ));
        remove_part_files(dir)?;
        reset_derived(dir)?;
        for name in &p.files {
            if contract::check_relative_path(name).is_ok()
                && !remote.iter().any(|f| f.path == *name)
            {
                remove_if_exists(&dir.join(name))?;
            }
        }
    }
    if let Some(prev) = prev {
        let changed =
            prev.source != source || prev.revision != revision || !same_files(prev, remote);
        if changed {
            events.log(&format!(
                "source changed ({}@{} -> {source}@{revision}); resetting derived artifacts",
                prev.source, prev.revision
            ));
            reset_derived(dir)?;
            for old in &prev.files {
                if contract::check_relative_path(&old.name).is_ok()
                    && !remote.iter().any(|f| f.path == old.name)
                {
                    remove_if_exists(&dir.join(&old.name))?;
                }
            }
        }
    }
    remove_if_exists(&dir.join(files::DOWNLOAD_COMPLETE))?;
    remove_if_exists(&dir.join(files::SOURCE_INTEGRITY))?;
    let body = serde_json::to_vec(&now).map_err(std::io::Error::other)?;
    write_atomic(&dir.join(IN_PROGRESS), &body)
}

/// Remove the caches later phases keep next to the downloaded weights (the GPTQ layer cache, the
/// abliteration status). Their outputs (`abliterated.<generation>`, `gptq-….<generation>`) stay: a Model
/// may serve one while the new revision downloads, and the controller's garbage collection removes them
/// once a newer generation is promoted.
pub fn reset_derived(dir: &Path) -> std::io::Result<()> {
    remove_if_exists(&dir.join(files::GPTQ_CACHE_DIR))?;
    remove_if_exists(&dir.join(files::ABLITERATION_STATUS))?;
    Ok(())
}

/// Removes a file or directory tree; whether there was one.
fn remove_if_exists(p: &Path) -> std::io::Result<bool> {
    let meta = match std::fs::symlink_metadata(p) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if meta.is_dir() {
        std::fs::remove_dir_all(p)?;
    } else {
        std::fs::remove_file(p)?;
    }
    Ok(true)
}

fn remove_part_files(dir: &Path) -> std::io::Result<()> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(_) => return Ok(()),
    };
    for e in rd.flatten() {
        let t = e.file_type()?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if t.is_dir() && !name.starts_with('.') && !crate::common::is_derived_dir(&name) {
            remove_part_files(&e.path())?;
        } else if t.is_file() && name.ends_with(".part") {
            std::fs::remove_file(e.path())?;
        }
    }
    Ok(())
}

/// Bytes still to fetch: listed sizes minus what is already on disk (finished or partial).
pub fn bytes_needed(dir: &Path, remote: &[RemoteFile]) -> u64 {
    remote
        .iter()
        .map(|f| {
            let dest = dir.join(&f.path);
            let have = match std::fs::metadata(&dest) {
                Ok(m) if m.len() == f.size => f.size,
                _ => {
                    let mut part = dest.into_os_string();
                    part.push(".part");
                    std::fs::metadata(&part)
                        .map(|m| m.len().min(f.size))
                        .unwrap_or(0)
                }
            };
            f.size.saturating_sub(have)
        })
        .sum()
}

/// Free bytes for an unprivileged writer on the filesystem holding `dir`.
pub fn available_bytes(dir: &Path) -> std::io::Result<u64> {
    let st = rustix::fs::statvfs(dir)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The error when `needed` bytes do not fit in `available`.
pub fn space_error(dir: &Path, needed: u64, available: u64) -> Option<WorkerError> {
    (needed > available).then(|| {
        WorkerError::from(DownloadError::NoSpace {
            dir: dir.to_path_buf(),
            needed,
            available,
        })
    })
}

pub fn check_free_space(dir: &Path, remote: &[RemoteFile]) -> Result<(), WorkerError> {
    let needed = bytes_needed(dir, remote);
    let available = available_bytes(dir).map_err(WorkerError::io(
        ExitKind::Failure,
        format!("cannot stat {}", dir.display()),
    ))?;
    match space_error(dir, needed, available) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Removes the in-progress record; whether there was one.
pub fn drop_in_progress(dir: &Path) -> std::io::Result<bool> {
    remove_if_exists(&dir.join(IN_PROGRESS))
}

/// `.source-integrity.json` then `.download_complete`, both atomic; then drop the in-progress record.
pub fn write_markers(dir: &Path, integrity: &SourceIntegrity) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(integrity).map_err(std::io::Error::other)?;
    write_atomic(&dir.join(files::SOURCE_INTEGRITY), &body)?;
    let done = serde_json::json!({
        "completedAt": crate::common::now_rfc3339(),
        "source": integrity.source,
        "revision": integrity.revision,
        "files": integrity.files.len(),
    });
    write_atomic(
        &dir.join(files::DOWNLOAD_COMPLETE),
        done.to_string().as_bytes(),
    )?;
    drop_in_progress(dir).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_error_names_both_numbers() {
        let e = space_error(Path::new("/cache/m"), 3 << 30, 1 << 30).unwrap();
        let m = flexinfer_contract::error::chain(&e);
        assert!(m.contains("need 3221225472 bytes"), "{m}");
        assert!(m.contains("1073741824 bytes (1.00 GiB) available"), "{m}");
        assert!(space_error(Path::new("/x"), 1, 2).is_none());
        let d = tempfile::tempdir().unwrap();
        assert!(available_bytes(d.path()).unwrap() > 0);
    }

    #[test]
    fn invalidate_removes_what_a_kill_inside_a_marker_write_left() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::write(p.join("config.json"), "{}").unwrap();
        // A kill between a marker's temporary file and its rename leaves this behind.
        let (_, left) = flexinfer_fsutil::temp_file_in(p).unwrap().keep().unwrap();
        let remote = [RemoteFile {
            path: "config.json".into(),
            size: 2,
            sha256: None,
            url: String::new(),
            git_sha1: None,
        }];
        let events = Events::new("download");
        invalidate(p, None, "hf://a/b", "main", &remote, &events).unwrap();
        assert!(!left.exists(), "{} is left", left.display());
        assert!(p.join("config.json").is_file());
        assert!(p.join(IN_PROGRESS).is_file());
    }

    #[test]
    fn reset_removes_only_derived() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        for sub in [
            "abliterated",
            ".flexinfer-gptq-cache/layers",
            "gptq-w4-g128",
            "keep",
        ] {
            std::fs::create_dir_all(p.join(sub)).unwrap();
        }
        std::fs::write(p.join(".abliteration-status.json"), "{}").unwrap();
        std::fs::write(p.join("model.safetensors"), "w").unwrap();
        reset_derived(p).unwrap();
        // Outputs a Model may be serving survive a new revision's download.
        assert!(p.join("abliterated").exists());
        assert!(p.join("gptq-w4-g128").exists());
        assert!(!p.join(".flexinfer-gptq-cache").exists());
        assert!(!p.join(".abliteration-status.json").exists());
        assert!(p.join("keep").exists());
        assert!(p.join("model.safetensors").exists());
    }
}
