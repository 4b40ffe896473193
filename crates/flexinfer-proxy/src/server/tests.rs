//! Unit tests of `server.rs`.

use super::*;

#[test]
fn request_bodies_table() {
    // (body, Ok(model) or Err(status))
    let cases: Vec<(&[u8], Result<&str, u16>)> = vec![
        (br#"{"model":"m","messages":[]}"#, Ok("m")),
        (b"  \n {\"model\": \"a/b:c\"}", Ok("a/b:c")),
        (br#"["m"]"#, Err(400)), // serde reads structs from arrays: refused before
        (br#"{"model":7}"#, Err(400)),
        (br#"{"model":""}"#, Err(400)),
        (br#"{"prompt":"x"}"#, Err(400)),
        (br#"{"model":"m""#, Err(400)),
        (b"", Err(400)),
        (b"\xff\xfe", Err(400)),
        (br#""m""#, Err(400)),
        (b"null", Err(400)),
    ];
    for (body, want) in cases {
        let got = requested_model(body).map_err(|e| e.status.as_u16());
        assert_eq!(
            got.as_deref().map_err(|e| *e),
            want,
            "{:?}",
            String::from_utf8_lossy(body)
        );
    }
    // Deep nesting (a body limit's worth) overflows no stack: other fields are skipped, not
    // parsed, for the peek and for the rewrite alike, and the rewrite keeps them byte for byte.
    let deep = format!(
        "{{\"model\":\"m\",\"x\":{}{}}}",
        "[".repeat(1_000_000),
        "]".repeat(1_000_000)
    );
    assert_eq!(requested_model(deep.as_bytes()).ok().as_deref(), Some("m"));
    let rewritten = rewrite_model(deep.as_bytes(), "s").unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(
        &rewritten[..],
        deep.replacen("\"m\"", "\"s\"", 1).as_bytes()
    );
    // Two `model`s: refused (a backend could read the other one).
    assert_eq!(
        requested_model(br#"{"model":"a","model":"b"}"#).map_err(|e| e.status.as_u16()),
        Err(400)
    );
}

#[test]
fn rewrite_keeps_the_rest_of_the_body() {
    let out = rewrite_model(
        br#"{"model":"alias","temperature":0.5,"stream":true}"#,
        "served",
    )
    .unwrap_or_else(|e| panic!("{e:?}"));
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        v,
        serde_json::json!({"model": "served", "temperature": 0.5, "stream": true})
    );
    assert_eq!(
        rewrite_model(b"[1]", "s").map_err(|e| e.status.as_u16()),
        Err(400)
    );
}

#[test]
fn hop_by_hop_headers_are_not_forwarded() {
    let mut h = HeaderMap::new();
    for (k, v) in [
        ("connection", "keep-alive, x-secret-hop"),
        ("x-secret-hop", "1"),
        ("keep-alive", "timeout=5"),
        ("transfer-encoding", "chunked"),
        ("host", "proxy:8000"),
        ("content-length", "12"),
        ("authorization", "Bearer sk"),
        ("content-type", "application/json"),
        ("x-request-id", "abc"),
    ] {
        h.append(
            HeaderName::from_static(k),
            http::HeaderValue::from_static(v),
        );
    }
    let out = forward_headers(&h, true, None);
    let mut names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
    names.sort();
    assert_eq!(names, vec!["content-type", "x-request-id"]);
    assert!(forward_headers(&h, false, None).contains_key("authorization"));
}

/// A Model with a backend key: the backend gets that key in `Authorization` and neither the
/// caller's `Authorization` nor its `X-Api-Key`, with the proxy's auth on or off.
#[test]
fn a_backend_key_replaces_the_callers_credentials() {
    let mut h = HeaderMap::new();
    for (k, v) in [
        ("authorization", "Bearer sk-caller"),
        ("x-api-key", "sk-caller-too"),
        ("content-type", "application/json"),
    ] {
        h.append(
            HeaderName::from_static(k),
            http::HeaderValue::from_static(v),
        );
    }
    for auth_enabled in [true, false] {
        let key = http::HeaderValue::from_static("Bearer sk-backend");
        let out = forward_headers(&h, auth_enabled, Some(key));
        let auth: Vec<_> = out.get_all(header::AUTHORIZATION).iter().collect();
        assert_eq!(auth, vec!["Bearer sk-backend"], "auth on: {auth_enabled}");
        assert!(!out.contains_key("x-api-key"), "auth on: {auth_enabled}");
        assert!(out.contains_key("content-type"));
    }
}
