//! The `flexinfer` CLI: request quantization of a ModelCache, inspect its progress, get a
//! recommendation that fits the target GPU, and run the quality and artifact gates in CI.
//!
//! Exit codes: 0 success, 1 failure (gate failed, artifact defects, API errors), 2 bad input.

pub mod args;
pub mod artifact;
pub mod cli;
pub mod cluster;
pub mod footprint;
pub mod output;
pub mod recommend;
pub mod request;
pub mod validate;

pub use cli::Cli;

/// Exit code: success.
pub const EXIT_OK: i32 = 0;
/// Exit code: a gate failed, the artifact has defects, or the API call failed.
pub const EXIT_FAIL: i32 = 1;
/// Exit code: bad input (flags, files).
pub const EXIT_BAD_INPUT: i32 = 2;

/// An error with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad flags or inputs (exit 2).
    #[error("{0}")]
    BadInput(String),
    /// Anything else (exit 1).
    #[error(transparent)]
    Failed(#[from] anyhow::Error),
}

impl CliError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::BadInput(_) => EXIT_BAD_INPUT,
            CliError::Failed(_) => EXIT_FAIL,
        }
    }
}

/// Shorthand for a bad-input error.
pub fn bad(msg: impl Into<String>) -> CliError {
    CliError::BadInput(msg.into())
}
