//! What every HTTP exchange of the worker shares: credentials bound to the origin they were
//! configured for, and response bodies read whole only within a limit (docs/dev/architecture.md, "Untrusted input").

use std::time::Duration;

use futures::StreamExt;
use reqwest::Url;

pub mod error;

/// The worker's HTTP client (the download's `http_client` wraps its error): rustls with the ring
/// provider, system roots; `insecure` disables verification.
pub fn build_http_client(insecure: bool) -> Result<reqwest::Client, reqwest::Error> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .tls_danger_accept_invalid_certs(insecure)
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(16)
        .user_agent(concat!("flexinfer-worker/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// Scheme, host and port of a URL: a credential is sent only to the origin it was configured for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    scheme: String,
    host: String,
    port: Option<u16>,
}

impl Origin {
    pub fn of(url: &Url) -> Option<Origin> {
        Some(Origin {
            scheme: url.scheme().to_ascii_lowercase(),
            host: url.host_str()?.to_ascii_lowercase(),
            port: url.port_or_known_default(),
        })
    }

    pub fn parse(url: &str) -> Option<Origin> {
        Origin::of(&Url::parse(url).ok()?)
    }

    /// Same scheme, host and port.
    pub fn matches(&self, url: &Url) -> bool {
        Origin::of(url).is_some_and(|o| o == *self)
    }

    pub fn matches_str(&self, url: &str) -> bool {
        Url::parse(url).is_ok_and(|u| self.matches(&u))
    }

    pub fn is_https(&self) -> bool {
        self.scheme == "https"
    }

    /// `host[:port]` as a registry reference spells it (the port only when not the scheme's default).
    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> Option<u16> {
        self.port
    }
}

/// An `Authorization` header value and the one origin it may be sent to. Its `Debug` never shows
/// the value.
#[derive(Clone)]
pub struct ScopedAuth {
    value: String,
    origin: Origin,
}

impl std::fmt::Debug for ScopedAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ScopedAuth(<redacted> for {:?})", self.origin)
    }
}

impl ScopedAuth {
    /// `value` for requests to `base`'s origin (None when `base` is not a URL).
    pub fn new(value: String, base: &str) -> Option<ScopedAuth> {
        Some(ScopedAuth {
            value,
            origin: Origin::parse(base)?,
        })
    }

    pub fn for_origin(value: String, origin: Origin) -> ScopedAuth {
        ScopedAuth { value, origin }
    }

    /// The header value if `url` is on the bound origin, else None.
    pub fn for_url(&self, url: &str) -> Option<&str> {
        self.origin.matches_str(url).then_some(self.value.as_str())
    }
}

/// The most bytes of each kind of response body read whole.
pub mod limits {
    const MIB: u64 = 1 << 20;
    /// One page of a hub tree listing (the hub pages at 1000 entries).
    pub const HUB_LISTING_PAGE: (u64, &str) = (32 * MIB, "hub listing page");
    /// An OCI image manifest (the distribution spec's recommended bound).
    pub const OCI_MANIFEST: (u64, &str) = (4 * MIB, "OCI manifest");
    /// One page of a registry tag list.
    pub const TAG_LIST: (u64, &str) = (8 * MIB, "registry tag list");
    /// A token endpoint's answer.
    pub const TOKEN_RESPONSE: (u64, &str) = (MIB, "token response");
    /// An error body (only its start is shown).
    pub const ERROR_BODY: (u64, &str) = (64 * 1024, "error body");
}

/// The body of `resp`, refusing more than `limit.0` bytes (by `Content-Length` before reading,
/// and while streaming); errors name `what` and the kind of body.
pub async fn read_body_limited(
    resp: reqwest::Response,
    limit: (u64, &str),
    what: &str,
) -> Result<Vec<u8>, BodyError> {
    let (max, kind) = limit;
    let too_large = |size: Option<u64>| BodyError::TooLarge {
        what: what.to_string(),
        kind: kind.to_string(),
        size,
        max,
    };
    if let Some(n) = resp.content_length().filter(|n| *n > max) {
        return Err(too_large(Some(n)));
    }
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Transport {
            what: what.to_string(),
            kind: kind.to_string(),
            source: error::Transport(e),
        })?;
        if (out.len() as u64).saturating_add(chunk.len() as u64) > max {
            return Err(too_large(None));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// The start of an error body, for a message (never more than [`limits::ERROR_BODY`] is read).
/// The target of the `rel="next"` entry of a `Link` header (pagination of hub listings and registry
/// tag lists), as written: it may be relative, and the caller decides which host it may go to.
pub fn next_link(h: &reqwest::header::HeaderMap) -> Option<String> {
    let v = h.get(reqwest::header::LINK)?.to_str().ok()?;
    v.split(',').find_map(|part| {
        let part = part.trim();
        if !part.contains("rel=\"next\"") {
            return None;
        }
        let (_, rest) = part.split_once('<')?;
        rest.split_once('>').map(|(url, _)| url.to_string())
    })
}

pub async fn error_text(resp: reqwest::Response) -> String {
    match read_body_limited(resp, limits::ERROR_BODY, "error").await {
        Ok(b) => String::from_utf8_lossy(&b).chars().take(300).collect(),
        Err(_) => String::new(),
    }
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Over the limit: the server (or its data) is bad, retrying will not help. `size`: the
    /// announced length (`None`: the stream went past `max`).
    #[error("{what}: the {kind} is {} bytes, over the {max} allowed", shown_size(*.size, *.max))]
    TooLarge {
        what: String,
        kind: String,
        size: Option<u64>,
        max: u64,
    },
    /// The connection failed while reading.
    #[error("{what}: reading the {kind}")]
    Transport {
        what: String,
        kind: String,
        #[source]
        source: error::Transport,
    },
}

fn shown_size(size: Option<u64>, max: u64) -> String {
    match size {
        Some(n) => n.to_string(),
        None => format!("more than {max}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_compare_scheme_host_and_port() {
        let o = Origin::parse("https://Hub.example/api").unwrap();
        assert!(o.matches_str("https://hub.example:443/x"));
        assert!(!o.matches_str("http://hub.example/x"), "plain http");
        assert!(!o.matches_str("https://hub.example:8443/x"), "other port");
        assert!(!o.matches_str("https://cdn.example/x"), "other host");
        assert!(!o.matches_str("https://hub.example.evil/x"));
        assert!(!o.matches_str("not a url"));
        let a = ScopedAuth::new("Bearer secret".into(), "https://hub.example").unwrap();
        assert_eq!(a.for_url("https://hub.example/a"), Some("Bearer secret"));
        assert_eq!(a.for_url("https://other.example/a"), None);
        assert!(!format!("{a:?}").contains("secret"));
    }
}
