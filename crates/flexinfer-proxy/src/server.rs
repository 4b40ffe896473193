//! The HTTP front: OpenAI's routes, auth, body limits, the cold-start hold and the streamed
//! forwarding to a Model's backend.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use flexinfer_api::contract::error::chain;
use flexinfer_runtime::server as runtime_server;

use crate::activity::{Activity, InFlight};
use crate::auth::{ApiKeys, Scope};
use crate::backend_keys::BackendKeys;
use crate::body::{full, Guarded, ProxyBody};
use crate::cluster::{Cluster, ModelKey};
use crate::endpoints::RoundRobin;
use crate::limits::{BodyBudget, Gate, PerModel};
use crate::metrics::{ColdStart, Metrics};
use crate::openai::{json_response, printable, ApiError, ModelEntry};
use crate::peek::{self, PeekError};
use crate::plan::{self, Admission};
use crate::route::{self, RouteError};

/// Settings of the front (docs/user/serving.md, "Settings" and "Limits").
#[derive(Debug, Clone)]
pub struct Config {
    pub api_keys: ApiKeys,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Bytes all request bodies in memory may hold together (see [`crate::limits`]).
    pub body_memory_bytes: usize,
    /// Client connections open at once on the front (more wait in the listen backlog).
    pub max_connections: usize,
    /// Requests admitted at once (all Models), streaming ones included.
    pub max_requests: usize,
    /// Requests that may wait for admission when `max_requests` are in; more get 429.
    pub max_queued_requests: usize,
    /// Requests admitted at once for one Model, cold-start waiters included; more get 429.
    pub max_requests_per_model: usize,
    /// Requests sent at once to a Model that just became ready (the rest follow as these get
    /// their response headers).
    pub cold_start_release: usize,
    /// Longest wait for a request head, on every port.
    pub header_read_timeout: Duration,
    /// Longest time to receive a request body (408 beyond).
    pub body_read_timeout: Duration,
    /// Longest wait for a backend's response headers (504 beyond).
    pub backend_header_timeout: Duration,
    /// Keepalive interval of Models that set none.
    pub keepalive_interval: Duration,
    /// TCP connect timeout towards a backend.
    pub connect_timeout: Duration,
    /// How long shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// How long a backend key read from its Secret is used before it is read again.
    pub backend_key_ttl: Duration,
}

impl Default for Config {
    fn default() -> Self {
        let body_memory_bytes = crate::limits::DEFAULT_BODY_MEMORY_BYTES;
        Self {
            api_keys: ApiKeys::default(),
            max_body_bytes: crate::limits::default_max_body_bytes(body_memory_bytes),
            body_memory_bytes,
            max_connections: 2048,
            max_requests: 1024,
            max_queued_requests: 1024,
            max_requests_per_model: 512,
            cold_start_release: 16,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
            backend_header_timeout: Duration::from_secs(600),
            keepalive_interval: plan::DEFAULT_KEEPALIVE_INTERVAL,
            connect_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            backend_key_ttl: Duration::from_secs(30),
        }
    }
}

/// The body length a request declares.
fn declared_length(req: &Request<Incoming>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The request head and its whole body; too large when it has over `limit` bytes, too slow when
/// it has not arrived within `timeout`.
async fn read_body(
    req: Request<Incoming>,
    limit: usize,
    timeout: Duration,
) -> Result<(http::request::Parts, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let collected = tokio::time::timeout(timeout, Limited::new(body, limit).collect())
        .await
        .map_err(|_| ApiError::body_timeout(timeout))?;
    let body = match collected {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(ApiError::too_large(limit))
        }
        Err(e) => {
            return Err(ApiError::bad_request(format!(
                "cannot read the request body: {}",
                chain(&*e)
            )))
        }
    };
    Ok((parts, body))
}

/// What is sent to a backend: the client's method, path, query, forwarded headers and body.
struct Outgoing {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Outgoing {
    /// The request for `backend` (`host:port`); the error text when that is no valid address.
    fn to(&self, backend: &str) -> Result<Request<Full<Bytes>>, String> {
        let uri: Uri = format!("http://{backend}{}", self.path_and_query)
            .parse()
            .map_err(|e| format!("bad backend address {backend}: {e}"))?;
        let mut out = Request::new(Full::new(self.body.clone()));
        *out.method_mut() = self.method.clone();
        *out.uri_mut() = uri;
        *out.headers_mut() = self.headers.clone();
        Ok(out)
    }
}

/// Routes whose body names a model and that are forwarded to it.
const FORWARDED: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];

/// The proxy: cluster view, in-flight bookkeeping, backend client.
pub struct Proxy {
    pub cluster: Cluster,
    pub activity: Activity,
    pub metrics: Metrics,
    config: Config,
    client: HttpClient<HttpConnector, Full<Bytes>>,
    balancers: Mutex<HashMap<ModelKey, Arc<RoundRobin>>>,
    admission: Gate,
    bodies: BodyBudget,
    per_model: PerModel,
    backend_keys: BackendKeys,
}

/// What an admitted request holds until its response ends: the global and the Model's admission.
struct Admitted {
    _global: tokio::sync::OwnedSemaphorePermit,
    _model: tokio::sync::OwnedSemaphorePermit,
}

impl Proxy {
    pub fn new(cluster: Cluster, config: Config) -> Result<Arc<Self>, prometheus::Error> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = HttpClient::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        let backend_keys = BackendKeys::new(cluster.client(), config.backend_key_ttl);
        Ok(Arc::new(Self {
            cluster,
            backend_keys,
            activity: Activity::default(),
            metrics: Metrics::new()?,
            client,
            balancers: Mutex::new(HashMap::new()),
            admission: Gate::new(config.max_requests, config.max_queued_requests),
            bodies: BodyBudget::new(config.body_memory_bytes),
            per_model: PerModel::new(config.max_requests_per_model, config.cold_start_release),
            config,
        }))
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The `Authorization` value for the Model's backends when it has a backend key
    /// (`spec.backendKeySecretRef`); a 503 naming the Model and the Secret when that key cannot be
    /// had: such a request is never forwarded without it.
    async fn backend_authorization(
        &self,
        key: &ModelKey,
    ) -> Result<Option<http::HeaderValue>, ApiError> {
        let Some(r) = self
            .cluster
            .model(key)
            .and_then(|m| m.spec.backend_key_secret_ref.clone())
        else {
            return Ok(None);
        };
        match self.backend_keys.authorization(&key.0, &key.1, &r).await {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                warn!(namespace = %key.0, model = %key.1, error = %e, "no backend key");
                Err(ApiError::unavailable(e.message))
            }
        }
    }

    /// Answer one request.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let mut key = None;
        let resp = match self.route(req, &mut key).await {
            Ok(r) => r,
            Err(e) => {
                debug!(%method, path = %printable(&path), status = e.status.as_u16(), error = %e.message, "request refused");
                e.into_response()
            }
        };
        self.metrics.request(key.as_ref(), resp.status().as_u16());
        resp
    }

    /// `key` is set once the request is resolved to a Model (the metrics' labels).
    async fn route(
        self: &Arc<Self>,
        req: Request<Incoming>,
        key: &mut Option<ModelKey>,
    ) -> Result<Response<ProxyBody>, ApiError> {
        let path = req.uri().path();
        if !path.starts_with("/v1/") {
            return Err(ApiError::not_found_path(path));
        }
        let scope = self
            .config
            .api_keys
            .authorize(req.headers())
            .ok_or_else(ApiError::unauthorized)?;
        let is_get = req.method() == Method::GET;
        let is_post = req.method() == Method::POST;
        if path == "/v1/models" {
            if !is_get {
                return Err(ApiError::method_not_allowed(req.method().as_str(), path));
            }
            return Ok(json_response(
                StatusCode::OK,
                &route::model_list(&self.cluster.models(), &scope),
            ));
        }
        if let Some(id) = path.strip_prefix("/v1/models/") {
            if !is_get {
                return Err(ApiError::method_not_allowed(req.method().as_str(), path));
            }
            return self.retrieve_model(id, &scope);
        }
        if FORWARDED.contains(&path) {
            if !is_post {
                return Err(ApiError::method_not_allowed(req.method().as_str(), path));
            }
            return self.forward(req, &scope, key).await;
        }
        Err(ApiError::not_found_path(path))
    }

    fn retrieve_model(&self, id: &str, scope: &Scope) -> Result<Response<ProxyBody>, ApiError> {
        let models = self.cluster.models();
        match route::resolve(&models, id, scope) {
            Ok(_) => {
                let list = route::model_list(&models, scope);
                let entry: Option<&ModelEntry> = list.data.iter().find(|e| e.id == id);
                match entry {
                    Some(e) => Ok(json_response(StatusCode::OK, e)),
                    None => Err(ApiError::model_not_found(id)),
                }
            }
            Err(RouteError::NotFound) => Err(ApiError::model_not_found(id)),
            Err(RouteError::Ambiguous(c)) => Err(ApiError::ambiguous_model(id, &c)),
        }
    }

    /// Forwards a request for a Model (`resolved` is set once the body names one) to one of its
    /// ready backends, waiting for a cold start when there are none. Admission first (429 when
    /// full), then room for the body in the body budget, then the body (bounded in size and time).
    async fn forward(
        self: &Arc<Self>,
        req: Request<Incoming>,
        scope: &Scope,
        resolved: &mut Option<ModelKey>,
    ) -> Result<Response<ProxyBody>, ApiError> {
        let received = Instant::now();
        let limit = self.config.max_body_bytes;
        let declared = declared_length(&req);
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::too_large(limit));
        }
        let global = self.admission.enter().await.map_err(|_| {
            ApiError::overloaded(
                format!(
                    "the proxy has {} requests in flight and {} waiting: try again",
                    self.config.max_requests, self.config.max_queued_requests
                ),
                1,
            )
        })?;
        let reserved = declared
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(limit);
        // Room is waited for at most the body timeout: requests held by a cold start keep theirs,
        // and another Model's requests must not wait for that cold start to end.
        let wait = self.config.body_read_timeout;
        let _body_room = tokio::time::timeout(wait, self.bodies.reserve(reserved))
            .await
            .ok()
            .flatten()
            .ok_or_else(|| {
                ApiError::overloaded(
                    format!(
                        "no room for the request body within {}s: other requests' bodies fill the \
                         proxy's body budget of {} bytes: try again",
                        wait.as_secs(),
                        self.config.body_memory_bytes
                    ),
                    1,
                )
            })?;
        let (parts, body) = read_body(req, limit, self.config.body_read_timeout).await?;
        let (key, body) = self.resolve_model(body, scope)?;
        *resolved = Some(key.clone());
        let limits = self.per_model.of(&key);
        let model = limits.admitted.clone().try_acquire_owned().map_err(|_| {
            ApiError::overloaded(
                format!(
                    "Model {}/{} has {} requests in flight or waiting: try again",
                    key.0, key.1, self.config.max_requests_per_model
                ),
                1,
            )
        })?;
        let admitted = Admitted {
            _global: global,
            _model: model,
        };
        // Before the Model counts as active (no cold start for a request that cannot be sent).
        let backend_auth = self.backend_authorization(&key).await?;

        // From here on the request counts as activity of the Model (also while it waits).
        let guard = self.activity.begin(&key);
        let (backends, waited) = self.await_backends(&key).await?;
        // Waiters of a cold start go to the new backend a few at a time (each until its response
        // headers), not all at once.
        let _release = if waited {
            limits.release.clone().acquire_owned().await.ok()
        } else {
            None
        };
        let out = Outgoing {
            method: parts.method.clone(),
            path_and_query: parts
                .uri
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(|| parts.uri.path().to_string()),
            headers: forward_headers(
                &parts.headers,
                self.config.api_keys.is_enabled(),
                backend_auth,
            ),
            body,
        };
        // The body was sent (or given up) when this returns: its room goes back then.
        self.send(&key, &backends, out, (guard, admitted), received)
            .await
    }

    /// The Model the body names (resolved against the cluster's Models), and the body to send
    /// it: with the model field rewritten to the served name when the route asks for that.
    fn resolve_model(&self, body: Bytes, scope: &Scope) -> Result<(ModelKey, Bytes), ApiError> {
        let field = peek::find_model(&body).map_err(peek_error)?;
        let requested = field.name.as_ref();
        let route = match route::resolve(&self.cluster.models(), requested, scope) {
            Ok(r) => r,
            Err(RouteError::NotFound) => return Err(ApiError::model_not_found(requested)),
            Err(RouteError::Ambiguous(c)) => return Err(ApiError::ambiguous_model(requested, &c)),
        };
        let key = (route.namespace.clone(), route.name.clone());
        let rewritten = if route.rewrite {
            Some(
                peek::replace_model(&body, field.span.clone(), &route.name)
                    .ok_or_else(|| ApiError::bad_request("cannot rewrite the model"))?,
            )
        } else {
            None
        };
        Ok((key, rewritten.unwrap_or(body)))
    }

    /// Sends `out` to the Model's backends in balancer order, up to three of them, moving on
    /// only when one cannot be connected to. The response body holds `guard` (the request's
    /// activity) until it ends and records the time to its first byte.
    async fn send(
        &self,
        key: &ModelKey,
        backends: &[String],
        out: Outgoing,
        guard: (InFlight, Admitted),
        received: Instant,
    ) -> Result<Response<ProxyBody>, ApiError> {
        let balancer = self.balancer(key);
        let mut last_err = String::new();
        for backend in balancer.order(backends).into_iter().take(3) {
            let req = match out.to(backend) {
                Ok(r) => r,
                Err(e) => {
                    last_err = e;
                    continue;
                }
            };
            let head =
                tokio::time::timeout(self.config.backend_header_timeout, self.client.request(req));
            let Ok(answered) = head.await else {
                warn!(namespace = %key.0, model = %key.1, backend = %backend, "no response headers in time");
                return Err(ApiError::backend_timeout(format!(
                    "Model {}/{}: backend {backend} sent no response headers within {}s",
                    key.0,
                    key.1,
                    self.config.backend_header_timeout.as_secs()
                )));
            };
            match answered {
                Ok(resp) => {
                    let (mut rparts, rbody) = resp.into_parts();
                    strip_hop_by_hop(&mut rparts.headers);
                    info!(namespace = %key.0, model = %key.1, backend = %backend, status = rparts.status.as_u16(), "forwarded");
                    let (metrics, k) = (self.metrics.clone(), key.clone());
                    let body = Guarded::new(rbody.boxed_unsync(), guard)
                        .on_first_frame(move || metrics.first_byte(&k, received.elapsed()))
                        .boxed_unsync();
                    return Ok(Response::from_parts(rparts, body));
                }
                Err(e) if e.is_connect() => {
                    let why = chain(&e);
                    warn!(namespace = %key.0, model = %key.1, backend = %backend, error = %why, "backend connect failed, trying the next");
                    last_err = format!("cannot connect to {backend}: {why}");
                }
                Err(e) => {
                    return Err(ApiError::bad_gateway(format!(
                        "Model {}/{}: backend {backend} failed: {}",
                        key.0,
                        key.1,
                        chain(&e)
                    )))
                }
            }
        }
        Err(ApiError::bad_gateway(format!(
            "Model {}/{}: no backend reachable ({last_err})",
            key.0, key.1
        )))
    }

    /// Ready backends of the Model, waiting for a cold start when there are none (and whether it
    /// waited). Waiters are woken only by changes of this Model's objects, and share one
    /// `lastActiveTime` write per Model.
    async fn await_backends(&self, key: &ModelKey) -> Result<(Vec<String>, bool), ApiError> {
        let mut backends = self.cluster.subscribe(key);
        let mut deadline: Option<(Instant, Duration)> = None;
        // Set while this request waits for a cold start (the queue gauge and the wait's outcome).
        let mut waiting: Option<(crate::metrics::Waiting, Instant)> = None;
        let ended = |waiting: &mut Option<(crate::metrics::Waiting, Instant)>, r: ColdStart| {
            if let Some((_, since)) = waiting.take() {
                self.metrics.cold_start(key, r, since.elapsed());
            }
        };
        loop {
            let ready = backends.borrow_and_update().clone();
            let Some(model) = self.cluster.model(key) else {
                ended(&mut waiting, ColdStart::Failed);
                return Err(ApiError::unavailable(format!(
                    "Model {}/{} was deleted",
                    key.0, key.1
                )));
            };
            let admission = plan::admit(&model, !ready.is_empty());
            if deadline.is_none() {
                // Request start: mark the Model active. A cold start needs the write before
                // the controller scales up; a warm Model need not wait for it.
                let touch = {
                    let (cluster, key, interval) = (
                        self.cluster.clone(),
                        key.clone(),
                        self.config.keepalive_interval,
                    );
                    async move {
                        if let Err(e) = cluster.touch_once(&key, interval).await {
                            warn!(namespace = %key.0, model = %key.1, error = %chain(&e), "cannot write lastActiveTime");
                        }
                    }
                };
                if admission == Admission::Wait {
                    touch.await;
                    let timeout = plan::cold_start_timeout(&model);
                    info!(namespace = %key.0, model = %key.1, timeout_s = timeout.as_secs(), "no ready backend: waiting for a cold start");
                    deadline = Some((plan::deadline(Instant::now(), timeout), timeout));
                    waiting = Some((self.metrics.waiting(key), Instant::now()));
                    // The Model may have become ready during the write.
                    continue;
                }
                tokio::spawn(touch);
            }
            match admission {
                Admission::Forward => {
                    let waited = waiting.is_some();
                    ended(&mut waiting, ColdStart::Ready);
                    return Ok((ready.as_ref().clone(), waited));
                }
                Admission::Reject(reason) => {
                    ended(&mut waiting, ColdStart::Failed);
                    return Err(ApiError::unavailable(reason));
                }
                Admission::Wait => {}
            }
            let Some((until, timeout)) = deadline else {
                continue;
            };
            tokio::select! {
                changed = backends.changed() => {
                    if changed.is_err() {
                        ended(&mut waiting, ColdStart::Failed);
                        return Err(ApiError::unavailable("the proxy's cluster watch stopped"));
                    }
                }
                _ = tokio::time::sleep_until(until) => {
                    ended(&mut waiting, ColdStart::Timeout);
                    return Err(ApiError::cold_start_timeout(plan::not_ready_reason(&model, timeout)));
                }
            }
        }
    }

    fn balancer(&self, key: &ModelKey) -> Arc<RoundRobin> {
        match self.balancers.lock() {
            Ok(mut b) => b.entry(key.clone()).or_default().clone(),
            Err(_) => Arc::new(RoundRobin::default()),
        }
    }
}

/// The error answered for a body without a usable `model`.
fn peek_error(e: PeekError) -> ApiError {
    match e {
        PeekError::NotAnObject(m) => ApiError::bad_request(m),
        PeekError::NoModel => ApiError::missing_model(),
        PeekError::Duplicate => ApiError::duplicate_model(),
    }
}

/// The `model` of a request body, which must be a JSON object (the body is bounded before this).
/// Read without building a JSON tree ([`peek::find_model`]).
pub fn requested_model(body: &[u8]) -> Result<String, ApiError> {
    peek::find_model(body)
        .map(|f| f.name.into_owned())
        .map_err(peek_error)
}

/// The body with `model` set to the served name, everything else kept byte for byte.
pub fn rewrite_model(body: &[u8], served: &str) -> Result<Bytes, ApiError> {
    let field = peek::find_model(body).map_err(peek_error)?;
    peek::replace_model(body, field.span, served)
        .ok_or_else(|| ApiError::bad_request("cannot rewrite the model"))
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Headers named by `Connection` are hop-by-hop too.
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
}

/// The header some OpenAI-compatible servers (llama-server among them) read a key from when there
/// is no `Authorization`.
const X_API_KEY: &str = "x-api-key";

/// Request headers for the backend: hop-by-hop headers, `Host` and `Content-Length` (the
/// client recomputes both) dropped; `Authorization` dropped when it carried the proxy's key. For a
/// Model with a backend key (`backend_auth`, the `Authorization` value to send), the caller's
/// `Authorization` and `X-Api-Key` are dropped whatever they hold and the backend key is sent.
fn forward_headers(
    h: &HeaderMap,
    auth_enabled: bool,
    backend_auth: Option<http::HeaderValue>,
) -> HeaderMap {
    let mut out = h.clone();
    strip_hop_by_hop(&mut out);
    out.remove(header::HOST);
    out.remove(header::CONTENT_LENGTH);
    if auth_enabled {
        out.remove(header::AUTHORIZATION);
    }
    if let Some(v) = backend_auth {
        out.remove(X_API_KEY);
        out.insert(header::AUTHORIZATION, v);
    }
    out
}

/// Serve the OpenAI front on `listener` until `shutdown` resolves, then wait (at most the drain
/// timeout) for in-flight requests.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let limits = runtime_server::Limits {
        max_connections: proxy.config.max_connections,
        header_read_timeout: Some(proxy.config.header_read_timeout),
        nodelay: true,
    };
    runtime_server::serve(listener, limits, shutdown, || {
        let p = proxy.clone();
        service_fn(move |req| {
            let p = p.clone();
            async move { Ok::<_, Infallible>(p.handle(req).await) }
        })
    })
    .await;
    let now = Instant::now();
    let until = now.checked_add(proxy.config.drain_timeout).unwrap_or(now);
    while proxy.activity.total_in_flight() > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Connections open at once on the health/metrics port (probes and scrapes need a few).
pub const HEALTH_MAX_CONNECTIONS: usize = runtime_server::PROBE_MAX_CONNECTIONS;

/// `/healthz` (alive), `/readyz` (caches synced) and `/metrics` (Prometheus) on their own port, at
/// most [`HEALTH_MAX_CONNECTIONS`] connections at once; a client that never finishes its request
/// head is dropped (slowloris).
pub async fn serve_health(listener: TcpListener, proxy: Arc<Proxy>) {
    let limits = runtime_server::Limits::probes(proxy.config.header_read_timeout);
    runtime_server::serve(listener, limits, runtime_server::forever(), || {
        let p = proxy.clone();
        service_fn(move |req: Request<Incoming>| {
            let p = p.clone();
            async move { Ok::<_, Infallible>(health_response(&p, req.uri().path())) }
        })
    })
    .await
}

/// The health port's answer for `path`.
fn health_response(p: &Proxy, path: &str) -> Response<ProxyBody> {
    let ready = p.cluster.is_ready();
    let (status, body) = match path {
        "/healthz" => (StatusCode::OK, Bytes::from_static(b"ok")),
        "/readyz" if ready => (StatusCode::OK, Bytes::from_static(b"ok")),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            Bytes::from_static(b"caches not synced"),
        ),
        "/metrics" => (
            StatusCode::OK,
            Bytes::from(p.metrics.render(&p.activity.snapshot())),
        ),
        _ => (StatusCode::NOT_FOUND, Bytes::from_static(b"not found")),
    };
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r
}

/// Bind `addr`.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Bind `addr` with a listen backlog of `backlog` connections (the kernel caps it at
/// `net.core.somaxconn`). The OpenAI port's backlog is its connection cap: with the default of
/// 128, a burst of new connections (a cold-start stampede) overflows the accept queue before the
/// proxy accepts them, and the kernel answers the overflow with resets (measured on the real node:
/// 673 to 1000 of 2000 connections reset, docs/benchmarks.md "On the real node").
pub fn bind_backlog(addr: SocketAddr, backlog: usize) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(u32::try_from(backlog.max(1)).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod limits_tests;

#[cfg(test)]
mod backend_keys_tests;
