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
use crate::http::ScopedAuth;
use crate::retry::Retry;

mod verify;

pub use crate::http::error::{
    http_error, status_is_retryable, strip_url, BadBody, FetchError, Transport, VerifyError,
};
pub use verify::git_blob_sha1;
use verify::{on_disk_sha256, verify};

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
            .field("transfer", &self.transfer)
            .finish_non_exhaustive()
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
    if let Some(done) = keep_finished(ctx, f, &dest).await? {
        return Ok(done);
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
            Ok(streamed) => match check_part(f, &part, &streamed).await? {
                Ok(sha) => {
                    tokio::fs::rename(&part, &dest)
                        .await
                        .map_err(|e| io_err("renaming", &part, e))?;
                    return Ok(record(f, sha));
                }
                Err(why) => {
                    let _ = tokio::fs::remove_file(&part).await;
                    ctx.done.fetch_sub(counted, Ordering::Relaxed);
                    counted = 0;
                    verify_failures = verify_failures.saturating_add(1);
                    let err = FetchError::Verify(why);
                    tracing::warn!(file = %f.path, "verification failed");
                    eprintln!("{}", flexinfer_contract::error::chain(&err));
                    if verify_failures >= 2 {
                        return Err(err);
                    }
                }
            },
            Err(msg) if msg.is_retryable() => {
                // Only failures in a row without progress count against the file.
                if counted > before {
                    retry.reset();
                }
                tokio::time::sleep(next_delay(&mut retry, f, msg)?).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The integrity record of a verified file.
fn record(f: &RemoteFile, sha256: String) -> IntegrityFile {
    IntegrityFile {
        name: f.path.clone(),
        size: f.size,
        sha256,
    }
}

/// A finished file from an earlier run: verified instead of fetched again (its record), or removed
/// when it is not what the source promised.
async fn keep_finished(
    ctx: &FetchCtx,
    f: &RemoteFile,
    dest: &Path,
) -> Result<Option<IntegrityFile>, FetchError> {
    let Ok(meta) = tokio::fs::metadata(dest).await else {
        return Ok(None);
    };
    if meta.is_file() && meta.len() == f.size {
        let p = dest.to_path_buf();
        let sha = blocking(move || flexinfer_fsutil::sha256_file(&p))
            .await
            .map_err(|e| io_err("hashing", dest, e))?;
        if verify(f, dest, &sha).await.is_ok() {
            ctx.done.fetch_add(f.size, Ordering::Relaxed);
            return Ok(Some(record(f, sha)));
        }
    }
    tokio::fs::remove_file(dest)
        .await
        .map_err(|e| io_err("removing stale", dest, e))?;
    Ok(None)
}

/// The finished `.part` file checked: what counts is what is on disk, not what went through the
/// stream, so it is re-read, then verified against the source. Its sha256, or why it failed.
async fn check_part(
    f: &RemoteFile,
    part: &Path,
    streamed: &str,
) -> Result<Result<String, VerifyError>, FetchError> {
    Ok(match on_disk_sha256(&f.path, part, streamed).await? {
        Ok(sha) => verify(f, part, &sha).await.map(|()| sha),
        Err(why) => Err(why),
    })
}

/// The wait before the next attempt after the transient failure `msg`, or the error that gives up.
fn next_delay(retry: &mut Retry, f: &RemoteFile, msg: FetchError) -> Result<Duration, FetchError> {
    let Some(delay) = retry.next_delay() else {
        return Err(FetchError::GaveUp {
            file: f.path.clone(),
            attempts: retry.attempt().saturating_add(1),
            last: Box::new(msg),
        });
    };
    let attempt = retry.attempt();
    let why = flexinfer_contract::error::chain(&msg);
    tracing::warn!(file = %f.path, attempt, error = %why, "retrying");
    eprintln!(
        "retrying {} in {delay:.1?} (attempt {attempt}): {why}",
        f.path
    );
    Ok(delay)
}

/// One attempt at one file: the `.part` file, the bytes of it counted in [`FetchCtx::done`].
struct Attempt<'a> {
    ctx: &'a FetchCtx,
    f: &'a RemoteFile,
    part: &'a Path,
    counted: &'a mut u64,
}

/// The `.part` file open for appending, and the hash of the `have` bytes it already holds.
struct Resume {
    file: tokio::fs::File,
    hasher: Sha256,
    have: u64,
}

/// One attempt (see [`Attempt`]): resume the `.part` file, request the rest, receive it. Returns the
/// sha256 of the whole received file.
async fn download_once(
    ctx: &FetchCtx,
    f: &RemoteFile,
    part: &Path,
    counted: &mut u64,
) -> Result<String, FetchError> {
    if let Some(src) = f.url.strip_prefix("file://") {
        return copy_local(ctx, Path::new(src), part, counted).await;
    }
    let mut a = Attempt {
        ctx,
        f,
        part,
        counted,
    };
    let mut r = a.resume().await?;
    if r.have == f.size && r.have > 0 {
        return Ok(hex::encode(r.hasher.finalize()));
    }
    let resp = a.request(r.have).await?;
    a.accept(&resp, &mut r).await?;
    a.receive(resp, r).await
}

impl Attempt<'_> {
    fn sync(&mut self, now: u64) {
        sync_counted(self.ctx, self.counted, now);
    }

    /// Opens the `.part` file and hashes what it already holds (at most the listed size).
    async fn resume(&mut self) -> Result<Resume, FetchError> {
        let part = self.part;
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
        if have > self.f.size {
            have = 0;
        }
        let (hasher, hashed) = if have > 0 {
            let p = part.to_path_buf();
            blocking(move || sha256_prefix(&p, have))
                .await
                .map_err(|e| io_err("hashing", part, e))?
        } else {
            (Sha256::new(), 0)
        };
        set_len(&mut file, part, hashed).await?;
        self.sync(hashed);
        Ok(Resume {
            file,
            hasher,
            have: hashed,
        })
    }

    /// The GET of the file from byte `have`, with the credential only where it is scoped to go.
    async fn request(&self, have: u64) -> Result<reqwest::Response, FetchError> {
        let f = self.f;
        let mut req = self.ctx.client.get(&f.url);
        // reqwest drops the header itself on a redirect to another scheme, host or port.
        if let Some(a) = self
            .ctx
            .authorization
            .as_ref()
            .and_then(|a| a.for_url(&f.url))
        {
            req = req.header(reqwest::header::AUTHORIZATION, a);
        }
        if have > 0 {
            req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
        }
        req.send().await.map_err(|e| FetchError::Request {
            file: f.path.clone(),
            source: Transport(e),
        })
    }

    /// What the answer's status means for the resume: the body continues the `.part` file, or
    /// replaces it (the file is emptied), or the attempt fails.
    async fn accept(&mut self, resp: &reqwest::Response, r: &mut Resume) -> Result<(), FetchError> {
        let file = || self.f.path.clone();
        match resp.status() {
            StatusCode::PARTIAL_CONTENT if r.have > 0 => {
                let start = resp
                    .headers()
                    .get(reqwest::header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_content_range_start);
                if start != Some(r.have) {
                    // Not the range we asked for: start over.
                    set_len(&mut r.file, self.part, 0).await?;
                    self.sync(0);
                    return Err(FetchError::WrongRange { file: file() });
                }
            }
            s if s.is_success() => {
                if r.have > 0 {
                    // The server ignored the Range header: take the whole body.
                    r.have = 0;
                    r.hasher = Sha256::new();
                    set_len(&mut r.file, self.part, 0).await?;
                    self.sync(0);
                }
            }
            StatusCode::RANGE_NOT_SATISFIABLE => {
                set_len(&mut r.file, self.part, 0).await?;
                self.sync(0);
                return Err(FetchError::RangeNotSatisfiable { file: file() });
            }
            s => {
                return Err(http_error(
                    &self.f.path,
                    s,
                    self.ctx.authorization.is_some(),
                ))
            }
        }
        Ok(())
    }

    /// Receives the body after `r.have` into the `.part` file: received on the runtime, hashed and
    /// written on a blocking thread, the two overlapping. The sha256 of the whole file.
    async fn receive(&mut self, resp: reqwest::Response, r: Resume) -> Result<String, FetchError> {
        let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(64);
        let std_file = r.file.into_std().await;
        let hasher = r.hasher;
        let writer = tokio::task::spawn_blocking(move || write_chunks(std_file, hasher, rx));
        let (pos, failure) = self.pump(resp, r.have, tx).await;
        let written = writer
            .await
            .map_err(FetchError::Writer)
            .and_then(|res| res.map_err(|e| io_err("writing", self.part, e)));
        let hasher = match written {
            Ok(h) => h,
            Err(e) => {
                self.sync(0);
                let _ = tokio::fs::remove_file(self.part).await;
                return Err(e);
            }
        };
        if let Some(e) = failure {
            if pos == 0 {
                let _ = tokio::fs::remove_file(self.part).await;
                self.sync(0);
            }
            return Err(e);
        }
        if pos != self.f.size {
            return Err(FetchError::Closed {
                file: self.f.path.clone(),
                at: pos,
                size: self.f.size,
            });
        }
        Ok(hex::encode(hasher.finalize()))
    }

    /// The chunk loop: every chunk of the body to the writer, bounded by the listed size. Returns the
    /// position reached (0 when the `.part` file must start over) and the failure that stopped it.
    /// Dropping `tx` at the end tells the writer the body is complete.
    async fn pump(
        &mut self,
        resp: reqwest::Response,
        mut pos: u64,
        tx: tokio::sync::mpsc::Sender<bytes::Bytes>,
    ) -> (u64, Option<FetchError>) {
        let f = self.f;
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    let dropped = FetchError::Dropped {
                        file: f.path.clone(),
                        at: pos,
                        size: f.size,
                        source: Transport(e),
                    };
                    return (pos, Some(dropped));
                }
            };
            if pos.saturating_add(chunk.len() as u64) > f.size {
                let too_long = FetchError::TooLong {
                    file: f.path.clone(),
                    size: f.size,
                };
                return (0, Some(too_long));
            }
            // Bounded by the listed size (checked above).
            pos = pos.saturating_add(chunk.len() as u64);
            self.ctx
                .received
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            if tx.send(chunk).await.is_err() {
                break; // the writer failed; its error is reported by the caller
            }
            self.sync(pos);
        }
        (pos, None)
    }
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
            e if e.is_fatal() && flexinfer_contract::error::chain(&e).contains("HF_TOKEN")
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
