//! OpenAI's wire shapes the proxy produces itself: errors and the model list. Everything else
//! is the backend's, passed through.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::body::{full, ProxyBody};

/// An error answered in OpenAI's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error`, …
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429).
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }
    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn missing_model() -> Self {
        Self::bad_request("you must provide a model parameter (a string)").param("model")
    }
    pub fn duplicate_model() -> Self {
        Self::bad_request("the request body has more than one `model`").param("model")
    }
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{}` does not exist", printable(model)),
        )
        .param("model")
        .code("model_not_found")
    }
    pub fn ambiguous_model(model: &str, candidates: &[String]) -> Self {
        Self::bad_request(format!(
            "The model `{}` names several Models ({}); use <namespace>/<name>",
            printable(model),
            candidates.join(", ")
        ))
        .param("model")
        .code("model_ambiguous")
    }
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect or missing API key: send `Authorization: Bearer <key>`",
        )
        .code("invalid_api_key")
    }
    pub fn not_found_path(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown request URL: {}", printable(path)),
        )
        .code("unknown_url")
    }
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!(
                "{} is not allowed on {}",
                printable(method),
                printable(path)
            ),
        )
        .code("method_not_allowed")
    }
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body larger than {limit} bytes"),
        )
        .code("request_too_large")
    }
    /// The proxy is at its limit of admitted (or waiting) requests, globally or for one Model.
    pub fn overloaded(message: impl Into<String>, retry_after_s: u32) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .code("proxy_overloaded");
        e.retry_after_s = Some(retry_after_s);
        e
    }
    /// The client did not send its whole body in time.
    pub fn body_timeout(timeout: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body was not received within {}s",
                timeout.as_secs()
            ),
        )
        .code("request_timeout")
    }
    /// The backend sent no response headers in time.
    pub fn backend_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message).code("backend_timeout")
    }
    /// The Model cannot be served (invalid configuration, deleted while waiting, …).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            .code("model_unavailable")
    }
    /// No ready backend within `serverless.coldStartTimeout`.
    pub fn cold_start_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message).code("cold_start_timeout")
    }
    /// The backend could not be reached or broke the exchange.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "server_error", message).code("backend_unavailable")
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        let mut resp = json_response(self.status, &self.body());
        if let Some(s) = self.retry_after_s {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// A JSON response with the given status.
pub fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response<ProxyBody> {
    let bytes = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(full(Bytes::from(bytes)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelEntry {
    pub id: String,
    pub object: &'static str,
    pub created: i64,
    pub owned_by: String,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelEntry>,
}

/// A client-supplied string as it may appear in a message: bounded, control characters escaped.
pub fn printable(s: &str) -> String {
    const MAX: usize = 200;
    let mut out: String = s.chars().take(MAX).flat_map(char::escape_default).collect();
    if s.chars().count() > MAX {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_shape_is_openais() {
        let e = ApiError::model_not_found("gpt-x");
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(
            e.body(),
            serde_json::json!({"error": {
                "message": "The model `gpt-x` does not exist",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
        );
        let t = ApiError::cold_start_timeout("no ready backend");
        assert_eq!(t.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(t.body()["error"]["param"], serde_json::Value::Null);
    }

    #[test]
    fn untrusted_names_are_bounded_and_escaped() {
        let long = "a".repeat(10_000);
        assert!(printable(&long).chars().count() <= 201);
        assert_eq!(printable("a\nb\u{0}"), "a\\nb\\u{0}");
        let e = ApiError::model_not_found(&"ü".repeat(500));
        assert!(e.message.len() < 2000);
    }
}
