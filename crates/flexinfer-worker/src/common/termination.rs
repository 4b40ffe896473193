//! The termination message, the version handshake and the exit-code mapping.

use std::path::PathBuf;

use flexinfer_contract::{
    self as contract, encode_termination, env, events, exit_codes, TerminationFailure,
    TerminationSuccess,
};

use super::{Events, WorkerError};

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
