//! The proxy against the real API server: Models and EndpointSlices are real objects, the
//! backends are small OpenAI-compatible HTTP servers on this host (at its non-loopback address,
//! which EndpointSlices accept), and the proxy runs in-process. The scale-from-zero test runs the
//! real Model controller in-process and plays the kubelet/EndpointSlice controller's part (it
//! publishes the endpoint once the Deployment is scaled up). Tests without the Model controller
//! make the Service it would make (owned by the Model); endpoints are published as EndpointSlices
//! owned by that Service, as Kubernetes' EndpointSlice controller writes them.
//!
//! Needs `KUBECONFIG` from `scripts/testenv/up.sh` (`api` is enough; `make test` sets it up).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use flexinfer_api::model::ModelPhase;
use flexinfer_api::Model;
use flexinfer_e2e::{client, install_crds, TestNamespace};
use flexinfer_proxy::auth::ApiKeys;
use flexinfer_proxy::cluster::ModelKey;
use flexinfer_proxy::{Cluster, Config, Proxy};
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Notify;

const WAIT: Duration = Duration::from_secs(60);
const MANAGER: &str = "flexinfer-proxy-tests";
const KEY: &str = "sk-test-key";
/// `endpointslice.kubernetes.io/managed-by` of the slices published here for a Service the Model
/// controller made: that Service selects the Model's pods, which cannot run here, so in cluster
/// mode the control plane's own EndpointSlice controller would replace a slice labelled as its
/// own. Proxies beside the Model controller trust this manager instead (every other rule holds).
const TEST_SLICE_MANAGER: &str = "flexinfer-proxy-tests";
/// Kubernetes' EndpointSlice controller: the manager every other proxy here trusts.
const KCM_SLICE_MANAGER: &str = "endpointslice-controller.k8s.io";

// ---------------------------------------------------------------------------------------------
// control plane

/// This host's address as other machines (and EndpointSlice validation) see it: not loopback.
fn host_ip() -> IpAddr {
    if let Some(ip) = std::env::var("TESTENV_HOST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return ip;
    }
    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    // No packet is sent: connecting a UDP socket only picks the route and source address.
    s.connect("192.0.2.255:9")
        .or_else(|_| s.connect("10.255.255.255:9"))
        .unwrap();
    let ip = s.local_addr().unwrap().ip();
    assert!(!ip.is_loopback(), "no non-loopback address on this host");
    ip
}

async fn apply_model(client: &Client, ns: &str, name: &str, spec: Value) -> Model {
    let api: Api<Model> = Api::namespaced(client.clone(), ns);
    let obj = json!({"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
                     "metadata": {"name": name}, "spec": spec});
    api.patch(
        name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .unwrap_or_else(|e| panic!("apply Model {name}: {e}"))
}

/// The Model and the Service the Model controller would make for it (named after it, labelled,
/// controlled by it), for tests without the controller. Without a selector: Kubernetes'
/// EndpointSlice controller leaves the slices of such a Service to whoever publishes them.
async fn apply_served_model(client: &Client, ns: &str, name: &str, spec: Value) -> Model {
    let m = apply_model(client, ns, name, spec).await;
    let api: Api<Service> = Api::namespaced(client.clone(), ns);
    let obj = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": {
            "app.kubernetes.io/managed-by": "flexinfer",
            "app.kubernetes.io/component": "inference-server",
        }, "ownerReferences": [{"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "name": name, "uid": m.uid().unwrap(), "controller": true}]},
        "spec": {"ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]},
    });
    api.patch(
        name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .unwrap_or_else(|e| panic!("apply Service {name}: {e}"));
    m
}

/// The EndpointSlice Kubernetes would publish for the Model's Service (labels copied from it,
/// owned by it), once that Service exists.
async fn publish_endpoint(client: &Client, ns: &str, model: &str, addr: SocketAddr, ready: bool) {
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let svc = tokio::time::timeout(
        WAIT,
        await_condition(services, model, |s: Option<&Service>| s.is_some()),
    )
    .await
    .unwrap_or_else(|_| panic!("no Service {model}"))
    .unwrap()
    .unwrap();
    let selects = svc
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .is_some_and(|s| !s.is_empty());
    let manager = if selects {
        TEST_SLICE_MANAGER
    } else {
        KCM_SLICE_MANAGER
    };
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let obj = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{model}-test"), "labels": {
            "kubernetes.io/service-name": model,
            "endpointslice.kubernetes.io/managed-by": manager,
            "app.kubernetes.io/managed-by": "flexinfer",
            "app.kubernetes.io/component": "inference-server",
        }, "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": model,
            "uid": svc.uid().unwrap(), "controller": true, "blockOwnerDeletion": true}]},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": addr.port(), "protocol": "TCP"}],
        "endpoints": [{"addresses": [addr.ip().to_string()], "conditions": {"ready": ready}}],
    });
    api.patch(
        &format!("{model}-test"),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .unwrap_or_else(|e| panic!("apply EndpointSlice for {model}: {e}"));
}

fn last_active(m: &Model) -> Option<Timestamp> {
    m.status
        .as_ref()
        .and_then(|s| s.last_active_time.as_ref())
        .map(|t| t.0)
}

// ---------------------------------------------------------------------------------------------
// a small OpenAI-compatible backend

#[derive(Default)]
struct BackendState {
    name: String,
    requests: Mutex<Vec<(String, Value, http::HeaderMap)>>,
    release: Notify,
    /// Streams whose body was dropped before it was complete (the client went away).
    abandoned: AtomicUsize,
    abandoned_notify: Notify,
    /// Bytes handed to hyper by the flood stream.
    produced: AtomicU64,
}

struct Backend {
    addr: SocketAddr,
    state: Arc<BackendState>,
}

/// Counts an unfinished stream as abandoned when dropped.
struct StreamGuard {
    state: Arc<BackendState>,
    done: bool,
}
impl Drop for StreamGuard {
    fn drop(&mut self) {
        if !self.done {
            self.state.abandoned.fetch_add(1, Ordering::SeqCst);
            self.state.abandoned_notify.notify_waiters();
        }
    }
}

fn sse_event(i: usize) -> String {
    format!("data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i}\"}}}}]}}\n\n")
}

fn expected_sse(n: usize) -> String {
    (0..n).map(sse_event).collect::<String>() + "data: [DONE]\n\n"
}

type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

async fn backend_handle(state: Arc<BackendState>, req: Request<Incoming>) -> Response<BoxBody> {
    let path = req.uri().path().to_string();
    let headers = req.headers().clone();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    state
        .requests
        .lock()
        .unwrap()
        .push((path.clone(), v.clone(), headers));
    let mut resp = if v["flood"] == true {
        // Unbounded-looking stream: counts what the proxy pulls.
        let st = state.clone();
        let chunk = Bytes::from(vec![b'x'; 64 << 10]);
        let s = futures::stream::unfold(0u64, move |sent| {
            let (st, chunk) = (st.clone(), chunk.clone());
            async move {
                if sent >= 512 << 20 {
                    return None;
                }
                st.produced.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                Some((
                    Ok::<_, Infallible>(Frame::data(chunk.clone())),
                    sent + chunk.len() as u64,
                ))
            }
        });
        let mut r = Response::new(StreamBody::new(s).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "application/octet-stream".parse().unwrap());
        r
    } else if v["stream"] == true {
        let n = v["max_tokens"].as_u64().unwrap_or(3) as usize;
        let delay = Duration::from_millis(v["delay_ms"].as_u64().unwrap_or(0));
        let hold = v["hold"] == true;
        let guard = StreamGuard {
            state: state.clone(),
            done: false,
        };
        let s = futures::stream::unfold((0usize, guard), move |(i, mut guard)| async move {
            if i > n {
                guard.done = true;
                drop(guard);
                return None;
            }
            if i == 1 && hold {
                guard.state.release.notified().await;
            } else if i > 0 {
                tokio::time::sleep(delay).await;
            }
            let text = if i == n {
                "data: [DONE]\n\n".to_string()
            } else {
                sse_event(i)
            };
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from(text))),
                (i + 1, guard),
            ))
        });
        let mut r = Response::new(StreamBody::new(s).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        r
    } else {
        let out = json!({"id": "cmpl-1", "object": "chat.completion", "model": v["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("hi from {}", state.name)}}]});
        let mut r = Response::new(Full::new(Bytes::from(out.to_string())).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        r
    };
    resp.headers_mut()
        .insert("x-backend", state.name.parse().unwrap());
    resp
}

async fn start_backend(name: &str) -> Backend {
    let listener = TcpListener::bind(SocketAddr::new(host_ip(), 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let state = Arc::new(BackendState {
        name: name.to_string(),
        ..Default::default()
    });
    let st = state.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let st = st.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let st = st.clone();
                    async move { Ok::<_, Infallible>(backend_handle(st, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Backend { addr, state }
}

// ---------------------------------------------------------------------------------------------
// the proxy, in-process

struct TestProxy {
    url: String,
    proxy: Arc<Proxy>,
}

async fn start_proxy(client: &Client, ns: &str, keys: &str, keepalive: Duration) -> TestProxy {
    start_proxy_trusting(client, ns, keys, keepalive, KCM_SLICE_MANAGER).await
}

/// A proxy using the slices `slice_manager` publishes ([`TEST_SLICE_MANAGER`] beside the Model
/// controller).
async fn start_proxy_trusting(
    client: &Client,
    ns: &str,
    keys: &str,
    keepalive: Duration,
    slice_manager: &str,
) -> TestProxy {
    let cluster =
        Cluster::start_with_slice_manager(client.clone(), &[ns.to_string()], slice_manager);
    assert!(cluster.wait_ready(WAIT).await, "proxy caches did not sync");
    let config = Config {
        api_keys: ApiKeys::parse(keys).unwrap(),
        max_body_bytes: 1 << 20,
        keepalive_interval: keepalive,
        ..Config::default()
    };
    let proxy = Proxy::new(cluster.clone(), config).unwrap();
    tokio::spawn(
        proxy
            .activity
            .clone()
            .run(cluster, keepalive, Duration::from_millis(200)),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(flexinfer_proxy::serve(
        listener,
        proxy.clone(),
        futures::future::pending(),
    ));
    TestProxy { url, proxy }
}

impl TestProxy {
    /// Wait (on the proxy's own watch signal) until its caches satisfy `f`.
    async fn wait_cache(&self, what: &str, f: impl Fn(&Cluster) -> bool) {
        let c = &self.proxy.cluster;
        let mut changes = c.changes();
        tokio::time::timeout(WAIT, async {
            loop {
                changes.borrow_and_update();
                if f(c) {
                    return;
                }
                changes.changed().await.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("proxy cache never saw: {what}"));
    }

    async fn wait_routable(&self, ns: &str, model: &str, backends: usize) {
        let key: ModelKey = (ns.to_string(), model.to_string());
        self.wait_cache(&format!("{model} with {backends} backends"), |c| {
            c.model(&key).is_some() && c.backends(&key).len() == backends
        })
        .await;
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn post(url: &str, path: &str, key: Option<&str>, body: &Value) -> reqwest::Response {
    let mut r = http().post(format!("{url}{path}")).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().await.unwrap()
}

async fn error_of(resp: reqwest::Response, status: u16) -> Value {
    assert_eq!(resp.status().as_u16(), status, "status");
    let v: Value = resp.json().await.unwrap();
    assert!(
        v["error"]["message"].is_string() && v["error"].get("type").is_some(),
        "OpenAI error shape: {v}"
    );
    v["error"].clone()
}

// ---------------------------------------------------------------------------------------------

mod replicas;
mod routing;
mod scale;
mod shared_gpu;
