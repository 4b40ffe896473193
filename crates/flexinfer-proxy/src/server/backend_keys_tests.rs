//! Backend keys (`spec.backendKeySecretRef`) without a cluster: the cluster view is fed by hand,
//! the API server is a small hyper server that serves Secrets (and counts the GETs), and the
//! backends are fake OpenAI servers that check `Authorization` the way vLLM does (401 unless it is
//! `Bearer <their key>`) and record what they were sent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use flexinfer_api::model::BackendKeySecretRef;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;

use super::limits_tests::{add_model, http_server, model, slice, test_config, BOUND, NS};
use super::*;

/// Secret name → its data, as the fake API server serves them.
type Secrets = Arc<Mutex<BTreeMap<String, BTreeMap<String, Vec<u8>>>>>;

/// An API server serving `secrets` (GETs counted in `reads`) and accepting `models/status` patches.
async fn api_server(secrets: Secrets, reads: Arc<AtomicUsize>) -> kube::Client {
    let port = http_server(move |req: Request<Incoming>| {
        let (secrets, reads) = (secrets.clone(), reads.clone());
        async move {
            let path = req.uri().path().to_string();
            if req.method() == Method::PATCH && path.ends_with("/status") {
                let name = path.rsplit('/').nth(1).unwrap_or_default().to_string();
                return json_response(StatusCode::OK, &model(&name, "30s"));
            }
            let prefix = format!("/api/v1/namespaces/{NS}/secrets/");
            if let (true, Some(name)) = (req.method() == Method::GET, path.strip_prefix(&prefix)) {
                reads.fetch_add(1, Ordering::SeqCst);
                if let Some(data) = secrets.lock().unwrap().get(name) {
                    let s = Secret {
                        metadata: kube::api::ObjectMeta {
                            name: Some(name.to_string()),
                            namespace: Some(NS.to_string()),
                            ..Default::default()
                        },
                        data: Some(
                            data.iter()
                                .map(|(k, v)| (k.clone(), ByteString(v.clone())))
                                .collect(),
                        ),
                        ..Default::default()
                    };
                    return json_response(StatusCode::OK, &s);
                }
            }
            json_response(
                StatusCode::NOT_FOUND,
                &serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                    "message": "not found", "reason": "NotFound", "code": 404}),
            )
        }
    })
    .await;
    let url: http::Uri = format!("http://127.0.0.1:{port}").parse().unwrap();
    kube::Client::try_from(kube::Config::new(url)).unwrap()
}

/// What a fake backend was sent: `(Authorization, X-Api-Key)` of each request.
type Seen = Arc<Mutex<Vec<(Option<String>, Option<String>)>>>;

/// A backend that demands `Authorization: Bearer <key>` when `key` holds one (vLLM's check), and
/// answers 200 otherwise; records each request's credentials.
async fn backend(key: Arc<Mutex<Option<String>>>, seen: Seen) -> u16 {
    http_server(move |req: Request<Incoming>| {
        let (key, seen) = (key.clone(), seen.clone());
        async move {
            let header = |n: &str| {
                req.headers()
                    .get(n)
                    .map(|v| v.to_str().unwrap().to_string())
            };
            let auth = header("authorization");
            seen.lock()
                .unwrap()
                .push((auth.clone(), header("x-api-key")));
            let want = key.lock().unwrap().clone();
            if let Some(k) = want {
                if auth.as_deref() != Some(format!("Bearer {k}").as_str()) {
                    return json_response(
                        StatusCode::UNAUTHORIZED,
                        &serde_json::json!({"error": "Unauthorized"}),
                    );
                }
            }
            json_response(StatusCode::OK, &serde_json::json!({"ok": true}))
        }
    })
    .await
}

struct Setup {
    url: String,
    secrets: Secrets,
    reads: Arc<AtomicUsize>,
    /// The key the keyed backend demands, and what it saw.
    backend_key: Arc<Mutex<Option<String>>>,
    keyed_seen: Seen,
    /// What the backend of the Model without a key saw.
    plain_seen: Seen,
    _feed: crate::cluster::Offline,
}

/// Model `keyed` (key `token` of Secret `backend-key`, which holds `sk-backend-1`) and Model
/// `plain` (no key), each with one ready backend; the proxy with `keys` as its callers' keys.
async fn setup(keys: &str, ttl: Duration) -> Setup {
    let secrets: Secrets = Arc::default();
    secrets.lock().unwrap().insert(
        "backend-key".into(),
        BTreeMap::from([("token".to_string(), b"sk-backend-1".to_vec())]),
    );
    let reads = Arc::new(AtomicUsize::new(0));
    let (cluster, mut feed) = Cluster::offline(api_server(secrets.clone(), reads.clone()).await);
    let backend_key = Arc::new(Mutex::new(Some("sk-backend-1".to_string())));
    let (keyed_seen, plain_seen): (Seen, Seen) = Default::default();
    let keyed_port = backend(backend_key.clone(), keyed_seen.clone()).await;
    let plain_port = backend(Arc::default(), plain_seen.clone()).await;
    let mut keyed = model("keyed", "30s");
    keyed.spec.backend_key_secret_ref = Some(BackendKeySecretRef {
        name: "backend-key".into(),
        key: "token".into(),
    });
    add_model(&mut feed, keyed);
    feed.apply_slice(slice("keyed", "keyed-1", keyed_port));
    add_model(&mut feed, model("plain", "30s"));
    feed.apply_slice(slice("plain", "plain-1", plain_port));
    let config = Config {
        api_keys: ApiKeys::parse(keys).unwrap(),
        backend_key_ttl: ttl,
        ..test_config()
    };
    let proxy = Proxy::new(cluster, config).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(serve(l, proxy, futures::future::pending()));
    Setup {
        url,
        secrets,
        reads,
        backend_key,
        keyed_seen,
        plain_seen,
        _feed: feed,
    }
}

/// POST a chat completion for `model` with `headers`: status and body.
async fn chat(url: &str, model: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let client: HttpClient<HttpConnector, Full<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build(HttpConnector::new());
    let body = serde_json::to_vec(&serde_json::json!({"model": model, "messages": []})).unwrap();
    let mut req = Request::post(format!("{url}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = tokio::time::timeout(
        BOUND,
        client.request(req.body(Full::new(Bytes::from(body))).unwrap()),
    )
    .await
    .expect("the proxy answers within the bound")
    .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn creds(auth: Option<&str>, x_api_key: Option<&str>) -> (Option<String>, Option<String>) {
    (auth.map(str::to_string), x_api_key.map(str::to_string))
}

/// The keyed Model's backend gets the Model's key and never the caller's credentials (with the
/// proxy's auth off and on); the Model without a key gets what it got before: the caller's
/// `Authorization` with auth off, none with auth on, and never one from the proxy. The Secret is
/// read once for many requests.
#[tokio::test]
async fn the_backend_gets_the_models_key_not_the_callers() {
    let s = setup("", Duration::from_secs(60)).await;
    let caller = [
        ("authorization", "Bearer sk-caller"),
        ("x-api-key", "sk-caller-x"),
    ];
    for _ in 0..5 {
        let (status, body) = chat(&s.url, "keyed", &caller).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = chat(&s.url, "keyed", &[]).await;
    assert_eq!(status, 200, "{body}");
    let seen = s.keyed_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 6);
    assert!(
        seen.iter()
            .all(|c| *c == creds(Some("Bearer sk-backend-1"), None)),
        "{seen:?}"
    );
    assert_eq!(s.reads.load(Ordering::SeqCst), 1, "one Secret GET");
    // Without a key, auth off: the caller's headers as today, nothing added.
    assert_eq!(chat(&s.url, "plain", &caller).await.0, 200);
    assert_eq!(chat(&s.url, "plain", &[]).await.0, 200);
    assert_eq!(
        s.plain_seen.lock().unwrap().clone(),
        vec![
            creds(Some("Bearer sk-caller"), Some("sk-caller-x")),
            creds(None, None)
        ]
    );

    // The proxy's auth on: the caller's key opens the proxy, the backend gets the Model's key.
    let s = setup("sk-caller", Duration::from_secs(60)).await;
    let (status, body) = chat(&s.url, "keyed", &[("authorization", "Bearer sk-caller")]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        chat(&s.url, "keyed", &[]).await.0,
        401,
        "the proxy's own auth"
    );
    assert_eq!(
        chat(&s.url, "plain", &[("authorization", "Bearer sk-caller")])
            .await
            .0,
        200
    );
    assert_eq!(
        s.keyed_seen.lock().unwrap().clone(),
        vec![creds(Some("Bearer sk-backend-1"), None)]
    );
    assert_eq!(
        s.plain_seen.lock().unwrap().clone(),
        vec![creds(None, None)]
    );
}

/// A missing Secret, a missing key or an unusable value: 503 naming the Model and the Secret,
/// nothing forwarded, and the failure is cached too (no GET per request).
#[tokio::test]
async fn no_key_no_request() {
    let s = setup("", Duration::from_secs(60)).await;
    s.secrets.lock().unwrap().clear();
    for _ in 0..3 {
        let (status, body) = chat(&s.url, "keyed", &[("authorization", "Bearer sk-caller")]).await;
        assert_eq!(status, 503, "{body}");
        for want in [
            "Model ns/keyed",
            "Secret ns/backend-key",
            "spec.backendKeySecretRef",
            "does not exist",
        ] {
            assert!(body.contains(want), "{want:?} in {body}");
        }
    }
    assert_eq!(s.reads.load(Ordering::SeqCst), 1, "the failure is kept too");
    // The Model without a key is not affected.
    assert_eq!(chat(&s.url, "plain", &[]).await.0, 200);

    // (the Secret's data, what the error says)
    type Case<'a> = (&'a [(&'a str, &'a [u8])], &'a str);
    let cases: [Case; 3] = [
        (&[("other", b"sk")], "has no such key"),
        (&[("token", b"sk-backend-1\n")], "trailing newline"),
        (&[("token", b"")], "empty"),
    ];
    for (data, want) in cases {
        let s = setup("", Duration::from_secs(60)).await;
        s.secrets.lock().unwrap().insert(
            "backend-key".into(),
            data.iter()
                .map(|(k, v)| (k.to_string(), v.to_vec()))
                .collect(),
        );
        let (status, body) = chat(&s.url, "keyed", &[]).await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains(want), "{want:?} in {body}");
        assert!(
            !body.contains("sk-backend-1"),
            "the value is never shown: {body}"
        );
        assert!(s.keyed_seen.lock().unwrap().is_empty(), "nothing forwarded");
    }
}

/// A changed Secret is read again after the time to live; a Secret that appears later is found.
#[tokio::test]
async fn key_rotation_is_picked_up() {
    let ttl = Duration::from_millis(300);
    let s = setup("", ttl).await;
    assert_eq!(chat(&s.url, "keyed", &[]).await.0, 200);
    // Rotated: the Secret and (after their restart) the backends hold the new key.
    s.secrets.lock().unwrap().insert(
        "backend-key".into(),
        BTreeMap::from([("token".to_string(), b"sk-backend-2".to_vec())]),
    );
    *s.backend_key.lock().unwrap() = Some("sk-backend-2".into());
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let (status, body) = chat(&s.url, "keyed", &[]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        s.keyed_seen.lock().unwrap().last().cloned(),
        Some(creds(Some("Bearer sk-backend-2"), None))
    );
    assert_eq!(s.reads.load(Ordering::SeqCst), 2);

    // Deleted, then made again: 503 while it is gone, served once it is back.
    s.secrets.lock().unwrap().clear();
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert_eq!(chat(&s.url, "keyed", &[]).await.0, 503);
    s.secrets.lock().unwrap().insert(
        "backend-key".into(),
        BTreeMap::from([("token".to_string(), b"sk-backend-2".to_vec())]),
    );
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert_eq!(chat(&s.url, "keyed", &[]).await.0, 200);
}
