//! What every worker subcommand shares: the JSON-line event stream on stdout, the termination
//! message, the version handshake, and the exit-code mapping (docs/dev/architecture.md, "The controller–worker contract").

use flexinfer_contract::error::chain;
use flexinfer_contract::exit_codes;

/// The exit-code class of a worker failure (the controller reads the code, not the text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    /// Bad input or configuration (exit 2).
    BadInput,
    /// A quality gate failed (exit 3).
    QualityGate,
    /// The image and the controller disagree on the contract version (exit 4).
    VersionMismatch,
    /// Anything else (exit 1).
    Failure,
}

impl ExitKind {
    pub fn code(self) -> i32 {
        match self {
            ExitKind::BadInput => exit_codes::BAD_INPUT,
            ExitKind::QualityGate => exit_codes::QUALITY_GATE,
            ExitKind::VersionMismatch => exit_codes::VERSION_MISMATCH,
            ExitKind::Failure => exit_codes::FAILURE,
        }
    }
}

/// A worker failure with the exit code it maps to ([`WorkerError::kind`]). Its text is what the
/// termination message and the cache's status show ([`chain`]: the variant's text, then its causes);
/// where an underlying error exists it is the variant's `#[source]` and the text names only the file
/// or field.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The image and the controller disagree on the contract version (exit 4).
    #[error("FATAL: Script version mismatch (image={image} controller={controller}). Rebuild or re-pin the worker image.")]
    VersionMismatch { image: String, controller: String },
    /// The text of another failure of class `kind` with secrets scrubbed out ([`WorkerError::map_message`]):
    /// the original is not kept, so that the secret is not either.
    #[error("{text}")]
    Scrubbed { kind: ExitKind, text: String },
    /// `node-copy` (exit 2).
    #[error(transparent)]
    NodeCopy(Box<NodeCopyError>),
    /// `download` (exit 2, or 1 for a full disk).
    #[error(transparent)]
    Download(Box<DownloadError>),
    /// `publish` (exit 2, or 1 when the registry stored something else).
    #[error(transparent)]
    Publish(Box<PublishError>),
    /// `abliterate` (exit 2, 3 for a failed quality gate, 1 for a failed edit).
    #[error(transparent)]
    Abliterate(Box<AbliterateError>),
    /// `quantize` (exit 2, or 3 for a failed quality gate).
    #[error(transparent)]
    Quantize(Box<QuantizeError>),
    /// A dataset setting (exit 2).
    #[error(transparent)]
    Dataset(Box<DatasetError>),
    /// A file-system call failed; `context` names the operation and the path.
    #[error("{context}")]
    Io {
        kind: ExitKind,
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A JSON document could not be parsed or encoded; `context` names it.
    #[error("{context}")]
    Json {
        kind: ExitKind,
        context: String,
        #[source]
        source: serde_json::Error,
    },
    /// Another underlying error (a path or reference that does not parse, a model config the
    /// engine refuses, …); `context` names the field or file.
    #[error("{context}")]
    Caused {
        kind: ExitKind,
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An underlying error whose own text already names the file or field (a refused read, a
    /// dataset the reader cannot use, a device that cannot be selected).
    #[error(transparent)]
    Wrapped(Wrapped),
    /// Another Job holds the writer lock of the output directory (exit 2).
    #[error(
        "refusing to write: another Job writes this directory (it must finish or be deleted first)"
    )]
    Locked(#[source] std::io::Error),
    /// A file pattern (`allowPatterns`, `ignorePatterns`) does not compile (exit 2).
    #[error("{context}")]
    Pattern {
        context: String,
        #[source]
        source: globset::Error,
    },
    /// The HTTP client could not be built (exit 1).
    #[error("cannot build the HTTP client")]
    HttpClient(#[source] reqwest::Error),
    /// A blocking task of the async runtime failed (exit 1).
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// A transfer failed (exit 2 when retrying cannot help, else 1).
    #[error(transparent)]
    Fetch(#[from] crate::http::error::FetchError),
    /// An OCI registry operation failed (exit 2 for a bad reference, artifact or credentials, else 1).
    #[error(transparent)]
    Oci(#[from] crate::oci::OciError),
    /// The engine failed (exit 2 when the input is at fault, else 1).
    #[error(transparent)]
    Quant(#[from] flexinfer_quant::QuantError),
}

impl WorkerError {
    /// `map_err` for a file-system call: `context` names the operation and the path.
    pub fn io(kind: ExitKind, context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let context = context.into();
        move |source| WorkerError::Io {
            kind,
            context,
            source,
        }
    }

    /// `map_err` for a JSON parse or encode: `context` names the document.
    pub fn json(
        kind: ExitKind,
        context: impl Into<String>,
    ) -> impl FnOnce(serde_json::Error) -> Self {
        let context = context.into();
        move |source| WorkerError::Json {
            kind,
            context,
            source,
        }
    }

    /// `map_err` for any other underlying error: `context` names the field or file.
    pub fn caused<E: std::error::Error + Send + Sync + 'static>(
        kind: ExitKind,
        context: impl Into<String>,
    ) -> impl FnOnce(E) -> Self {
        let context = context.into();
        move |source| WorkerError::Caused {
            kind,
            context,
            source: Box::new(source),
        }
    }

    /// `map_err` for an underlying error whose text already names what failed.
    pub fn wrap<E: std::error::Error + Send + Sync + 'static>(
        kind: ExitKind,
    ) -> impl FnOnce(E) -> Self {
        move |source| {
            WorkerError::Wrapped(Wrapped {
                kind,
                source: Box::new(source),
            })
        }
    }

    pub fn kind(&self) -> ExitKind {
        match self {
            WorkerError::Locked(_) | WorkerError::Pattern { .. } => ExitKind::BadInput,
            WorkerError::VersionMismatch { .. } => ExitKind::VersionMismatch,
            WorkerError::HttpClient(_) | WorkerError::Task(_) => ExitKind::Failure,
            WorkerError::NodeCopy(e) => e.kind(),
            WorkerError::Download(e) => e.kind(),
            WorkerError::Publish(e) => e.kind(),
            WorkerError::Abliterate(e) => e.kind(),
            WorkerError::Quantize(e) => e.kind(),
            WorkerError::Dataset(e) => e.kind(),
            WorkerError::Scrubbed { kind, .. }
            | WorkerError::Io { kind, .. }
            | WorkerError::Json { kind, .. }
            | WorkerError::Caused { kind, .. }
            | WorkerError::Wrapped(Wrapped { kind, .. }) => *kind,
            WorkerError::Fetch(e) if e.is_fatal() => ExitKind::BadInput,
            WorkerError::Fetch(_) => ExitKind::Failure,
            WorkerError::Oci(e) if e.is_bad_input() => ExitKind::BadInput,
            WorkerError::Oci(_) => ExitKind::Failure,
            WorkerError::Quant(e) if e.is_bad_input() => ExitKind::BadInput,
            WorkerError::Quant(_) => ExitKind::Failure,
        }
    }

    pub fn exit_code(&self) -> i32 {
        self.kind().code()
    }

    /// The same failure (same exit code) with its text rewritten by `f` (scrubbing secrets before
    /// the termination message). An error whose text `f` changes becomes [`WorkerError::Scrubbed`]
    /// of its class: its cause is in the text, and the original is not kept, secret included.
    pub fn map_message(self, f: impl Fn(String) -> String) -> Self {
        let text = chain(&self);
        let scrubbed = f(text.clone());
        if scrubbed == text {
            self
        } else {
            WorkerError::Scrubbed {
                kind: self.kind(),
                text: scrubbed,
            }
        }
    }
}

// The per-area errors are boxed: a `Result<_, WorkerError>` stays small.
macro_rules! boxed_from {
    ($($area:ident => $variant:ident),* $(,)?) => {$(
        impl From<$area> for WorkerError {
            fn from(e: $area) -> Self {
                WorkerError::$variant(Box::new(e))
            }
        }
    )*};
}
boxed_from!(
    NodeCopyError => NodeCopy,
    DownloadError => Download,
    PublishError => Publish,
    AbliterateError => Abliterate,
    QuantizeError => Quantize,
    DatasetError => Dataset,
);

/// An underlying error of class `kind` whose own text already names what failed: shown as that error
/// (its text and its `source()` are the wrapped error's, as `#[error(transparent)]` would).
#[derive(Debug)]
pub struct Wrapped {
    pub kind: ExitKind,
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.source, f)
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

pub use flexinfer_fsutil::{now_rfc3339, write_atomic};

mod error;
mod events;
mod fs;
mod termination;

pub use error::{
    AbliterateError, DatasetError, DownloadError, ModelPackProblem, NodeCopyError, PublishError,
    QuantizeError,
};

pub use crate::retry::Retry;
pub use events::Events;
pub use fs::{is_derived_dir, model_files, ModelFile, IN_PROGRESS_FILE};
pub use termination::{check_version, exit_on_sigterm, finish, termination_log_path};

#[cfg(test)]
mod tests {
    use super::*;
    use flexinfer_contract as contract;

    #[test]
    fn version_mismatch_is_exit_4_with_the_fatal_message() {
        assert!(check_version(None).is_ok());
        assert!(check_version(Some(contract::SCRIPT_VERSION)).is_ok());
        let e = check_version(Some("v1")).unwrap_err();
        assert_eq!(e.exit_code(), 4);
        assert!(e
            .to_string()
            .starts_with("FATAL: Script version mismatch (image="));
        assert!(flexinfer_contract::error::chain(&e).contains("controller=v1"));
    }

    /// The termination text names the engine's causes, and scrubbing reaches them.
    #[test]
    fn the_message_names_the_cause_and_scrubbing_reaches_it() {
        let engine = |cause: &str| {
            WorkerError::Quant(flexinfer_quant::QuantError::Safetensors {
                path: "m/a.safetensors".into(),
                tensor: None,
                source: cause.to_string().into(),
            })
        };
        let e = engine("header too large");
        assert_eq!(
            chain(&e),
            "safetensors error in m/a.safetensors: header too large"
        );
        let e = engine("token s3cret refused").map_message(|m| m.replace("s3cret", "<redacted>"));
        assert_eq!(e.exit_code(), 2);
        assert!(!chain(&e).contains("s3cret"), "{}", chain(&e));
        assert!(
            chain(&e).contains("token <redacted> refused"),
            "{}",
            chain(&e)
        );
    }
}
