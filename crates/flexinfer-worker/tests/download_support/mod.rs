//! Test helpers for the transfer tests: a Hugging Face Hub-compatible HTTP server over generated
//! files with fault injection and per-file request accounting, generated data, and a runner for
//! the worker binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use sha2::{Digest, Sha256};

pub const WORKER: &str = env!("CARGO_BIN_EXE_flexinfer-worker");

/// Write `size` bytes of non-repeating pseudo-random data (1 MiB xorshift block, each MiB stamped
/// with its index and the seed) and return its sha256.
pub fn write_data(path: &Path, size: u64, seed: u64) -> String {
    write_prefixed(path, &[], size, seed)
}

/// A valid safetensors file whose one tensor (`data`, U8) holds `size` bytes of [`write_data`]'s
/// pseudo-random data; returns the file's sha256. What publish describes must be a readable checkpoint.
pub fn write_safetensors(path: &Path, size: u64, seed: u64) -> String {
    let mut header =
        format!(r#"{{"data":{{"dtype":"U8","shape":[{size}],"data_offsets":[0,{size}]}}}}"#)
            .into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut prefix = (header.len() as u64).to_le_bytes().to_vec();
    prefix.extend(header);
    write_prefixed(path, &prefix, size, seed)
}

fn write_prefixed(path: &Path, prefix: &[u8], size: u64, seed: u64) -> String {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    let mut block = vec![0u8; 1 << 20];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in block.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    let mut f = std::io::BufWriter::with_capacity(4 << 20, std::fs::File::create(path).unwrap());
    let mut h = Sha256::new();
    h.update(prefix);
    f.write_all(prefix).unwrap();
    let mut left = size;
    let mut i = 0u64;
    while left > 0 {
        block[..8].copy_from_slice(&i.to_le_bytes());
        block[8..16].copy_from_slice(&seed.to_le_bytes());
        let n = left.min(block.len() as u64) as usize;
        h.update(&block[..n]);
        f.write_all(&block[..n]).unwrap();
        left -= n as u64;
        i += 1;
    }
    f.flush().unwrap();
    hex::encode(h.finalize())
}

pub fn sha256_of(path: &Path) -> String {
    let mut f = std::fs::File::open(path).unwrap();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    hex::encode(h.finalize())
}

fn git_sha1(path: &Path) -> String {
    use sha1::Digest as _;
    let data = std::fs::read(path).unwrap();
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", data.len()).as_bytes());
    h.update(&data);
    hex::encode(h.finalize())
}

/// One served file.
#[derive(Clone, Debug)]
pub struct ServedFile {
    pub path: String,
    pub disk: PathBuf,
    pub size: u64,
    pub sha256: String,
    pub lfs: bool,
    pub git_sha1: String,
}

/// Fault injection knobs (all may be changed while the server runs).
#[derive(Default)]
pub struct Faults {
    /// path → drop the connection once, after this absolute byte offset.
    pub drop_once_at: HashMap<String, u64>,
    /// Paths whose content is served with one byte flipped.
    pub corrupt: HashSet<String>,
    /// path → answer the next N requests with HTTP 500.
    pub fail_500: HashMap<String, u32>,
    /// Bytes per second per response (None: unthrottled).
    pub throttle: Option<u64>,
    /// Bearer token every request must carry.
    pub token: Option<String>,
}

/// One resolve request seen by the server.
#[derive(Clone, Debug)]
pub struct Seen {
    pub revision: String,
    pub range_start: Option<u64>,
    pub status: u16,
}

pub struct HubState {
    pub repo: String,
    pub revisions: Mutex<BTreeMap<String, Vec<ServedFile>>>,
    pub faults: Mutex<Faults>,
    pub seen: Mutex<BTreeMap<String, Vec<Seen>>>,
    pub listings: Mutex<u32>,
}

impl HubState {
    pub fn requests(&self, path: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .get(path)
            .cloned()
            .unwrap_or_default()
    }
    pub fn total_file_requests(&self) -> usize {
        self.seen.lock().unwrap().values().map(Vec::len).sum()
    }
    pub fn reset_counts(&self) {
        self.seen.lock().unwrap().clear();
        *self.listings.lock().unwrap() = 0;
    }
}

/// Describe the files of a directory as the hub would (`*.safetensors` and files ≥ 1 MiB are LFS).
pub fn describe(dir: &Path) -> Vec<ServedFile> {
    let mut out = Vec::new();
    fn walk(root: &Path, d: &Path, out: &mut Vec<ServedFile>) {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(root, &e.path(), out);
                continue;
            }
            let rel = e
                .path()
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .to_string();
            let size = e.metadata().unwrap().len();
            out.push(ServedFile {
                lfs: rel.ends_with(".safetensors") || size >= 1 << 20,
                sha256: sha256_of(&e.path()),
                git_sha1: git_sha1(&e.path()),
                disk: e.path(),
                path: rel,
                size,
            });
        }
    }
    walk(dir, dir, &mut out);
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

pub struct HubServer {
    pub addr: SocketAddr,
    pub state: Arc<HubState>,
    _rt: tokio::runtime::Runtime,
}

impl HubServer {
    /// Serve `revisions` (revision → files) of `repo` (a model repo).
    pub fn start(repo: &str, revisions: Vec<(&str, Vec<ServedFile>)>) -> HubServer {
        let mut revs = BTreeMap::new();
        for (r, files) in revisions {
            revs.insert(r.to_string(), files);
        }
        let state = Arc::new(HubState {
            repo: repo.to_string(),
            revisions: Mutex::new(revs),
            faults: Mutex::new(Faults::default()),
            seen: Mutex::new(BTreeMap::new()),
            listings: Mutex::new(0),
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let st = state.clone();
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        HubServer {
            addr,
            state,
            _rt: rt,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

type Body = BoxBody<Bytes, std::io::Error>;

fn text(status: StatusCode, msg: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(msg.to_string()))
            .map_err(|e| match e {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

/// Revision key of a tree listing: `rev` for the model, `dataset:<id>@<rev>` for datasets.
fn listing_key(repo: &str, path: &str) -> Option<String> {
    if let Some(rest) = path.strip_prefix(&format!("/api/models/{repo}/tree/")) {
        return Some(decode(rest));
    }
    let rest = path.strip_prefix("/api/datasets/")?;
    let (ds, rev) = rest.split_once("/tree/")?;
    Some(format!("dataset:{ds}@{}", decode(rev)))
}

/// (revision key, recorded name, file path inside the repo) of a resolve URL.
fn resolve_parts(repo: &str, path: &str) -> Option<(String, String, String)> {
    if let Some(rest) = path.strip_prefix(&format!("/{repo}/resolve/")) {
        let (rev, file) = rest.split_once('/')?;
        return Some((decode(rev), decode(file), decode(file)));
    }
    let rest = path.strip_prefix("/datasets/")?;
    let (ds, rest) = rest.split_once("/resolve/")?;
    let (rev, file) = rest.split_once('/')?;
    Some((
        format!("dataset:{ds}@{}", decode(rev)),
        format!("datasets/{ds}/{}", decode(file)),
        decode(file),
    ))
}

async fn handle(
    st: Arc<HubState>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let token = st.faults.lock().unwrap().token.clone();
    if let Some(t) = token {
        let ok = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == format!("Bearer {t}"));
        if !ok {
            return Ok(text(
                StatusCode::UNAUTHORIZED,
                "{\"error\":\"Invalid credentials\"}",
            ));
        }
    }
    if let Some(rev) = listing_key(&st.repo, &path) {
        *st.listings.lock().unwrap() += 1;
        let revs = st.revisions.lock().unwrap();
        let Some(files) = revs.get(&rev) else {
            return Ok(text(
                StatusCode::NOT_FOUND,
                "{\"error\":\"Invalid rev id\"}",
            ));
        };
        let list: Vec<serde_json::Value> = files
            .iter()
            .map(|f| {
                let mut v = serde_json::json!({"type": "file", "path": f.path, "size": f.size, "oid": f.git_sha1});
                if f.lfs {
                    v["lfs"] = serde_json::json!({"oid": f.sha256, "size": f.size, "pointerSize": 134});
                    v["size"] = serde_json::json!(f.size);
                }
                v
            })
            .chain(std::iter::once(serde_json::json!({"type": "directory", "path": "tokenizer", "size": 0, "oid": "x"})))
            .collect();
        return Ok(text(StatusCode::OK, &serde_json::to_string(&list).unwrap()));
    }
    let Some((rev, file, lookup)) = resolve_parts(&st.repo, &path) else {
        return Ok(text(
            StatusCode::NOT_FOUND,
            "{\"error\":\"Repository not found\"}",
        ));
    };
    let range_start = req
        .headers()
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.trim_end_matches('-').parse::<u64>().ok());
    let served = st
        .revisions
        .lock()
        .unwrap()
        .get(&rev)
        .and_then(|fs| fs.iter().find(|f| f.path == lookup).cloned());
    let record = |status: u16| {
        st.seen
            .lock()
            .unwrap()
            .entry(file.clone())
            .or_default()
            .push(Seen {
                revision: rev.clone(),
                range_start,
                status,
            });
    };
    let Some(f) = served else {
        record(404);
        return Ok(text(
            StatusCode::NOT_FOUND,
            "{\"error\":\"Entry not found\"}",
        ));
    };
    {
        let mut faults = st.faults.lock().unwrap();
        if let Some(n) = faults.fail_500.get_mut(&file) {
            if *n > 0 {
                *n -= 1;
                drop(faults);
                record(500);
                return Ok(text(StatusCode::INTERNAL_SERVER_ERROR, "boom"));
            }
        }
    }
    let start = range_start.unwrap_or(0).min(f.size);
    let (drop_at, corrupt, throttle) = {
        let mut faults = st.faults.lock().unwrap();
        (
            faults.drop_once_at.remove(&file),
            faults.corrupt.contains(&file),
            faults.throttle,
        )
    };
    let status = if range_start.is_some() { 206 } else { 200 };
    record(status);
    let corrupt_at = if corrupt { Some(f.size / 2) } else { None };
    let body = file_stream(f.disk.clone(), start, f.size, drop_at, corrupt_at, throttle);
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert("content-length", (f.size - start).into());
    resp.headers_mut()
        .insert("accept-ranges", "bytes".parse().unwrap());
    if range_start.is_some() {
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        resp.headers_mut().insert(
            "content-range",
            format!("bytes {start}-{}/{}", f.size.saturating_sub(1), f.size)
                .parse()
                .unwrap(),
        );
    }
    Ok(resp)
}

fn file_stream(
    disk: PathBuf,
    start: u64,
    end: u64,
    drop_at: Option<u64>,
    corrupt_at: Option<u64>,
    throttle: Option<u64>,
) -> Body {
    use std::io::Seek;
    struct St {
        f: Option<std::fs::File>,
        pos: u64,
    }
    let mut f = std::fs::File::open(&disk).unwrap();
    f.seek(std::io::SeekFrom::Start(start)).unwrap();
    let stream = futures::stream::unfold(
        St {
            f: Some(f),
            pos: start,
        },
        move |mut s| async move {
            let file = s.f.as_mut()?;
            if s.pos >= end {
                return None;
            }
            if let Some(d) = drop_at {
                if s.pos >= d {
                    s.f = None;
                    return Some((Err(std::io::Error::other("injected connection drop")), s));
                }
            }
            let mut n = (256 * 1024u64).min(end - s.pos);
            if let Some(d) = drop_at.filter(|d| *d > s.pos) {
                n = n.min(d - s.pos);
            }
            let mut buf = vec![0u8; n as usize];
            file.read_exact(&mut buf).unwrap();
            if let Some(c) = corrupt_at {
                if c >= s.pos && c < s.pos + n {
                    buf[(c - s.pos) as usize] ^= 0xFF;
                }
            }
            if let Some(bps) = throttle {
                tokio::time::sleep(Duration::from_secs_f64(n as f64 / bps as f64)).await;
            }
            s.pos += n;
            Some((Ok(Frame::data(Bytes::from(buf))), s))
        },
    );
    StreamBody::new(stream).boxed()
}

/// The shared model fixture (generated once into the cargo target tmp dir and reused):
/// `model-00001-of-00002.safetensors` (210 MiB), `model-00002-of-00002.safetensors` (6 MiB),
/// `config.json`, `tokenizer/tokenizer.json`, `tokenizer/vocab.txt`, `README.md`.
pub fn fixture() -> &'static Vec<ServedFile> {
    static F: std::sync::OnceLock<Vec<ServedFile>> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("flexinfer-transfer-fixture-v1");
        let big = dir.join("model-00001-of-00002.safetensors");
        let big_size = 210u64 << 20;
        if std::fs::metadata(&big).map(|m| m.len()).ok() != Some(big_size)
            || !dir.join("README.md").exists()
        {
            let _ = std::fs::remove_dir_all(&dir);
            write_data(&big, big_size, 1);
            write_data(&dir.join("model-00002-of-00002.safetensors"), 6 << 20, 2);
            std::fs::write(
                dir.join("config.json"),
                r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64}"#,
            )
            .unwrap();
            std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
            std::fs::write(
                dir.join("tokenizer/tokenizer.json"),
                r#"{"model":{"type":"BPE"}}"#,
            )
            .unwrap();
            write_data(&dir.join("tokenizer/vocab.txt"), 300_000, 3);
            std::fs::write(dir.join("README.md"), "# test model\n").unwrap();
        }
        describe(&dir)
    })
}

/// Result of one worker run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub termination: serde_json::Value,
}

impl Run {
    pub fn events(&self, name: &str) -> Vec<serde_json::Value> {
        self.stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == name)
            .collect()
    }
    pub fn describe(&self) -> String {
        format!(
            "exit {}\n--- stdout\n{}\n--- stderr\n{}\n--- termination\n{}",
            self.code, self.stdout, self.stderr, self.termination
        )
    }
}

/// A worker command with a termination-log path in `scratch` and no inherited transfer env.
pub fn worker(sub: &str, scratch: &Path) -> Command {
    let mut c = Command::new(WORKER);
    c.arg(sub);
    for k in [
        "SOURCE",
        "REVISION",
        "REPO_TYPE",
        "DATASET",
        "ALLOW_PATTERNS",
        "IGNORE_PATTERNS",
        "MODEL_DIR",
        "OUT_DIR",
        "HF_TOKEN",
        "HF_ENDPOINT",
        "OCI_REF",
        "OCI_TAG_POLICY",
        "OCI_ADDITIONAL_TAGS",
        "OCI_INSECURE",
        "OCI_USERNAME",
        "OCI_PASSWORD",
        "DOCKER_CONFIG_JSON",
        "FLEXINFER_SCRIPT_VERSION",
        "FLEXINFER_LOCAL_SOURCE_ROOT",
    ] {
        c.env_remove(k);
    }
    c.env("FLEXINFER_TERMINATION_LOG", scratch.join("termination-log"));
    c.env("FLEXINFER_PROGRESS_INTERVAL_SECONDS", "0.2");
    c
}

pub fn run(mut c: Command, scratch: &Path) -> Run {
    let _ = std::fs::remove_file(scratch.join("termination-log"));
    let out: Output = c.output().expect("run the worker binary");
    let termination = std::fs::read_to_string(scratch.join("termination-log"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null);
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).to_string(),
        termination,
    }
}

/// Every regular file under `dir` (relative path → sha256), skipping the given names.
pub fn tree(dir: &Path, skip: &[&str]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    fn walk(root: &Path, d: &Path, skip: &[&str], out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            if skip.contains(&name.as_str()) {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                walk(root, &e.path(), skip, out);
            } else {
                let rel = e
                    .path()
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .to_string();
                out.insert(rel, sha256_of(&e.path()));
            }
        }
    }
    walk(dir, dir, skip, &mut out);
    out
}
