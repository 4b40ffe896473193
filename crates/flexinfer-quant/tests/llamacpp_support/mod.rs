//! What tests/gguf_llamacpp.rs needs around the real llama.cpp: the root (`FLEXINFER_LLAMACPP_ROOT`),
//! running its tools there, a `llama-server` on a unix socket, its loader's report, the generated
//! models and our forward pass as the reference.

use flexinfer_quant::gguf::{write_gguf, FileType, GgufJob, GgufSummary};
use flexinfer_quant::testkit::{self, ModelSize};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Output;

pub const WIDE: ModelSize = ModelSize::GGUF_WIDE;
/// Rows of 288 values do not split into 256-value super-blocks (llama.cpp's fallback types); 8
/// layers reach more of the presets' per-layer rules.
pub const NARROW: ModelSize = ModelSize {
    hidden: 288,
    layers: 8,
    ..WIDE
};

pub fn llamacpp_root() -> Option<PathBuf> {
    match std::env::var_os("FLEXINFER_LLAMACPP_ROOT") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => {
            let required = std::env::var("FLEXINFER_REQUIRE_LLAMACPP").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "FLEXINFER_REQUIRE_LLAMACPP=1 but FLEXINFER_LLAMACPP_ROOT is not set \
                 (export FLEXINFER_LLAMACPP_ROOT=$(bash scripts/gguf/llamacpp-root.sh))"
            );
            println!(
                "SKIPPED: FLEXINFER_LLAMACPP_ROOT is not set (bash scripts/gguf/llamacpp-root.sh builds the root)"
            );
            None
        }
    }
}

/// Runs a llama.cpp tool in the root with `dir` as its /work (scripts/gguf/llamacpp-run.sh), under a
/// time limit.
pub fn run(root: &Path, dir: &Path, args: &[&str]) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf/llamacpp-run.sh");
    std::process::Command::new("bash")
        .arg(script)
        .arg(root)
        .arg(dir)
        .args(["timeout", "300"])
        .args(args)
        .output()
        .unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub enum Arch {
    /// testkit's Llama: Llama 3 rope scaling with an original context of 64, so that most
    /// frequencies are scaled (`rope_freqs.weight` matters even for short prompts).
    Llama(ModelSize),
    /// The same weights with linear rope scaling (factor 4).
    LlamaLinearRope,
    /// The same weights without rope scaling.
    LlamaNoRopeScaling,
    Qwen2,
}

pub fn set_rope_scaling(dir: &Path, scaling: Option<serde_json::Value>) {
    let p = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    match scaling {
        Some(v) => cfg["rope_scaling"] = v,
        None => {
            cfg.as_object_mut().unwrap().remove("rope_scaling");
        }
    }
    std::fs::write(&p, serde_json::to_vec(&cfg).unwrap()).unwrap();
}

pub fn model(dir: &Path, arch: &Arch) {
    match arch {
        Arch::Llama(size) => {
            testkit::write_model_sized(dir, "LlamaForCausalLM", 1, size).unwrap();
        }
        Arch::LlamaLinearRope => {
            testkit::write_model_sized(dir, "LlamaForCausalLM", 1, &WIDE).unwrap();
            set_rope_scaling(dir, Some(json!({"type": "linear", "factor": 4.0})));
        }
        Arch::LlamaNoRopeScaling => {
            testkit::write_model_sized(dir, "LlamaForCausalLM", 1, &WIDE).unwrap();
            set_rope_scaling(dir, None);
        }
        Arch::Qwen2 => {
            testkit::write_model_sized(dir, "Qwen2ForCausalLM", 2, &WIDE).unwrap();
            // Qwen2 with Llama 3 rope scaling is not a real config (as in gguf_export.rs).
            let p = dir.join("config.json");
            let mut cfg: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
            cfg.as_object_mut().unwrap().remove("rope_scaling");
            cfg["model_type"] = json!("qwen2");
            std::fs::write(&p, serde_json::to_vec(&cfg).unwrap()).unwrap();
        }
    }
    testkit::write_byte_level_tokenizer(dir).unwrap();
}

pub fn ours(
    src: &Path,
    out: &Path,
    ft: FileType,
    imp: Option<&HashMap<String, Vec<f32>>>,
) -> GgufSummary {
    write_gguf(&GgufJob {
        model_dir: src,
        out_path: out,
        file_type: ft,
        importance: imp,
        name: "tiny",
    })
    .unwrap()
}

/// llama.cpp's `llama_model_ftype_name` for a preset (what its loader prints as "file type").
pub fn llama_cpp_ftype_name(ft: FileType) -> &'static str {
    match ft {
        FileType::F16 => "F16",
        FileType::BF16 => "BF16",
        FileType::Q8_0 => "Q8_0",
        FileType::Q4_0 => "Q4_0",
        FileType::Q6K => "Q6_K",
        FileType::Q5KM => "Q5_K - Medium",
        FileType::Q5KS => "Q5_K - Small",
        FileType::Q4KM => "Q4_K - Medium",
        FileType::Q4KS => "Q4_K - Small",
        FileType::Q3KM => "Q3_K - Medium",
        FileType::Q2K => "Q2_K - Medium",
        FileType::IQ4XS => "IQ4_XS - 4.25 bpw",
    }
}

/// The value after `marker` on the first log line that has it, up to the end of the line.
pub fn after<'a>(log: &'a str, marker: &str) -> Option<&'a str> {
    log.lines()
        .find_map(|l| l.split_once(marker).map(|(_, rest)| rest.trim()))
}

/// The number right before `unit` in `s` ("... and 40 tensors" → 40).
pub fn count_before(s: &str, unit: &str) -> Option<usize> {
    let head = s.split(unit).next()?;
    head.split_whitespace().last()?.parse().ok()
}

/// What llama.cpp's loader reported: tensor count, key-value count, tensors per ggml type (its
/// lowercase names), file type.
#[derive(Debug)]
pub struct LoadReport {
    pub kv: usize,
    pub tensors: usize,
    pub per_type: BTreeMap<String, usize>,
    pub file_type: String,
}

pub fn load_report(log: &str) -> LoadReport {
    let loaded = after(log, "llama_model_loader: loaded meta data with ")
        .unwrap_or_else(|| panic!("no load line in llama.cpp's log:\n{log}"));
    // "<kv> key-value pairs and <n> tensors from ..."
    let kv = count_before(loaded, "key-value pairs").unwrap();
    let tensors = count_before(loaded.split_once("pairs and").unwrap().1, "tensors").unwrap();
    // The loader logs the type counts right after the metadata; the model may be loaded more than
    // once (the tools fit the parameters to the memory first), so only the first block is read.
    let mut per_type = BTreeMap::new();
    let mut in_block = false;
    for l in log.lines() {
        if let Some((_, rest)) = l.split_once("llama_model_loader: - type ") {
            let (name, n) = rest.split_once(':').unwrap();
            per_type.insert(name.trim().to_string(), count_before(n, "tensors").unwrap());
            in_block = true;
        } else if in_block {
            break;
        }
    }
    let file_type = after(log, "print_info: file type   = ")
        .unwrap()
        .to_string();
    LoadReport {
        kv,
        tensors,
        per_type,
        file_type,
    }
}

pub const PROMPT: &str = "the that at";

/// How many tokens the model directory's tokenizer.json (through the `tokenizers` crate) makes of
/// `text`, with the special tokens its post-processor adds.
pub fn token_count(model_dir: &Path, text: &str) -> usize {
    use flexinfer_quant::calib::{encode, load_tokenizer};
    encode(&load_tokenizer(model_dir).unwrap(), text, "prompt")
        .unwrap()
        .len()
}

/// A `llama-server` on a unix socket in the test's directory (no TCP port), killed on drop. Its log
/// (`-v`: the loader's report) goes to a file: llama-server keeps running, so the log is complete by
/// the time it is read (llama-completion may exit before its logging thread has written everything).
pub struct Server {
    child: std::process::Child,
    sock: PathBuf,
    log: PathBuf,
}

impl Server {
    pub fn start(root: &Path, dir: &Path, file: &str) -> Server {
        let tag = file.trim_end_matches(".gguf");
        let (sock, log) = (
            dir.join(format!("{tag}.sock")),
            dir.join(format!("{tag}.log")),
        );
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf/llamacpp-run.sh");
        let out = std::fs::File::create(&log).unwrap();
        let child = std::process::Command::new("bash")
            .arg(script)
            .arg(root)
            .arg(dir)
            // Under `timeout`: a server whose test process was killed does not outlive it by long.
            .args([
                "timeout",
                "--kill-after=10",
                "600",
                "llama-server",
                "-m",
                file,
                "--host",
            ])
            .arg(format!("/work/{tag}.sock"))
            .args([
                "-t",
                "2",
                "-c",
                "256",
                "-np",
                "1",
                "--no-warmup",
                "--no-webui",
                "-v",
            ])
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let mut server = Server { child, sock, log };
        // Ready when /health answers 200 (503 while loading); a server that exits is a failure.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!(
                    "{file}: llama-server exited ({status}):\n{}",
                    server.log_text()
                );
            }
            if server.sock.exists() {
                if let Ok((200, _)) = server.try_request("GET", "/health", None) {
                    return server;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{file}: llama-server not ready in 120 s:\n{}",
                server.log_text()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        text(&std::fs::read(&self.log).unwrap_or_default())
    }

    /// One HTTP/1.1 request over the socket: status and JSON body.
    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> std::io::Result<(u16, serde_json::Value)> {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&self.sock)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(300)))?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: llama\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp)?;
        let resp = text(&resp);
        let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
        assert!(
            !head
                .to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "{head}"
        );
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        Ok((
            status,
            serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
        ))
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> serde_json::Value {
        let (status, v) = self.try_request(method, path, body).unwrap();
        assert_eq!(status, 200, "{method} {path}: {v}\n{}", self.log_text());
        v
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The child is `timeout` (the run script and chroot exec it): SIGTERM makes it stop the
        // server and exit; SIGKILL only if that takes more than 10 s.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's pid, which `wait` has not reaped yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Token ids of `text` by the model directory's tokenizer.json (the `tokenizers` crate).
pub fn token_ids(model_dir: &Path, text: &str) -> Vec<u32> {
    use flexinfer_quant::calib::{encode, load_tokenizer};
    encode(&load_tokenizer(model_dir).unwrap(), text, "prompt").unwrap()
}

/// log-softmax of the next-token logits after `tokens`, by our forward pass over the source
/// checkpoint in transformers' layout (`flexinfer_quant::llama::logits`; no GGUF involved).
pub fn reference_logprobs(model_dir: &Path, tokens: &[u32]) -> Vec<f64> {
    use flexinfer_quant::llama::logits;
    use flexinfer_quant::model::ModelConfig;
    use flexinfer_quant::tensors::TensorStore;
    let cfg = ModelConfig::load(model_dir).unwrap();
    let l = logits(&TensorStore::open_dir(model_dir).unwrap(), &cfg, tokens).unwrap();
    let last: Vec<f64> = (0..l.ncols())
        .map(|j| f64::from(l[(l.nrows() - 1, j)]))
        .collect();
    let max = last.iter().copied().fold(f64::MIN, f64::max);
    let log_z = last.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    last.iter().map(|v| v - max - log_z).collect()
}

pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}
