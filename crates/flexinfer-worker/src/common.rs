//! What every worker subcommand shares: the JSON-line event stream on stdout, the termination
//! message, the version handshake, and the exit-code mapping (docs/dev/architecture.md §2).

use flexinfer_contract::exit_codes;

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

mod events;
mod fs;
mod retry;
mod termination;

pub use events::Events;
pub use fs::{is_derived_dir, model_files, ModelFile};
pub use retry::Retry;
pub use termination::{check_version, finish, termination_log_path};

#[cfg(test)]
mod tests {
    use super::*;
    use flexinfer_contract as contract;

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
}
