//! Hugging Face Hub HTTP API: list a repository's files at a revision and build download URLs.

use std::time::Duration;

use flexinfer_contract::check_relative_path;
use serde::Deserialize;

use crate::http::error::{http_error, BadBody, FetchError};
use crate::http::{self, ScopedAuth};
use crate::remote::RemoteFile;
use crate::retry::Retry;

/// Default hub endpoint when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// `model` or `dataset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoType {
    Model,
    Dataset,
}

impl RepoType {
    pub fn parse(s: &str) -> Option<RepoType> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "model" | "models" => Some(RepoType::Model),
            "dataset" | "datasets" => Some(RepoType::Dataset),
            _ => None,
        }
    }
    fn api_segment(self) -> &'static str {
        match self {
            RepoType::Model => "models",
            RepoType::Dataset => "datasets",
        }
    }
    fn resolve_prefix(self) -> &'static str {
        match self {
            RepoType::Model => "",
            RepoType::Dataset => "datasets/",
        }
    }
}

/// One entry of `/api/{type}s/{repo}/tree/{rev}?recursive=true`.
#[derive(Debug, Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    lfs: Option<LfsInfo>,
}

#[derive(Debug, Deserialize)]
struct LfsInfo {
    oid: String,
    size: u64,
}

/// Percent-encode one URL path segment (RFC 3986 unreserved characters pass through).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Encode a relative path keeping its `/` separators.
pub fn encode_path(p: &str) -> String {
    p.split('/')
        .map(encode_segment)
        .collect::<Vec<_>>()
        .join("/")
}

fn encode_repo(repo: &str) -> String {
    encode_path(repo)
}

/// Why a hub repo id is refused.
#[derive(Debug, thiserror::Error)]
pub enum RepoIdError {
    #[error(transparent)]
    Path(#[from] flexinfer_contract::PathError),
    #[error("invalid Hugging Face repo id {0:?} (expected org/name)")]
    Shape(String),
}

/// Validate a hub repo id (`org/name` or `name`).
pub fn check_repo_id(repo: &str) -> Result<(), RepoIdError> {
    check_relative_path(repo)?;
    if repo.split('/').count() > 2 || repo.split('/').any(|c| c.is_empty() || c == ".") {
        return Err(RepoIdError::Shape(repo.to_string()));
    }
    Ok(())
}

/// URL of one file at a revision.
pub fn resolve_url(
    endpoint: &str,
    kind: RepoType,
    repo: &str,
    revision: &str,
    path: &str,
) -> String {
    format!(
        "{}/{}{}/resolve/{}/{}",
        endpoint.trim_end_matches('/'),
        kind.resolve_prefix(),
        encode_repo(repo),
        encode_segment(revision),
        encode_path(path)
    )
}

/// List every file of `repo` at `revision` (follows `Link: rel="next"` pagination). The token is
/// sent only to the configured endpoint's origin (scheme, host, port): a `Link` to another host
/// is followed without it.
pub async fn list_files(
    client: &reqwest::Client,
    endpoint: &str,
    token: Option<&str>,
    kind: RepoType,
    repo: &str,
    revision: &str,
) -> Result<Vec<RemoteFile>, FetchError> {
    let mut url = format!(
        "{}/api/{}/{}/tree/{}?recursive=true",
        endpoint.trim_end_matches('/'),
        kind.api_segment(),
        encode_repo(repo),
        encode_segment(revision)
    );
    let listing = Listing {
        client,
        endpoint,
        has_token: token.is_some(),
        kind,
        repo,
        revision,
        what: format!(
            "{} {repo}@{revision}",
            kind.api_segment().trim_end_matches('s')
        ),
        auth: token.and_then(|t| ScopedAuth::new(format!("Bearer {t}"), endpoint)),
    };
    let mut out = Vec::new();
    for _page in 0..10_000 {
        let (entries, next) = listing.page(&url).await?;
        listing.push_files(entries, &mut out)?;
        match next {
            Some(n) => url = n,
            None => break,
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// One page of a listing: its entries and the next page's URL.
type Page = (Vec<TreeEntry>, Option<String>);

/// A listing in progress: the repository at a revision, and the token scoped to the endpoint.
struct Listing<'a> {
    client: &'a reqwest::Client,
    endpoint: &'a str,
    has_token: bool,
    kind: RepoType,
    repo: &'a str,
    revision: &'a str,
    /// `model org/name@rev`, for messages.
    what: String,
    auth: Option<ScopedAuth>,
}

impl Listing<'_> {
    /// The page at `url`, retried with backoff while the failure is worth retrying.
    async fn page(&self, url: &str) -> Result<Page, FetchError> {
        let mut retry = Retry::new(Duration::from_secs(1), Duration::from_secs(8), 4);
        loop {
            let failure = match self.attempt(url).await? {
                Ok(page) => return Ok(page),
                Err(failure) => failure,
            };
            tracing::warn!(error = %flexinfer_contract::error::chain(&failure), "hub listing failed");
            if !retry.wait().await {
                return Err(failure);
            }
        }
    }

    /// One request for the page at `url`: `Ok(Err(_))` is a failure worth retrying (transport,
    /// unreadable body, retryable status), `Err(_)` one that is not.
    async fn attempt(&self, url: &str) -> Result<Result<Page, FetchError>, FetchError> {
        let mut req = self.client.get(url);
        if let Some(a) = self.auth.as_ref().and_then(|a| a.for_url(url)) {
            req = req.header(reqwest::header::AUTHORIZATION, a);
        }
        match req.send().await {
            Ok(resp) if resp.status().is_success() => self.read_page(resp).await,
            Ok(resp) => {
                let err = http_error(&self.what, resp.status(), self.has_token);
                if !err.is_retryable() {
                    return Err(err);
                }
                Ok(Err(err))
            }
            Err(source) => Ok(Err(FetchError::Listing {
                what: self.what.clone(),
                source,
            })),
        }
    }

    /// The entries and next link of a successful response; a body over the page limit is not
    /// worth retrying, an unreadable or unparsable one is.
    async fn read_page(
        &self,
        resp: reqwest::Response,
    ) -> Result<Result<Page, FetchError>, FetchError> {
        let next = http::next_link(resp.headers());
        let body = match http::read_body_limited(
            resp,
            http::limits::HUB_LISTING_PAGE,
            &format!("listing {}", self.what),
        )
        .await
        {
            Ok(b) => Ok(b),
            Err(e @ http::BodyError::TooLarge { .. }) => return Err(FetchError::TooLarge(e)),
            Err(e @ http::BodyError::Transport { .. }) => Err(BadBody::Read(e)),
        };
        Ok(
            match body.and_then(|b| Ok(serde_json::from_slice::<Vec<TreeEntry>>(&b)?)) {
                Ok(e) => Ok((e, next)),
                Err(source) => Err(FetchError::ListingBody {
                    what: self.what.clone(),
                    source,
                }),
            },
        )
    }

    /// Appends the files among `entries` (not directories) to `out`; an unsafe path is an error.
    fn push_files(
        &self,
        entries: Vec<TreeEntry>,
        out: &mut Vec<RemoteFile>,
    ) -> Result<(), FetchError> {
        for e in entries {
            if e.kind != "file" {
                continue;
            }
            check_relative_path(&e.path).map_err(FetchError::UnsafeName)?;
            let (size, sha256, git_sha1) = match e.lfs {
                Some(l) => (l.size, Some(l.oid.to_ascii_lowercase()), None),
                None => (e.size, None, e.oid.map(|o| o.to_ascii_lowercase())),
            };
            out.push(RemoteFile {
                url: resolve_url(self.endpoint, self.kind, self.repo, self.revision, &e.path),
                path: e.path,
                size,
                sha256,
                git_sha1,
            });
        }
        Ok(())
    }
}

/// `Link: <url>; rel="next"`.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_encoded() {
        assert_eq!(
            resolve_url(
                "http://h/",
                RepoType::Dataset,
                "org/ds",
                "refs/pr/1",
                "a b/c.json"
            ),
            "http://h/datasets/org/ds/resolve/refs%2Fpr%2F1/a%20b/c.json"
        );
        assert_eq!(
            resolve_url(
                "http://h",
                RepoType::Model,
                "org/m",
                "main",
                "model.safetensors"
            ),
            "http://h/org/m/resolve/main/model.safetensors"
        );
    }

    #[test]
    fn repo_ids() {
        assert!(check_repo_id("org/name").is_ok());
        assert!(check_repo_id("gpt2").is_ok());
        assert!(check_repo_id("a/b/c").is_err());
        assert!(check_repo_id("../x").is_err());
        assert!(check_repo_id("org/").is_err());
    }

    #[test]
    fn link_header() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            reqwest::header::LINK,
            "<https://h/api/models/a/tree/main?cursor=x>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(
            http::next_link(&h).as_deref(),
            Some("https://h/api/models/a/tree/main?cursor=x")
        );
    }
}
