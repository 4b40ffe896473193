//! Why a transfer failed: [`FetchError`] (with its fatal / retryable classes), [`VerifyError`] for a
//! file that is not what the source promised, and the transport error shown without its URL.

use std::path::PathBuf;

use reqwest::StatusCode;

/// Why a transfer failed. Each failure is of one class ([`FetchError::is_fatal`],
/// [`FetchError::is_retryable`]): fatal ones (401/403/404, unsafe names) will not get better by
/// retrying and exit 2; transient ones (5xx, 429, a dropped connection) are retried with backoff;
/// the rest (verification failed, retries exhausted, the disk) exit 1.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// An HTTP error status; fatal unless [`status_is_retryable`].
    #[error("{}", status_message(.what, *.status, *.has_token))]
    Status {
        what: String,
        status: StatusCode,
        has_token: bool,
    },
    /// The request was not answered.
    #[error("{file}: request failed")]
    Request {
        file: String,
        #[source]
        source: Transport,
    },
    #[error("{file}: server answered a different range; restarting the file")]
    WrongRange { file: String },
    #[error("{file}: range not satisfiable; restarting")]
    RangeNotSatisfiable { file: String },
    #[error("{file}: connection dropped at byte {at} of {size}")]
    Dropped {
        file: String,
        at: u64,
        size: u64,
        #[source]
        source: Transport,
    },
    #[error("{file}: server sent more than the listed {size} bytes")]
    TooLong { file: String, size: u64 },
    #[error("{file}: connection closed at byte {at} of {size}")]
    Closed { file: String, at: u64, size: u64 },
    /// A hub listing page that was not answered.
    #[error("listing {what}")]
    Listing {
        what: String,
        #[source]
        source: reqwest::Error,
    },
    /// A hub listing page that could not be read or parsed.
    #[error("listing {what}: bad response body")]
    ListingBody {
        what: String,
        #[source]
        source: BadBody,
    },
    /// A body over its limit: the server (or its data) is bad.
    #[error(transparent)]
    TooLarge(super::BodyError),
    /// The hub listed a name that would leave the download directory.
    #[error("hub listed an unsafe file name")]
    UnsafeName(#[source] flexinfer_contract::PathError),
    /// The local file system.
    #[error("{what} {}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The blocking writer task did not finish.
    #[error(transparent)]
    Writer(#[from] tokio::task::JoinError),
    /// The file failed verification twice.
    #[error("verification failed twice; the partial file was removed")]
    Verify(#[source] VerifyError),
    /// Transient failures in a row until the retries ran out.
    #[error("{file}: giving up after {attempts} attempts")]
    GaveUp {
        file: String,
        attempts: u32,
        #[source]
        last: Box<FetchError>,
    },
}

impl FetchError {
    /// Will not get better by retrying (exit 2).
    pub fn is_fatal(&self) -> bool {
        match self {
            FetchError::Status { status, .. } => !status_is_retryable(*status),
            FetchError::TooLarge(_) | FetchError::UnsafeName(_) => true,
            _ => false,
        }
    }

    /// Transient: retried with backoff.
    pub fn is_retryable(&self) -> bool {
        match self {
            FetchError::Status { status, .. } => status_is_retryable(*status),
            FetchError::Request { .. }
            | FetchError::WrongRange { .. }
            | FetchError::RangeNotSatisfiable { .. }
            | FetchError::Dropped { .. }
            | FetchError::TooLong { .. }
            | FetchError::Closed { .. }
            | FetchError::Listing { .. }
            | FetchError::ListingBody { .. } => true,
            _ => false,
        }
    }
}

/// A transport error of reqwest shown without its URL (which may carry a signed query), its causes
/// inline ([`strip_url`]).
#[derive(Debug)]
pub struct Transport(pub reqwest::Error);

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&strip_url(&self.0))
    }
}

impl std::error::Error for Transport {}

/// Why a hub listing page was unusable.
#[derive(Debug, thiserror::Error)]
pub enum BadBody {
    #[error(transparent)]
    Read(super::BodyError),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// 5xx, 429 and 408 are transient; other error statuses are not.
pub fn status_is_retryable(s: StatusCode) -> bool {
    s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS || s == StatusCode::REQUEST_TIMEOUT
}

/// A clear error for an HTTP status; never contains credentials.
pub fn http_error(what: &str, s: StatusCode, has_token: bool) -> FetchError {
    FetchError::Status {
        what: what.to_string(),
        status: s,
        has_token,
    }
}

fn status_message(what: &str, s: StatusCode, has_token: bool) -> String {
    match s {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            let hint = if has_token {
                "the token was rejected or lacks access (gated repos need their terms accepted)"
            } else {
                "set HF_TOKEN (secretRef) for private or gated repositories"
            };
            format!("access denied to {what} (HTTP {}): {hint}", s.as_u16())
        }
        StatusCode::NOT_FOUND => {
            format!("{what} not found (HTTP 404): check the repository id, repo type and revision")
        }
        _ => format!("{what}: HTTP {}", s.as_u16()),
    }
}

/// A reqwest error without its URL (URLs may carry presigned query strings).
pub fn strip_url(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    if let Some(u) = e.url() {
        s = s.replace(u.as_str(), "<url>");
    }
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// A downloaded file that is not what the source promised (the partial file is removed and the
/// download retried once).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Another writer, or the disk, changed the file while it was written.
    #[error("{file}: the bytes on disk differ from the bytes received (sha256 {on_disk} on disk, {streamed} received)")]
    ChangedOnDisk {
        file: String,
        on_disk: String,
        streamed: String,
    },
    #[error("sha256 mismatch for {file}: expected {want}, got {got}")]
    Sha256 {
        file: String,
        want: String,
        got: String,
    },
    #[error("git blob sha1 mismatch for {file}: expected {want}, got {got}")]
    GitSha1 {
        file: String,
        want: String,
        got: String,
    },
    #[error("hashing {file}")]
    Hashing {
        file: String,
        #[source]
        source: std::io::Error,
    },
}
