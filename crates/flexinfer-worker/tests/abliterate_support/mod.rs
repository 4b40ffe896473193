//! Tiny generated Llama-architecture and Gemma 4 models with a planted refusal direction, their tokenizer and
//! prompt datasets, and helpers to run `flexinfer-worker abliterate` against them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use flexinfer_contract::env;
use sha2::{Digest, Sha256};

#[path = "tiny.rs"]
mod tiny;
pub use tiny::*;
#[path = "gemma.rs"]
mod gemma;
#[allow(unused_imports)] // not every test binary that includes this module builds Gemma models
pub use gemma::*;

pub struct RunOutput {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub termination: serde_json::Value,
}

/// Runs `flexinfer-worker abliterate` with a clean abliteration environment plus `envs`.
pub fn run(model: &TinyModel, out: &Path, envs: &[(&str, &str)], args: &[&str]) -> RunOutput {
    let term = model.root.path().join(format!(
        "termination-{}.json",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flexinfer-worker"));
    cmd.arg("abliterate").args(args);
    for k in [
        env::NUM_SAMPLES,
        env::TARGET_LAYERS,
        env::WEIGHT_MATRICES,
        env::SKIP_GDN_LAYERS,
        env::SKIP_VISION,
        env::NORM_THRESHOLD,
        env::ABLITERATE_LM_HEAD,
        env::MAX_PERPLEXITY_INCREASE_PERCENT,
        env::REFUSAL_DATASET,
        env::HARMLESS_DATASET,
        env::SCRIPT_VERSION,
        env::TELEMETRY,
    ] {
        cmd.env_remove(k);
    }
    cmd.env(env::MODEL_DIR, &model.dir)
        .env(env::OUT_DIR, out)
        .env(env::REFUSAL_DATASET, &model.refusal)
        .env(env::HARMLESS_DATASET, &model.harmless)
        .env(env::NUM_SAMPLES, "24")
        .env(env::TERMINATION_LOG, &term);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    let termination = std::fs::read_to_string(&term)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(serde_json::Value::Null);
    RunOutput {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        termination,
    }
}

/// sha256 of every file below `dir` (relative path → hex).
pub fn checksums(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().to_string();
                out.insert(rel, hex::encode(Sha256::digest(std::fs::read(&p).unwrap())));
            }
        }
    }
    out
}

/// JSON event lines of a run's stdout.
pub fn events(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
        .filter(|v| v.get("event").is_some())
        .collect()
}
