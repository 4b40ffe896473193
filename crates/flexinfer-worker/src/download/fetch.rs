//! One file over HTTP: Range resume from `<name>.part`, sha256 while streaming, retries with
//! backoff on 5xx and dropped connections, rename into place only after verification.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flexinfer_contract::IntegrityFile;
use futures::StreamExt;
use reqwest::StatusCode;
use sha2::{Digest, Sha256};
use tokio::io::AsyncSeekExt;

use super::RemoteFile;
use crate::common::Retry;
use crate::http::ScopedAuth;

/// The flags as `Debug` shows them: the hub token redacted (the registry flags redact their own).
impl std::fmt::Debug for super::DownloadArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownloadArgs")
            .field("source", &self.source)
            .field("revision", &self.revision)
            .field("repo_type", &self.repo_type)
            .field("allow_patterns", &self.allow_patterns)
            .field("ignore_patterns", &self.ignore_patterns)
            .field("model_dir", &self.model_dir)
            .field("out_dir", &self.out_dir)
            .field("hf_endpoint", &self.hf_endpoint)
            .field("hf_token", &self.hf_token.as_ref().map(|_| "<redacted>"))
            .field("dataset", &self.dataset)
            .field("refusal_dataset", &self.refusal_dataset)
            .field("harmless_dataset", &self.harmless_dataset)
            .field("local_source_root", &self.local_source_root)
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

/// Why a transfer failed. Each failure is of one class ([`FetchError::is_fatal`],
/// [`FetchError::is_retryable`]): fatal ones (401/403/404, unsafe names) will not get better by
/// retrying and exit 2; transient ones (5xx, 429, a dropped connection) are retried with backoff;
/// the rest (verification failed, retries exhausted, the disk) exit 1.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// An HTTP error status; fatal unless [`status_is_retryable`].
    #[error("{}", status_message(.what, *.status, *.has_token))]
    Status {
        what: String,
        status: StatusCode,
        has_token: bool,
    },
    /// The request was not answered.
    #[error("{file}: request failed: {source}")]
    Request {
        file: String,
        #[source]
        source: Transport,
    },
    #[error("{file}: server answered a different range; restarting the file")]
    WrongRange { file: String },
    #[error("{file}: range not satisfiable; restarting")]
    RangeNotSatisfiable { file: String },
    #[error("{file}: connection dropped at byte {at} of {size}: {source}")]
    Dropped {
        file: String,
        at: u64,
        size: u64,
        #[source]
        source: Transport,
    },
    #[error("{file}: server sent more than the listed {size} bytes")]
    TooLong { file: String, size: u64 },
    #[error("{file}: connection closed at byte {at} of {size}")]
    Closed { file: String, at: u64, size: u64 },
    /// A hub listing page that was not answered.
    #[error("listing {what}: {source}")]
    Listing {
        what: String,
        #[source]
        source: reqwest::Error,
    },
    /// A hub listing page that could not be read or parsed.
    #[error("listing {what}: bad response body: {source}")]
    ListingBody {
        what: String,
        #[source]
        source: BadBody,
    },
    /// A body over its limit: the server (or its data) is bad.
    #[error(transparent)]
    TooLarge(crate::http::BodyError),
    /// The hub listed a name that would leave the download directory.
    #[error("hub listed an unsafe file name: {0}")]
    UnsafeName(#[source] flexinfer_contract::PathError),
    /// The local file system.
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The blocking writer task did not finish.
    #[error(transparent)]
    Writer(#[from] tokio::task::JoinError),
    /// The file failed verification twice.
    #[error("{0}; the partial file was removed")]
    Verify(#[source] VerifyError),
    /// Transient failures in a row until the retries ran out.
    #[error("{file}: giving up after {attempts} attempts: {last}")]
    GaveUp {
        file: String,
        attempts: u32,
        #[source]
        last: Box<FetchError>,
    },
}

impl FetchError {
    /// Will not get better by retrying (exit 2).
    pub fn is_fatal(&self) -> bool {
        match self {
            FetchError::Status { status, .. } => !status_is_retryable(*status),
            FetchError::TooLarge(_) | FetchError::UnsafeName(_) => true,
            _ => false,
        }
    }

    /// Transient: retried with backoff.
    pub fn is_retryable(&self) -> bool {
        match self {
            FetchError::Status { status, .. } => status_is_retryable(*status),
            FetchError::Request { .. }
            | FetchError::WrongRange { .. }
            | FetchError::RangeNotSatisfiable { .. }
            | FetchError::Dropped { .. }
            | FetchError::TooLong { .. }
            | FetchError::Closed { .. }
            | FetchError::Listing { .. }
            | FetchError::ListingBody { .. } => true,
            _ => false,
        }
    }
}

/// A transport error of reqwest shown without its URL (which may carry a signed query), its causes
/// inline ([`strip_url`]).
#[derive(Debug)]
pub struct Transport(pub reqwest::Error);

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&strip_url(&self.0))
    }
}

impl std::error::Error for Transport {}

/// Why a hub listing page was unusable.
#[derive(Debug, thiserror::Error)]
pub enum BadBody {
    #[error(transparent)]
    Read(crate::http::BodyError),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// 5xx, 429 and 408 are transient; other error statuses are not.
pub fn status_is_retryable(s: StatusCode) -> bool {
    s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS || s == StatusCode::REQUEST_TIMEOUT
}

/// A clear error for an HTTP status; never contains credentials.
pub fn http_error(what: &str, s: StatusCode, has_token: bool) -> FetchError {
    FetchError::Status {
        what: what.to_string(),
        status: s,
        has_token,
    }
}

fn status_message(what: &str, s: StatusCode, has_token: bool) -> String {
    match s {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            let hint = if has_token {
                "the token was rejected or lacks access (gated repos need their terms accepted)"
            } else {
                "set HF_TOKEN (secretRef) for private or gated repositories"
            };
            format!("access denied to {what} (HTTP {}): {hint}", s.as_u16())
        }
        StatusCode::NOT_FOUND => {
            format!("{what} not found (HTTP 404): check the repository id, repo type and revision")
        }
        _ => format!("{what}: HTTP {}", s.as_u16()),
    }
}

/// Shared state of one download run.
pub struct FetchCtx {
    pub client: reqwest::Client,
    /// The `Authorization` header and the one origin it goes to (the hub endpoint or the
    /// registry): file URLs elsewhere, and redirects to other hosts, get none (never logged).
    pub authorization: Option<ScopedAuth>,
    /// Bytes present on disk for the files of this run (progress).
    pub done: Arc<AtomicU64>,
    /// Consecutive failed attempts without progress before giving up.
    pub max_retries: u32,
    /// Bytes actually received over the network in this run.
    pub received: Arc<AtomicU64>,
}

fn part_path(dest: &Path) -> PathBuf {
    let mut name = dest
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".part");
    dest.with_file_name(name)
}

/// Hash the first `len` bytes of a file; returns the hasher and the bytes read.
fn sha256_prefix(path: &Path, len: u64) -> std::io::Result<(Sha256, u64)> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let n_total = flexinfer_fsutil::hash_reader(f.take(len), &mut h, 1 << 20, |_| Ok(()))?;
    Ok((h, n_total))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?
}

fn io_err(what: &'static str, p: &Path, e: std::io::Error) -> FetchError {
    FetchError::Io {
        what,
        path: p.to_path_buf(),
        source: e,
    }
}

/// Fetch `f` into `dir/f.path`, resuming from its `.part` file. Returns its integrity record.
pub async fn fetch_file(
    ctx: &FetchCtx,
    dir: &Path,
    f: &RemoteFile,
) -> Result<IntegrityFile, FetchError> {
    let dest = dir.join(&f.path);
    let part = part_path(&dest);
    if let Some(parent) = dest.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| io_err("creating", parent, e))?;
    }
    // A finished file from an earlier run: verify it instead of fetching it again.
    if let Ok(meta) = tokio::fs::metadata(&dest).await {
        if meta.is_file() && meta.len() == f.size {
            let p = dest.clone();
            let sha = blocking(move || flexinfer_fsutil::sha256_file(&p))
                .await
                .map_err(|e| io_err("hashing", &dest, e))?;
            if verify(f, &dest, &sha).await.is_ok() {
                ctx.done.fetch_add(f.size, Ordering::Relaxed);
                return Ok(IntegrityFile {
                    name: f.path.clone(),
                    size: f.size,
                    sha256: sha,
                });
            }
        }
        tokio::fs::remove_file(&dest)
            .await
            .map_err(|e| io_err("removing stale", &dest, e))?;
    }
    let mut counted = 0u64; // bytes of this file included in ctx.done
    let mut retry = Retry::new(
        Duration::from_millis(500),
        Duration::from_secs(30),
        ctx.max_retries as usize,
    );
    let mut verify_failures = 0u32;
    loop {
        let before = counted;
        let res = download_once(ctx, f, &part, &mut counted).await;
        match res {
            Ok(streamed) => {
                // What counts is what is on disk, not what went through the stream: re-read it.
                let checked = match on_disk_sha256(&f.path, &part, &streamed).await? {
                    Ok(sha) => verify(f, &part, &sha).await.map(|()| sha),
                    Err(why) => Err(why),
                };
                let sha = match checked {
                    Ok(sha) => sha,
                    Err(why) => {
                        let _ = tokio::fs::remove_file(&part).await;
                        ctx.done.fetch_sub(counted, Ordering::Relaxed);
                        counted = 0;
                        verify_failures = verify_failures.saturating_add(1);
                        let err = FetchError::Verify(why);
                        tracing::warn!(file = %f.path, "verification failed");
                        eprintln!("{err}");
                        if verify_failures >= 2 {
                            return Err(err);
                        }
                        continue;
                    }
                };
                tokio::fs::rename(&part, &dest)
                    .await
                    .map_err(|e| io_err("renaming", &part, e))?;
                return Ok(IntegrityFile {
                    name: f.path.clone(),
                    size: f.size,
                    sha256: sha,
                });
            }
            Err(msg) if msg.is_retryable() => {
                // Only failures in a row without progress count against the file.
                if counted > before {
                    retry.reset();
                }
                let Some(delay) = retry.next_delay() else {
                    return Err(FetchError::GaveUp {
                        file: f.path.clone(),
                        attempts: retry.attempt().saturating_add(1),
                        last: Box::new(msg),
                    });
                };
                let attempt = retry.attempt();
                tracing::warn!(file = %f.path, attempt, error = %msg, "retrying");
                eprintln!(
                    "retrying {} in {delay:.1?} (attempt {attempt}): {msg}",
                    f.path
                );
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A downloaded file that is not what the source promised (the partial file is removed and the
/// download retried once).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Another writer, or the disk, changed the file while it was written.
    #[error("{file}: the bytes on disk differ from the bytes received (sha256 {on_disk} on disk, {streamed} received)")]
    ChangedOnDisk {
        file: String,
        on_disk: String,
        streamed: String,
    },
    #[error("sha256 mismatch for {file}: expected {want}, got {got}")]
    Sha256 {
        file: String,
        want: String,
        got: String,
    },
    #[error("git blob sha1 mismatch for {file}: expected {want}, got {got}")]
    GitSha1 {
        file: String,
        want: String,
        got: String,
    },
    #[error("hashing {file}: {source}")]
    Hashing {
        file: String,
        #[source]
        source: std::io::Error,
    },
}

/// The sha256 of `part` as it is on disk, once it equals the hash of the received stream; otherwise the
/// mismatch (another writer, or the disk, changed the file) as `Ok(Err(..))`.
async fn on_disk_sha256(
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
async fn verify(f: &RemoteFile, path: &Path, sha256: &str) -> Result<(), VerifyError> {
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

async fn download_once(
    ctx: &FetchCtx,
    f: &RemoteFile,
    part: &Path,
    counted: &mut u64,
) -> Result<String, FetchError> {
    if let Some(src) = f.url.strip_prefix("file://") {
        return copy_local(ctx, Path::new(src), part, counted).await;
    }
    let mut have = match tokio::fs::metadata(part).await {
        Ok(m) => m.len(),
        Err(_) => 0,
    };
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(part)
        .await
        .map_err(|e| io_err("opening", part, e))?;
    if have > f.size {
        have = 0;
    }
    // Hash what is already on disk (resume).
    let (mut hasher, hashed) = if have > 0 {
        let p = part.to_path_buf();
        blocking(move || sha256_prefix(&p, have))
            .await
            .map_err(|e| io_err("hashing", part, e))?
    } else {
        (Sha256::new(), 0)
    };
    have = hashed;
    set_len(&mut file, part, have).await?;
    sync_counted(ctx, counted, have);
    if have == f.size && have > 0 {
        return Ok(hex::encode(hasher.finalize()));
    }
    let mut req = ctx.client.get(&f.url);
    // reqwest drops the header itself on a redirect to another scheme, host or port.
    if let Some(a) = ctx.authorization.as_ref().and_then(|a| a.for_url(&f.url)) {
        req = req.header(reqwest::header::AUTHORIZATION, a);
    }
    if have > 0 {
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let resp = req.send().await.map_err(|e| FetchError::Request {
        file: f.path.clone(),
        source: Transport(e),
    })?;
    let status = resp.status();
    match status {
        StatusCode::PARTIAL_CONTENT if have > 0 => {
            let start = resp
                .headers()
                .get(reqwest::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_content_range_start);
            if start != Some(have) {
                // Not the range we asked for: start over.
                set_len(&mut file, part, 0).await?;
                sync_counted(ctx, counted, 0);
                return Err(FetchError::WrongRange {
                    file: f.path.clone(),
                });
            }
        }
        s if s.is_success() => {
            if have > 0 {
                // The server ignored the Range header: take the whole body.
                have = 0;
                hasher = Sha256::new();
                set_len(&mut file, part, 0).await?;
                sync_counted(ctx, counted, 0);
            }
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            set_len(&mut file, part, 0).await?;
            sync_counted(ctx, counted, 0);
            return Err(FetchError::RangeNotSatisfiable {
                file: f.path.clone(),
            });
        }
        s => return Err(http_error(&f.path, s, ctx.authorization.is_some())),
    }
    // Receive on the runtime, hash and write on a blocking thread: the two overlap.
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(64);
    let std_file = file.into_std().await;
    let writer = tokio::task::spawn_blocking(move || write_chunks(std_file, hasher, rx));
    let mut stream = resp.bytes_stream();
    let mut pos = have;
    let mut failure = None;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                failure = Some(FetchError::Dropped {
                    file: f.path.clone(),
                    at: pos,
                    size: f.size,
                    source: Transport(e),
                });
                break;
            }
        };
        if pos.saturating_add(chunk.len() as u64) > f.size {
            failure = Some(FetchError::TooLong {
                file: f.path.clone(),
                size: f.size,
            });
            pos = 0;
            break;
        }
        // Bounded by the listed size (checked above).
        pos = pos.saturating_add(chunk.len() as u64);
        ctx.received
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        if tx.send(chunk).await.is_err() {
            break; // the writer failed; its error is reported below
        }
        sync_counted(ctx, counted, pos);
    }
    drop(tx);
    let written = writer
        .await
        .map_err(FetchError::Writer)
        .and_then(|r| r.map_err(|e| io_err("writing", part, e)));
    let hasher = match written {
        Ok(h) => h,
        Err(e) => {
            sync_counted(ctx, counted, 0);
            let _ = tokio::fs::remove_file(part).await;
            return Err(e);
        }
    };
    if let Some(e) = failure {
        if pos == 0 {
            let _ = tokio::fs::remove_file(part).await;
            sync_counted(ctx, counted, 0);
        }
        return Err(e);
    }
    if pos != f.size {
        return Err(FetchError::Closed {
            file: f.path.clone(),
            at: pos,
            size: f.size,
        });
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The blocking half of a transfer: hash and append every chunk, then flush and fsync.
fn write_chunks(
    file: std::fs::File,
    mut hasher: Sha256,
    mut rx: tokio::sync::mpsc::Receiver<bytes::Bytes>,
) -> std::io::Result<Sha256> {
    use std::io::Write;
    let mut w = std::io::BufWriter::with_capacity(4 << 20, file);
    while let Some(chunk) = rx.blocking_recv() {
        hasher.update(&chunk);
        w.write_all(&chunk)?;
    }
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(hasher)
}

/// `local://` sources: copy into the `.part` file while hashing.
async fn copy_local(
    ctx: &FetchCtx,
    src: &Path,
    part: &Path,
    counted: &mut u64,
) -> Result<String, FetchError> {
    sync_counted(ctx, counted, 0);
    let (src, part2, done) = (src.to_path_buf(), part.to_path_buf(), ctx.done.clone());
    let res = blocking(move || {
        use std::io::Write;
        let r = std::fs::File::open(&src)?;
        let mut w = std::fs::File::create(&part2)?;
        let mut h = Sha256::new();
        let n_total = flexinfer_fsutil::hash_reader(r, &mut h, 4 << 20, |b| {
            w.write_all(b)?;
            done.fetch_add(b.len() as u64, Ordering::Relaxed);
            Ok(())
        })?;
        w.sync_all()?;
        Ok((hex::encode(h.finalize()), n_total))
    })
    .await
    .map_err(|e| io_err("copying to", part, e))?;
    *counted = res.1;
    Ok(res.0)
}

async fn set_len(file: &mut tokio::fs::File, part: &Path, len: u64) -> Result<(), FetchError> {
    file.set_len(len)
        .await
        .map_err(|e| io_err("truncating", part, e))?;
    file.seek(std::io::SeekFrom::Start(len))
        .await
        .map_err(|e| io_err("seeking", part, e))?;
    Ok(())
}

fn sync_counted(ctx: &FetchCtx, counted: &mut u64, now: u64) {
    if now >= *counted {
        ctx.done
            .fetch_add(now.saturating_sub(*counted), Ordering::Relaxed);
    } else {
        ctx.done
            .fetch_sub(counted.saturating_sub(now), Ordering::Relaxed);
    }
    *counted = now;
}

/// `bytes 100-199/200` → 100.
fn parse_content_range_start(v: &str) -> Option<u64> {
    let rest = v.trim().strip_prefix("bytes")?.trim();
    rest.split('-').next()?.trim().parse().ok()
}

/// A reqwest error without its URL (URLs may carry presigned query strings).
pub fn strip_url(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    if let Some(u) = e.url() {
        s = s.replace(u.as_str(), "<url>");
    }
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_the_flags_redacts_secrets() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: super::super::DownloadArgs,
        }
        let cli = Cli::try_parse_from([
            "x",
            "--source",
            "oci://reg.example/m:v1",
            "--model-dir",
            "/cache/m",
            "--hf-token",
            "hf_topsecret",
            "--oci-username",
            "bob",
            "--oci-password",
            "pw_topsecret",
        ])
        .unwrap();
        let shown = format!("{:?}", cli.a);
        assert!(
            shown.contains("oci://reg.example/m:v1") && shown.contains("bob"),
            "{shown}"
        );
        assert!(!shown.contains("topsecret"), "{shown}");
    }

    #[test]
    fn content_range() {
        assert_eq!(parse_content_range_start("bytes 100-199/200"), Some(100));
        assert_eq!(parse_content_range_start("bytes */200"), None);
    }

    #[test]
    fn statuses() {
        assert!(matches!(
            http_error("x", StatusCode::UNAUTHORIZED, false),
            e if e.is_fatal() && e.to_string().contains("HF_TOKEN")
        ));
        assert!(matches!(
            http_error("x", StatusCode::NOT_FOUND, true),
            e if e.is_fatal()
        ));
        assert!(matches!(
            http_error("x", StatusCode::BAD_GATEWAY, true),
            e if e.is_retryable()
        ));
    }
}
