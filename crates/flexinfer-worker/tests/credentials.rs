//! Credentials follow the user, not the server: local HTTP servers play a hub, a registry, a
//! token service, a CDN and an upload backend, and record every `Authorization` header they get.
//! The configured host gets the credential (the positive control in each test); another host
//! named by a `Link`, a redirect, an upload `Location` or a token realm gets none.
//! (`127.0.0.1` and `localhost` are different hosts to a URL, as two servers on one machine.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::convert::Infallible;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};

use flexinfer_worker::download::fetch::{fetch_file, FetchCtx};
use flexinfer_worker::download::RemoteFile;
use flexinfer_worker::hf::{self, RepoType};
use flexinfer_worker::http::ScopedAuth;
use flexinfer_worker::oci::{Credentials, Reference, Registry};

/// (method path?query, Authorization) of each request.
type Log = Arc<Mutex<Vec<(String, Option<String>)>>>;

type Handler = dyn Fn(&str, Option<&str>) -> Response<Full<Bytes>> + Send + Sync;

/// One recording server: (method path?query, Authorization) of every request.
struct Server {
    port: u16,
    seen: Log,
}

impl Server {
    async fn start(handler: Arc<Handler>) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen: Log = Arc::new(Mutex::new(Vec::new()));
        let rec = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (rec, handler) = (rec.clone(), handler.clone());
                tokio::spawn(async move {
                    let svc =
                        hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                            let (rec, handler) = (rec.clone(), handler.clone());
                            async move {
                                let target = format!(
                                    "{} {}",
                                    req.method(),
                                    req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("")
                                );
                                let auth = req
                                    .headers()
                                    .get("authorization")
                                    .and_then(|v| v.to_str().ok())
                                    .map(String::from);
                                rec.lock().unwrap().push((target.clone(), auth.clone()));
                                let _ = req.into_body().collect().await;
                                Ok::<_, Infallible>(handler(&target, auth.as_deref()))
                            }
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Server { port, seen }
    }

    fn seen(&self) -> Vec<(String, Option<String>)> {
        self.seen.lock().unwrap().clone()
    }

    /// Requests that carried any Authorization header.
    fn authorized(&self) -> Vec<String> {
        self.seen()
            .into_iter()
            .filter(|(_, a)| a.is_some())
            .map(|(t, a)| format!("{t} ({})", a.unwrap_or_default()))
            .collect()
    }
}

fn respond(
    status: StatusCode,
    headers: &[(&str, String)],
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    for (k, v) in headers {
        r.headers_mut().insert(
            hyper::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    r
}

fn client() -> reqwest::Client {
    flexinfer_worker::download::http_client(false).unwrap()
}

#[tokio::test]
async fn hub_token_is_not_sent_to_a_pagination_link_on_another_host() {
    let other = Server::start(Arc::new(|_, _| respond(StatusCode::OK, &[], "[]"))).await;
    let next = format!(
        "<http://localhost:{}/api/models/org/m/tree/main?cursor=2>; rel=\"next\"",
        other.port
    );
    let hub = Server::start(Arc::new(move |_, _| {
        respond(
            StatusCode::OK,
            &[("link", next.clone())],
            r#"[{"type":"file","path":"config.json","size":2,"oid":"x"}]"#,
        )
    }))
    .await;
    let endpoint = format!("http://127.0.0.1:{}", hub.port);
    let files = hf::list_files(
        &client(),
        &endpoint,
        Some("hf_secret"),
        RepoType::Model,
        "org/m",
        "main",
    )
    .await
    .unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(
        hub.authorized().len(),
        1,
        "the configured hub gets the token: {:?}",
        hub.seen()
    );
    assert!(hub.authorized()[0].contains("Bearer hf_secret"));
    assert_eq!(other.seen().len(), 1, "the Link was followed");
    assert!(other.authorized().is_empty(), "{:?}", other.authorized());
}

#[tokio::test]
async fn hub_token_is_dropped_on_a_redirect_to_a_cdn_host() {
    let body = b"hello weights".to_vec();
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body));
    let b2 = body.clone();
    let cdn = Server::start(Arc::new(move |_, _| {
        respond(StatusCode::OK, &[], b2.clone())
    }))
    .await;
    let loc = format!("http://localhost:{}/blob/abc", cdn.port);
    let hub = Server::start(Arc::new(move |_, _| {
        respond(StatusCode::FOUND, &[("location", loc.clone())], "")
    }))
    .await;
    let endpoint = format!("http://127.0.0.1:{}", hub.port);
    let ctx = FetchCtx {
        client: client(),
        authorization: ScopedAuth::new("Bearer hf_secret".into(), &endpoint),
        done: Arc::new(AtomicU64::new(0)),
        max_retries: 1,
        received: Arc::new(AtomicU64::new(0)),
    };
    let dir = tempfile::tempdir().unwrap();
    let f = RemoteFile {
        path: "model.safetensors".into(),
        url: hf::resolve_url(
            &endpoint,
            RepoType::Model,
            "org/m",
            "main",
            "model.safetensors",
        ),
        size: body.len() as u64,
        sha256: Some(sha),
        git_sha1: None,
    };
    fetch_file(&ctx, dir.path(), &f).await.unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("model.safetensors")).unwrap(),
        body
    );
    assert_eq!(hub.authorized().len(), 1, "{:?}", hub.seen());
    assert_eq!(cdn.seen().len(), 1);
    assert!(cdn.authorized().is_empty(), "{:?}", cdn.authorized());

    // A file URL that is not on the hub's origin gets no token at all.
    let f2 = RemoteFile {
        path: "other.bin".into(),
        url: format!("http://localhost:{}/direct", cdn.port),
        ..f
    };
    let _ = fetch_file(&ctx, dir.path(), &f2).await;
    assert!(cdn.authorized().is_empty(), "{:?}", cdn.authorized());
}

const MANIFEST: &str = r#"{"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.empty.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[]}"#;

/// A registry that answers every request without `Authorization` with a Bearer challenge naming
/// `realm`, and serves a manifest, tags with a `Link` to `next`, and uploads sent to `upload`.
async fn registry(realm: String, upload: String, next: String) -> Server {
    Server::start(Arc::new(move |target, auth| {
        if auth.is_none() {
            let challenge = format!("Bearer realm=\"{realm}\",service=\"reg\"");
            return respond(
                StatusCode::UNAUTHORIZED,
                &[("www-authenticate", challenge)],
                "",
            );
        }
        if target.contains("/manifests/") {
            return respond(StatusCode::OK, &[], MANIFEST);
        }
        if target.contains("/tags/list") {
            return respond(
                StatusCode::OK,
                &[("link", next.clone())],
                r#"{"tags":["v1"]}"#,
            );
        }
        if target.starts_with("HEAD ") {
            return respond(StatusCode::NOT_FOUND, &[], "");
        }
        if target.starts_with("POST ") {
            return respond(StatusCode::ACCEPTED, &[("location", upload.clone())], "");
        }
        respond(StatusCode::CREATED, &[], "")
    }))
    .await
}

fn creds() -> Option<Credentials> {
    Some(Credentials {
        username: "user".into(),
        password: "s3cret".into(),
    })
}

async fn token_server() -> Server {
    Server::start(Arc::new(|_, _| {
        respond(StatusCode::OK, &[], r#"{"token":"tok"}"#)
    }))
    .await
}

#[tokio::test]
async fn basic_credentials_go_to_a_realm_on_the_registry_host_only() {
    // Positive control: the realm on the registry's host (insecure registry, so http is allowed).
    let same = token_server().await;
    let reg = registry(
        format!("http://127.0.0.1:{}/token", same.port),
        String::new(),
        String::new(),
    )
    .await;
    let r = Reference::parse(&format!("127.0.0.1:{}/models/m:v1", reg.port)).unwrap();
    let c = Registry::connect(&r, creds(), true).await.unwrap();
    c.get_manifest("v1").await.unwrap();
    assert_eq!(same.authorized().len(), 1, "{:?}", same.seen());
    assert!(same.authorized()[0].starts_with("GET /token"));
    assert!(same.authorized()[0].contains("Basic "));

    // A realm on another host: an anonymous token request, never the password.
    let other = token_server().await;
    let reg = registry(
        format!("http://localhost:{}/token", other.port),
        String::new(),
        String::new(),
    )
    .await;
    let r = Reference::parse(&format!("127.0.0.1:{}/models/m:v1", reg.port)).unwrap();
    let c = Registry::connect(&r, creds(), true).await.unwrap();
    c.get_manifest("v1").await.unwrap();
    assert_eq!(other.seen().len(), 1, "the token was still requested");
    assert!(other.authorized().is_empty(), "{:?}", other.authorized());
    assert!(
        reg.authorized().iter().all(|a| a.contains("Bearer tok")),
        "the registry gets the token: {:?}",
        reg.authorized()
    );
}

#[tokio::test]
async fn registry_auth_is_not_sent_to_an_upload_location_or_a_tag_link_elsewhere() {
    let tokens = token_server().await;
    let elsewhere = Server::start(Arc::new(|target, _| {
        if target.contains("tags") {
            respond(StatusCode::OK, &[], r#"{"tags":["v2"]}"#)
        } else {
            respond(StatusCode::CREATED, &[], "")
        }
    }))
    .await;
    let reg = registry(
        format!("http://127.0.0.1:{}/token", tokens.port),
        format!("http://localhost:{}/upload/1?_state=x", elsewhere.port),
        format!(
            "<http://localhost:{}/v2/models/m/tags/list?last=v1>; rel=\"next\"",
            elsewhere.port
        ),
    )
    .await;
    let r = Reference::parse(&format!("127.0.0.1:{}/models/m:v1", reg.port)).unwrap();
    let c = Registry::connect(&r, creds(), true).await.unwrap();
    c.push_bytes(b"{}").await.unwrap();
    let tags = c.list_tags().await.unwrap();
    assert_eq!(tags, ["v1", "v2"]);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("blob");
    std::fs::write(&p, b"layer").unwrap();
    let digest = format!(
        "sha256:{}",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"layer"))
    );
    c.push_file(&p, &digest, 5, Arc::new(AtomicU64::new(0)))
        .await
        .unwrap();

    assert!(
        !reg.authorized().is_empty(),
        "the registry itself gets the token"
    );
    let seen = elsewhere.seen();
    assert!(
        seen.iter().any(|(t, _)| t.starts_with("PUT /upload/1")),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|(t, _)| t.contains("tags/list")),
        "{seen:?}"
    );
    assert!(
        elsewhere.authorized().is_empty(),
        "{:?}",
        elsewhere.authorized()
    );
}
