//! The contract between the FlexInfer controller, its worker images and the CLI: annotation and
//! label keys, environment variable names, event names, marker-file names, and the serde types of
//! events, marker files and termination messages. See `docs/dev/architecture.md` ("The
//! controller–worker contract").
//!
//! Serde only: no Kubernetes client, so the worker and the quantization engine depend on this
//! without pulling in kube. Every string here is part of the wire contract; this crate's test
//! `tests/spelled_once.rs` checks that production code spells each one only here.
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

pub mod annotations;
pub mod controller;
pub mod env;
pub mod error;
pub mod events;
pub mod files;
pub mod labels;
pub mod oci_artifact;
pub mod phase;
pub mod proxy;
pub mod reasons;
pub mod serving;
pub mod source;
pub mod termination;
pub mod text;

pub use events::{latest_event, latest_progress, GptqDeviceReport, ProgressEvent, WorkerEvent};
pub use files::{
    AbliterationStatusFile, AwqQuality, Fp8Quality, IntegrityFile, QualitySummary, SaveComplete,
    SaveShard, SourceIntegrity,
};
/// The cache layout, also at the root: every phase needs it.
pub use files::{ABLITERATED_SUBDIR, CACHE_MOUNT, DATASETS_SUBDIR, SOURCE_SUBDIR};
pub use phase::JobPhase;
pub use reasons::FailureReason;
pub use source::SourceUri;
pub use termination::{
    encode_termination, TerminationFailure, TerminationMessage, TerminationSuccess,
};

/// Version of this contract. The controller sets `FLEXINFER_SCRIPT_VERSION` to it; a worker built
/// for another version exits with code 4 and
/// `FATAL: Script version mismatch (image=X controller=Y)`.
pub const SCRIPT_VERSION: &str = "v15";

/// Exit codes of every worker subcommand.
pub mod exit_codes {
    pub const OK: i32 = 0;
    pub const FAILURE: i32 = 1;
    pub const BAD_INPUT: i32 = 2;
    pub const QUALITY_GATE: i32 = 3;
    pub const VERSION_MISMATCH: i32 = 4;
    /// Stopped by SIGTERM (its Job or pod was deleted, the node drained): 128 + 15, like a shell. Not
    /// deterministic: the Job's retry (if any) resumes from what was kept.
    pub const TERMINATED: i32 = 143;
}

/// Parse a boolean env/flag value: `true`/`false` in any letter case, `1`/`0`, `yes`/`no`.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "on" => Some(true),
        "false" | "0" | "no" | "n" | "off" => Some(false),
        _ => None,
    }
}

/// Why a relative path from a spec, a hub listing or a manifest is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    Empty,
    Nul(String),
    Absolute(String),
    ParentDir(String),
}

impl std::fmt::Display for PathError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathError::Empty => write!(f, "empty path"),
            PathError::Nul(p) => write!(f, "path {p:?} contains a NUL byte"),
            PathError::Absolute(p) => write!(f, "path {p:?} is absolute"),
            PathError::ParentDir(p) => write!(f, "path {p:?} contains '..'"),
        }
    }
}

impl std::error::Error for PathError {}

/// Validate a relative path that came from a spec, a hub listing or a manifest: non-empty, not
/// absolute, no `..` component, no NUL. Returns the reason when invalid.
pub fn check_relative_path(p: &str) -> Result<(), PathError> {
    if p.is_empty() {
        return Err(PathError::Empty);
    }
    if p.contains('\0') {
        return Err(PathError::Nul(p.to_string()));
    }
    if p.starts_with('/') || p.starts_with('\\') {
        return Err(PathError::Absolute(p.to_string()));
    }
    if p.split(['/', '\\']).any(|c| c == "..") {
        return Err(PathError::ParentDir(p.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bools_accept_the_usual_spellings() {
        for t in ["true", "True", "TRUE", "1", "yes"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["false", "False", "FALSE", "0", "no"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        assert_eq!(parse_bool("maybe"), None);
    }

    #[test]
    fn latest_progress_skips_noise_and_invalid() {
        let log = r#"human line
{"ts":"2026-01-01T00:00:00Z","event":"progress","percent":10,"layer":1,"layers":10}
{"ts":"2026-01-01T00:00:01Z","event":"progress","percent":20}
{"ts":"2026-01-01T00:00:02Z","event":"progress","percent":250}
{"ts":"2026-01-01T00:00:03Z","event":"hessian_recovery","module":"x"}
{"ts": broken
"#;
        let (ts, p) = latest_progress(log).expect("progress");
        assert_eq!(ts, "2026-01-01T00:00:01Z");
        assert_eq!(p.percent, 20.0);
        assert!(latest_progress("no json here").is_none());
    }

    #[test]
    fn termination_messages_roundtrip_and_fit() {
        let f = TerminationFailure {
            error: "x".repeat(10_000),
            phase: "quantize".into(),
            exit_code: 2,
            tail: "y".repeat(10_000),
        };
        let s = encode_termination(&f);
        assert!(
            s.len() <= files::TERMINATION_MESSAGE_MAX_BYTES,
            "{}",
            s.len()
        );
        match TerminationMessage::parse(&s) {
            Some(TerminationMessage::Failure(back)) => assert_eq!(back.exit_code, 2),
            other => panic!("expected failure, got {other:?}"),
        }
        let ok = TerminationSuccess {
            kind: "gptq-w4-g128".into(),
            compressed_size_bytes: Some(5),
            ..Default::default()
        };
        match TerminationMessage::parse(&encode_termination(&ok)) {
            Some(TerminationMessage::Success(back)) => assert_eq!(back, ok),
            other => panic!("expected success, got {other:?}"),
        }
    }

    #[test]
    fn relative_paths() {
        assert!(check_relative_path("a/b.safetensors").is_ok());
        assert!(check_relative_path("../etc/passwd").is_err());
        assert!(check_relative_path("a/../../b").is_err());
        assert!(check_relative_path("/abs").is_err());
        assert!(check_relative_path("").is_err());
    }

    #[test]
    fn job_phase_names() {
        assert_eq!(JobPhase::Quantize.job_name("c"), "c-quantize");
        assert_eq!(JobPhase::parse("abliteration"), Some(JobPhase::Abliterate));
        assert_eq!(JobPhase::parse("publish"), Some(JobPhase::Publish));
        assert_eq!(
            env::controller_override(env::GPTQ_RESUME_LAYERS),
            "FLEXINFER_GPTQ_RESUME_LAYERS"
        );
    }
}
