//! The termination message, the version handshake and the exit-code mapping.

use std::path::PathBuf;

use flexinfer_contract::{
    self as contract, encode_termination, env, events, exit_codes, TerminationFailure,
    TerminationSuccess,
};

use super::{Events, WorkerError};
use flexinfer_contract::error::chain;

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
            Err(WorkerError::VersionMismatch {
                image: contract::SCRIPT_VERSION.to_string(),
                controller: v.to_string(),
            })
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
                error: chain(&e),
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

/// Ends the process at once, as SIGKILL would, when SIGTERM arrives (its Job or pod was deleted, the node
/// is drained): the termination message says so and the exit code is [`exit_codes::TERMINATED`]. What the
/// run wrote so far stays for the next run exactly as after SIGKILL (partial downloads, the per-layer GPTQ
/// cache, staged outputs; every write that matters is atomic or verified on resume). Without it the worker,
/// PID 1 of its container and so deaf to SIGTERM, would run on until the grace period's SIGKILL: a replaced
/// quantize Job (new quantizer image) could even finish into an output nobody uses and clear the layer cache
/// its replacement was to resume from. Called once by the worker binary, not by the library's tests.
pub fn exit_on_sigterm(phase: &'static str) {
    let spawned = std::thread::Builder::new()
        .name("sigterm".into())
        .spawn(move || {
            let waited = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .map_err(|e| e.to_string())
                .and_then(|rt| {
                    rt.block_on(async {
                        let mut term = tokio::signal::unix::signal(
                            tokio::signal::unix::SignalKind::terminate(),
                        )
                        .map_err(|e| e.to_string())?;
                        term.recv().await;
                        Ok(())
                    })
                });
            if let Err(e) = waited {
                eprintln!("warning: cannot listen for SIGTERM ({e}); the worker stops at SIGKILL");
                return;
            }
            let msg = TerminationFailure {
                error: "stopped by SIGTERM (the Job or pod was deleted, or the node drained); what was written so far is kept for the next run".into(),
                phase: phase.to_string(),
                exit_code: exit_codes::TERMINATED,
                tail: String::new(),
            };
            eprintln!("error: {}", msg.error);
            write_termination(&encode_termination(&msg));
            std::process::exit(exit_codes::TERMINATED);
        });
    if let Err(e) = spawned {
        eprintln!("warning: cannot start the SIGTERM listener ({e}); the worker stops at SIGKILL");
    }
}
