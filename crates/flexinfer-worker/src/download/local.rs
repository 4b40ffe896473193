//! `local://path` sources: confined to `FLEXINFER_LOCAL_SOURCE_ROOT`; copied into `MODEL_DIR`, or
//! verified in place when the source is `MODEL_DIR` itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flexinfer_contract::{files, TerminationSuccess};

use super::{fetch_all, is_marker, new_ctx, select, DownloadArgs, PatternFilter, RemoteFile};
use crate::common::{DownloadError, Events, ExitKind, WorkerError};

pub async fn run(
    args: &DownloadArgs,
    out: &Path,
    events: &Arc<Events>,
    path: &str,
) -> Result<TerminationSuccess, WorkerError> {
    let root = args
        .local_source_root
        .as_ref()
        .ok_or(DownloadError::NoLocalRoot)?;
    let root = std::fs::canonicalize(root).map_err(WorkerError::io(
        ExitKind::BadInput,
        format!("local source root {} is not usable", root.display()),
    ))?;
    let candidate = if Path::new(path).is_absolute() {
        PathBuf::from(path)
    } else {
        root.join(path)
    };
    let src = std::fs::canonicalize(&candidate).map_err(WorkerError::io(
        ExitKind::BadInput,
        format!("local source {path:?} is not readable"),
    ))?;
    if !src.starts_with(&root) {
        return Err(DownloadError::LocalOutsideRoot {
            path: path.into(),
            root,
        }
        .into());
    }
    if !src.is_dir() {
        return Err(DownloadError::LocalNotADirectory { path: path.into() }.into());
    }
    let filter = PatternFilter::new(&args.allow_patterns, &args.ignore_patterns)?;
    let src2 = src.clone();
    let listed = tokio::task::spawn_blocking(move || list_and_hash(&src2))
        .await?
        .map_err(WorkerError::io(
            ExitKind::Failure,
            format!("reading local source {}", src.display()),
        ))?;
    let files = select(listed, &filter)?;
    let ctx = new_ctx(super::http_client(false)?, None, args.transfer.retries);
    let revision = "local".to_string();
    fetch_all(
        args,
        out,
        events,
        &ctx,
        &format!("local://{path}"),
        &revision,
        files,
    )
    .await
}

/// Every regular file under `src` (skipping our markers, partial files and derived artifacts),
/// with its sha256 and a `file://` URL.
fn list_and_hash(src: &Path) -> std::io::Result<Vec<RemoteFile>> {
    let mut out = Vec::new();
    for f in crate::common::model_files(src)? {
        if is_marker(&f.rel) || f.rel == files::ABLITERATION_STATUS {
            continue;
        }
        let sha = flexinfer_fsutil::sha256_file(&f.path)?;
        out.push(RemoteFile {
            url: format!("file://{}", f.path.display()),
            path: f.rel,
            size: f.size,
            sha256: Some(sha),
            git_sha1: None,
        });
    }
    Ok(out)
}
