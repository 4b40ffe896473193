//! The `flexinfer-hub` binary as the end-to-end setup and the transfer benchmark run it: a root of
//! model and dataset repositories (or one directory as one model), then the API over HTTP — the
//! tree listing, the revision info, `resolve` with its headers, ranges and HEAD, and the errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_flexinfer-hub");

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// One HTTP/1.1 exchange.
fn http(port: u16, method: &str, path: &str, extra: &str) -> Answer {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(
        format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n")
            .as_bytes(),
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    Answer {
        status: head.split(' ').nth(1).unwrap().parse().unwrap(),
        head,
        body: out[split + 4..].to_vec(),
    }
}

fn write(path: &Path, data: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, data).unwrap();
}

fn sha256(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

fn git_sha1(data: &[u8]) -> String {
    use sha1::Digest;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", data.len()).as_bytes());
    h.update(data);
    hex::encode(h.finalize())
}

/// Start the binary and wait for its ready file; the port.
fn start(args: &[&str], ready: &Path) -> (Server, u16) {
    let child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .expect("start flexinfer-hub");
    let server = Server(child);
    let t0 = Instant::now();
    loop {
        if let Ok(p) = std::fs::read_to_string(ready) {
            return (server, p.trim().parse().expect("a port"));
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no ready file");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serves_every_repository_under_a_root() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repos");
    let big: Vec<u8> = (0..(3u32 << 20) / 4)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    let config = br#"{"architectures":["LlamaForCausalLM"]}"#;
    let model = root.join("models/org/model");
    write(&model.join("model.safetensors"), &big);
    write(&model.join("config.json"), config);
    write(&model.join("tokenizer/tokenizer.json"), b"{}");
    write(
        &root.join("datasets/org/calib/train.jsonl"),
        b"{\"text\":\"a\"}\n",
    );
    let ready = tmp.path().join("port");
    let (_server, port) = start(
        &[
            "--root",
            root.to_str().unwrap(),
            "--port",
            "0",
            "--ready-file",
            ready.to_str().unwrap(),
        ],
        &ready,
    );

    // The tree listing: directories, files with their blob ids, LFS files with their sha256.
    let tree = http(
        port,
        "GET",
        "/api/models/org/model/tree/main?recursive=true",
        "",
    );
    assert_eq!(tree.status, 200, "{}", tree.head);
    let tree = tree.json();
    let entry = |p: &str| {
        tree.as_array()
            .unwrap()
            .iter()
            .find(|e| e["path"] == p)
            .cloned()
            .unwrap_or_else(|| panic!("{p} not listed: {tree}"))
    };
    assert_eq!(entry("tokenizer")["type"], "directory");
    assert_eq!(entry("config.json")["oid"], git_sha1(config));
    assert!(entry("config.json").get("lfs").is_none());
    let st = entry("model.safetensors");
    assert_eq!(st["size"], big.len());
    assert_eq!(st["lfs"]["oid"], sha256(&big));
    assert_eq!(st["lfs"]["size"], big.len());
    let sub = http(port, "GET", "/api/models/org/model/tree/main/tokenizer", "").json();
    assert_eq!(sub.as_array().unwrap().len(), 1, "{sub}");

    // The revision info; the commit resolves like `main`, and so does any revision name.
    let info = http(port, "GET", "/api/models/org/model/revision/main", "").json();
    let commit = info["sha"].as_str().unwrap().to_string();
    assert_eq!(commit.len(), 40);
    assert_eq!(info["siblings"].as_array().unwrap().len(), 3, "{info}");
    let plain = http(port, "GET", "/api/models/org/model", "").json();
    assert_eq!(plain["sha"], commit);

    // resolve: the whole file with the hub's headers; HEAD the same headers without a body.
    let path = format!("/org/model/resolve/{commit}/model.safetensors");
    let got = http(port, "GET", &path, "");
    assert_eq!(got.status, 200);
    assert!(got.body == big, "the body differs");
    let quoted = format!("\"{}\"", sha256(&big));
    assert_eq!(got.header("etag"), Some(quoted.clone()));
    assert_eq!(got.header("x-linked-etag"), Some(quoted));
    assert_eq!(got.header("x-linked-size"), Some(big.len().to_string()));
    assert_eq!(got.header("x-repo-commit"), Some(commit.clone()));
    assert_eq!(got.header("accept-ranges").as_deref(), Some("bytes"));
    let head = http(
        port,
        "HEAD",
        "/org/model/resolve/main/model.safetensors",
        "",
    );
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some(big.len().to_string()));
    assert!(head.body.is_empty());
    let small = http(port, "HEAD", "/org/model/resolve/main/config.json", "");
    assert_eq!(
        small.header("etag"),
        Some(format!("\"{}\"", git_sha1(config)))
    );
    assert_eq!(small.header("x-linked-etag"), None);

    // Ranges: closed, open, suffix; past the end is unsatisfiable.
    let n = big.len();
    for (range, from, to) in [
        ("bytes=5-1048580", 5, 1048581),
        ("bytes=3000000-", 3000000, n),
        ("bytes=-10", n - 10, n),
    ] {
        let r = http(port, "GET", &path, &format!("Range: {range}\r\n"));
        assert_eq!(r.status, 206, "{range}");
        assert!(r.body == big[from..to], "{range}");
        assert_eq!(
            r.header("content-range"),
            Some(format!("bytes {from}-{}/{n}", to - 1)),
        );
    }
    let past = http(port, "GET", &path, &format!("Range: bytes={n}-\r\n"));
    assert_eq!(past.status, 416);
    assert_eq!(past.header("content-range"), Some(format!("bytes */{n}")));

    // A dataset, and a file under a directory.
    let ds = http(
        port,
        "GET",
        "/datasets/org/calib/resolve/main/train.jsonl",
        "",
    );
    assert_eq!(ds.body, b"{\"text\":\"a\"}\n");
    let ds_tree = http(port, "GET", "/api/datasets/org/calib/tree/main", "").json();
    assert_eq!(ds_tree[0]["path"], "train.jsonl");
    let nested = http(
        port,
        "GET",
        "/org/model/resolve/main/tokenizer%2Ftokenizer.json",
        "",
    );
    assert_eq!(nested.body, b"{}");

    // Not found, with the hub's error codes.
    for (path, code) in [
        ("/api/models/org/other/tree/main", "RepoNotFound"),
        ("/org/other/resolve/main/config.json", "RepoNotFound"),
        ("/org/model/resolve/main/missing.json", "EntryNotFound"),
    ] {
        let r = http(port, "GET", path, "");
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.header("x-error-code").as_deref(), Some(code), "{path}");
    }
}

#[test]
fn serves_one_directory_as_one_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("src");
    write(&dir.join("a.bin"), b"hello");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(BIN)
        .args([dir.to_str().unwrap(), "bench/model", &port.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = child.stdout.take().unwrap();
    let mut b = [0u8; 1];
    while out.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0] as char);
    }
    let _server = Server(child);
    assert_eq!(line, format!("ready {port}"));
    let r = http(port, "GET", "/bench/model/resolve/main/a.bin", "");
    assert_eq!(r.body, b"hello");
}

#[test]
fn a_bad_command_line_exits_2() {
    let out = Command::new(BIN).args(["--port", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "--root is required");
}
