//! The start and stop of FlexInfer's long-running binaries (the controller and the proxy): logs as
//! JSON (plain text for a terminal), a failed run logged and exited with status 1, and SIGTERM or
//! SIGINT as the stop signal.

use std::fmt::Display;

/// Log to stdout: JSON lines (one flat object per event), or plain text when `text` is set.
/// `RUST_LOG` sets the filter (default `info,kube=warn`).
pub fn init_logging(text: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    if text {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    } else {
        tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter(filter)
            .init();
    }
}

/// A failed run is logged (`<binary> exited`, with the whole cause chain) and ends the process with
/// status 1.
pub fn exit_on_error<E: Display>(binary: &str, result: Result<(), E>) {
    if let Err(e) = result {
        tracing::error!(error = %format!("{e:#}"), "{binary} exited");
        std::process::exit(1);
    }
}

/// Resolves on SIGTERM (the kubelet) or SIGINT (a terminal); only on SIGINT where SIGTERM cannot be
/// listened for (logged).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; only SIGINT stops the process");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
