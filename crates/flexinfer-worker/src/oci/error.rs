//! The OCI client's errors: which are bad input (exit 2) and which are transport or registry failures.

use super::artifact::LayerProblem;
use super::InvalidTag;
use crate::http;
use crate::http::error::Transport;
use reqwest::StatusCode;
use std::path::PathBuf;

/// OCI client errors: a bad reference, artifact or credentials ([`OciError::is_bad_input`], exit
/// 2), else a transport or registry failure (exit 1; a blob upload retries those).
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("invalid OCI reference {reference:?}")]
    Reference {
        reference: String,
        #[source]
        problem: ReferenceProblem,
    },
    #[error("cannot read docker config {}", .path.display())]
    DockerConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("docker config {} is not valid JSON", .path.display())]
    DockerConfigJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("docker config entry for {registry}: auth is not base64")]
    AuthNotBase64 {
        registry: String,
        #[source]
        source: base64::DecodeError,
    },
    #[error("docker config entry for {registry}: auth is not UTF-8")]
    AuthNotUtf8 {
        registry: String,
        #[source]
        source: std::string::FromUtf8Error,
    },
    #[error("docker config entry for {registry} has neither username/password nor auth")]
    NoCredentialsInEntry { registry: String },
    #[error(
        "if this registry speaks plain HTTP or uses a certificate you do not trust, set \
         publish.insecure: true (OCI_INSECURE); TLS with {base} failed"
    )]
    Tls {
        base: String,
        #[source]
        source: Transport,
    },
    #[error("registry {registry} is not a host name")]
    NotAHost { registry: String },
    #[error("{what}: not found (HTTP 404)")]
    NotFound { what: String },
    #[error("manifest digest mismatch: asked for {want}, registry served {served}")]
    DigestMismatch { want: String, served: String },
    #[error("{reference} is not an OCI image manifest")]
    NotAManifest {
        reference: String,
        #[source]
        source: serde_json::Error,
    },
    /// A layer that is not written out as a file (an archive, an unknown media type, no or an unsafe path).
    #[error("layer {index} ({digest}, media type {media_type})")]
    LayerRefused {
        index: usize,
        digest: String,
        media_type: String,
        #[source]
        problem: LayerProblem,
    },
    #[error("layers {first} and {second} both write {path}")]
    DuplicatePath {
        path: String,
        first: usize,
        second: usize,
    },
    #[error("layer {file_layer} writes the file {file}, but layer {below_layer} writes {below} below it")]
    PathConflict {
        file: String,
        file_layer: usize,
        below: String,
        below_layer: usize,
    },
    #[error("{reference} has no file layers")]
    NoFileLayers { reference: String },
    #[error("the registry token is not a header value")]
    TokenNotAHeader,
    #[error(
        "registry requires authentication: set OCI_USERNAME/OCI_PASSWORD or DOCKER_CONFIG_JSON"
    )]
    NeedCredentials,
    #[error(
        "the registry asks for basic credentials over plain http; set insecure only \
         for a registry you trust on this network"
    )]
    BasicOverHttp,
    #[error("registry rejected the credentials (HTTP 401)")]
    CredentialsRejected,
    #[error("bearer challenge without realm")]
    NoRealm,
    #[error("bearer challenge realm {realm:?} is not a URL")]
    RealmNotAUrl { realm: String },
    /// `anonymous`: no credentials were configured (the message says how to set them).
    #[error(
        "token endpoint refused the request (HTTP {}){}",
        .status.as_u16(),
        if *.anonymous { ": set OCI_USERNAME/OCI_PASSWORD or DOCKER_CONFIG_JSON" } else { "" }
    )]
    TokenRefused { status: StatusCode, anonymous: bool },
    #[error("token response is not JSON")]
    TokenNotJson(#[source] serde_json::Error),
    #[error("token endpoint returned no token")]
    NoToken,
    #[error(
        "{what}: access denied (HTTP {}); check OCI_USERNAME/OCI_PASSWORD or DOCKER_CONFIG_JSON",
        .status.as_u16()
    )]
    AccessDenied { what: String, status: StatusCode },
    /// A body over its limit (bad input) or cut off while read (transport).
    #[error(transparent)]
    Body(http::BodyError),
    #[error("cannot build the HTTP client")]
    HttpClient(#[source] reqwest::Error),
    #[error("{what}")]
    Request {
        what: String,
        #[source]
        source: Transport,
    },
    /// `body`: the start of the registry's answer.
    #[error("{what}: registry answered HTTP {} {body}", .status.as_u16())]
    Status {
        what: String,
        status: StatusCode,
        body: String,
    },
    #[error("upload session without Location")]
    NoUploadLocation,
    #[error("opening {}", .path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("upload location {url:?} is not a URL")]
    UploadLocationNotAUrl { url: String },
    #[error("uploading {}: token expired (HTTP 401)", .path.display())]
    TokenExpired { path: PathBuf },
    #[error("tag list is not JSON")]
    TagListNotJson(#[source] serde_json::Error),
}

impl OciError {
    /// A bad reference, artifact or credentials: retrying will not help (exit 2).
    pub fn is_bad_input(&self) -> bool {
        match self {
            OciError::Body(b) => matches!(b, http::BodyError::TooLarge { .. }),
            OciError::HttpClient(_)
            | OciError::Request { .. }
            | OciError::Status { .. }
            | OciError::NoUploadLocation
            | OciError::Open { .. }
            | OciError::UploadLocationNotAUrl { .. }
            | OciError::TokenExpired { .. }
            | OciError::TagListNotJson(_) => false,
            _ => true,
        }
    }
}

/// Why an OCI reference is not one.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceProblem {
    #[error("digest must be sha256:<64 hex>")]
    Digest,
    #[error("expected registry/repository")]
    NoRepository,
    #[error("the first component must be a registry host (e.g. ghcr.io or host:5000)")]
    NoRegistry,
    #[error("repository must be lowercase [a-z0-9._-] path components")]
    Repository,
    #[error(transparent)]
    Tag(#[from] InvalidTag),
}
