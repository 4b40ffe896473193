//! The serving backends' own API keys (a Model's `spec.backendKeySecretRef`), which the proxy sends
//! to a Model's backends as `Authorization: Bearer <key>`. Not the callers' keys ([`crate::auth`]):
//! those say who may use the proxy; these let only the proxy use a backend.
//!
//! A key is read from its Secret with one GET (the proxy has `get` on Secrets only where the chart
//! grants it: `proxy.backendKeys.enabled`) and kept for a time to live, so that requests do not
//! read the Secret each: a changed key is sent within that time. Concurrent requests for a key
//! being read wait for that one read. A failed read is kept too (no GET per request for a missing
//! Secret); a transient failure after a good read keeps the last good key until the next read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexinfer_api::contract::serving::BACKEND_KEY_FIELD;
use flexinfer_api::model::BackendKeySecretRef;
use http::HeaderValue;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::Client;
use tokio::time::Instant;

/// `(namespace, Model, Secret, key)`: per Model, so that an error names the Model it is about.
type SecretKey = (String, String, String, String);

/// One read of a key: the `Authorization` value to send, or why there is none.
#[derive(Clone)]
struct Read {
    at: Instant,
    value: Result<HeaderValue, KeyError>,
}

/// Why a Model's backend key cannot be sent (the request is refused, never forwarded without it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct KeyError {
    pub message: String,
    /// The API server could not be asked (not an answer about the Secret).
    transient: bool,
}

impl KeyError {
    fn about_the_secret(message: String) -> Self {
        Self {
            message,
            transient: false,
        }
    }
}

/// The backend keys read so far, per Model and Secret key.
pub struct BackendKeys {
    client: Client,
    ttl: Duration,
    entries: Mutex<HashMap<SecretKey, Arc<tokio::sync::Mutex<Option<Read>>>>>,
}

impl BackendKeys {
    /// Keys read with `client`, each kept for `ttl`.
    pub fn new(client: Client, ttl: Duration) -> Self {
        Self {
            client,
            ttl,
            entries: Mutex::default(),
        }
    }

    /// The `Authorization` value for the backends of Model `namespace/model`, whose
    /// `spec.backendKeySecretRef` is `r`: from the cache while it is fresh, else read now.
    pub async fn authorization(
        &self,
        namespace: &str,
        model: &str,
        r: &BackendKeySecretRef,
    ) -> Result<HeaderValue, KeyError> {
        let id = (
            namespace.to_string(),
            model.to_string(),
            r.name.clone(),
            r.key.clone(),
        );
        let entry = {
            let Ok(mut entries) = self.entries.lock() else {
                return self.read(namespace, model, r).await;
            };
            entries.entry(id).or_default().clone()
        };
        // Held across the read: requests for the same key wait for it instead of reading too.
        let mut cached = entry.lock().await;
        if let Some(c) = cached.as_ref() {
            if c.at.elapsed() < self.ttl {
                return c.value.clone();
            }
        }
        let mut value = self.read(namespace, model, r).await;
        if let (
            Err(e),
            Some(Read {
                value: Ok(good), ..
            }),
        ) = (&value, cached.as_ref())
        {
            if e.transient {
                value = Ok(good.clone());
            }
        }
        *cached = Some(Read {
            at: Instant::now(),
            value: value.clone(),
        });
        value
    }

    async fn read(
        &self,
        namespace: &str,
        model: &str,
        r: &BackendKeySecretRef,
    ) -> Result<HeaderValue, KeyError> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let what = format!(
            "Model {namespace}/{model}: the backend key ({BACKEND_KEY_FIELD}: Secret {namespace}/{}, key {})",
            r.name, r.key
        );
        let secret = match api.get(&r.name).await {
            Ok(s) => s,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return Err(KeyError::about_the_secret(format!(
                    "{what} cannot be sent: the Secret does not exist"
                )))
            }
            Err(kube::Error::Api(e)) if e.code == 403 => {
                return Err(KeyError::about_the_secret(format!(
                    "{what} cannot be sent: the proxy may not read Secrets in {namespace} \
                     (chart value proxy.backendKeys.enabled)"
                )))
            }
            Err(e) => {
                return Err(KeyError {
                    message: format!(
                        "{what} cannot be sent: cannot read the Secret: {}",
                        flexinfer_api::contract::error::chain(&e)
                    ),
                    transient: true,
                })
            }
        };
        let Some(bytes) = secret.data.as_ref().and_then(|d| d.get(&r.key)) else {
            return Err(KeyError::about_the_secret(format!(
                "{what} cannot be sent: the Secret has no such key"
            )));
        };
        bearer(&bytes.0).ok_or_else(|| {
            KeyError::about_the_secret(format!(
                "{what} cannot be sent: the value is empty or holds whitespace or control \
                 characters (a trailing newline?)"
            ))
        })
    }
}

/// `Bearer <key>` for a key of visible ASCII characters (what an HTTP header carries and what a
/// backend compares byte for byte); `None` for anything else.
fn bearer(key: &[u8]) -> Option<HeaderValue> {
    if key.is_empty() || !key.iter().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    let mut v = HeaderValue::from_bytes(&[b"Bearer ".as_slice(), key].concat()).ok()?;
    v.set_sensitive(true);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_visible_ascii_keys_are_sent() {
        let cases: [(&[u8], Option<&str>); 7] = [
            (b"sk-backend", Some("Bearer sk-backend")),
            (b"a.b_c-d~e/f+g=", Some("Bearer a.b_c-d~e/f+g=")),
            (b"", None),
            (b"sk\n", None),
            (b"sk key", None),
            (b"sk\x7f", None),
            ("sk-é".as_bytes(), None),
        ];
        for (key, want) in cases {
            let got = bearer(key);
            assert_eq!(
                got.as_ref().map(|v| v.to_str().unwrap_or_default()),
                want,
                "{key:?}"
            );
            assert!(got.is_none_or(|v| v.is_sensitive()));
        }
    }
}
