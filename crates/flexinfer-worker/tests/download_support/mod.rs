//! Test helpers for the transfer tests: the Hugging Face Hub-compatible server (flexinfer-hub, with
//! fault injection and per-file request accounting) over generated files, generated data, and a
//! runner for the worker binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

pub use flexinfer_hub::{HubServer, ServedFile};

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
    let (_, sha256, _) = flexinfer_hub::repo::hash_file(path)
        .unwrap_or_else(|e| panic!("hash {}: {e}", path.display()));
    sha256
}

/// Describe the files of a directory as the hub lists them ([`flexinfer_hub::describe`]).
pub fn describe(dir: &Path) -> Vec<ServedFile> {
    flexinfer_hub::describe(dir).unwrap_or_else(|e| panic!("describe {}: {e}", dir.display()))
}

/// Serve `revisions` of `repo` on a loopback port ([`HubServer::start`]).
pub fn start_hub(repo: &str, revisions: Vec<(&str, Vec<ServedFile>)>) -> HubServer {
    HubServer::start(repo, revisions).expect("start the hub")
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
