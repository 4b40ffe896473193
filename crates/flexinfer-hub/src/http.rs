//! The hub's HTTP API, read-only:
//! - `GET /api/{models,datasets}/<repo>/tree/<rev>[/<dir>]`: the files (and their directories) at
//!   a revision, each file with its size and git blob id, an LFS file also with its sha256 (what
//!   flexinfer-worker lists);
//! - `GET /api/{models,datasets}/<repo>[/revision/<rev>]`: the repository's commit id (`sha`) and
//!   files (`siblings`), what `huggingface_hub` resolves a revision with;
//! - `GET`/`HEAD /<repo>/resolve/<rev>/<path>` (datasets: `/datasets/<repo>/resolve/…`): the file,
//!   with `ETag`, `X-Linked-Etag`/`X-Linked-Size` (LFS files), `X-Repo-Commit`, `Accept-Ranges`
//!   and one `Range` (`bytes=a-b`, `a-`, `-n`) answered with 206 and `Content-Range`.
//!
//! Path segments are percent-decoded one by one, so a revision may be `refs%2Fpr%2F1`. Errors
//! are JSON with the `X-Error-Code` the hub sends (`RepoNotFound`, `RevisionNotFound`,
//! `EntryNotFound`).

use std::convert::Infallible;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};

use crate::repo::{directories, Kind, RepoId, Revision, ServedFile};
use crate::state::{lock, HubState, Seen};

pub type Body = BoxBody<Bytes, std::io::Error>;

/// Bytes per body chunk (smaller when throttled, so a throttled transfer advances steadily).
const CHUNK: u64 = 1 << 20;
const THROTTLED_CHUNK: u64 = 256 << 10;

fn full(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut r = full(status, value.to_string());
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error(status: StatusCode, code: Option<&'static str>, message: &str) -> Response<Body> {
    let mut r = json(status, &serde_json::json!({ "error": message }));
    if let Some(c) = code {
        r.headers_mut()
            .insert("x-error-code", HeaderValue::from_static(c));
    }
    r
}

fn header(v: impl AsRef<str>) -> HeaderValue {
    HeaderValue::from_str(v.as_ref()).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// Percent-decode one path segment (a `%` not followed by two hex digits stays as it is).
fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The repository `segments` start with (`org/name`, else `name`) among those served, and the
/// segments after it. `then` must be the first segment after the id, when given.
fn find_repo<'a>(
    st: &HubState,
    kind: Kind,
    segments: &'a [String],
    then: Option<&str>,
) -> Option<(RepoId, &'a [String])> {
    let repos = lock(&st.repos);
    for n in [2, 1] {
        if segments.len() < n {
            continue;
        }
        let id = RepoId {
            kind,
            id: segments[..n].join("/"),
        };
        let rest = &segments[n..];
        if then.is_some_and(|t| rest.first().map(String::as_str) != Some(t)) {
            continue;
        }
        if repos.contains_key(&id) {
            return Some((id, rest));
        }
    }
    None
}

/// The revision `name` of `id`: `Ok(None)` when the repository is served but has no such revision.
fn revision(st: &HubState, id: &RepoId, name: &str) -> Option<Option<Revision>> {
    let repos = lock(&st.repos);
    let repo = repos.get(id)?;
    Some(repo.revision(name).cloned())
}

/// The name a file's requests and faults are kept under: the path in a model repository,
/// `datasets/<id>/<path>` for a dataset.
fn file_key(id: &RepoId, path: &str) -> String {
    match id.kind {
        Kind::Model => path.to_string(),
        Kind::Dataset => format!("datasets/{}/{path}", id.id),
    }
}

/// The revision as [`Seen`] records it: `dataset:<id>@<rev>` for a dataset.
fn revision_key(id: &RepoId, rev: &str) -> String {
    match id.kind {
        Kind::Model => rev.to_string(),
        Kind::Dataset => format!("dataset:{}@{rev}", id.id),
    }
}

pub async fn handle(
    st: Arc<HubState>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let token = lock(&st.faults).token.clone();
    if let Some(t) = token {
        let ok = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == format!("Bearer {t}"));
        if !ok {
            return Ok(error(StatusCode::UNAUTHORIZED, None, "Invalid credentials"));
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(error(
            StatusCode::METHOD_NOT_ALLOWED,
            None,
            "the hub is read-only",
        ));
    }
    let segments: Vec<String> = req
        .uri()
        .path()
        .split('/')
        .filter(|s| !s.is_empty())
        .map(decode)
        .collect();
    Ok(match segments.first().map(String::as_str) {
        Some("api") => api(&st, &segments[1..]),
        Some("datasets") => resolve(&st, Kind::Dataset, &segments[1..], &req).await,
        _ => resolve(&st, Kind::Model, &segments, &req).await,
    })
}

/// `/api/…`: tree listings and repository info.
fn api(st: &HubState, segments: &[String]) -> Response<Body> {
    let Some(kind) = segments.first().and_then(|k| Kind::from_plural(k)) else {
        return error(StatusCode::NOT_FOUND, None, "api route not found");
    };
    let Some((id, rest)) = find_repo(st, kind, &segments[1..], None) else {
        return error(
            StatusCode::NOT_FOUND,
            Some("RepoNotFound"),
            "Repository not found",
        );
    };
    match rest.first().map(String::as_str) {
        Some("tree") => {
            *lock(&st.listings) += 1;
            let rev_name = rest.get(1).map(String::as_str).unwrap_or("main");
            let Some(Some(rev)) = revision(st, &id, rev_name) else {
                return error(
                    StatusCode::NOT_FOUND,
                    Some("RevisionNotFound"),
                    "Invalid rev id",
                );
            };
            let sub = rest.get(2..).map(|s| s.join("/")).unwrap_or_default();
            let under = |p: &str| sub.is_empty() || p.starts_with(&format!("{sub}/"));
            let mut list: Vec<serde_json::Value> = directories(&rev.files)
                .into_iter()
                .filter(|d| under(d))
                .map(|d| serde_json::json!({"type": "directory", "path": d, "size": 0, "oid": rev.commit}))
                .collect();
            list.extend(rev.files.iter().filter(|f| under(&f.path)).map(|f| {
                let mut v = serde_json::json!({"type": "file", "path": f.path, "size": f.size, "oid": f.git_sha1});
                if f.lfs {
                    v["lfs"] = serde_json::json!({"oid": f.sha256, "size": f.size, "pointerSize": 134});
                }
                v
            }));
            json(StatusCode::OK, &serde_json::Value::Array(list))
        }
        None | Some("revision") => {
            let rev = match rest.get(1) {
                Some(name) => revision(st, &id, name).flatten(),
                None => lock(&st.repos)
                    .get(&id)
                    .and_then(|r| r.default_revision().cloned()),
            };
            let Some(rev) = rev else {
                return error(
                    StatusCode::NOT_FOUND,
                    Some("RevisionNotFound"),
                    "Invalid rev id",
                );
            };
            json(
                StatusCode::OK,
                &serde_json::json!({
                    "id": id.id, "modelId": id.id, "sha": rev.commit, "private": false,
                    "siblings": rev.files.iter().map(|f| serde_json::json!({"rfilename": f.path})).collect::<Vec<_>>(),
                }),
            )
        }
        Some(_) => error(StatusCode::NOT_FOUND, None, "api route not found"),
    }
}

/// A `Range` header's bytes, first to last inclusive, within a file of `size` bytes. `None`: no
/// range (or one the hub ignores: another unit, several ranges); `Some(Err(()))`: unsatisfiable.
fn parse_range(value: &str, size: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = value.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    let parsed = match (a.is_empty(), b.is_empty()) {
        (true, true) => Err(()),
        // The last n bytes.
        (true, false) => match b.parse::<u64>() {
            Ok(0) | Err(_) => Err(()),
            Ok(n) => Ok((size.saturating_sub(n), size.wrapping_sub(1))),
        },
        (false, _) => match (
            a.parse::<u64>(),
            if b.is_empty() {
                Ok(u64::MAX)
            } else {
                b.parse::<u64>()
            },
        ) {
            (Ok(a), Ok(b)) if a <= b => Ok((a, b.min(size.wrapping_sub(1)))),
            _ => Err(()),
        },
    };
    Some(parsed.and_then(|(a, b)| {
        if size == 0 || a >= size {
            Err(())
        } else {
            Ok((a, b))
        }
    }))
}

/// `[/datasets]/<repo>/resolve/<rev>/<path>`: the file's bytes (or, for HEAD, its headers).
async fn resolve(
    st: &HubState,
    kind: Kind,
    segments: &[String],
    req: &Request<hyper::body::Incoming>,
) -> Response<Body> {
    let found = find_repo(st, kind, segments, Some("resolve"));
    let Some((id, rest)) = found.filter(|(_, rest)| rest.len() >= 3) else {
        return error(
            StatusCode::NOT_FOUND,
            Some("RepoNotFound"),
            "Repository not found",
        );
    };
    let (rev_name, path) = (&rest[1], rest[2..].join("/"));
    let key = file_key(&id, &path);
    let range = req
        .headers()
        .get("range")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let range_start = range.as_deref().and_then(|r| {
        let spec = r.trim().strip_prefix("bytes=")?;
        spec.split_once('-')?.0.trim().parse::<u64>().ok()
    });
    let record = |status: StatusCode| {
        st.record(
            &key,
            Seen {
                revision: revision_key(&id, rev_name),
                range_start,
                status: status.as_u16(),
            },
        )
    };
    let rev = revision(st, &id, rev_name).flatten();
    let Some((commit, f)) = rev.and_then(|r| r.file(&path).cloned().map(|f| (r.commit, f))) else {
        record(StatusCode::NOT_FOUND);
        return error(
            StatusCode::NOT_FOUND,
            Some("EntryNotFound"),
            "Entry not found",
        );
    };
    {
        let mut faults = lock(&st.faults);
        if let Some(n) = faults.fail_500.get_mut(&key).filter(|n| **n > 0) {
            *n -= 1;
            drop(faults);
            record(StatusCode::INTERNAL_SERVER_ERROR);
            return full(StatusCode::INTERNAL_SERVER_ERROR, "boom".into());
        }
    }
    // `end` is exclusive.
    let (first, end, status) = match range.as_deref().and_then(|r| parse_range(r, f.size)) {
        None => (0, f.size, StatusCode::OK),
        Some(Ok((a, b))) => (a, b + 1, StatusCode::PARTIAL_CONTENT),
        Some(Err(())) => {
            record(StatusCode::RANGE_NOT_SATISFIABLE);
            let mut r = error(
                StatusCode::RANGE_NOT_SATISFIABLE,
                None,
                "Range not satisfiable",
            );
            r.headers_mut()
                .insert("content-range", header(format!("bytes */{}", f.size)));
            return r;
        }
    };
    record(status);
    let body = if req.method() == Method::HEAD || first == end {
        Empty::new().map_err(|e| match e {}).boxed()
    } else {
        let (drop_at, corrupt, throttle) = {
            let mut faults = lock(&st.faults);
            (
                faults.drop_once_at.remove(&key),
                faults.corrupt.contains(&key),
                faults.throttle,
            )
        };
        let file = match std::fs::File::open(&f.disk) {
            Ok(file) => file,
            Err(e) => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    None,
                    &format!("cannot open {}: {e}", f.disk.display()),
                )
            }
        };
        file_stream(FileRead {
            file: Arc::new(file),
            disk: f.disk.clone(),
            pos: first,
            end,
            drop_at,
            corrupt_at: corrupt.then_some(f.size / 2),
            throttle,
        })
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    file_headers(h, &f, &commit);
    h.insert(CONTENT_LENGTH, (end - first).into());
    if status == StatusCode::PARTIAL_CONTENT {
        h.insert(
            "content-range",
            header(format!("bytes {first}-{}/{}", end - 1, f.size)),
        );
    }
    resp
}

fn file_headers(h: &mut hyper::HeaderMap, f: &ServedFile, commit: &str) {
    let etag = format!("\"{}\"", f.etag());
    if f.lfs {
        h.insert("x-linked-etag", header(&etag));
        h.insert("x-linked-size", f.size.into());
    }
    h.insert("etag", header(etag));
    h.insert("x-repo-commit", header(commit));
    h.insert("accept-ranges", HeaderValue::from_static("bytes"));
}

/// The part of a file a body sends, and the faults it injects.
struct FileRead {
    file: Arc<std::fs::File>,
    disk: PathBuf,
    pos: u64,
    /// Exclusive.
    end: u64,
    /// Fail the body (the connection drops) once `pos` reaches this offset.
    drop_at: Option<u64>,
    /// Flip the byte at this offset.
    corrupt_at: Option<u64>,
    /// Bytes per second.
    throttle: Option<u64>,
}

/// The body streamed from disk, one chunk at a time (read on a blocking thread).
fn file_stream(read: FileRead) -> Body {
    let stream = futures::stream::unfold(Some(read), |s| async move {
        let mut s = s?;
        if s.pos >= s.end {
            return None;
        }
        if s.drop_at.is_some_and(|d| s.pos >= d) {
            return Some((Err(std::io::Error::other("injected connection drop")), None));
        }
        let chunk = if s.throttle.is_some() {
            THROTTLED_CHUNK
        } else {
            CHUNK
        };
        let mut n = chunk.min(s.end - s.pos);
        if let Some(d) = s.drop_at.filter(|d| *d > s.pos) {
            n = n.min(d - s.pos);
        }
        let (file, pos) = (s.file.clone(), s.pos);
        let read = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; n as usize];
            file.read_exact_at(&mut buf, pos).map(|()| buf)
        })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
        let mut buf = match read {
            Ok(b) => b,
            Err(e) => {
                let e = std::io::Error::other(format!("reading {}: {e}", s.disk.display()));
                return Some((Err(e), None));
            }
        };
        if let Some(c) = s.corrupt_at.filter(|c| *c >= s.pos && *c < s.pos + n) {
            buf[(c - s.pos) as usize] ^= 0xFF;
        }
        if let Some(bps) = s.throttle.filter(|b| *b > 0) {
            tokio::time::sleep(Duration::from_secs_f64(n as f64 / bps as f64)).await;
        }
        s.pos += n;
        Some((Ok(Frame::data(Bytes::from(buf))), Some(s)))
    });
    StreamBody::new(stream).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-", 10), Some(Ok((0, 9))));
        assert_eq!(parse_range("bytes=3-5", 10), Some(Ok((3, 5))));
        assert_eq!(parse_range("bytes=3-50", 10), Some(Ok((3, 9))));
        assert_eq!(parse_range("bytes=-4", 10), Some(Ok((6, 9))));
        assert_eq!(parse_range("bytes=-40", 10), Some(Ok((0, 9))));
        assert_eq!(parse_range("bytes=10-", 10), Some(Err(())));
        assert_eq!(parse_range("bytes=5-3", 10), Some(Err(())));
        assert_eq!(parse_range("bytes=x-", 10), Some(Err(())));
        assert_eq!(parse_range("bytes=0-", 0), Some(Err(())));
        assert_eq!(parse_range("bytes=0-1,4-5", 10), None);
        assert_eq!(parse_range("items=0-1", 10), None);
    }

    #[test]
    fn segments_are_decoded() {
        assert_eq!(decode("refs%2Fpr%2F1"), "refs/pr/1");
        assert_eq!(decode("a%20b"), "a b");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(decode("%zz"), "%zz");
    }
}
