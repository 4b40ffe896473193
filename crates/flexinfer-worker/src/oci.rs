//! A small OCI distribution client: blob HEAD / monolithic streamed upload / GET, manifest PUT
//! and GET, tag listing, basic and bearer-token auth, credentials from env or dockerconfigjson.
//!
//! Why not `oci-client` (it can stream blobs too): the `oci://` pull reuses the hub downloader's
//! resume/verify/progress code, which needs plain blob URLs plus the negotiated auth header; see
//! docs/user/download-and-publish.md.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use flexinfer_contract::{check_relative_path, oci_artifact};
use futures::TryStreamExt;
use reqwest::header::{
    HeaderMap, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, LOCATION, WWW_AUTHENTICATE,
};
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use crate::common::Retry;
use crate::download::fetch::{strip_url, Transport};
use crate::download::RemoteFile;
use crate::http::{self, Origin, ScopedAuth};

/// `registry[:port]/repo/path[:tag][@sha256:…]`.
mod auth;
mod error;
mod reference;

use auth::parse_challenge;
pub use auth::{Credentials, RegistryArgs};
pub use error::{worker_error, OciError, ReferenceProblem};
pub use reference::{check_tag, is_sha256_digest, InvalidTag, Reference};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// An OCI image manifest (artifact form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// The empty JSON config blob `{}`.
pub const EMPTY_CONFIG: &[u8] = b"{}";

pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A connection to one repository of one registry.
///
/// Credentials follow the user, not the server: the negotiated `Authorization` goes only to the
/// registry's own origin (scheme, host, port), never to an upload `Location`, tag-list `Link` or
/// redirect elsewhere; basic credentials go to the registry and to a token realm on the same host,
/// over https unless the registry was configured `insecure`; a realm on another host gets an
/// anonymous token request.
pub struct Registry {
    client: reqwest::Client,
    base: String,
    origin: Origin,
    insecure: bool,
    repository: String,
    creds: Option<Credentials>,
    auth: Mutex<Option<String>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("base", &self.base)
            .field("repository", &self.repository)
            .field("creds", &self.creds)
            .field("auth", &"<redacted>")
            .finish()
    }
}

fn transport(what: &str, e: reqwest::Error) -> OciError {
    OciError::Request {
        what: what.to_string(),
        source: Transport(e),
    }
}

impl Registry {
    /// Pick the scheme (https; with `insecure` also plain http when TLS does not answer).
    pub async fn connect(
        reference: &Reference,
        creds: Option<Credentials>,
        insecure: bool,
    ) -> Result<Registry, OciError> {
        let client = crate::download::build_http_client(insecure).map_err(OciError::HttpClient)?;
        let mut base = format!("https://{}", reference.registry);
        let probe = client
            .get(format!("{base}/v2/"))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        if let Err(e) = probe {
            if insecure {
                base = format!("http://{}", reference.registry);
            } else if is_tls_error(&e) {
                return Err(OciError::Tls {
                    base,
                    source: Transport(e),
                });
            }
            // Anything else (refused, timeout) is retried by the requests that follow.
        }
        let origin = Origin::parse(&base).ok_or_else(|| OciError::NotAHost {
            registry: reference.registry.clone(),
        })?;
        Ok(Registry {
            client,
            base,
            origin,
            insecure,
            repository: reference.repository.clone(),
            creds,
            auth: Mutex::new(None),
        })
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The current `Authorization` value (after a request negotiated it), bound to the registry's
    /// origin.
    pub async fn authorization(&self) -> Option<ScopedAuth> {
        let value = self.auth.lock().await.clone()?;
        Some(ScopedAuth::for_origin(value, self.origin.clone()))
    }

    /// The `Authorization` value for a request to `url`: only on the registry's origin.
    async fn auth_for(&self, url: &reqwest::Url) -> Option<String> {
        if !self.origin.matches(url) {
            return None;
        }
        self.auth.lock().await.clone()
    }

    fn url(&self, tail: &str) -> String {
        format!("{}/v2/{}/{tail}", self.base, self.repository)
    }

    /// Send a body-less (or small-body) request, negotiating auth on 401 and retrying transient
    /// failures.
    async fn send(
        &self,
        what: &str,
        build: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, OciError> {
        let mut authed = false;
        let mut retry = Retry::new(Duration::from_millis(600), Duration::from_secs(5), 4);
        loop {
            let mut req = build(&self.client)
                .build()
                .map_err(|e| transport(what, e))?;
            if let Some(h) = self.auth_for(req.url()).await {
                let value = reqwest::header::HeaderValue::from_str(&h)
                    .map_err(|_| OciError::TokenNotAHeader)?;
                req.headers_mut().insert(AUTHORIZATION, value);
            }
            match self.client.execute(req).await {
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !authed => {
                    authed = true;
                    self.authenticate(resp.headers()).await?;
                }
                // A 5xx is retried; once the retries are used it is answered as it is.
                Ok(resp) if resp.status().is_server_error() => {
                    if !retry.wait().await {
                        return Ok(resp);
                    }
                }
                Ok(resp) => return Ok(resp),
                Err(e) if !e.is_builder() => {
                    tracing::warn!(error = %strip_url(&e), "registry request failed");
                    if !retry.wait().await {
                        return Err(transport(what, e));
                    }
                }
                Err(e) => return Err(transport(what, e)),
            }
        }
    }

    /// Answer a `WWW-Authenticate` challenge (Basic or Bearer token).
    async fn authenticate(&self, headers: &HeaderMap) -> Result<(), OciError> {
        let challenge = headers
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let lower = challenge.to_ascii_lowercase();
        if lower.starts_with("basic") {
            let c = self.creds.as_ref().ok_or(OciError::NeedCredentials)?;
            if !self.origin.is_https() && !self.insecure {
                return Err(OciError::BasicOverHttp);
            }
            let v = base64::engine::general_purpose::STANDARD
                .encode(format!("{}:{}", c.username, c.password));
            *self.auth.lock().await = Some(format!("Basic {v}"));
            return Ok(());
        }
        if !lower.starts_with("bearer") {
            return Err(match &self.creds {
                Some(_) => OciError::CredentialsRejected,
                None => OciError::NeedCredentials,
            });
        }
        let params = parse_challenge(&challenge["bearer".len()..]);
        let realm = params
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.clone())
            .ok_or(OciError::NoRealm)?;
        let mut query: Vec<(String, String)> = Vec::new();
        for key in ["service", "scope"] {
            if let Some((_, v)) = params.iter().find(|(k, _)| k == key) {
                query.push((key.to_string(), v.clone()));
            }
        }
        if !query.iter().any(|(k, _)| k == "scope") {
            query.push((
                "scope".into(),
                format!("repository:{}:pull,push", self.repository),
            ));
        }
        let realm_url = reqwest::Url::parse(&realm).map_err(|_| OciError::RealmNotAUrl {
            realm: realm.clone(),
        })?;
        let mut req = self.client.get(realm_url.clone()).query(&query);
        match &self.creds {
            Some(c) if self.realm_may_get_credentials(&realm_url) => {
                req = req.basic_auth(&c.username, Some(&c.password));
            }
            Some(_) => tracing::warn!(
                realm = %realm_url.host_str().unwrap_or(""),
                "token realm is not on the registry's host (or not https): anonymous token request"
            ),
            None => {}
        }
        let resp = req
            .send()
            .await
            .map_err(|e| transport("token request", e))?;
        if !resp.status().is_success() {
            return Err(OciError::TokenRefused {
                status: resp.status(),
                anonymous: self.creds.is_none(),
            });
        }
        #[derive(Deserialize)]
        struct Token {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
        }
        let body = http::read_body_limited(resp, http::limits::TOKEN_RESPONSE, "token request")
            .await
            .map_err(OciError::Body)?;
        let t: Token = serde_json::from_slice(&body).map_err(OciError::TokenNotJson)?;
        let tok = t.token.or(t.access_token).ok_or(OciError::NoToken)?;
        *self.auth.lock().await = Some(format!("Bearer {tok}"));
        Ok(())
    }

    /// Basic credentials go to a token realm only on the registry's host, and over https unless
    /// the registry was configured insecure.
    fn realm_may_get_credentials(&self, realm: &reqwest::Url) -> bool {
        let same_host = realm
            .host_str()
            .is_some_and(|h| h.eq_ignore_ascii_case(self.origin.host()));
        same_host && (realm.scheme() == "https" || self.insecure)
    }

    fn status_error(&self, what: &str, s: StatusCode, body: &str) -> OciError {
        let what = what.to_string();
        match s {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                OciError::AccessDenied { what, status: s }
            }
            StatusCode::NOT_FOUND => OciError::NotFound { what },
            _ => OciError::Status {
                what,
                status: s,
                body: body.chars().take(300).collect(),
            },
        }
    }

    /// Does the repository already hold this blob?
    pub async fn blob_exists(&self, digest: &str) -> Result<bool, OciError> {
        let url = self.url(&format!("blobs/{digest}"));
        let resp = self.send("blob HEAD", |c| c.head(&url)).await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            s => Err(self.status_error("blob HEAD", s, "")),
        }
    }

    async fn start_upload(&self) -> Result<String, OciError> {
        let url = self.url("blobs/uploads/");
        let resp = self
            .send("starting a blob upload", |c| {
                c.post(&url).header(CONTENT_LENGTH, 0)
            })
            .await?;
        if resp.status() != StatusCode::ACCEPTED {
            let s = resp.status();
            let body = http::error_text(resp).await;
            return Err(self.status_error("starting a blob upload", s, &body));
        }
        let loc = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or(OciError::NoUploadLocation)?;
        Ok(self.absolute(loc))
    }

    fn absolute(&self, loc: &str) -> String {
        if loc.starts_with("http://") || loc.starts_with("https://") {
            loc.to_string()
        } else {
            format!("{}/{}", self.base, loc.trim_start_matches('/'))
        }
    }

    /// Upload small bytes (the config blob) unless present.
    pub async fn push_bytes(&self, bytes: &[u8]) -> Result<String, OciError> {
        let digest = sha256_digest(bytes);
        if self.blob_exists(&digest).await? {
            return Ok(digest);
        }
        let loc = self.start_upload().await?;
        let url = with_digest(&loc, &digest);
        let body = bytes.to_vec();
        let resp = self
            .send("uploading a blob", |c| {
                c.put(&url)
                    .header(CONTENT_TYPE, "application/octet-stream")
                    .body(body.clone())
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            let s = resp.status();
            let body = http::error_text(resp).await;
            return Err(self.status_error("uploading a blob", s, &body));
        }
        Ok(digest)
    }

    /// Stream a file as one monolithic PUT (`Content-Length` known, never whole in memory).
    /// `sent` counts bytes handed to the connection.
    pub async fn push_file(
        &self,
        path: &Path,
        digest: &str,
        size: u64,
        sent: Arc<AtomicU64>,
    ) -> Result<(), OciError> {
        let mut retry = Retry::new(Duration::from_secs(1), Duration::from_secs(10), 4);
        loop {
            let before = sent.load(Ordering::Relaxed);
            match self.push_file_once(path, digest, size, &sent).await {
                Ok(()) => return Ok(()),
                Err(m) if !m.is_bad_input() => {
                    // Bytes of the failed attempt do not count.
                    let now = sent.load(Ordering::Relaxed);
                    sent.fetch_sub(now.saturating_sub(before), Ordering::Relaxed);
                    let Some(delay) = retry.next_delay() else {
                        return Err(m);
                    };
                    let attempt = retry.attempt();
                    tracing::warn!(error = %m, attempt, "blob upload failed; retrying");
                    eprintln!(
                        "retrying upload of {} in {delay:.1?} (attempt {attempt}): {m}",
                        path.display()
                    );
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn push_file_once(
        &self,
        path: &Path,
        digest: &str,
        size: u64,
        sent: &Arc<AtomicU64>,
    ) -> Result<(), OciError> {
        let loc = self.start_upload().await?;
        let url = with_digest(&loc, digest);
        let file = tokio::fs::File::open(path)
            .await
            .map_err(|source| OciError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        let counter = sent.clone();
        let stream =
            tokio_util::io::ReaderStream::with_capacity(file, 1 << 20).inspect_ok(move |b| {
                counter.fetch_add(b.len() as u64, Ordering::Relaxed);
            });
        let mut req = self
            .client
            .put(&url)
            .header(CONTENT_TYPE, "application/octet-stream")
            .header(CONTENT_LENGTH, size)
            .body(reqwest::Body::wrap_stream(stream));
        // An upload Location on another host (a storage backend) gets no registry credentials.
        let target = reqwest::Url::parse(&url)
            .map_err(|_| OciError::UploadLocationNotAUrl { url: url.clone() })?;
        if let Some(h) = self.auth_for(&target).await {
            req = req.header(AUTHORIZATION, h);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| transport("uploading a blob", e))?;
        if resp.status() == StatusCode::CREATED {
            return Ok(());
        }
        let s = resp.status();
        let body = http::error_text(resp).await;
        if s == StatusCode::UNAUTHORIZED {
            // Token expired mid-upload: renegotiate and let the caller retry.
            *self.auth.lock().await = None;
            return Err(OciError::TokenExpired {
                path: path.to_path_buf(),
            });
        }
        Err(self.status_error(&format!("uploading {}", path.display()), s, &body))
    }

    /// PUT a manifest under a tag (or digest); returns the digest the registry reports.
    pub async fn put_manifest(&self, reference: &str, body: &[u8]) -> Result<String, OciError> {
        let url = self.url(&format!("manifests/{reference}"));
        let body = body.to_vec();
        let resp = self
            .send("pushing the manifest", |c| {
                c.put(&url)
                    .header(CONTENT_TYPE, oci_artifact::MANIFEST_MEDIA_TYPE)
                    .body(body.clone())
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            let s = resp.status();
            let text = http::error_text(resp).await;
            return Err(self.status_error(&format!("pushing manifest {reference}"), s, &text));
        }
        Ok(resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .unwrap_or_else(|| sha256_digest(&body)))
    }

    /// GET a manifest by tag or digest; returns (digest of the bytes, bytes).
    pub async fn get_manifest(&self, reference: &str) -> Result<(String, Vec<u8>), OciError> {
        let url = self.url(&format!("manifests/{reference}"));
        let resp = self
            .send("fetching the manifest", |c| {
                c.get(&url).header(
                    reqwest::header::ACCEPT,
                    format!(
                        "{}, application/vnd.docker.distribution.manifest.v2+json",
                        oci_artifact::MANIFEST_MEDIA_TYPE
                    ),
                )
            })
            .await?;
        if !resp.status().is_success() {
            let s = resp.status();
            let text = http::error_text(resp).await;
            return Err(self.status_error(
                &format!("manifest {}:{reference}", self.repository),
                s,
                &text,
            ));
        }
        let what = format!("manifest {}:{reference}", self.repository);
        let bytes = http::read_body_limited(resp, http::limits::OCI_MANIFEST, &what)
            .await
            .map_err(OciError::Body)?;
        Ok((sha256_digest(&bytes), bytes))
    }

    /// All tags of the repository.
    pub async fn list_tags(&self) -> Result<Vec<String>, OciError> {
        #[derive(Deserialize)]
        struct Tags {
            #[serde(default)]
            tags: Option<Vec<String>>,
        }
        let mut url = self.url("tags/list?n=1000");
        let mut out = Vec::new();
        for _ in 0..1000 {
            let resp = self.send("listing tags", |c| c.get(&url)).await?;
            if resp.status() == StatusCode::NOT_FOUND {
                return Ok(out);
            }
            if !resp.status().is_success() {
                let s = resp.status();
                return Err(self.status_error("listing tags", s, ""));
            }
            let next = http::next_link(resp.headers()).map(|u| self.absolute(&u));
            let body = http::read_body_limited(resp, http::limits::TAG_LIST, "listing tags")
                .await
                .map_err(OciError::Body)?;
            let t: Tags = serde_json::from_slice(&body).map_err(OciError::TagListNotJson)?;
            out.extend(t.tags.unwrap_or_default());
            match next {
                Some(n) => url = n,
                None => break,
            }
        }
        Ok(out)
    }

    /// The files of a published model artifact: (manifest digest, one entry per titled layer).
    pub async fn artifact_files(
        &self,
        reference: &Reference,
    ) -> Result<(String, Vec<RemoteFile>), OciError> {
        let what = reference
            .digest
            .clone()
            .or(reference.tag.clone())
            .unwrap_or_else(|| "latest".into());
        let (digest, bytes) = self.get_manifest(&what).await?;
        if let Some(want) = &reference.digest {
            if *want != digest {
                return Err(OciError::DigestMismatch {
                    want: want.clone(),
                    served: digest,
                });
            }
        }
        let m: Manifest =
            serde_json::from_slice(&bytes).map_err(|source| OciError::NotAManifest {
                reference: reference.to_string(),
                source,
            })?;
        let mut files = Vec::new();
        for l in &m.layers {
            let Some(title) = l.annotations.get(oci_artifact::TITLE_ANNOTATION) else {
                tracing::warn!(digest = %l.digest, "layer without a title annotation skipped");
                continue;
            };
            check_relative_path(title).map_err(OciError::UnsafeTitle)?;
            if !is_sha256_digest(&l.digest) {
                return Err(OciError::UnsupportedDigest {
                    title: title.clone(),
                    digest: l.digest.clone(),
                });
            }
            files.push(RemoteFile {
                path: title.clone(),
                url: self.url(&format!("blobs/{}", l.digest)),
                size: l.size,
                sha256: Some(l.digest["sha256:".len()..].to_string()),
                git_sha1: None,
            });
        }
        if files.is_empty() {
            return Err(OciError::NoFileLayers {
                reference: reference.to_string(),
            });
        }
        Ok((digest, files))
    }
}

/// A handshake or certificate failure (as opposed to a refused or dropped connection).
fn is_tls_error(e: &reqwest::Error) -> bool {
    let text = strip_url(e).to_ascii_lowercase();
    [
        "certificate",
        "tls",
        "handshake",
        "invalidcontenttype",
        "corrupt message",
        "unknownissuer",
    ]
    .iter()
    .any(|k| text.contains(k))
}

fn with_digest(location: &str, digest: &str) -> String {
    let sep = if location.contains('?') { '&' } else { '?' };
    format!("{location}{sep}digest={}", digest.replace(':', "%3A"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upload_urls() {
        assert_eq!(
            with_digest("http://h/u/1?_state=x", "sha256:ab"),
            "http://h/u/1?_state=x&digest=sha256%3Aab"
        );
        assert_eq!(
            with_digest("http://h/u/1", "sha256:ab"),
            "http://h/u/1?digest=sha256%3Aab"
        );
    }
}
