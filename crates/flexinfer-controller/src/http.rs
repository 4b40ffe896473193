//! A tiny HTTP/1.1 responder on tokio for `/metrics`, `/healthz` and `/readyz`. Hand-written to
//! keep the controller's dependency tree small: it answers GETs of three fixed paths.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing::warn;

use crate::metrics::Metrics;

/// Readiness flags shared with the probes.
#[derive(Clone, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    pub fn set_ready(&self, v: bool) {
        self.ready.store(v, Ordering::SeqCst);
    }
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
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
        ("/healthz" | "/livez", None) => (200, "text/plain", "ok\n".into()),
        ("/readyz", None) if health.is_ready() => (200, "text/plain", "ok\n".into()),
        ("/readyz", None) => (503, "text/plain", "not ready\n".into()),
        _ => (404, "text/plain", "not found\n".into()),
    }
}

/// Serve until the process ends. With `metrics` it serves `/metrics`, else the probes.
pub async fn serve(
    addr: SocketAddr,
    metrics: Option<Metrics>,
    health: Health,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    loop {
        let (mut sock, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "accept failed");
                continue;
            }
        };
        let metrics = metrics.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // Read until the end of the request head (or 4 KiB).
            while n < buf.len() {
                match sock.read(&mut buf[n..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        n += k;
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                }
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let mut parts = head.split_whitespace();
            let method = parts.next().unwrap_or("");
            let path = parts.next().unwrap_or("/").split('?').next().unwrap_or("/");
            let (code, ctype, body) = if method == "GET" || method == "HEAD" {
                respond(path, metrics.as_ref(), &health)
            } else {
                (405, "text/plain", "method not allowed\n".to_string())
            };
            let reason = match code {
                200 => "OK",
                404 => "Not Found",
                405 => "Method Not Allowed",
                _ => "Service Unavailable",
            };
            let head = format!(
                "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            if method != "HEAD" {
                let _ = sock.write_all(body.as_bytes()).await;
            }
            let _ = sock.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_and_metrics() {
        let h = Health::default();
        assert_eq!(respond("/healthz", None, &h).0, 200);
        assert_eq!(respond("/readyz", None, &h).0, 503);
        h.set_ready(true);
        assert_eq!(respond("/readyz", None, &h).0, 200);
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
    async fn serves_over_tcp() {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = probe.local_addr().expect("addr");
        drop(probe);
        let h = Health::default();
        tokio::spawn(serve(addr, None, h));
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
}
