//! What a source (the hub, a registry, a local directory) offers: one file to fetch.

/// One file a source offers.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteFile {
    /// Relative path (validated with `check_relative_path`).
    pub path: String,
    pub url: String,
    pub size: u64,
    /// LFS / OCI sha256 (hex), when the source publishes one.
    pub sha256: Option<String>,
    /// Git blob sha1 of a non-LFS hub file.
    pub git_sha1: Option<String>,
}
