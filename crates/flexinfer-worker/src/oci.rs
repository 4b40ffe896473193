//! A small OCI distribution client: blob HEAD / monolithic streamed upload / GET, manifest PUT
//! and GET, tag listing, basic and bearer-token auth, credentials from env or dockerconfigjson.
//!
//! Why not `oci-client` (it can stream blobs too): the `oci://` pull reuses the hub downloader's
//! resume/verify/progress code, which needs plain blob URLs plus the negotiated auth header; see
//! docs/user/download-and-publish.md.

use std::time::Duration;

use base64::Engine as _;
use reqwest::header::{HeaderMap, AUTHORIZATION, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use crate::http::error::{strip_url, Transport};
use crate::http::{self, Origin, ScopedAuth};
use crate::retry::Retry;

/// `registry[:port]/repo/path[:tag][@sha256:…]`.
mod api;
pub mod artifact;
mod auth;
mod error;
mod reference;

use auth::parse_challenge;
pub use auth::{Credentials, RegistryArgs};
pub use error::{OciError, ReferenceProblem};
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

/// The empty JSON config blob `{}` (the config of FlexInfer's pre-ModelPack layout; publish asks the
/// registry for it to reach the registry, and negotiate its auth, before hashing).
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
        let client = http::build_http_client(insecure).map_err(OciError::HttpClient)?;
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
