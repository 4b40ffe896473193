//! Property tests over what a client or a Model author controls in the proxy:
//! request bodies (the `model` peek and the rewrite), `Authorization` headers against the key
//! list, the requested model name against the routing table, and a Model's serverless timings
//! (cold-start wait, keepalive, the lastActiveTime write decision). None may panic.
//!
//! 100 000 cases per property by default (`PROPTEST_CASES` overrides).

use std::sync::Arc;
use std::time::Duration;

use flexinfer_api::Model;
use flexinfer_proxy::auth::{ApiKeys, Scope};
use flexinfer_proxy::{plan, route, server};
use k8s_openapi::jiff::Timestamp;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

/// Bodies: arbitrary bytes, JSON objects with odd `model` values, deep nesting, huge numbers.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..200),
        "\\PC{0,120}".prop_map(String::into_bytes),
        (
            prop_oneof![
                ".{0,40}".prop_map(serde_json::Value::from),
                any::<f64>().prop_map(serde_json::Value::from),
                Just(serde_json::Value::Null),
                Just(serde_json::json!({"a": [1, 2]})),
            ],
            ".{0,30}"
        )
            .prop_map(|(model, extra)| {
                serde_json::to_vec(
                    &serde_json::json!({"model": model, "prompt": extra, "stream": true}),
                )
                .unwrap_or_default()
            }),
        (1usize..200)
            .prop_map(|n| format!("{}{}", "{\"a\":[".repeat(n), "]}".repeat(n)).into_bytes()),
        Just(b"{\"model\": 1e999999}".to_vec()),
        Just(b"  \n{\"model\":\"m\"".to_vec()),
        // Shapes the tree-free peek must read exactly as a JSON parser does: escaped keys and
        // names, duplicates, nested `model`s, wide values, trailing bytes.
        (
            prop::sample::select(vec![
                "model",
                "mod\\u0065l",
                "Model",
                "model ",
                "m\\u006fdel",
                "x",
            ]),
            prop::sample::select(vec![
                "\"m\"",
                "\"a\\u002fb\"",
                "\"\\ud83d\\ude00\"",
                "\"\\ud800\"",
                "[0,0,0]",
                "{\"model\":\"in\"}",
                "\"\"",
                "null",
                "\"x\\\"y\"",
                "7",
            ]),
            prop::sample::select(vec![
                "",
                ",\"model\":\"dup\"",
                ",\"a\":{\"model\":\"n\"}",
                ",\"b\":[1,2,[3]]",
                ",",
                ",\"c\":\"\\u0000\"",
            ]),
            prop::sample::select(vec!["", " ", "x", "}", "\n\t"]),
            0usize..3000,
        )
            .prop_map(|(key, value, more, tail, wide)| {
                let filler = "0,".repeat(wide);
                format!("{{\"{key}\":{value}{more},\"w\":[{filler}0]}}{tail}").into_bytes()
            }),
    ]
}

/// The `model` as a JSON parser reads it into a tree (the proxy's earlier reading): the reference
/// the tree-free peek must agree with. `None`: no usable model (400).
fn reference_model(body: &[u8]) -> Option<String> {
    if body.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    // Duplicate keys: a tree keeps the last; the proxy refuses (a backend may read either).
    #[derive(serde::Deserialize)]
    struct Peek {
        model: Option<serde_json::Value>,
    }
    let peek: Peek = serde_json::from_slice(body).ok()?;
    match peek.model {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s),
        _ => None,
    }
}

fn model(
    name: &str,
    aliases: &[String],
    cold: &str,
    keepalive: &str,
    idle: &str,
) -> Option<Arc<Model>> {
    serde_json::from_value::<Model>(serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"backend": "vllm", "source": "pvc://c/p", "aliases": aliases,
                 "serverless": {"enabled": true, "minReplicas": 0, "coldStartTimeout": cold,
                                "keepaliveInterval": keepalive, "idleTimeout": idle}}
    }))
    .ok()
    .map(Arc::new)
}

fn duration_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,20}",
        "[0-9]{1,30}(ms|s|m|h|d)?",
        Just("4999999999999999h".to_string()),
        Just("0s".to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn request_bodies_never_panic(b in body(), served in ".{0,40}") {
        let peeked = server::requested_model(&b);
        let rewritten = server::rewrite_model(&b, &served);
        // The tree-free peek reads what a JSON parser reads (serde's derive refuses duplicate
        // fields too), and refuses with 400 what it cannot use.
        let reference = reference_model(&b);
        prop_assert_eq!(peeked.as_ref().ok(), reference.as_ref(), "{:?}", String::from_utf8_lossy(&b));
        if let Err(e) = &peeked {
            prop_assert_eq!(e.status.as_u16(), 400);
        }
        // A body whose model could be read is a JSON object, so it can be rewritten; the rewrite
        // names the served model and keeps every other field.
        if peeked.is_ok() {
            let out = rewritten.unwrap_or_else(|e| panic!("peeked but not rewritten: {e:?}"));
            prop_assert_eq!(server::requested_model(&out).ok(), Some(served.clone()).filter(|s| !s.is_empty()));
            // Compared as trees where the body is one (a lone surrogate elsewhere is skipped by
            // the peek, as by serde's derive, but refused by a tree).
            if let Ok(mut before) = serde_json::from_slice::<serde_json::Value>(&b) {
                let mut v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
                prop_assert_eq!(v["model"].as_str(), Some(served.as_str()));
                if let (Some(a), Some(o)) = (v.as_object_mut(), before.as_object_mut()) {
                    a.remove("model");
                    o.remove("model");
                }
                prop_assert_eq!(v, before);
            }
        }
    }

    #[test]
    fn auth_headers_never_panic(
        keys in "\\PC{0,80}",
        header in prop::collection::vec(any::<u8>(), 0..80),
        bearer in ".{0,40}",
    ) {
        // Text that is no key list is refused (naming the line), never a panic.
        let Ok(k) = ApiKeys::parse(&keys) else { return Ok(()); };
        for value in [header.clone(), format!("Bearer {bearer}").into_bytes(), b"bearer ".to_vec()] {
            let mut h = http::HeaderMap::new();
            if let Ok(v) = http::HeaderValue::from_bytes(&value) {
                h.insert(http::header::AUTHORIZATION, v);
            }
            let _ = k.authorize(&h);
        }
        // A listed key is always accepted: the first field of a line (a comma-separated list
        // when it is the only field).
        let first = keys
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .find_map(|l| {
                let mut fields = l.split_whitespace();
                let f = fields.next()?;
                if fields.next().is_some() {
                    Some(f.to_string())
                } else {
                    f.split(',').map(str::trim).find(|k| !k.is_empty()).map(String::from)
                }
            });
        if let Some(first) = first {
            if let Ok(v) = http::HeaderValue::from_str(&format!("Bearer {first}")) {
                let mut h = http::HeaderMap::new();
                h.insert(http::header::AUTHORIZATION, v);
                prop_assert!(k.allows(&h), "key {first:?} of {keys:?} refused");
            }
        }
    }

    #[test]
    fn routing_and_serverless_timings_never_panic(
        requested in prop_oneof!["\\PC{0,60}", "[a-z/]{0,20}"],
        aliases in prop::collection::vec("[a-z0-9./-]{0,20}", 0..4),
        cold in duration_text(),
        keepalive in duration_text(),
        idle in duration_text(),
        current in prop::option::of(-10_000_000_000i64..10_000_000_000),
        now in -10_000_000_000i64..10_000_000_000,
        interval_ms in any::<u64>(),
        waited_s in any::<u64>(),
    ) {
        let Some(m) = model("m", &aliases, &cold, &keepalive, &idle) else { return Ok(()); };
        let models = vec![m.clone(), model("other", &[], "1s", "1s", "1s").unwrap_or_else(|| m.clone())];
        let all = route::resolve(&models, &requested, &Scope::All)
            .map(|r| (r.namespace, r.name, r.rewrite));
        let _ = route::model_list(&models, &Scope::All);
        // A caller scoped to the Models' namespace sees what an unscoped one sees; one scoped
        // elsewhere sees nothing.
        let scope = |n: &str| Scope::Namespaces(std::iter::once(n.to_string()).collect());
        let own = route::resolve(&models, &requested, &scope("ns"))
            .map(|r| (r.namespace, r.name, r.rewrite));
        prop_assert_eq!(own, all);
        prop_assert!(route::resolve(&models, &requested, &scope("elsewhere")).is_err());
        prop_assert!(route::model_list(&models, &scope("elsewhere")).data.is_empty());
        let _ = plan::admit(&m, false);
        let timeout = plan::cold_start_timeout(&m);
        let _ = plan::deadline(tokio::time::Instant::now(), timeout);
        let ka = plan::keepalive_interval(&m, Duration::from_millis(interval_ms));
        let ts = |s: i64| Timestamp::from_second(s).unwrap_or_default();
        let _ = plan::should_write(current.map(ts), ts(now), ka);
        let _ = plan::written_at_most(ts(now));
        let _ = plan::not_ready_reason(&m, Duration::from_secs(waited_s));
    }
}
