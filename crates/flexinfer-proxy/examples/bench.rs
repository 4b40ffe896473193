//! Proxy benchmark (not a test; run by `scripts/bench/proxy/run.sh`): the `flexinfer-proxy`
//! binary in front of a small in-process OpenAI-style backend on a local control plane, measured
//! side by side with the same requests sent straight to the backend, in one run:
//!
//! 1. added latency: `LAT_N` sequential small chat completions, alternating direct / via proxy
//!    on kept-alive connections → p50 / p99 of each and their difference;
//! 2. streaming throughput: `STREAMS` concurrent SSE streams of `EVENTS` events each, direct then via
//!    the proxy, `ROUNDS` times alternating → events per second and the ratio;
//! 3. paced streaming: the same streams with the backend emitting one event every `PACE_MS`
//!    milliseconds (a model decoding at 1000 / PACE_MS tokens per second per stream), direct then
//!    via the proxy → wall time, events per second and the ratio: whether the proxy keeps up with
//!    a realistic aggregate token rate, where (2) measures the saturated machine;
//! 4. the proxy process's CPU time (from /proc) per phase and its peak RSS (VmHWM).
//!
//! Env: KUBECONFIG (the cluster), PROXY_BIN (the binary), BENCH_HOST_IP (a non-loopback address
//! of this host for the EndpointSlice), LAT_N (2000), STREAMS (500), EVENTS (200), ROUNDS (2),
//! PACE_MS (20; 0 skips the paced phase).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};
use tokio::net::TcpListener;

type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

fn env_or(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Microseconds since the first call (the backend and the client are this one process).
fn now_us() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// The `"t":` send time of one event, if it has one.
fn sent_us(event: &[u8]) -> Option<u64> {
    let at = event.windows(4).position(|w| w == b"\"t\":")? + 4;
    let digits: Vec<u8> = event[at..]
        .iter()
        .copied()
        .take_while(u8::is_ascii_digit)
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

async fn backend(req: Request<Incoming>) -> Response<BoxBody> {
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if v["stream"] == true {
        let n = v["max_tokens"].as_u64().unwrap_or(10) as usize;
        // `pace_ms` (a field of this benchmark only): the time between two events, like a model
        // decoding at 1000 / pace_ms tokens per second; 0: as fast as the machine allows.
        let pace = Duration::from_millis(v["pace_ms"].as_u64().unwrap_or(0));
        // Paced events carry the time they were sent (`"t"`, µs on this process's clock, which the
        // client shares), so the client measures each event's delivery latency.
        let s = futures::stream::iter(0..=n).then(move |i| async move {
            if pace.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(pace).await;
            }
            let text = if i == n {
                "data: [DONE]\n\n".to_string()
            } else if pace.is_zero() {
                format!("data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i}\"}}}}]}}\n\n")
            } else {
                format!("data: {{\"object\":\"chat.completion.chunk\",\"t\":{},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i}\"}}}}]}}\n\n", now_us())
            };
            // One event per poll, like a token stream (not one write of everything).
            Ok::<_, Infallible>(Frame::data(Bytes::from(text)))
        });
        let mut r = Response::new(StreamBody::new(s).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        r
    } else {
        let out = json!({"id": "cmpl-1", "object": "chat.completion", "model": v["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]});
        let mut r = Response::new(Full::new(Bytes::from(out.to_string())).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        r
    }
}

async fn start_backend(ip: std::net::IpAddr) -> SocketAddr {
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req| async move {
                    Ok::<_, Infallible>(backend(req).await)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// (utime + stime in seconds, VmHWM in KiB, VmRSS in KiB) of a process.
fn proc_stats(pid: u32) -> (f64, u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields after the command: state is [0]; utime is field 14 of the file → [11], stime → [12].
    let tick = 100.0; // USER_HZ on Linux
    let cpu = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (cpu / tick, kib("VmHWM:"), kib("VmRSS:"))
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

async fn one_request(c: &reqwest::Client, url: &str) -> f64 {
    let t = Instant::now();
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    t.elapsed().as_secs_f64() * 1e3
}

/// `streams` concurrent SSE streams of `events` events; returns (seconds, events received, delivery
/// latencies in ms of the events that carry their send time).
async fn streams(url: &str, streams: usize, events: usize, pace_ms: u64) -> (f64, usize, Vec<f64>) {
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(streams)
        .build()
        .unwrap();
    let t = Instant::now();
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let (c, url) = (c.clone(), url.to_string());
            tokio::spawn(async move {
                let r = c
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&json!({"model": "bench", "stream": true, "max_tokens": events, "pace_ms": pace_ms, "messages": []}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                let mut body = r.bytes_stream();
                // Whole events (a TCP read may split one or carry several).
                let (mut n, mut lat) = (0usize, Vec::new());
                let mut carry: Vec<u8> = Vec::new();
                while let Some(chunk) = body.next().await {
                    carry.extend_from_slice(&chunk.unwrap());
                    let arrived = now_us();
                    while let Some(end) = carry.windows(2).position(|w| w == b"\n\n") {
                        let ev: Vec<u8> = carry.drain(..end + 2).collect();
                        if ev.starts_with(b"data: ") {
                            n += 1;
                            if let Some(sent) = sent_us(&ev) {
                                lat.push(arrived.saturating_sub(sent) as f64 / 1e3);
                            }
                        }
                    }
                }
                (n, lat)
            })
        })
        .collect();
    let (mut total, mut lat) = (0, Vec::new());
    for t in tasks {
        let (n, l) = t.await.unwrap();
        total += n;
        lat.extend(l);
    }
    (t.elapsed().as_secs_f64(), total, lat)
}

#[tokio::main]
async fn main() {
    let lat_n = env_or("LAT_N", 2000);
    let n_streams = env_or("STREAMS", 500);
    let events = env_or("EVENTS", 200);
    let rounds = env_or("ROUNDS", 2);
    let pace_ms = env_or("PACE_MS", 20) as u64;
    let ip: std::net::IpAddr = std::env::var("BENCH_HOST_IP")
        .expect("BENCH_HOST_IP")
        .parse()
        .expect("BENCH_HOST_IP is an IP address");
    let bin = std::env::var("PROXY_BIN").expect("PROXY_BIN");
    let client = Client::try_default().await.expect("KUBECONFIG");

    let ns = format!("proxy-bench-{}", std::process::id());
    let nsapi: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    nsapi
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
        )
        .await
        .unwrap();
    let addr = start_backend(ip).await;
    let pp = PatchParams::apply("flexinfer-proxy-bench").force();
    let models: Api<flexinfer_api::Model> = Api::namespaced(client.clone(), &ns);
    let model = models
        .patch("bench", &pp, &Patch::Apply(json!({"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": "bench"},
            "spec": {"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"}, "serverless": {"enabled": false}}})))
        .await
        .unwrap();
    // The Service the Model controller would make (controlled by the Model; no selector, so the
    // control plane's EndpointSlice controller leaves the slice below alone) and the slice
    // Kubernetes would publish for it: the only kind the proxy uses.
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), &ns);
    let service = services
        .patch("bench", &pp, &Patch::Apply(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "bench", "labels": {"app.kubernetes.io/managed-by": "flexinfer",
                "app.kubernetes.io/component": "inference-server"},
                "ownerReferences": [{"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model", "name": "bench",
                    "uid": model.metadata.uid, "controller": true}]},
            "spec": {"ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}})))
        .await
        .unwrap();
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(client.clone(), &ns);
    slices
        .patch("bench-1", &pp, &Patch::Apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "bench-1", "labels": {"kubernetes.io/service-name": "bench",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "app.kubernetes.io/managed-by": "flexinfer", "app.kubernetes.io/component": "inference-server"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "bench",
                    "uid": service.metadata.uid, "controller": true}]},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": addr.port(), "protocol": "TCP"}],
            "endpoints": [{"addresses": [addr.ip().to_string()], "conditions": {"ready": true}}]})))
        .await
        .unwrap();

    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (pport, hport) = (free(), free());
    let admit = n_streams.max(1024);
    let mut child = tokio::process::Command::new(&bin)
        .env("FLEXINFER_PROXY_LISTEN_ADDR", format!("127.0.0.1:{pport}"))
        .env("FLEXINFER_PROXY_HEALTH_ADDR", format!("127.0.0.1:{hport}"))
        .env("FLEXINFER_PROXY_WATCH_NAMESPACE", &ns)
        // Admit every stream of the run (the defaults answer 429 beyond 512 per Model).
        .env("FLEXINFER_PROXY_MAX_REQUESTS", admit.to_string())
        .env("FLEXINFER_PROXY_MAX_REQUESTS_PER_MODEL", admit.to_string())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the proxy");
    let pid = child.id().unwrap();
    let proxy = format!("http://127.0.0.1:{pport}");
    let direct = format!("http://{addr}");
    let c = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        if let Ok(r) = c
            .post(format!("{proxy}/v1/chat/completions"))
            .json(&json!({"model": "bench", "messages": []}))
            .send()
            .await
        {
            if r.status() == 200 {
                break;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "proxy never routed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, rss_idle, _) = proc_stats(pid);

    // 1. Added latency, interleaved on kept-alive connections (after a warm-up).
    let (cd, cp) = (reqwest::Client::new(), reqwest::Client::new());
    for _ in 0..100 {
        one_request(&cd, &direct).await;
        one_request(&cp, &proxy).await;
    }
    let cpu0 = proc_stats(pid).0;
    let (mut d, mut p) = (Vec::new(), Vec::new());
    for _ in 0..lat_n {
        d.push(one_request(&cd, &direct).await);
        p.push(one_request(&cp, &proxy).await);
    }
    let cpu_lat = proc_stats(pid).0 - cpu0;
    let (d50, d99, p50, p99) = (
        pct(&mut d, 0.5),
        pct(&mut d, 0.99),
        pct(&mut p, 0.5),
        pct(&mut p, 0.99),
    );

    // 2. Streams, alternating direct / proxy.
    let mut rows = Vec::new();
    let mut cpu_streams = 0.0;
    for r in 0..rounds {
        let (ds, dn, _) = streams(&direct, n_streams, events, 0).await;
        let c0 = proc_stats(pid).0;
        let (ps, pn, _) = streams(&proxy, n_streams, events, 0).await;
        cpu_streams += proc_stats(pid).0 - c0;
        let want = n_streams * (events + 1);
        assert_eq!(
            (dn, pn),
            (want, want),
            "every event of every stream arrived"
        );
        rows.push((r + 1, ds, ps, dn as f64 / ds, pn as f64 / ps));
    }
    // 3. Paced streams, direct then via the proxy.
    let mut paced = None;
    if pace_ms > 0 {
        let (ds, dn, mut dl) = streams(&direct, n_streams, events, pace_ms).await;
        let c0 = proc_stats(pid).0;
        let (ps, pn, mut pl) = streams(&proxy, n_streams, events, pace_ms).await;
        let cpu = proc_stats(pid).0 - c0;
        let want = n_streams * (events + 1);
        assert_eq!((dn, pn), (want, want), "every paced event arrived");
        assert_eq!(
            (dl.len(), pl.len()),
            (n_streams * events, n_streams * events)
        );
        let lat = (
            pct(&mut dl, 0.5),
            pct(&mut dl, 0.99),
            pct(&mut pl, 0.5),
            pct(&mut pl, 0.99),
        );
        paced = Some((ds, ps, dn as f64 / ds, pn as f64 / ps, cpu, lat));
    }
    let (_, hwm, rss) = proc_stats(pid);

    println!("## proxy benchmark ({lat_n} sequential requests; {n_streams} concurrent SSE streams x {events} events, {rounds} rounds)\n");
    println!("| figure | direct | via proxy | proxy − direct / ratio |");
    println!("|---|---|---|---|");
    println!(
        "| latency p50 (ms) | {d50:.3} | {p50:.3} | +{:.3} ms |",
        p50 - d50
    );
    println!(
        "| latency p99 (ms) | {d99:.3} | {p99:.3} | +{:.3} ms |",
        p99 - d99
    );
    for (r, ds, ps, de, pe) in &rows {
        println!(
            "| round {r}: {n_streams} streams wall time (s) / events per s | {ds:.2} s / {de:.0} | {ps:.2} s / {pe:.0} | {:.1} % of direct |",
            pe / de * 100.0
        );
    }
    if let Some((ds, ps, de, pe, cpu, (d50, d99, p50, p99))) = paced {
        // The floor: events × pace, the time a stream takes at the backend's rate alone.
        let floor = (events + 1) as f64 * pace_ms as f64 / 1e3;
        println!(
            "| paced ({pace_ms} ms per event; floor {floor:.2} s): {n_streams} streams wall time (s) / events per s | {ds:.2} s / {de:.0} | {ps:.2} s / {pe:.0} | {:.1} % of direct (proxy CPU {cpu:.2} s, {:.1} µs per event) |",
            pe / de * 100.0,
            cpu / (n_streams * (events + 1)) as f64 * 1e6
        );
        println!(
            "| paced: event delivery latency p50 / p99 (ms, send → client) | {d50:.3} / {d99:.3} | {p50:.3} / {p99:.3} | +{:.3} / +{:.3} ms |",
            p50 - d50,
            p99 - d99
        );
    }
    println!(
        "| proxy CPU time | — | {:.2} s for {lat_n} requests ({:.0} µs each); {:.2} s for {rounds}×{n_streams} streams | |",
        cpu_lat,
        cpu_lat / lat_n as f64 * 1e6,
        cpu_streams
    );
    println!(
        "| proxy RSS | — | idle {:.1} MiB, peak {:.1} MiB, after {:.1} MiB | |",
        rss_idle as f64 / 1024.0,
        hwm as f64 / 1024.0,
        rss as f64 / 1024.0
    );
    let _ = child.kill().await;
    let _ = nsapi.delete(&ns, &Default::default()).await;
}
