//! The HTTP server of `/metrics`, `/healthz` and `/readyz` (hyper, HTTP/1.1). It answers GETs
//! (and HEADs) of these fixed paths; every response closes its connection.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use flexinfer_runtime::server;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{CONNECTION, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Readiness and the state of each supervised controller, shared with the probes.
#[derive(Clone, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
    /// Controller name → why it is down (`None`: running).
    controllers: Arc<Mutex<BTreeMap<&'static str, Option<String>>>>,
}

impl Health {
    pub fn set_ready(&self, v: bool) {
        self.ready.store(v, Ordering::SeqCst);
    }
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
    /// Record that controller `name` runs (`down: None`) or is down, and why.
    pub fn set_controller(&self, name: &'static str, down: Option<String>) {
        if let Ok(mut c) = self.controllers.lock() {
            c.insert(name, down);
        }
    }
    /// `"<controller>: <why>"` for every controller that is down.
    pub fn down(&self) -> Vec<String> {
        match self.controllers.lock() {
            Ok(c) => c
                .iter()
                .filter_map(|(name, why)| why.as_ref().map(|w| format!("{name}: {w}")))
                .collect(),
            Err(_) => vec!["controller state unavailable".to_string()],
        }
    }
}

/// Response of one request path.
pub fn respond(
    path: &str,
    metrics: Option<&Metrics>,
    health: &Health,
) -> (u16, &'static str, String) {
    match (path, metrics) {
        ("/metrics", Some(m)) => (200, "text/plain; version=0.0.4", m.render()),
        ("/healthz" | "/livez", None) => match health.down() {
            down if down.is_empty() => (200, "text/plain", "ok\n".into()),
            down => (503, "text/plain", format!("down: {}\n", down.join("; "))),
        },
        ("/readyz", None) if health.is_ready() => (200, "text/plain", "ok\n".into()),
        ("/readyz", None) => (503, "text/plain", "not ready\n".into()),
        _ => (404, "text/plain", "not found\n".into()),
    }
}

/// The response to one request.
fn handle<B>(
    req: &Request<B>,
    metrics: Option<&Metrics>,
    health: &Health,
) -> Response<Full<Bytes>> {
    let (code, ctype, body) = match *req.method() {
        Method::GET | Method::HEAD => respond(req.uri().path(), metrics, health),
        _ => (405, "text/plain", "method not allowed\n".to_string()),
    };
    let body = if req.method() == Method::HEAD {
        Bytes::new()
    } else {
        Bytes::from(body)
    };
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(ctype));
    headers.insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
    resp
}

/// Listen on `addr`, the value of setting `setting`: an address that cannot be bound (in use,
/// not local) stops the controller at start-up with an error naming both, instead of a controller
/// that runs without its metrics or probes.
pub async fn bind(addr: SocketAddr, setting: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr} ({setting}): {e}"))
}

/// A client of the metrics or probe port that has not sent its request head within this time is
/// dropped.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serve on `listener` until the process ends. With `metrics` it serves `/metrics`, else the probes.
pub async fn serve(listener: TcpListener, metrics: Option<Metrics>, health: Health) {
    let limits = server::Limits::probes(HEADER_READ_TIMEOUT);
    server::serve(listener, limits, server::forever(), || {
        let (metrics, health) = (metrics.clone(), health.clone());
        service_fn(move |req| {
            let resp = handle(&req, metrics.as_ref(), &health);
            async move { Ok::<_, Infallible>(resp) }
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn probes_and_metrics() {
        let h = Health::default();
        assert_eq!(respond("/healthz", None, &h).0, 200);
        assert_eq!(respond("/readyz", None, &h).0, 503);
        h.set_ready(true);
        assert_eq!(respond("/readyz", None, &h).0, 200);
        // A supervised controller that is down fails the liveness probe, naming it.
        h.set_controller("model", None);
        assert_eq!(respond("/healthz", None, &h).0, 200);
        h.set_controller("model", Some("its watch stream ended".into()));
        let (code, _, body) = respond("/healthz", None, &h);
        assert_eq!(code, 503);
        assert_eq!(body, "down: model: its watch stream ended\n");
        h.set_controller("model", None);
        assert_eq!(respond("/healthz", None, &h).0, 200);
        assert_eq!(
            respond("/metrics", None, &h).0,
            404,
            "probe port serves no metrics"
        );
        let m = Metrics::new().expect("metrics");
        m.reconcile_errors_total
            .with_label_values(&["modelcache"])
            .inc();
        let (code, ctype, body) = respond("/metrics", Some(&m), &h);
        assert_eq!(code, 200);
        assert!(ctype.starts_with("text/plain"));
        assert!(body.contains("flexinfer_reconcile_errors_total{controller=\"modelcache\"} 1"));
        assert_eq!(
            respond("/healthz", Some(&m), &h).0,
            404,
            "metrics port serves no probes"
        );
    }

    #[tokio::test]
    async fn an_address_in_use_is_an_error_naming_the_setting() {
        let taken = bind("127.0.0.1:0".parse().unwrap(), "TEST")
            .await
            .expect("bind");
        let addr = taken.local_addr().expect("addr");
        let err = bind(addr, "FLEXINFER_METRICS_ADDR")
            .await
            .expect_err("the address is in use")
            .to_string();
        assert!(
            err.contains(&addr.to_string()) && err.contains("FLEXINFER_METRICS_ADDR"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn serves_over_tcp() {
        let listener = bind("127.0.0.1:0".parse().unwrap(), "TEST")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let h = Health::default();
        tokio::spawn(serve(listener, None, h));
        let mut body = String::new();
        for _ in 0..50 {
            if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    .await
                    .expect("write");
                s.read_to_string(&mut body).await.expect("read");
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.ends_with("ok\n"));
    }

    #[tokio::test]
    async fn head_has_no_body_and_other_methods_get_405() {
        let listener = bind("127.0.0.1:0".parse().unwrap(), "TEST")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(serve(listener, None, Health::default()));
        let mut replies = Vec::new();
        for req in [
            "HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            "POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
            "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
        ] {
            let mut body = String::new();
            for _ in 0..50 {
                if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                    s.write_all(req.as_bytes()).await.expect("write");
                    s.read_to_string(&mut body).await.expect("read");
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            replies.push(body);
        }
        assert!(replies[0].starts_with("HTTP/1.1 200 OK"), "{}", replies[0]);
        assert!(
            replies[0].ends_with("\r\n\r\n"),
            "HEAD without a body: {}",
            replies[0]
        );
        assert!(replies[1].starts_with("HTTP/1.1 405"), "{}", replies[1]);
        assert!(replies[2].starts_with("HTTP/1.1 404"), "{}", replies[2]);
    }
}
