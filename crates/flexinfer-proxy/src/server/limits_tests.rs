//! The proxy's limits without a cluster (issue #40): the cluster view is fed by hand
//! ([`Cluster::offline`]), backends and the API server's `models/status` endpoint are small hyper
//! servers on 127.0.0.1, and the proxy serves on 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;
use crate::cluster::Offline;

const NS: &str = "ns";
/// Every wait here is bounded: a limit that does not act fails the test instead of hanging it.
const BOUND: Duration = Duration::from_secs(20);

/// The settings under test, small so that the tests are quick.
fn test_config() -> Config {
    Config {
        header_read_timeout: Duration::from_millis(300),
        body_read_timeout: Duration::from_millis(300),
        backend_header_timeout: Duration::from_millis(300),
        max_requests: 64,
        max_queued_requests: 64,
        max_requests_per_model: 32,
        ..Config::default()
    }
}

fn model(name: &str, cold_start_timeout: &str) -> flexinfer_api::Model {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "1"},
        "spec": {"backend": "vllm", "source": "pvc://c/p",
                 "serverless": {"enabled": true, "minReplicas": 0,
                                "coldStartTimeout": cold_start_timeout}}
    }))
    .unwrap()
}

fn slice(model: &str, name: &str, port: u16) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {
            "kubernetes.io/service-name": model,
            "app.kubernetes.io/managed-by": "flexinfer",
            "app.kubernetes.io/component": "inference-server"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": true}}]
    }))
    .unwrap()
}

/// Serve `handle` on 127.0.0.1 (a backend or the API server); its port.
async fn http_server<F, Fut>(handle: F) -> u16
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let h = handle.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let h = h.clone();
                    async move { Ok::<_, Infallible>(h(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    port
}

/// An API server whose `PATCH …/models/<m>/status` answers the Model after 200 ms; counts them.
async fn api_server(patches: Arc<AtomicUsize>) -> kube::Client {
    let port = http_server(move |req: Request<Incoming>| {
        let patches = patches.clone();
        async move {
            let path = req.uri().path().to_string();
            if req.method() == Method::PATCH && path.ends_with("/status") {
                patches.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                let name = path.rsplit('/').nth(1).unwrap_or_default().to_string();
                let mut m = model(&name, "30s");
                m.metadata.resource_version = Some("2".into());
                return json_response(StatusCode::OK, &m);
            }
            json_response(StatusCode::NOT_FOUND, &serde_json::json!({}))
        }
    })
    .await;
    let url: http::Uri = format!("http://127.0.0.1:{port}").parse().unwrap();
    kube::Client::try_from(kube::Config::new(url)).unwrap()
}

struct Harness {
    url: String,
    proxy: Arc<Proxy>,
    feed: Offline,
}

async fn harness(config: Config) -> Harness {
    let patches = Arc::new(AtomicUsize::new(0));
    let (cluster, feed) = Cluster::offline(api_server(patches.clone()).await);
    let proxy = Proxy::new(cluster, config).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(serve(l, proxy.clone(), futures::future::pending()));
    Harness { url, proxy, feed }
}

/// POST a chat completion for `model`: status, `Retry-After`, body.
async fn chat(url: &str, model: &str) -> (u16, Option<String>, Bytes) {
    let client: HttpClient<HttpConnector, Full<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build(HttpConnector::new());
    let body = serde_json::to_vec(&serde_json::json!({"model": model, "messages": []})).unwrap();
    let req = Request::post(format!("{url}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(BOUND, client.request(req))
        .await
        .expect("the proxy answers within the bound")
        .unwrap();
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap().to_string());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, retry, body)
}

/// Whether the server closes a connection that sent half a request head, within the bound.
async fn closes_half_a_head(addr: &str) -> bool {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(BOUND, s.read_to_end(&mut buf))
        .await
        .is_ok()
}

#[tokio::test]
async fn every_server_times_out_a_slow_request_head() {
    let h = harness(test_config()).await;
    let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health_addr = health.local_addr().unwrap().to_string();
    tokio::spawn(serve_health(health, h.proxy.clone()));
    let started = Instant::now();
    assert!(
        closes_half_a_head(&health_addr).await,
        "the health/metrics server kept a half-sent request head open"
    );
    assert!(
        closes_half_a_head(h.url.trim_start_matches("http://")).await,
        "the front kept a half-sent request head open"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_slow_request_body_is_answered_408() {
    let h = harness(test_config()).await;
    let mut s = TcpStream::connect(h.url.trim_start_matches("http://"))
        .await
        .unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(BOUND, s.read(&mut buf))
        .await
        .expect("an answer to a stalled body within the bound")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
}

#[tokio::test]
async fn a_backend_that_sends_no_headers_is_answered_504() {
    let mut h = harness(test_config()).await;
    // Accepts and reads, never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    h.feed.apply_model(model("m", "30s"));
    h.feed.apply_slice(slice("m", "m-1", port));
    let (status, _, body) = chat(&h.url, "m").await;
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test]
async fn requests_over_a_models_limit_are_answered_429_with_retry_after() {
    let mut h = harness(Config {
        max_requests_per_model: 4,
        ..test_config()
    })
    .await;
    h.feed.apply_model(model("cold", "2s"));
    let all: Vec<_> = (0..10).map(|_| chat(&h.url, "cold")).collect();
    let started = Instant::now();
    let answers = futures::future::join_all(all).await;
    let refused: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert_eq!(
        refused.len(),
        6,
        "{:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    assert!(
        refused.iter().all(|a| a.1.is_some()),
        "Retry-After on every 429"
    );
    // The refused ones are answered at once, not after the cold-start timeout.
    assert!(answers.iter().filter(|a| a.0 == 504).count() == 4);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn requests_over_the_global_limit_and_queue_are_answered_429() {
    let mut h = harness(Config {
        max_requests: 2,
        max_queued_requests: 2,
        ..test_config()
    })
    .await;
    h.feed.apply_model(model("cold", "1s"));
    let all: Vec<_> = (0..10).map(|_| chat(&h.url, "cold")).collect();
    let answers = futures::future::join_all(all).await;
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    // 2 admitted and 2 queued (then admitted): 504 after the cold start; 6 refused at once.
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        6,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 504).count(),
        4,
        "{statuses:?}"
    );
}
