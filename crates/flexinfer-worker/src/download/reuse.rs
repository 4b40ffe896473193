//! A new download generation starts from what earlier complete downloads of the same cache hold: a
//! file whose published digest (or name and size, for files the source publishes no sha256 of) matches
//! one recorded in an earlier `.source-integrity.json` is hard-linked into the new generation. The link
//! is only a candidate: `fetch::fetch_file` re-hashes it on disk like any finished file and fetches it
//! again when it does not verify (removing the link, never writing into the shared inode).

use std::path::{Path, PathBuf};

use flexinfer_contract::{self as contract, files, SourceIntegrity};

use super::RemoteFile;

/// What [`link_from_earlier`] linked.
#[derive(Debug, Default, PartialEq)]
pub struct Linked {
    pub files: u64,
    pub bytes: u64,
    /// The directories the links came from (names only).
    pub from: Vec<String>,
}

/// Earlier complete downloads under `model_dir` other than `dir`: its download generations
/// (`source.<generation>`) and `model_dir` itself (a download made before generations existed).
fn earlier_downloads(dir: &Path, model_dir: &Path) -> Vec<(PathBuf, SourceIntegrity)> {
    let mut dirs = vec![model_dir.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(model_dir) {
        let mut gens: Vec<PathBuf> = rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter(|e| {
                files::is_generation_of(&e.file_name().to_string_lossy(), contract::SOURCE_SUBDIR)
            })
            .map(|e| e.path())
            .collect();
        // Newest generation first (the names sort by time).
        gens.sort();
        gens.reverse();
        dirs.extend(gens);
    }
    dirs.into_iter()
        .filter(|d| d != dir)
        .filter(|d| super::state::is_complete(d))
        .filter_map(|d| super::state::read_previous(&d).map(|i| (d, i)))
        .collect()
}

/// Hard-links into `dir` every listed file that is not there yet and that an earlier complete download
/// recorded with the same digest and size. Links that cannot be made (another filesystem, a missing
/// file) are skipped: the file is fetched.
pub fn link_from_earlier(dir: &Path, model_dir: &Path, remote: &[RemoteFile]) -> Linked {
    let earlier = earlier_downloads(dir, model_dir);
    let mut out = Linked::default();
    if earlier.is_empty() {
        return out;
    }
    for f in remote {
        let dest = dir.join(&f.path);
        if std::fs::symlink_metadata(&dest).is_ok() {
            continue;
        }
        let found = earlier.iter().find_map(|(d, integrity)| {
            integrity
                .files
                .iter()
                .find(|p| {
                    p.size == f.size
                        && match (&f.sha256, &f.git_sha1) {
                            (Some(want), _) => p.sha256 == *want,
                            // Re-checked against the git blob id by `fetch_file`.
                            (None, Some(_)) => p.name == f.path,
                            // Nothing to verify a link against: fetch it.
                            (None, None) => false,
                        }
                })
                .filter(|p| contract::check_relative_path(&p.name).is_ok())
                .map(|p| (d, d.join(&p.name)))
        });
        let Some((from_dir, src)) = found else {
            continue;
        };
        // Only a regular file inside the earlier generation (no symlink out of it).
        let regular =
            std::fs::symlink_metadata(&src).is_ok_and(|m| m.is_file() && m.len() == f.size);
        if !regular {
            continue;
        }
        if let Some(parent) = dest.parent() {
            if std::fs::create_dir_all(parent).is_err() {
                continue;
            }
        }
        if std::fs::hard_link(&src, &dest).is_ok() {
            out.files = out.files.saturating_add(1);
            out.bytes = out.bytes.saturating_add(f.size);
            let name = from_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if !out.from.contains(&name) {
                out.from.push(name);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexinfer_contract::IntegrityFile;

    fn remote(path: &str, body: &[u8], sha: bool) -> RemoteFile {
        use sha2::Digest;
        RemoteFile {
            path: path.into(),
            url: String::new(),
            size: body.len() as u64,
            sha256: sha.then(|| hex::encode(sha2::Sha256::digest(body))),
            git_sha1: None,
        }
    }

    fn complete(dir: &Path, files: &[(&str, &[u8])]) {
        use sha2::Digest;
        let mut recs = Vec::new();
        for (n, b) in files {
            let p = dir.join(n);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b).unwrap();
            recs.push(IntegrityFile {
                name: n.to_string(),
                size: b.len() as u64,
                sha256: hex::encode(sha2::Sha256::digest(b)),
            });
        }
        let i = SourceIntegrity {
            files: recs,
            ..Default::default()
        };
        super::super::state::write_markers(dir, &i).unwrap();
    }

    #[test]
    fn links_only_matching_files_of_complete_downloads() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        let old = root.join("source.0a1b2c3d-20261201000000");
        let partial = root.join("source.0a1b2c3e-20261201000001");
        let new = root.join("source.0a1b2c3f-20261201000002");
        complete(
            &old,
            &[("w.safetensors", b"weights-v1"), ("config.json", b"{}")],
        );
        // An incomplete generation is never a source of links.
        std::fs::create_dir_all(&partial).unwrap();
        std::fs::write(partial.join("tok.json"), b"tok").unwrap();
        std::fs::create_dir_all(&new).unwrap();
        let listed = vec![
            // Same digest under another name: linked.
            remote("model/w.safetensors", b"weights-v1", true),
            // Changed content: fetched.
            remote("config.json", b"{\"v\":2}", true),
            // No published digest at all: never linked, whatever the name.
            remote("config.json.bak", b"{}", false),
            remote("tok.json", b"tok", true),
        ];
        let l = link_from_earlier(&new, root, &listed);
        assert_eq!(l.files, 1, "{l:?}");
        assert_eq!(l.from, vec!["source.0a1b2c3d-20261201000000".to_string()]);
        let a = std::fs::metadata(old.join("w.safetensors")).unwrap();
        let b = std::fs::metadata(new.join("model/w.safetensors")).unwrap();
        assert_eq!(a.ino(), b.ino(), "a hard link, not a copy");
        assert!(!new.join("config.json").exists());
        assert!(!new.join("tok.json").exists());
        // Nothing is linked twice or over an existing file.
        assert_eq!(link_from_earlier(&new, root, &listed).files, 0);
    }

    #[test]
    fn a_legacy_root_download_is_a_source_of_links() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        complete(root, &[("w.safetensors", b"weights")]);
        let new = root.join("source.0a1b2c3d-20261201000000");
        std::fs::create_dir_all(&new).unwrap();
        let l = link_from_earlier(&new, root, &[remote("w.safetensors", b"weights", true)]);
        assert_eq!(l.files, 1);
        assert_eq!(
            std::fs::read(new.join("w.safetensors")).unwrap(),
            b"weights"
        );
    }
}
