//! What every worker subcommand shares: the JSON-line event stream on stdout, the termination
//! message, the version handshake, and the exit-code mapping (docs/dev/architecture.md §2).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use flexinfer_contract::{
    self as contract, encode_termination, env, events, exit_codes, ProgressEvent,
    TerminationFailure, TerminationSuccess, WorkerEvent,
};
use serde::Serialize;

/// A worker failure with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Bad input or configuration (exit 2).
    #[error("{0}")]
    BadInput(String),
    /// A quality gate failed (exit 3).
    #[error("{0}")]
    QualityGate(String),
    /// The image and the controller disagree on the contract version (exit 4).
    #[error("{0}")]
    VersionMismatch(String),
    /// Anything else (exit 1).
    #[error("{0}")]
    Other(String),
}

impl WorkerError {
    pub fn exit_code(&self) -> i32 {
        match self {
            WorkerError::BadInput(_) => exit_codes::BAD_INPUT,
            WorkerError::QualityGate(_) => exit_codes::QUALITY_GATE,
            WorkerError::VersionMismatch(_) => exit_codes::VERSION_MISMATCH,
            WorkerError::Other(_) => exit_codes::FAILURE,
        }
    }
}

pub use flexinfer_fsutil::{now_rfc3339, write_atomic};

/// Writes events to stdout and keeps `progress` monotonic within the process.
pub struct Events {
    phase: String,
    enabled: bool,
    last_percent: Mutex<f64>,
    /// Recent human/log lines kept for the failure termination message.
    tail: Mutex<Vec<String>>,
}

impl Events {
    /// `phase`: the status name (`download`, `abliteration`, `quantization`, `publish`).
    pub fn new(phase: &str) -> Self {
        let enabled = std::env::var(env::TELEMETRY)
            .ok()
            .and_then(|v| contract::parse_bool(&v))
            .unwrap_or(true);
        Self {
            phase: phase.to_string(),
            enabled,
            last_percent: Mutex::new(0.0),
            tail: Mutex::new(Vec::new()),
        }
    }

    /// Emit an arbitrary event with a serializable object payload.
    pub fn emit<T: Serialize>(&self, event: &str, payload: &T) {
        let ev = WorkerEvent::new(now_rfc3339(), event, payload);
        if let Ok(line) = serde_json::to_string(&ev) {
            self.remember(&line);
            if self.enabled || event == events::ERROR || event == events::COMPLETE {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        }
    }

    /// Emit a `progress` event; a percent lower than the last one is raised to it.
    pub fn progress(&self, mut p: ProgressEvent) {
        let mut last = self.last_percent.lock().unwrap_or_else(|e| e.into_inner());
        if !p.percent.is_finite() {
            return;
        }
        p.percent = p.percent.clamp(0.0, 100.0).max(*last);
        *last = p.percent;
        drop(last);
        if p.phase.is_none() {
            p.phase = Some(self.phase.clone());
        }
        self.emit(events::PROGRESS, &p);
    }

    /// A human log line (stderr) that is also kept for the failure tail.
    pub fn log(&self, msg: &str) {
        eprintln!("{msg}");
        self.remember(msg);
    }

    fn remember(&self, line: &str) {
        let mut t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        t.push(line.to_string());
        let excess = t.len().saturating_sub(40);
        if excess > 0 {
            t.drain(..excess);
        }
    }

    pub fn tail(&self) -> String {
        self.tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    pub fn phase(&self) -> &str {
        &self.phase
    }
}

/// Where the termination message goes.
pub fn termination_log_path() -> PathBuf {
    std::env::var_os(env::TERMINATION_LOG)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(contract::files::DEFAULT_TERMINATION_LOG))
}

fn write_termination(text: &str) {
    let path = termination_log_path();
    if let Err(e) = std::fs::write(&path, text) {
        eprintln!(
            "warning: cannot write termination message to {}: {e}",
            path.display()
        );
    }
}

/// Check `FLEXINFER_SCRIPT_VERSION` against this build's contract version (unset = by hand: ok).
pub fn check_version(expected_by_controller: Option<&str>) -> Result<(), WorkerError> {
    match expected_by_controller {
        Some(v) if !v.is_empty() && v != contract::SCRIPT_VERSION => {
            Err(WorkerError::VersionMismatch(format!(
                "FATAL: Script version mismatch (image={} controller={v}). Rebuild or re-pin the worker image.",
                contract::SCRIPT_VERSION
            )))
        }
        _ => Ok(()),
    }
}

/// Finish a subcommand: write the termination message and the `complete`/`error` event, and
/// return the process exit code.
pub fn finish(events: &Events, result: Result<TerminationSuccess, WorkerError>) -> i32 {
    match result {
        Ok(msg) => {
            events.emit(events::COMPLETE, &msg);
            write_termination(&encode_termination(&msg));
            exit_codes::OK
        }
        Err(e) => {
            let code = e.exit_code();
            let msg = TerminationFailure {
                error: e.to_string(),
                phase: events.phase().to_string(),
                exit_code: code,
                tail: events.tail(),
            };
            events.emit(
                events::ERROR,
                &serde_json::json!({"error": msg.error, "exitCode": code}),
            );
            eprintln!("error: {}", msg.error);
            write_termination(&encode_termination(&msg));
            code
        }
    }
}

/// Whether a directory under a model directory holds derived or in-progress artifacts (abliterated
/// model, GPTQ outputs and resume cache, hub datasets, `*.partial`/`*.old` staging) rather than the
/// model's own files.
pub fn is_derived_dir(name: &str) -> bool {
    name == contract::ABLITERATED_SUBDIR
        || name.starts_with(&format!("{}.", contract::ABLITERATED_SUBDIR))
        || name == contract::files::GPTQ_CACHE_DIR
        || name == contract::DATASETS_SUBDIR
        || name.starts_with("gptq-")
        || contract::files::is_generation_of(name, contract::SOURCE_SUBDIR)
        || name.ends_with(".partial")
        || name.ends_with(".old")
}

/// One regular file of a model directory: path relative to the root (with `/`), full path, size.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ModelFile {
    pub rel: String,
    pub path: PathBuf,
    pub size: u64,
}

/// The model's own files under `root`, sorted by relative path: derived directories
/// ([`is_derived_dir`]), `*.part` files and the download's in-progress marker are skipped.
pub fn model_files(root: &Path) -> std::io::Result<Vec<ModelFile>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<ModelFile>) -> std::io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().to_string();
            let t = e.file_type()?;
            if t.is_dir() {
                if !is_derived_dir(&name) {
                    walk(root, &e.path(), out)?;
                }
                continue;
            }
            if !t.is_file() || name.ends_with(".part") || name == crate::download::IN_PROGRESS_FILE
            {
                continue;
            }
            // The writer lock of a derived directory beside the model's files (`abliterated.<gen>.lock`).
            if name
                .strip_prefix('.')
                .and_then(|n| n.strip_suffix(flexinfer_fsutil::LOCK_SUFFIX))
                .is_some_and(is_derived_dir)
            {
                continue;
            }
            let rel = e
                .path()
                .strip_prefix(root)
                .map_err(std::io::Error::other)?
                .to_string_lossy()
                .replace('\\', "/");
            out.push(ModelFile {
                rel,
                path: e.path(),
                size: e.metadata()?.len(),
            });
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, root, &mut out)?;
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_mismatch_is_exit_4_with_seed_text() {
        assert!(check_version(None).is_ok());
        assert!(check_version(Some(contract::SCRIPT_VERSION)).is_ok());
        let e = check_version(Some("v1")).unwrap_err();
        assert_eq!(e.exit_code(), 4);
        assert!(e
            .to_string()
            .starts_with("FATAL: Script version mismatch (image="));
        assert!(e.to_string().contains("controller=v1"));
    }

    #[test]
    fn progress_is_monotonic() {
        let ev = Events::new("quantization");
        ev.progress(ProgressEvent {
            percent: 40.0,
            ..Default::default()
        });
        ev.progress(ProgressEvent {
            percent: 10.0,
            ..Default::default()
        });
        assert_eq!(*ev.last_percent.lock().unwrap(), 40.0);
        let tail = ev.tail();
        let last = tail.lines().last().unwrap();
        let parsed = WorkerEvent::parse_line(last).unwrap().progress().unwrap();
        assert_eq!(parsed.percent, 40.0);
    }

    #[test]
    fn model_files_skip_derived_and_partial() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "config.json",
            "sub/model.safetensors",
            "x.part",
            "abliterated/model.safetensors",
            "abliterated.partial/a",
            ".gptq-w4-g128.partial/a",
            "gptq-w4-g128/model.safetensors",
            ".flexinfer-gptq-cache/checkpoint.json",
            ".datasets/d/train.jsonl",
        ] {
            let p = d.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"x").unwrap();
        }
        let rels: Vec<String> = model_files(d.path())
            .unwrap()
            .into_iter()
            .map(|f| f.rel)
            .collect();
        assert_eq!(rels, ["config.json", "sub/model.safetensors"]);
    }

    #[test]
    fn atomic_write_replaces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x/y.json");
        write_atomic(&p, b"1").unwrap();
        write_atomic(&p, b"2").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"2");
    }
}
