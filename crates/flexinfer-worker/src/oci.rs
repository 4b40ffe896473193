//! A small OCI distribution client: blob HEAD / monolithic streamed upload / GET, manifest PUT
//! and GET, tag listing, basic and bearer-token auth, credentials from env or dockerconfigjson.
//!
//! Written here instead of using `oci-client` so that uploads stream from files with a known
//! `Content-Length` in one PUT, the auth header can be handed to the resumable downloader for
//! blob GETs, and plain HTTP is allowed only when `insecure` is set (docs/user/download-and-publish.md).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use flexinfer_api::contract::{check_relative_path, oci_artifact};
use futures::TryStreamExt;
use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, LOCATION, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use crate::common::WorkerError;
use crate::download::fetch::strip_url;
use crate::download::RemoteFile;

/// OCI client errors.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// Bad reference, credentials or artifact (exit 2).
    #[error("{0}")]
    BadInput(String),
    /// Authentication failed (exit 2).
    #[error("{0}")]
    Auth(String),
    /// Transport or registry error (exit 1).
    #[error("{0}")]
    Transport(String),
}

pub fn worker_error(e: OciError) -> WorkerError {
    match e {
        OciError::BadInput(m) | OciError::Auth(m) => WorkerError::BadInput(m),
        OciError::Transport(m) => WorkerError::Other(m),
    }
}

/// `registry[:port]/repo/path[:tag][@sha256:…]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, OciError> {
        let bad = |why: &str| OciError::BadInput(format!("invalid OCI reference {s:?}: {why}"));
        let s = s.trim().trim_start_matches("oci://");
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !is_sha256_digest(d) {
                    return Err(bad("digest must be sha256:<64 hex>"));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (registry, path) = rest.split_once('/').ok_or_else(|| bad("expected registry/repository"))?;
        if !(registry.contains('.') || registry.contains(':') || registry == "localhost") {
            return Err(bad("the first component must be a registry host (e.g. ghcr.io or host:5000)"));
        }
        let (repository, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, Some(t.to_string())),
            _ => (path, None),
        };
        let repo_ok = !repository.is_empty()
            && repository.split('/').all(|c| {
                !c.is_empty()
                    && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            });
        if !repo_ok {
            return Err(bad("repository must be lowercase [a-z0-9._-] path components"));
        }
        if let Some(t) = &tag {
            check_tag(t).map_err(|e| bad(&e))?;
        }
        Ok(Reference {
            registry: registry.to_string(),
            repository: repository.to_string(),
            tag,
            digest,
        })
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// OCI tag grammar `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
pub fn check_tag(t: &str) -> Result<(), String> {
    let ok = !t.is_empty()
        && t.len() <= 128
        && t.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!("invalid tag {t:?} (allowed: [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})"))
    }
}

pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// Username and password for one registry.
#[derive(Clone, Default)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.username)
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: std::collections::BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

impl Credentials {
    /// Env `OCI_USERNAME`/`OCI_PASSWORD` first, then the dockerconfigjson entry for `registry`.
    pub fn resolve(
        registry: &str,
        username: Option<&str>,
        password: Option<&str>,
        docker_config: Option<&Path>,
    ) -> Result<Option<Credentials>, OciError> {
        if let (Some(u), Some(p)) = (username, password) {
            if !u.is_empty() {
                return Ok(Some(Credentials { username: u.into(), password: p.into() }));
            }
        }
        let Some(path) = docker_config.filter(|p| !p.as_os_str().is_empty()) else {
            return Ok(None);
        };
        // A mounted Secret directory holds the file under `.dockerconfigjson` or `config.json`.
        let file = if path.is_dir() {
            [".dockerconfigjson", "config.json"]
                .iter()
                .map(|n| path.join(n))
                .find(|p| p.is_file())
                .unwrap_or_else(|| path.join(".dockerconfigjson"))
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|e| {
            OciError::BadInput(format!("cannot read docker config {}: {e}", file.display()))
        })?;
        let cfg: DockerConfig = serde_json::from_str(&text).map_err(|e| {
            OciError::BadInput(format!("docker config {} is not valid JSON: {e}", file.display()))
        })?;
        let host_of = |k: &str| {
            let k = k.trim_start_matches("https://").trim_start_matches("http://");
            k.split('/').next().unwrap_or(k).to_string()
        };
        let Some(entry) = cfg.auths.iter().find(|(k, _)| host_of(k) == registry).map(|(_, v)| v)
        else {
            return Ok(None);
        };
        if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
            return Ok(Some(Credentials { username: u.clone(), password: p.clone() }));
        }
        if let Some(a) = &entry.auth {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(a.trim())
                .map_err(|_| OciError::BadInput(format!("docker config entry for {registry}: auth is not base64")))?;
            let s = String::from_utf8(raw)
                .map_err(|_| OciError::BadInput(format!("docker config entry for {registry}: auth is not UTF-8")))?;
            if let Some((u, p)) = s.split_once(':') {
                return Ok(Some(Credentials { username: u.into(), password: p.into() }));
            }
        }
        Err(OciError::BadInput(format!(
            "docker config entry for {registry} has neither username/password nor auth"
        )))
    }
}

/// A descriptor in a manifest.
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
pub struct Registry {
    client: reqwest::Client,
    base: String,
    repository: String,
    creds: Option<Credentials>,
    auth: Mutex<Option<String>>,
}

fn transport(what: &str, e: &reqwest::Error) -> OciError {
    OciError::Transport(format!("{what}: {}", strip_url(e)))
}

impl Registry {
    /// Pick the scheme (https; with `insecure` also plain http when TLS does not answer).
    pub async fn connect(
        reference: &Reference,
        creds: Option<Credentials>,
        insecure: bool,
    ) -> Result<Registry, OciError> {
        let client = crate::download::http_client(insecure).map_err(|e| OciError::Transport(e.to_string()))?;
        let mut base = format!("https://{}", reference.registry);
        if insecure {
            let probe = client
                .get(format!("{base}/v2/"))
                .timeout(Duration::from_secs(10))
                .send()
                .await;
            if probe.is_err() {
                base = format!("http://{}", reference.registry);
            }
        }
        Ok(Registry {
            client,
            base,
            repository: reference.repository.clone(),
            creds,
            auth: Mutex::new(None),
        })
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The current `Authorization` value (after a request negotiated it).
    pub async fn authorization(&self) -> Option<String> {
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
        let mut attempt = 0u32;
        loop {
            let mut req = build(&self.client);
            if let Some(h) = self.auth.lock().await.clone() {
                req = req.header(AUTHORIZATION, h);
            }
            match req.send().await {
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !authed => {
                    authed = true;
                    self.authenticate(resp.headers()).await?;
                }
                Ok(resp) if resp.status().is_server_error() && attempt < 4 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(300 << attempt)).await;
                }
                Ok(resp) => return Ok(resp),
                Err(e) if attempt < 4 && !e.is_builder() => {
                    attempt += 1;
                    tracing::warn!(error = %strip_url(&e), "registry request failed; retrying");
                    tokio::time::sleep(Duration::from_millis(300 << attempt)).await;
                }
                Err(e) => return Err(transport(what, &e)),
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
        let need_creds = || {
            OciError::Auth(
                "registry requires authentication: set OCI_USERNAME/OCI_PASSWORD or DOCKER_CONFIG_JSON"
                    .to_string(),
            )
        };
        let lower = challenge.to_ascii_lowercase();
        if lower.starts_with("basic") {
            let c = self.creds.as_ref().ok_or_else(need_creds)?;
            let v = base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", c.username, c.password));
            *self.auth.lock().await = Some(format!("Basic {v}"));
            return Ok(());
        }
        if !lower.starts_with("bearer") {
            return Err(match &self.creds {
                Some(_) => OciError::Auth("registry rejected the credentials (HTTP 401)".into()),
                None => need_creds(),
            });
        }
        let params = parse_challenge(&challenge["bearer".len()..]);
        let realm = params
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.clone())
            .ok_or_else(|| OciError::Auth("bearer challenge without realm".into()))?;
        let mut query: Vec<(String, String)> = Vec::new();
        for key in ["service", "scope"] {
            if let Some((_, v)) = params.iter().find(|(k, _)| k == key) {
                query.push((key.to_string(), v.clone()));
            }
        }
        if !query.iter().any(|(k, _)| k == "scope") {
            query.push(("scope".into(), format!("repository:{}:pull,push", self.repository)));
        }
        let mut req = self.client.get(&realm).query(&query);
        if let Some(c) = &self.creds {
            req = req.basic_auth(&c.username, Some(&c.password));
        }
        let resp = req.send().await.map_err(|e| transport("token request", &e))?;
        if !resp.status().is_success() {
            return Err(OciError::Auth(format!(
                "token endpoint refused the request (HTTP {}){}",
                resp.status().as_u16(),
                if self.creds.is_none() { ": set OCI_USERNAME/OCI_PASSWORD or DOCKER_CONFIG_JSON" } else { "" }
            )));
        }
        #[derive(Deserialize)]
        struct Token {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
        }
        let t: Token = resp.json().await.map_err(|e| transport("token response", &e))?;
        let tok = t.token.or(t.access_token).ok_or_else(|| OciError::Auth("token endpoint returned no token".into()))?;
        *self.auth.lock().await = Some(format!("Bearer {tok}"));
        Ok(())
    }

    fn status_error(&self, what: &str, s: StatusCode, body: &str) -> OciError {
        let body: String = body.chars().take(300).collect();
        let msg = format!("{what}: registry answered HTTP {} {body}", s.as_u16());
        match s {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => OciError::Auth(format!(
                "{what}: access denied (HTTP {}); check OCI_USERNAME/OCI_PASSWORD or DOCKER_CONFIG_JSON",
                s.as_u16()
            )),
            StatusCode::NOT_FOUND => OciError::BadInput(format!("{what}: not found (HTTP 404)")),
            _ => OciError::Transport(msg),
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
            .send("starting a blob upload", |c| c.post(&url).header(CONTENT_LENGTH, 0))
            .await?;
        if resp.status() != StatusCode::ACCEPTED {
            let s = resp.status();
            let body = resp.text().await.unwrap_or_default();
            return Err(self.status_error("starting a blob upload", s, &body));
        }
        let loc = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| OciError::Transport("upload session without Location".into()))?;
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
                c.put(&url).header(CONTENT_TYPE, "application/octet-stream").body(body.clone())
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            let s = resp.status();
            let body = resp.text().await.unwrap_or_default();
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
        let mut attempt = 0u32;
        loop {
            let before = sent.load(Ordering::Relaxed);
            match self.push_file_once(path, digest, size, &sent).await {
                Ok(()) => return Ok(()),
                Err(OciError::Transport(m)) if attempt < 4 => {
                    attempt += 1;
                    // Bytes of the failed attempt do not count.
                    let now = sent.load(Ordering::Relaxed);
                    sent.fetch_sub(now.saturating_sub(before), Ordering::Relaxed);
                    tracing::warn!(error = %m, attempt, "blob upload failed; retrying");
                    eprintln!("retrying upload of {} (attempt {attempt}): {m}", path.display());
                    tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
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
            .map_err(|e| OciError::Transport(format!("opening {}: {e}", path.display())))?;
        let counter = sent.clone();
        let stream = tokio_util::io::ReaderStream::with_capacity(file, 1 << 20).inspect_ok(move |b| {
            counter.fetch_add(b.len() as u64, Ordering::Relaxed);
        });
        let mut req = self
            .client
            .put(&url)
            .header(CONTENT_TYPE, "application/octet-stream")
            .header(CONTENT_LENGTH, size)
            .body(reqwest::Body::wrap_stream(stream));
        if let Some(h) = self.auth.lock().await.clone() {
            req = req.header(AUTHORIZATION, h);
        }
        let resp = req.send().await.map_err(|e| transport("uploading a blob", &e))?;
        if resp.status() == StatusCode::CREATED {
            return Ok(());
        }
        let s = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if s == StatusCode::UNAUTHORIZED {
            // Token expired mid-upload: renegotiate and let the caller retry.
            *self.auth.lock().await = None;
            return Err(OciError::Transport(format!("uploading {}: token expired (HTTP 401)", path.display())));
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
            let text = resp.text().await.unwrap_or_default();
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
            let text = resp.text().await.unwrap_or_default();
            return Err(self.status_error(&format!("manifest {}:{reference}", self.repository), s, &text));
        }
        let bytes = resp.bytes().await.map_err(|e| transport("reading the manifest", &e))?;
        if bytes.len() > 4 << 20 {
            return Err(OciError::BadInput("manifest larger than 4 MiB".into()));
        }
        Ok((sha256_digest(&bytes), bytes.to_vec()))
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
            let next = resp
                .headers()
                .get(reqwest::header::LINK)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| {
                    let s = v.find('<')? + 1;
                    let e = v.find('>')?;
                    Some(self.absolute(&v[s..e]))
                });
            let t: Tags = resp.json().await.map_err(|e| transport("tag list", &e))?;
            out.extend(t.tags.unwrap_or_default());
            match next {
                Some(n) => url = n,
                None => break,
            }
        }
        Ok(out)
    }

    /// The files of a published model artifact: (manifest digest, one entry per titled layer).
    pub async fn artifact_files(&self, reference: &Reference) -> Result<(String, Vec<RemoteFile>), OciError> {
        let what = reference.digest.clone().or(reference.tag.clone()).unwrap_or_else(|| "latest".into());
        let (digest, bytes) = self.get_manifest(&what).await?;
        if let Some(want) = &reference.digest {
            if *want != digest {
                return Err(OciError::BadInput(format!(
                    "manifest digest mismatch: asked for {want}, registry served {digest}"
                )));
            }
        }
        let m: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| OciError::BadInput(format!("{reference} is not an OCI image manifest: {e}")))?;
        let mut files = Vec::new();
        for l in &m.layers {
            let Some(title) = l.annotations.get(oci_artifact::TITLE_ANNOTATION) else {
                tracing::warn!(digest = %l.digest, "layer without a title annotation skipped");
                continue;
            };
            check_relative_path(title)
                .map_err(|r| OciError::BadInput(format!("artifact layer has an unsafe title: {r}")))?;
            if !is_sha256_digest(&l.digest) {
                return Err(OciError::BadInput(format!("layer {title}: unsupported digest {}", l.digest)));
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
            return Err(OciError::BadInput(format!("{reference} has no titled file layers")));
        }
        Ok((digest, files))
    }
}

fn with_digest(location: &str, digest: &str) -> String {
    let sep = if location.contains('?') { '&' } else { '?' };
    format!("{location}{sep}digest={}", digest.replace(':', "%3A"))
}

/// `realm="…",service="…",scope="…"` → pairs.
fn parse_challenge(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some(eq) = rest.find('=') else { break };
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_ascii_lowercase();
        rest = &rest[eq + 1..];
        let value;
        if let Some(r) = rest.strip_prefix('"') {
            let end = r.find('"').unwrap_or(r.len());
            value = r[..end].to_string();
            rest = r.get(end + 1..).unwrap_or("");
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            value = rest[..end].trim().to_string();
            rest = &rest[end..];
        }
        rest = rest.trim_start_matches(',').trim();
        out.push((key, value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = Reference::parse("oci://localhost:5000/org/model:v1").unwrap();
        assert_eq!(r.registry, "localhost:5000");
        assert_eq!(r.repository, "org/model");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("ghcr.io/o/m@{d}")).unwrap();
        assert_eq!(r.digest.as_deref(), Some(d.as_str()));
        assert_eq!(r.tag, None);
        assert!(Reference::parse("model:v1").is_err());
        assert!(Reference::parse("ghcr.io/O/M").is_err());
        assert!(Reference::parse("ghcr.io/o/m@sha256:xyz").is_err());
        assert!(Reference::parse("ghcr.io/o/m:-bad").is_err());
        assert_eq!(Reference::parse("ghcr.io/o/m:v1").unwrap().to_string(), "ghcr.io/o/m:v1");
    }

    #[test]
    fn challenges() {
        let p = parse_challenge(r#" realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#);
        assert_eq!(p[0], ("realm".into(), "https://auth.example/token".into()));
        assert_eq!(p[1], ("service".into(), "registry.example".into()));
        assert_eq!(p[2], ("scope".into(), "repository:a/b:pull,push".into()));
    }

    #[test]
    fn docker_config() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("u:p:w");
        std::fs::write(&p, format!(r#"{{"auths":{{"https://reg.example:5000":{{"auth":"{auth}"}}}}}}"#)).unwrap();
        let c = Credentials::resolve("reg.example:5000", None, None, Some(&p)).unwrap().unwrap();
        assert_eq!((c.username.as_str(), c.password.as_str()), ("u", "p:w"));
        assert!(Credentials::resolve("other.example", None, None, Some(&p)).unwrap().is_none());
        let env = Credentials::resolve("reg.example:5000", Some("a"), Some("b"), Some(&p)).unwrap().unwrap();
        assert_eq!(env.username, "a");
        assert!(!format!("{c:?}").contains("p:w"));
    }

    #[test]
    fn upload_urls() {
        assert_eq!(with_digest("http://h/u/1?_state=x", "sha256:ab"), "http://h/u/1?_state=x&digest=sha256%3Aab");
        assert_eq!(with_digest("http://h/u/1", "sha256:ab"), "http://h/u/1?digest=sha256%3Aab");
    }
}
