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

#[tokio::test]
async fn proxy_routes_streams_and_authenticates() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let ns = TestNamespace::new(&client, "proxy-route").await.unwrap();
    let ns = ns.name.clone();
    let a = start_backend("backend-a").await;
    let b = start_backend("backend-b").await;
    let spec = |aliases: Value| {
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
                                       "serverless": {"enabled": false}, "aliases": aliases})
    };
    apply_served_model(
        &client,
        &ns,
        "m-a",
        spec(json!(["alias-a", "org/Model-A:v1"])),
    )
    .await;
    apply_served_model(&client, &ns, "m-b", spec(json!([]))).await;
    // A hand-made slice carrying every label of m-a's real one (but no owner), pointing at m-b's
    // backend: in the proxy's initial list, never used.
    let hand_made = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "m-a-hand-made", "labels": {
            "kubernetes.io/service-name": "m-a",
            "endpointslice.kubernetes.io/managed-by": KCM_SLICE_MANAGER,
            "app.kubernetes.io/managed-by": "flexinfer",
            "app.kubernetes.io/component": "inference-server",
        }},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": b.addr.port(), "protocol": "TCP"}],
        "endpoints": [{"addresses": [b.addr.ip().to_string()]}],
    });
    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
        .patch(
            "m-a-hand-made",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&hand_made),
        )
        .await
        .unwrap();
    publish_endpoint(&client, &ns, "m-a", a.addr, true).await;
    publish_endpoint(&client, &ns, "m-b", b.addr, true).await;
    // KEY reaches every namespace; the others only theirs.
    let keys =
        format!("{KEY}\nsk-elsewhere namespaces=elsewhere\nsk-own namespaces=elsewhere,{ns}");
    let p = start_proxy(&client, &ns, &keys, Duration::from_secs(30)).await;
    p.wait_routable(&ns, "m-a", 1).await;
    p.wait_routable(&ns, "m-b", 1).await;
    assert_eq!(
        p.proxy.cluster.backends(&(ns.clone(), "m-a".to_string())),
        vec![a.addr.to_string()],
        "only the slice of m-a's own Service is used"
    );
    let url = p.url.as_str();

    // Auth: no key, a wrong key, the right key.
    let e = error_of(
        http().get(format!("{url}/v1/models")).send().await.unwrap(),
        401,
    )
    .await;
    assert_eq!(e["code"], "invalid_api_key");
    let e = error_of(
        post(
            url,
            "/v1/chat/completions",
            Some("sk-wrong"),
            &json!({"model": "m-a"}),
        )
        .await,
        401,
    )
    .await;
    assert_eq!(e["code"], "invalid_api_key");
    assert!(
        a.state.requests.lock().unwrap().is_empty(),
        "nothing reached a backend without the key"
    );
    let list: Value = http()
        .get(format!("{url}/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(list["object"], "list");
    assert_eq!(ids, vec!["alias-a", "m-a", "m-b", "org/Model-A:v1"]);
    let one: Value = http()
        .get(format!("{url}/v1/models/org/Model-A:v1"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["id"], "org/Model-A:v1");

    // A key scoped to other namespaces sees none of this namespace's Models, by any name.
    let list: Value = http()
        .get(format!("{url}/v1/models"))
        .bearer_auth("sk-elsewhere")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"], json!([]), "{list}");
    for model in ["alias-a", "m-a", &*format!("{ns}/m-a")] {
        let e = error_of(
            post(
                url,
                "/v1/chat/completions",
                Some("sk-elsewhere"),
                &json!({"model": model}),
            )
            .await,
            404,
        )
        .await;
        assert_eq!(e["code"], "model_not_found", "{model}");
    }
    assert!(
        a.state.requests.lock().unwrap().is_empty(),
        "nothing reached a backend out of the key's scope"
    );
    let r = post(
        url,
        "/v1/chat/completions",
        Some("sk-own"),
        &json!({"model": "alias-a"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-backend"],
        "backend-a",
        "a key of the Model's namespace reaches it"
    );
    let _ = r.text().await;

    // Routing by name and alias; an alias is rewritten to the served name; the proxy's key stays.
    for (model, want_backend, served) in [
        ("alias-a", "backend-a", "m-a"),
        ("org/Model-A:v1", "backend-a", "m-a"),
        ("m-b", "backend-b", "m-b"),
        (&*format!("{ns}/m-b"), "backend-b", "m-b"),
    ] {
        let r = post(
            url,
            "/v1/chat/completions",
            Some(KEY),
            &json!({"model": model, "messages": [], "temperature": 0.5}),
        )
        .await;
        assert_eq!(r.status(), StatusCode::OK, "{model}");
        assert_eq!(r.headers()["x-backend"], want_backend, "{model}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["model"], served,
            "{model}: the backend saw the served name"
        );
    }
    {
        let reqs = a.state.requests.lock().unwrap();
        let (path, body, headers) = reqs.last().unwrap();
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(body["temperature"], 0.5, "the rest of the body is kept");
        assert!(
            headers.get("authorization").is_none(),
            "the proxy's key is not forwarded"
        );
    }
    let r = post(
        url,
        "/v1/embeddings",
        Some(KEY),
        &json!({"model": "m-b", "input": "x"}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        b.state.requests.lock().unwrap().last().unwrap().0,
        "/v1/embeddings"
    );

    // Bad input: unknown model, no model, not JSON, too large, wrong method/path.
    let e = error_of(
        post(
            url,
            "/v1/chat/completions",
            Some(KEY),
            &json!({"model": "gpt-9"}),
        )
        .await,
        404,
    )
    .await;
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-9"));
    let e = error_of(
        post(url, "/v1/completions", Some(KEY), &json!({"prompt": "x"})).await,
        400,
    )
    .await;
    assert_eq!(e["param"], "model");
    let e = error_of(
        post(url, "/v1/completions", Some(KEY), &json!({"model": 7})).await,
        400,
    )
    .await;
    assert_eq!(e["param"], "model");
    let r = http()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(KEY)
        .body("{not json")
        .send()
        .await
        .unwrap();
    error_of(r, 400).await;
    let e = error_of(
        post(url, "/v1/completions", Some(KEY), &json!(["alias-a"])).await,
        400,
    )
    .await;
    assert!(
        e["message"].as_str().unwrap().contains("JSON object"),
        "{e}"
    );
    let big = json!({"model": "m-a", "prompt": "x".repeat(2 << 20)});
    let e = error_of(post(url, "/v1/completions", Some(KEY), &big).await, 413).await;
    assert_eq!(e["code"], "request_too_large");
    let r = http()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(KEY)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(
            (0..40).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b' '; 64 << 10]))),
        )))
        .send()
        .await
        .unwrap();
    error_of(r, 413).await; // chunked, no Content-Length: the limit holds while reading
    error_of(
        http()
            .get(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap(),
        405,
    )
    .await;
    error_of(
        http()
            .get(format!("{url}/v2/x"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;

    // SSE passes through unchanged and as it is produced: the first event arrives while the
    // backend still holds the rest.
    let r = post(
        url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": "alias-a", "stream": true, "hold": true, "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut stream = r.bytes_stream();
    let mut got = Vec::new();
    while got.len() < sse_event(0).len() {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("the first SSE event arrives before the stream ends")
            .unwrap()
            .unwrap();
        got.extend_from_slice(&chunk);
    }
    assert_eq!(String::from_utf8_lossy(&got), sse_event(0));
    a.state.release.notify_one();
    while let Some(c) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap()
    {
        got.extend_from_slice(&c.unwrap());
    }
    assert_eq!(
        String::from_utf8(got).unwrap(),
        expected_sse(4),
        "byte-for-byte"
    );
    assert_eq!(a.state.abandoned.load(Ordering::SeqCst), 0);

    // A client that goes away mid-stream releases the backend's stream.
    let r = post(
        url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": "m-a", "stream": true, "hold": true, "max_tokens": 4}),
    )
    .await;
    let mut stream = r.bytes_stream();
    let _first = stream.next().await.unwrap().unwrap();
    let abandoned = a.state.abandoned_notify.notified();
    drop(stream);
    tokio::time::timeout(Duration::from_secs(10), abandoned)
        .await
        .expect("backend stream dropped after the client left");
    assert_eq!(a.state.abandoned.load(Ordering::SeqCst), 1);
    assert_eq!(
        p.proxy.activity.total_in_flight(),
        0,
        "in-flight count released"
    );

    // Back-pressure: a client that stops reading stops the backend (no response is buffered).
    let r = post(
        url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": "m-b", "flood": true}),
    )
    .await;
    let mut stream = r.bytes_stream();
    let _ = stream.next().await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await; // let an unbounded pull show itself
    let pulled = b.state.produced.load(Ordering::SeqCst);
    assert!(
        pulled < 64 << 20,
        "the proxy pulled {pulled} bytes for a client that reads nothing"
    );
    drop(stream);
}

#[tokio::test]
async fn proxy_scales_from_zero_keeps_alive_and_lets_idle() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-cold").await.unwrap();
    let ns = tns.name.clone();
    let metrics = flexinfer_controller::metrics::Metrics::new().unwrap();
    let opts = flexinfer_controller::model::Options {
        namespace: Some(ns.clone()),
        profile_namespace: None,
        render: Default::default(),
        preemption_grace: None,
    };
    let (c, m) = (client.clone(), metrics.clone());
    let controller = tokio::spawn(async move {
        let _ = flexinfer_controller::model::run_with(c, m, opts).await;
    });
    let backend = start_backend("cold").await;
    // Unschedulable on purpose: in cluster mode no kwok pod (with an unreachable fake IP) may
    // become the endpoint; the test publishes the endpoint itself.
    apply_model(
        &client,
        &ns,
        "cold",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
        "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
        "serverless": {"idleTimeout": "6s", "keepaliveInterval": "1s", "coldStartTimeout": "45s"}}),
    )
    .await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let replicas_are = |n: i32| {
        move |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(n)
        }
    };
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "cold", replicas_are(0)),
    )
    .await
    .unwrap()
    .unwrap();
    tokio::time::timeout(
        WAIT,
        await_condition(models.clone(), "cold", |m: Option<&Model>| {
            m.and_then(|m| m.status.as_ref()).and_then(|s| s.phase) == Some(ModelPhase::Idle)
        }),
    )
    .await
    .unwrap()
    .unwrap();
    let p = start_proxy_trusting(
        &client,
        &ns,
        "",
        Duration::from_secs(30),
        TEST_SLICE_MANAGER,
    )
    .await;
    p.wait_routable(&ns, "cold", 0).await;

    // A request for the idle Model marks it active; the controller scales it up; the request
    // waits until the endpoint is ready and then succeeds.
    let url = p.url.clone();
    let pending = tokio::spawn(async move {
        let r = post(
            &url,
            "/v1/chat/completions",
            None,
            &json!({"model": "cold", "messages": []}),
        )
        .await;
        (
            r.status(),
            r.headers()
                .get("x-backend")
                .map(|v| v.to_str().unwrap().to_string()),
        )
    });
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "cold", replicas_are(1)),
    )
    .await
    .expect("the controller scales the Model up on demand")
    .unwrap();
    let m = models.get("cold").await.unwrap();
    assert!(last_active(&m).is_some(), "the proxy wrote lastActiveTime");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !pending.is_finished(),
        "the request is held while no endpoint is ready"
    );
    publish_endpoint(&client, &ns, "cold", backend.addr, false).await; // starting, not ready
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!pending.is_finished(), "a not-ready endpoint is not used");
    publish_endpoint(&client, &ns, "cold", backend.addr, true).await;
    let (status, via) = tokio::time::timeout(WAIT, pending).await.unwrap().unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(via.as_deref(), Some("cold"));
    // The cold start is on /metrics: one wait that ended ready, nothing queued any more, the
    // time to first byte includes the wait.
    let text = String::from_utf8(p.proxy.metrics.render(&[])).unwrap();
    let series = format!(r#"model="cold",namespace="{ns}""#);
    assert!(
        text.contains(&format!(
            "flexinfer_proxy_cold_starts_total{{{series},result=\"ready\"}} 1"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("flexinfer_proxy_waiting_requests{{{series}}} 0")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "flexinfer_proxy_requests_total{{code=\"200\",{series}}} 1"
        )),
        "{text}"
    );
    let ttfb_sum: f64 = text
        .lines()
        .find(|l| {
            l.starts_with(&format!(
                "flexinfer_proxy_time_to_first_byte_seconds_sum{{{series}}}"
            ))
        })
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        ttfb_sum >= 0.5,
        "first byte after the held wait: {ttfb_sum}\n{text}"
    );

    // A streamed request longer than idleTimeout keeps the Model up and lastActiveTime fresh.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let watch_deploy = {
        let deployments = deployments.clone();
        let models = models.clone();
        tokio::spawn(async move {
            loop {
                let d = deployments.get("cold").await.unwrap();
                let m = models.get("cold").await.unwrap();
                let _ = tx.send((d.spec.and_then(|s| s.replicas), last_active(&m)));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let r = post(
        &p.url,
        "/v1/chat/completions",
        None,
        &json!({"model": "cold", "stream": true, "max_tokens": 20, "delay_ms": 500}),
    )
    .await;
    let text = r.text().await.unwrap();
    assert_eq!(text, expected_sse(20));
    let ended = tokio::time::Instant::now();
    watch_deploy.abort();
    let mut samples = Vec::new();
    while let Ok(s) = rx.try_recv() {
        samples.push(s);
    }
    assert!(samples.len() > 20, "sampled during the 10 s stream");
    assert!(
        samples.iter().all(|(r, _)| *r == Some(1)),
        "never scaled down mid-request: {samples:?}"
    );
    let mut stamps: Vec<Timestamp> = samples.iter().filter_map(|(_, t)| *t).collect();
    stamps.dedup();
    assert!(
        stamps.len() >= 5,
        "lastActiveTime advanced during the stream: {stamps:?}"
    );

    // After the last request: idle → zero after idleTimeout, not before.
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "cold", replicas_are(0)),
    )
    .await
    .expect("scaled back to zero after idleTimeout")
    .unwrap();
    let idle_after = ended.elapsed();
    assert!(
        idle_after >= Duration::from_secs(4),
        "scaled down {idle_after:?} after the request ended (idleTimeout 6s)"
    );
    controller.abort();
}

#[tokio::test]
async fn proxy_cold_start_timeout_and_unservable_models() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-timeout").await.unwrap();
    let ns = tns.name.clone();
    apply_model(
        &client,
        &ns,
        "never",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
        "serverless": {"coldStartTimeout": "2s"}}),
    )
    .await;
    apply_model(
        &client,
        &ns,
        "broken",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"}}),
    )
    .await;
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let status = json!({"status": {"phase": "Failed", "conditions": [{"type": "ConfigValid", "status": "False",
        "reason": "BackendUnsupported", "message": "backend vllm cannot serve gguf artifacts",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    models
        .patch_status("broken", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let p = start_proxy(&client, &ns, "", Duration::from_secs(30)).await;
    p.wait_cache("broken with its status", |c| {
        c.model(&(ns.clone(), "broken".into()))
            .and_then(|m| m.status.clone())
            .is_some()
            && c.model(&(ns.clone(), "never".into())).is_some()
    })
    .await;

    let t0 = tokio::time::Instant::now();
    let e = error_of(
        post(
            &p.url,
            "/v1/completions",
            None,
            &json!({"model": "never", "prompt": "x"}),
        )
        .await,
        504,
    )
    .await;
    let waited = t0.elapsed();
    assert_eq!(e["code"], "cold_start_timeout");
    let text = String::from_utf8(p.proxy.metrics.render(&[])).unwrap();
    assert!(
        text.contains(&format!(
            r#"flexinfer_proxy_cold_starts_total{{model="never",namespace="{ns}",result="timeout"}} 1"#
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            r#"flexinfer_proxy_requests_total{{code="504",model="never",namespace="{ns}"}} 1"#
        )),
        "{text}"
    );
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("{ns}/never")) && msg.contains("coldStartTimeout"),
        "{msg}"
    );
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
    assert!(
        last_active(&models.get("never").await.unwrap()).is_some(),
        "the request marked the Model active"
    );

    let t0 = tokio::time::Instant::now();
    let e = error_of(
        post(
            &p.url,
            "/v1/completions",
            None,
            &json!({"model": "broken", "prompt": "x"}),
        )
        .await,
        503,
    )
    .await;
    assert!(t0.elapsed() < Duration::from_secs(2), "refused at once");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("BackendUnsupported"),
        "{e}"
    );
}

#[tokio::test]
async fn proxy_last_active_time_is_throttled_across_replicas() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-throttle").await.unwrap();
    let ns = tns.name.clone();
    let backend = start_backend("shared").await;
    apply_served_model(
        &client,
        &ns,
        "busy",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
        "serverless": {"idleTimeout": "5m", "keepaliveInterval": "2s"}}),
    )
    .await;
    publish_endpoint(&client, &ns, "busy", backend.addr, true).await;
    // Two proxy replicas, each with its own caches, both serving long streams of the same Model.
    let p1 = start_proxy(&client, &ns, "", Duration::from_secs(30)).await;
    let p2 = start_proxy(&client, &ns, "", Duration::from_secs(30)).await;
    p1.wait_routable(&ns, "busy", 1).await;
    p2.wait_routable(&ns, "busy", 1).await;
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let stream = json!({"model": "busy", "stream": true, "max_tokens": 16, "delay_ms": 500});
    let t0 = tokio::time::Instant::now();
    let (r1, r2) = tokio::join!(
        async {
            post(&p1.url, "/v1/chat/completions", None, &stream)
                .await
                .text()
                .await
                .unwrap()
        },
        async {
            post(&p2.url, "/v1/chat/completions", None, &stream)
                .await
                .text()
                .await
                .unwrap()
        },
    );
    assert_eq!(r1, expected_sse(16));
    assert_eq!(r2, expected_sse(16));
    // Let the end-of-request writes happen (at most one interval later).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let window = t0.elapsed().as_secs_f64();
    let writes = p1.proxy.cluster.writes() + p2.proxy.cluster.writes();
    // Once per 2 s across both replicas (+1 for the first write); each replica alone would do
    // as many, so together without coordination about twice that.
    let max = (window / 2.0).ceil() as u64 + 1;
    assert!(writes >= 3, "start + keepalives + end: {writes} writes");
    assert!(
        writes <= max,
        "{writes} writes in {window:.1}s at 2s intervals (max {max})"
    );
    let last = last_active(&models.get("busy").await.unwrap()).unwrap();
    let age = Timestamp::now().duration_since(last);
    assert!(
        age.as_secs() <= 6,
        "lastActiveTime reflects the end of the requests: {age:?} old"
    );
    // The proxy's cache and the server agree on what was written.
    assert!(p1.proxy.activity.total_in_flight() == 0 && p2.proxy.activity.total_in_flight() == 0);
}

/// Two profiles on one shared GPU group (a warm primary and a canary), with the real Model controller: a
/// warm primary (250) serves; a request for the scale-to-zero canary (255) preempts it (the
/// primary goes to zero before the canary starts), the canary serves, goes idle, and the primary
/// comes back. A lower-priority Model's request queues behind the primary and fails with a 504
/// that says so.
#[tokio::test]
async fn proxy_shared_gpu_group_preempts_serves_and_hands_the_lane_back() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-shared").await.unwrap();
    let ns = tns.name.clone();
    let metrics = flexinfer_controller::metrics::Metrics::new().unwrap();
    let opts = flexinfer_controller::model::Options {
        namespace: Some(ns.clone()),
        profile_namespace: None,
        render: Default::default(),
        preemption_grace: Some(Duration::from_secs(5)),
    };
    let (c, m) = (client.clone(), metrics.clone());
    let controller = tokio::spawn(async move {
        let _ = flexinfer_controller::model::run_with(c, m, opts).await;
    });
    let primary_backend = start_backend("primary").await;
    let canary_backend = start_backend("canary").await;
    let member = |priority: i32, min: i32, cold: &str| {
        json!({"backend": "vllm", "source": "pvc://models/m",
        "gpu": {"vendor": "nvidia", "shared": "gpu0", "priority": priority},
        // Unschedulable on purpose (see proxy_scales_from_zero_keeps_alive_and_lets_idle).
        "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
        "serverless": {"minReplicas": min, "idleTimeout": "6s", "keepaliveInterval": "1s",
                       "coldStartTimeout": cold}})
    };
    apply_model(&client, &ns, "primary", member(250, 1, "45s")).await;
    apply_model(&client, &ns, "canary", member(255, 0, "45s")).await;
    apply_model(&client, &ns, "batch", member(100, 0, "3s")).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let replicas_are = |n: i32| {
        move |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(n)
        }
    };
    let shared_state = |m: &Model| {
        m.status
            .as_ref()
            .and_then(|s| s.shared_group.as_ref())
            .map(|g| g.state)
    };
    use flexinfer_api::model::SharedGroupState;
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "primary", replicas_are(1)),
    )
    .await
    .expect("the warm primary takes the lane")
    .unwrap();
    publish_endpoint(&client, &ns, "primary", primary_backend.addr, true).await;
    let p = start_proxy_trusting(
        &client,
        &ns,
        "",
        Duration::from_secs(30),
        TEST_SLICE_MANAGER,
    )
    .await;
    p.wait_routable(&ns, "primary", 1).await;
    let r = post(
        &p.url,
        "/v1/chat/completions",
        None,
        &json!({"model": "primary", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);

    // Lower priority: queued behind the primary; its cold start times out with the reason.
    p.wait_cache("batch", |c| {
        c.model(&(ns.clone(), "batch".into())).is_some()
    })
    .await;
    let e = error_of(
        post(
            &p.url,
            "/v1/completions",
            None,
            &json!({"model": "batch", "prompt": "x"}),
        )
        .await,
        504,
    )
    .await;
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("Queued") && msg.contains("behind primary"),
        "{msg}"
    );
    let b = models.get("batch").await.unwrap();
    assert_eq!(shared_state(&b), Some(SharedGroupState::Queued));
    assert_eq!(
        deployments
            .get("batch")
            .await
            .unwrap()
            .spec
            .and_then(|s| s.replicas),
        Some(0),
        "the queued Model never started"
    );

    // Sample both Deployments while the canary is asked for: the primary must be at zero before
    // the canary is scaled up.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let sampler = {
        let deployments = deployments.clone();
        tokio::spawn(async move {
            loop {
                let p = deployments.get("primary").await.unwrap();
                let c = deployments.get("canary").await.unwrap();
                let _ = tx.send((
                    p.spec.and_then(|s| s.replicas),
                    c.spec.and_then(|s| s.replicas),
                ));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let url = p.url.clone();
    let canary_req = tokio::spawn(async move {
        let r = post(
            &url,
            "/v1/chat/completions",
            None,
            &json!({"model": "canary", "messages": []}),
        )
        .await;
        (
            r.status(),
            r.headers()
                .get("x-backend")
                .map(|v| v.to_str().unwrap().to_string()),
        )
    });
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "primary", replicas_are(0)),
    )
    .await
    .expect("the primary is preempted")
    .unwrap();
    // The endpoint controller's part: the primary's pod is gone.
    publish_endpoint(&client, &ns, "primary", primary_backend.addr, false).await;
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "canary", replicas_are(1)),
    )
    .await
    .expect("the canary gets the lane")
    .unwrap();
    publish_endpoint(&client, &ns, "canary", canary_backend.addr, true).await;
    let (status, via) = tokio::time::timeout(WAIT, canary_req)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(via.as_deref(), Some("canary"));
    sampler.abort();
    let mut samples = Vec::new();
    while let Ok(s) = rx.try_recv() {
        samples.push(s);
    }
    assert!(
        samples
            .iter()
            .all(|(p, c)| !(*p == Some(1) && *c == Some(1))),
        "never both scaled up: {samples:?}"
    );
    let pm = models.get("primary").await.unwrap();
    let pg = pm
        .status
        .as_ref()
        .and_then(|s| s.shared_group.clone())
        .unwrap();
    assert_eq!(pg.state, SharedGroupState::Preempted);
    assert_eq!(pg.preempted_by.as_deref(), Some("canary"));
    // The status follows the scale-up in the same reconcile.
    tokio::time::timeout(
        WAIT,
        await_condition(models.clone(), "canary", move |m: Option<&Model>| {
            m.and_then(shared_state) == Some(SharedGroupState::Active)
        }),
    )
    .await
    .expect("the canary is Active")
    .unwrap();
    let text = metrics.render();
    assert!(
        text.contains(&format!(
            r#"flexinfer_model_preemptions_total{{group="gpu0",model="primary",namespace="{ns}"}} 1"#
        )),
        "{text}"
    );
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), &ns);
    let reasons: Vec<String> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some("primary"))
        .filter_map(|e| e.reason)
        .collect();
    assert!(
        reasons.iter().any(|r| r == "SharedGroupPreempted"),
        "{reasons:?}"
    );

    // The canary idles out (6 s); the lane goes back to the warm primary.
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "canary", replicas_are(0)),
    )
    .await
    .expect("the canary idles out")
    .unwrap();
    publish_endpoint(&client, &ns, "canary", canary_backend.addr, false).await;
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "primary", replicas_are(1)),
    )
    .await
    .expect("the primary comes back")
    .unwrap();
    tokio::time::timeout(
        WAIT,
        await_condition(models.clone(), "primary", |m: Option<&Model>| {
            m.and_then(|m| m.status.as_ref())
                .and_then(|s| s.shared_group.as_ref())
                .is_some_and(|g| g.state == SharedGroupState::Active)
        }),
    )
    .await
    .expect("the primary is Active again")
    .unwrap();
    publish_endpoint(&client, &ns, "primary", primary_backend.addr, true).await;
    p.wait_routable(&ns, "primary", 1).await;
    let r = post(
        &p.url,
        "/v1/chat/completions",
        None,
        &json!({"model": "primary", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers().get("x-backend").unwrap(), "primary");
    controller.abort();
}

/// The official `openai` Python client (PyPI) against the proxy: model list, a chat completion,
/// a streamed one (deltas in order), and the error classes it maps 404 and 401 to. The venv comes
/// from scripts/install-deps.sh; `scripts/test.sh` exports `FLEXINFER_OPENAI_PYTHON`.
#[tokio::test]
async fn proxy_works_with_the_official_openai_python_client() {
    let python = std::env::var("FLEXINFER_OPENAI_PYTHON").unwrap_or_else(|_| {
        panic!(
            "FLEXINFER_OPENAI_PYTHON is not set: run scripts/install-deps.sh and point it at \
             ~/.cache/flexinfer/openai-venv-<version>/bin/python (scripts/test.sh does)"
        )
    });
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-openai").await.unwrap();
    let ns = tns.name.clone();
    let backend = start_backend("py").await;
    apply_served_model(
        &client,
        &ns,
        "py-model",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
               "serverless": {"enabled": false}}),
    )
    .await;
    publish_endpoint(&client, &ns, "py-model", backend.addr, true).await;
    let p = start_proxy(&client, &ns, KEY, Duration::from_secs(30)).await;
    p.wait_routable(&ns, "py-model", 1).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/proxy/openai_client_check.py"
    );
    let out = tokio::process::Command::new(&python)
        .args([script, p.url.as_str(), KEY, "py-model"])
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {python}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client check failed:\n{stdout}\n{stderr}"
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        seen["stream"],
        json!(["tok0", "tok1", "tok2", "tok3", "tok4"])
    );
    assert_eq!(seen["not_found"]["status"], 404);
    // The backend saw the streamed request with the body the client wrote.
    let reqs = backend.state.requests.lock().unwrap();
    assert!(
        reqs.iter()
            .any(|(path, v, _)| path == "/v1/chat/completions" && v["stream"] == true),
        "{:?}",
        reqs.iter().map(|r| &r.0).collect::<Vec<_>>()
    );
}

/// HA: two proxy processes (the real binary) serve one Model. One is SIGKILLed in the middle of a
/// stream: that client's stream ends early, the backend sees its request released, and the other
/// replica serves new requests (streamed and not) with nothing to recover.
#[tokio::test]
async fn proxy_replica_killed_mid_stream_the_other_serves() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-ha").await.unwrap();
    let ns = tns.name.clone();
    let backend = start_backend("ha").await;
    apply_served_model(
        &client,
        &ns,
        "ha-model",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
               "serverless": {"enabled": false}}),
    )
    .await;
    publish_endpoint(&client, &ns, "ha-model", backend.addr, true).await;

    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let spawn = |name: &str| {
        let (port, health) = (free_port(), free_port());
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flexinfer-proxy"))
            .args(["--log-text"])
            .env("FLEXINFER_PROXY_LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .env("FLEXINFER_PROXY_HEALTH_ADDR", format!("127.0.0.1:{health}"))
            .env("FLEXINFER_PROXY_WATCH_NAMESPACE", &ns)
            .env("FLEXINFER_PROXY_KEEPALIVE_INTERVAL", "1s")
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start proxy {name}: {e}"));
        (child, format!("http://127.0.0.1:{port}"), health)
    };
    let (mut a, url_a, health_a) = spawn("a");
    let (mut b, url_b, health_b) = spawn("b");
    // Ready: caches synced and the Model routable through each replica.
    for (url, health) in [(&url_a, health_a), (&url_b, health_b)] {
        let ready = format!("http://127.0.0.1:{health}/readyz");
        tokio::time::timeout(WAIT, async {
            loop {
                let ok = http()
                    .get(&ready)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                let routed = ok
                    && post(
                        url,
                        "/v1/chat/completions",
                        None,
                        &json!({"model": "ha-model", "messages": []}),
                    )
                    .await
                    .status()
                        == StatusCode::OK;
                if routed {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("proxy at {url} never became ready"));
    }

    // A long stream through A; A is killed after the first chunks.
    let mut stream = http()
        .post(format!("{url_a}/v1/chat/completions"))
        .json(&json!({"model": "ha-model", "stream": true, "max_tokens": 40, "delay_ms": 200}))
        .send()
        .await
        .unwrap()
        .bytes_stream();
    let mut got = Vec::new();
    while got.len() < 2 {
        match tokio::time::timeout(WAIT, stream.next()).await.unwrap() {
            Some(Ok(chunk)) => got.push(chunk),
            other => panic!("stream through A ended early: {other:?}"),
        }
    }
    let abandoned_before = backend.state.abandoned.load(Ordering::SeqCst);
    a.start_kill().unwrap(); // SIGKILL
    a.wait().await.unwrap();
    let rest = tokio::time::timeout(WAIT, async {
        let mut more = Vec::new();
        while let Some(Ok(chunk)) = stream.next().await {
            more.push(chunk);
        }
        more
    })
    .await
    .expect("the cut stream ends");
    let text: String = got
        .iter()
        .chain(&rest)
        .map(|c| String::from_utf8_lossy(c).to_string())
        .collect();
    assert!(
        !text.contains("[DONE]") && text.matches("data: ").count() < 40,
        "the stream through the killed replica was cut short: {text}"
    );
    // The backend sees its request go away (the killed replica's socket closed).
    tokio::time::timeout(WAIT, async {
        while backend.state.abandoned.load(Ordering::SeqCst) <= abandoned_before {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the backend request of the killed replica is released");

    // B serves new requests, streamed and not.
    let r = post(
        &url_b,
        "/v1/chat/completions",
        None,
        &json!({"model": "ha-model", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = post(
        &url_b,
        "/v1/chat/completions",
        None,
        &json!({"model": "ha-model", "stream": true, "max_tokens": 5}),
    )
    .await;
    assert_eq!(r.text().await.unwrap(), expected_sse(5));
    b.start_kill().unwrap();
    let _ = b.wait().await;
}
