//! One download generation: nothing to do when the earlier download in the directory is complete and
//! still matches; otherwise the files earlier downloads hold are linked, the rest fetched and every file
//! verified, and the markers written last.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use flexinfer_contract::{self as contract, IntegrityFile, SourceIntegrity, TerminationSuccess};
use futures::{StreamExt, TryStreamExt};

use super::fetch::{self, FetchCtx, FetchError};
use super::{
    bytes_progress, fetch_error, is_weight_file, reuse, spawn_progress_ticker, state, DownloadArgs,
    RemoteFile,
};
use crate::common::{Events, ExitKind, WorkerError};

/// Downloads the listed `files` of `source@revision` into the generation `dir` (nothing to do when
/// it already holds them, complete and verified) and reports it as the job's success.
pub(super) async fn fetch_all(
    args: &DownloadArgs,
    dir: &Path,
    events: &Arc<Events>,
    ctx: &FetchCtx,
    source: &str,
    revision: &str,
    files: Vec<RemoteFile>,
) -> Result<TerminationSuccess, WorkerError> {
    let total: u64 = files.iter().map(|f| f.size).sum();
    let prev = state::read_previous(dir);
    let prev = prev.as_ref();
    if let Some(done) = already_complete(dir, prev, source, revision, &files, events, total).await {
        return Ok(done);
    }
    state::invalidate(dir, prev, source, revision, &files, events).map_err(WorkerError::io(
        ExitKind::Failure,
        format!("cannot reset {}", dir.display()),
    ))?;
    link_earlier(args, dir, events, &files);
    state::check_free_space(dir, &files)?;
    events.log(&format!(
        "downloading {} file(s), {} bytes from {source}@{revision} into {}",
        files.len(),
        total,
        dir.display()
    ));
    let started = Instant::now();
    let integrity_files = fetch_verified(args, dir, events, ctx, &files, total).await?;
    let secs = started.elapsed().as_secs_f64();
    let received = ctx.received.load(Ordering::Relaxed);
    let rate = received as f64 / secs.max(1e-3);
    events.progress(bytes_progress(total, total, rate, "verified"));
    let integrity = record(dir, source, revision, integrity_files)?;
    events.log(&format!(
        "downloaded {received} bytes in {secs:.1}s ({:.1} MiB/s); {} file(s) verified",
        rate / 1048576.0,
        integrity.files.len()
    ));
    Ok(success(&integrity, dir))
}

/// The earlier download in `dir` when it is complete and still matches `source@revision` and
/// `files` (then there is nothing to fetch, which is logged); `None` otherwise.
async fn already_complete(
    dir: &Path,
    prev: Option<&SourceIntegrity>,
    source: &str,
    revision: &str,
    files: &[RemoteFile],
    events: &Events,
    total: u64,
) -> Option<TerminationSuccess> {
    let p = prev?;
    if !(state::is_complete(dir) && state::still_valid(dir, p, source, revision, files).await) {
        return None;
    }
    // A kill after the completion marker and before the in-progress record's removal leaves both: finish
    // that step (a complete download has no in-progress record).
    match state::drop_in_progress(dir) {
        Ok(true) => events.log("removed the in-progress record a finished download left behind"),
        Ok(false) => {}
        Err(e) => {
            events.log(&format!(
                "could not remove the in-progress record a finished download left behind ({e}); downloading again"
            ));
            return None;
        }
    }
    events.log(&format!(
        "{source}@{revision} is already downloaded and verified; nothing to do"
    ));
    events.progress(bytes_progress(total, total, 0.0, "already complete"));
    Some(success(p, dir))
}

/// A new generation starts from the files earlier complete downloads already hold: they are
/// hard-linked (and logged), and each is re-verified before it counts.
fn link_earlier(args: &DownloadArgs, dir: &Path, events: &Events, files: &[RemoteFile]) {
    let linked = reuse::link_from_earlier(dir, &args.model_dir, files);
    if linked.files > 0 {
        events.log(&format!(
            "{} file(s), {} bytes, hard-linked from {}; each is re-verified before it counts",
            linked.files,
            linked.bytes,
            linked.from.join(", ")
        ));
    }
}

/// Fetches and verifies `files` into `dir`, `args.transfer.concurrency` at a time, with progress events
/// while it runs: their integrity records sorted by name, their directories synced; the first
/// failure is the error.
async fn fetch_verified(
    args: &DownloadArgs,
    dir: &Path,
    events: &Arc<Events>,
    ctx: &FetchCtx,
    files: &[RemoteFile],
    total: u64,
) -> Result<Vec<IntegrityFile>, WorkerError> {
    let ticker = spawn_ticker(events.clone(), ctx, total, args.transfer.progress_interval);
    let results: Result<Vec<IntegrityFile>, FetchError> = futures::stream::iter(files.iter())
        .map(|f| fetch::fetch_file(ctx, dir, f))
        .buffer_unordered(args.transfer.concurrency)
        .try_collect()
        .await;
    ticker.abort();
    let mut integrity_files = results.map_err(fetch_error)?;
    integrity_files.sort_by(|a, b| a.name.cmp(&b.name));
    sync_parents(dir, &integrity_files)?;
    Ok(integrity_files)
}

/// Records the verified `files` of `source@revision` (with their weight bytes) in `dir`'s markers,
/// written last: from then on the download counts as complete.
fn record(
    dir: &Path,
    source: &str,
    revision: &str,
    files: Vec<IntegrityFile>,
) -> Result<SourceIntegrity, WorkerError> {
    let integrity = SourceIntegrity {
        weight_bytes: files
            .iter()
            .filter(|f| is_weight_file(&f.name))
            .map(|f| f.size)
            .sum(),
        files,
        revision: revision.to_string(),
        source: source.to_string(),
    };
    state::write_markers(dir, &integrity).map_err(WorkerError::io(
        ExitKind::Failure,
        format!("cannot write markers in {}", dir.display()),
    ))?;
    Ok(integrity)
}

fn success(i: &SourceIntegrity, dir: &Path) -> TerminationSuccess {
    TerminationSuccess {
        kind: contract::JobPhase::Download.as_str().to_string(),
        size_bytes: Some(i.files.iter().map(|f| f.size).sum()),
        file_count: Some(i.files.len() as u64),
        revision: Some(i.revision.clone()),
        output_dir: Some(dir.display().to_string()),
        ..Default::default()
    }
}

fn spawn_ticker(
    events: Arc<Events>,
    ctx: &FetchCtx,
    total: u64,
    interval: f64,
) -> tokio::task::JoinHandle<()> {
    let done = ctx.done.clone();
    let received = ctx.received.clone();
    spawn_progress_ticker(events, interval, move |secs| {
        let rate = received.load(Ordering::Relaxed) as f64 / secs;
        let d = done.load(Ordering::Relaxed).min(total);
        bytes_progress(d, total, rate, "downloading")
    })
}

/// The `.part` → final renames are durable only once their directories are: fsync each directory that
/// received a file.
fn sync_parents(dir: &Path, files: &[IntegrityFile]) -> Result<(), WorkerError> {
    let mut parents: Vec<PathBuf> = files
        .iter()
        .filter_map(|f| dir.join(&f.name).parent().map(Path::to_path_buf))
        .collect();
    parents.sort();
    parents.dedup();
    for p in parents {
        flexinfer_fsutil::fsync_dir(&p).map_err(WorkerError::io(
            ExitKind::Failure,
            format!("cannot sync {}", p.display()),
        ))?;
    }
    Ok(())
}
