//! Verification of a transferred file: its bytes on disk against the received stream, then against
//! what the source promised (LFS sha256, else git's blob sha1).

use std::path::Path;

use super::{blocking, io_err, FetchError, VerifyError};
use crate::download::RemoteFile;

/// The sha256 of `part` as it is on disk, once it equals the hash of the received stream; otherwise the
/// mismatch (another writer, or the disk, changed the file) as `Ok(Err(..))`.
pub(super) async fn on_disk_sha256(
    file: &str,
    part: &Path,
    streamed: &str,
) -> Result<Result<String, VerifyError>, FetchError> {
    let p = part.to_path_buf();
    let on_disk = blocking(move || flexinfer_fsutil::sha256_file(&p))
        .await
        .map_err(|e| io_err("re-hashing", part, e))?;
    if on_disk == streamed {
        Ok(Ok(on_disk))
    } else {
        Ok(Err(VerifyError::ChangedOnDisk {
            file: file.to_string(),
            on_disk,
            streamed: streamed.to_string(),
        }))
    }
}

/// Check a file against what the source promised: LFS sha256, else the git blob sha1.
pub(super) async fn verify(f: &RemoteFile, path: &Path, sha256: &str) -> Result<(), VerifyError> {
    if let Some(want) = &f.sha256 {
        if want != sha256 {
            return Err(VerifyError::Sha256 {
                file: f.path.clone(),
                want: want.clone(),
                got: sha256.to_string(),
            });
        }
        return Ok(());
    }
    if let Some(want) = &f.git_sha1 {
        let p = path.to_path_buf();
        let got = blocking(move || git_blob_sha1(&p))
            .await
            .map_err(|source| VerifyError::Hashing {
                file: f.path.clone(),
                source,
            })?;
        if *want != got {
            return Err(VerifyError::GitSha1 {
                file: f.path.clone(),
                want: want.clone(),
                got,
            });
        }
    }
    Ok(())
}

/// Git's object id of a file: sha1 over `blob <len>\0<content>`.
pub fn git_blob_sha1(path: &Path) -> std::io::Result<String> {
    use sha1::Digest as _;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {len}\0").as_bytes());
    flexinfer_fsutil::hash_reader(f, &mut h, 1 << 16, |_| Ok(()))?;
    Ok(hex::encode(h.finalize()))
}
