//! Every user-written field of the CRDs is bounded, so no manifest can hand the operator (or a
//! CEL rule) an unbounded string, list or map: strings have `maxLength` (or are enums/formats),
//! lists `maxItems`, maps `maxProperties` and bounded values. Embedded Kubernetes types
//! (tolerations, resources, env vars) keep Kubernetes' own rules; their lists are bounded here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_api::crdgen::crds;
use serde_json::Value;

/// Paths inside embedded Kubernetes types, validated by Kubernetes where they are used.
const EMBEDDED: &[&str] = &["spec.env[].", "spec.tolerations[].", "spec.resources."];

fn walk(s: &Value, path: &str, missing: &mut Vec<String>) {
    if EMBEDDED.iter().any(|e| path.starts_with(e)) {
        return;
    }
    let has = |k: &str| s.get(k).is_some();
    match s.get("type").and_then(Value::as_str) {
        Some("string") if !has("enum") && !has("format") && !has("maxLength") => {
            missing.push(format!("{path}: string without maxLength"));
        }
        Some("array") => {
            if !has("maxItems") {
                missing.push(format!("{path}: list without maxItems"));
            }
            if let Some(items) = s.get("items") {
                walk(items, &format!("{path}[]"), missing);
            }
        }
        Some("object") => {
            if let Some(v) = s.get("additionalProperties").filter(|v| v.is_object()) {
                if !has("maxProperties") {
                    missing.push(format!("{path}: map without maxProperties"));
                }
                walk(v, &format!("{path}{{}}"), missing);
            }
        }
        _ => {}
    }
    if let Some(props) = s.get("properties").and_then(Value::as_object) {
        for (k, c) in props {
            walk(c, &format!("{path}.{k}"), missing);
        }
    }
}

#[test]
fn every_spec_field_is_bounded() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for (name, crd) in crds() {
        for v in &crd.spec.versions {
            let schema = serde_json::to_value(v.schema.as_ref().unwrap()).unwrap();
            let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
            assert!(spec.is_object(), "{name} {}: no spec schema", v.name);
            let before = missing.len();
            walk(spec, "spec", &mut missing);
            for m in missing.iter_mut().skip(before) {
                *m = format!("{name} {}: {m}", v.name);
            }
            checked += 1;
        }
    }
    assert!(checked >= 3, "all three CRDs checked");
    assert!(
        missing.is_empty(),
        "unbounded fields:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_walk_finds_an_unbounded_field() {
    // The check itself: a schema with one unbounded string, list and map is reported thrice.
    let s = serde_json::json!({"type": "object", "properties": {
        "a": {"type": "string"},
        "b": {"type": "array", "items": {"type": "string", "maxLength": 3}},
        "c": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}},
        "ok": {"type": "string", "enum": ["x"]},
    }});
    let mut missing = Vec::new();
    walk(&s, "spec", &mut missing);
    assert_eq!(missing.len(), 3, "{missing:?}");
}
