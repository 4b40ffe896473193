//! The quantized-artifact promotion gate (docs/user/promotion-gate.md).
//!
//! Pure: takes a Model (and the digest of the artifact it would serve, when known), returns the
//! decision. The reconciler turns the decision into the `PromotionGate` condition and, when
//! blocked, serves the Model as a scale-to-zero canary.
//!
//! A validation is bound to one artifact. When the served artifact's digest is known (a
//! `modelcache://` source: the cache's quantization `configDigest`, else its published manifest
//! digest), evidence that names a digest must name that one. A validation that names none
//! (`promotion-validation: passed`, or evidence without a digest) covers the artifact served when
//! it was first accepted, recorded in `status.validatedArtifact`. A different artifact later (a
//! new generation) closes the gate again until the evidence names the new digest.

use std::time::Duration;

use flexinfer_api::contract::annotations;
use flexinfer_api::model::{ModelSpec, WarmPolicy};
use flexinfer_api::{Model, ModelCache};

/// Longest `idleTimeout` a blocked (or gated) canary keeps: demand cannot turn it into a
/// de-facto warm primary.
pub const DEFAULT_CANARY_MAX_IDLE: Duration = Duration::from_secs(15 * 60);

/// Outcome of the promotion gate for one Model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateDecision {
    /// Not annotated with the gate: no `PromotionGate` condition (a stale one is removed).
    Ungated,
    /// Gated and asks only for scale-to-zero, on-demand service: allowed (`True`, `Canary`).
    Canary,
    /// Gated, asks for warm-primary service and carries validation for the served artifact:
    /// allowed (`True`, `Validated`). `artifact` is what `status.validatedArtifact` records.
    Validated {
        message: String,
        artifact: Option<String>,
    },
    /// Gated, asks for warm-primary service without validation: runs as a canary instead
    /// (`False`, `Blocked`).
    Blocked { message: String },
}

/// Condition reasons of `PromotionGate`.
pub mod reasons {
    pub const CANARY: &str = "Canary";
    pub const VALIDATED: &str = "Validated";
    pub const BLOCKED: &str = "Blocked";
}

impl GateDecision {
    /// `(status, reason, message)` of the `PromotionGate` condition; `None` = no condition.
    pub fn condition(&self) -> Option<(bool, &'static str, String)> {
        match self {
            GateDecision::Ungated => None,
            GateDecision::Canary => Some((
                true,
                reasons::CANARY,
                "gated canary: served scale-to-zero and on demand; warm-primary promotion needs \
                 flexinfer.ai/promotion-validation: passed or flexinfer.ai/promotion-evidence"
                    .to_string(),
            )),
            GateDecision::Validated { message, .. } => {
                Some((true, reasons::VALIDATED, message.clone()))
            }
            GateDecision::Blocked { message } => Some((false, reasons::BLOCKED, message.clone())),
        }
    }

    /// Whether the Model must be served as a canary although its spec asks for more.
    pub fn is_blocked(&self) -> bool {
        matches!(self, GateDecision::Blocked { .. })
    }
}

/// Whether the spec asks for warm-primary service: `serverless.minReplicas > 0`, serverless
/// disabled, or `config.warmPolicy: primary`.
pub fn wants_warm_primary(spec: &ModelSpec) -> bool {
    !spec.serverless.enabled
        || spec.serverless.min_replicas > 0
        || spec.config.warm_policy == Some(WarmPolicy::Primary)
}

/// Whether the Model is annotated with the quantized-artifact gate. Only the exact value
/// `quantized-artifact-v1` gates (the admission policy uses the same rule).
pub fn is_gated(model: &Model) -> bool {
    annotation(model, annotations::PROMOTION_GATE) == Some(annotations::PROMOTION_GATE_V1)
}

fn annotation<'a>(model: &'a Model, key: &str) -> Option<&'a str> {
    model
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Whether the Model carries `promotion-validation: passed`, and its non-empty evidence.
fn validation_of(model: &Model) -> (bool, Option<&str>) {
    let passed = annotation(model, annotations::PROMOTION_VALIDATION)
        == Some(annotations::PROMOTION_VALIDATION_PASSED);
    let evidence = annotation(model, annotations::PROMOTION_EVIDENCE)
        .map(str::trim)
        .filter(|e| !e.is_empty());
    (passed, evidence)
}

/// The digest that identifies the artifact a `modelcache://` Model serves: the quantization's
/// `configDigest`, else the published manifest digest; `None` when the cache has neither.
pub fn served_artifact(cache: Option<&ModelCache>) -> Option<String> {
    let st = cache?.status.as_ref()?;
    let config = st
        .quantization
        .as_ref()
        .and_then(|q| q.config_digest.as_deref())
        .map(str::trim)
        .filter(|d| !d.is_empty());
    let manifest = st
        .publish
        .as_ref()
        .and_then(|p| p.oci_digest.as_deref())
        .map(str::trim)
        .filter(|d| !d.is_empty());
    config.or(manifest).map(str::to_string)
}

/// Digests named in an evidence value: `sha256:<64 hex>` or a bare 64-hex token.
fn named_digests(evidence: &str) -> Vec<&str> {
    evidence
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == ':'))
        .filter(|t| {
            let hex = t.strip_prefix("sha256:").unwrap_or(t);
            hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
        })
        .collect()
}

/// Whether `named` (from the evidence) is the digest `served` (either may carry `sha256:`).
fn same_digest(named: &str, served: &str) -> bool {
    let bare = |d: &str| d.strip_prefix("sha256:").unwrap_or(d).to_ascii_lowercase();
    bare(named) == bare(served)
}

/// The gate decision for a Model that would serve the artifact `served` (its digest, when known).
pub fn gate(model: &Model, served: Option<&str>) -> GateDecision {
    if !is_gated(model) {
        return GateDecision::Ungated;
    }
    if !wants_warm_primary(&model.spec) {
        return GateDecision::Canary;
    }
    let (passed, evidence) = validation_of(model);
    if !passed && evidence.is_none() {
        return missing_validation(model);
    }
    let how = validation_how(passed, evidence);
    let recorded = model
        .status
        .as_ref()
        .and_then(|s| s.validated_artifact.as_deref());
    let Some(served) = served else {
        // Nothing to bind to (not a modelcache:// source, or no digest yet): as validated.
        return GateDecision::Validated {
            message: format!("warm-primary promotion validated ({how})"),
            artifact: recorded.map(str::to_string),
        };
    };
    let named = evidence.map(named_digests).unwrap_or_default();
    bound_decision(served, &how, &named, recorded)
}

/// A gated Model that asks for warm-primary service without validation: blocked, with a message
/// that names the missing annotations (and the validation value that is not `passed`, if any).
fn missing_validation(model: &Model) -> GateDecision {
    let validation = annotation(model, annotations::PROMOTION_VALIDATION);
    let validation_note = match validation {
        Some(v) => format!(
            " ({} is {v:?}, not \"passed\")",
            annotations::PROMOTION_VALIDATION
        ),
        None => String::new(),
    };
    GateDecision::Blocked {
        message: format!(
            "gate {}: warm-primary service ({}) needs annotation {}: passed or a non-empty {}; \
             missing{validation_note}. Running as a scale-to-zero canary until validated",
            annotations::PROMOTION_GATE_V1,
            warm_reason(&model.spec),
            annotations::PROMOTION_VALIDATION,
            annotations::PROMOTION_EVIDENCE,
        ),
    }
}

/// How the Model was validated (validation annotation, evidence or both), for the message.
fn validation_how(passed: bool, evidence: Option<&str>) -> String {
    match (passed, evidence) {
        (true, Some(ev)) => format!(
            "{}: passed, {}: {ev}",
            annotations::PROMOTION_VALIDATION,
            annotations::PROMOTION_EVIDENCE
        ),
        (true, None) => format!("{}: passed", annotations::PROMOTION_VALIDATION),
        (false, ev) => format!(
            "by evidence, {}: {}",
            annotations::PROMOTION_EVIDENCE,
            ev.unwrap_or_default()
        ),
    }
}

/// The decision for a validated Model whose served artifact is known (`served`): evidence that
/// names digests (`named`) must name `served`; a validation that names none holds for the
/// artifact it was first accepted for (`recorded`), or for `served` when none is recorded yet.
fn bound_decision(served: &str, how: &str, named: &[&str], recorded: Option<&str>) -> GateDecision {
    let reblock = |why: String| GateDecision::Blocked {
        message: format!(
            "gate {}: {why}; running as a scale-to-zero canary until {} names {served}",
            annotations::PROMOTION_GATE_V1,
            annotations::PROMOTION_EVIDENCE
        ),
    };
    if !named.is_empty() {
        return if named.iter().any(|n| same_digest(n, served)) {
            GateDecision::Validated {
                message: format!("warm-primary promotion validated for artifact {served} ({how})"),
                artifact: Some(served.to_string()),
            }
        } else {
            reblock(format!(
                "the evidence names artifact {} but the served artifact is {served}",
                named.join(", ")
            ))
        };
    }
    match recorded {
        Some(r) if !same_digest(r, served) => reblock(format!(
            "the validation was accepted for artifact {r}; the served artifact changed to {served}"
        )),
        _ => GateDecision::Validated {
            message: format!("warm-primary promotion validated for artifact {served} ({how})"),
            artifact: Some(served.to_string()),
        },
    }
}

/// What `status.validatedArtifact` records after this decision: the artifact a validation was
/// accepted for; kept while the gate is closed again by a different artifact (so the old
/// validation cannot re-open it for the new one); cleared when no validation is left.
pub fn recorded_artifact(model: &Model, decision: &GateDecision) -> Option<String> {
    match decision {
        GateDecision::Validated { artifact, .. } => artifact.clone(),
        GateDecision::Blocked { .. } => {
            let (passed, evidence) = validation_of(model);
            if passed || evidence.is_some() {
                model
                    .status
                    .as_ref()
                    .and_then(|s| s.validated_artifact.clone())
            } else {
                None
            }
        }
        GateDecision::Ungated | GateDecision::Canary => None,
    }
}

/// Which spec fields ask for warm-primary service, for messages.
fn warm_reason(spec: &ModelSpec) -> String {
    let mut why = Vec::new();
    if !spec.serverless.enabled {
        why.push("spec.serverless.enabled=false".to_string());
    }
    if spec.serverless.min_replicas > 0 {
        why.push(format!(
            "spec.serverless.minReplicas={}",
            spec.serverless.min_replicas
        ));
    }
    if spec.config.warm_policy == Some(WarmPolicy::Primary) {
        why.push("spec.config.warmPolicy=primary".to_string());
    }
    why.join(", ")
}

/// The spec a blocked Model is served with: scale-to-zero, on demand, and idle after at most
/// `max_idle` without requests.
pub fn as_canary(spec: &ModelSpec, max_idle: Duration) -> ModelSpec {
    let mut s = spec.clone();
    s.serverless.enabled = true;
    s.serverless.min_replicas = 0;
    s.config.warm_policy = Some(WarmPolicy::Ondemand);
    cap_idle(&mut s, max_idle);
    s
}

/// Cap `serverless.idleTimeout` at `max_idle` (a canary of the gate, blocked or not).
pub fn cap_idle(spec: &mut ModelSpec, max_idle: Duration) {
    if spec.serverless.idle_timeout() > max_idle {
        spec.serverless.idle_timeout = format!("{}s", max_idle.as_secs().max(1));
    }
}

/// The spec the replica policy uses: a blocked Model as its canary; a gated canary with its idle
/// time capped too.
pub fn effective_spec(model: &Model, decision: &GateDecision, max_idle: Duration) -> ModelSpec {
    match decision {
        GateDecision::Blocked { .. } => as_canary(&model.spec, max_idle),
        GateDecision::Canary => {
            let mut s = model.spec.clone();
            cap_idle(&mut s, max_idle);
            s
        }
        _ => model.spec.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn model(annos: &[(&str, &str)], enabled: bool, min: i32, warm: Option<WarmPolicy>) -> Model {
        let mut spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "backend": "vllm", "source": "pvc://c/p"
        }))
        .unwrap_or_else(|e| panic!("spec: {e}"));
        spec.serverless.enabled = enabled;
        spec.serverless.min_replicas = min;
        spec.config.warm_policy = warm;
        let mut m = Model::new("m", spec);
        let a: BTreeMap<String, String> = annos
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        m.metadata.annotations = Some(a);
        m
    }

    const G: (&str, &str) = (annotations::PROMOTION_GATE, annotations::PROMOTION_GATE_V1);
    const PASSED: (&str, &str) = (annotations::PROMOTION_VALIDATION, "passed");
    const FAILED: (&str, &str) = (annotations::PROMOTION_VALIDATION, "failed");
    const EVIDENCE: (&str, &str) = (annotations::PROMOTION_EVIDENCE, "runbook#run-1");
    const EMPTY_EVIDENCE: (&str, &str) = (annotations::PROMOTION_EVIDENCE, "  ");

    #[test]
    fn every_gate_case() {
        use WarmPolicy::*;
        // (annotations, serverless.enabled, minReplicas, warmPolicy, expected reason or None)
        type Case<'a> = (
            Vec<(&'a str, &'a str)>,
            bool,
            i32,
            Option<WarmPolicy>,
            Option<&'a str>,
        );
        let cases: Vec<Case> = vec![
            // ungated: never a condition, whatever the spec asks for
            (vec![], true, 0, None, None),
            (vec![], true, 1, Some(Primary), None),
            (vec![], false, 0, None, None),
            (
                vec![(annotations::PROMOTION_GATE, "something-else")],
                true,
                1,
                None,
                None,
            ),
            // gated canaries
            (vec![G], true, 0, None, Some("Canary")),
            (vec![G], true, 0, Some(Ondemand), Some("Canary")),
            (vec![G, FAILED], true, 0, Some(Ondemand), Some("Canary")),
            // gated warm-primary without evidence: each of the three triggers
            (vec![G], true, 1, None, Some("Blocked")),
            (vec![G], false, 0, None, Some("Blocked")),
            (vec![G], true, 0, Some(Primary), Some("Blocked")),
            (vec![G, FAILED], true, 1, Some(Primary), Some("Blocked")),
            (vec![G, EMPTY_EVIDENCE], true, 1, None, Some("Blocked")),
            // gated warm-primary with validation or evidence
            (vec![G, PASSED], true, 1, Some(Primary), Some("Validated")),
            (vec![G, EVIDENCE], false, 0, None, Some("Validated")),
            (
                vec![G, FAILED, EVIDENCE],
                true,
                0,
                Some(Primary),
                Some("Validated"),
            ),
            (vec![G, PASSED, EVIDENCE], true, 2, None, Some("Validated")),
        ];
        for (i, (annos, enabled, min, warm, want)) in cases.into_iter().enumerate() {
            let m = model(&annos, enabled, min, warm);
            let d = gate(&m, None);
            let got = d.condition().map(|(_, r, _)| r);
            assert_eq!(
                got, want,
                "case {i}: {annos:?} enabled={enabled} min={min} warm={warm:?}"
            );
            if let Some((status, reason, msg)) = d.condition() {
                assert_eq!(status, reason != reasons::BLOCKED, "case {i}");
                if reason == reasons::BLOCKED {
                    assert!(msg.contains(annotations::PROMOTION_VALIDATION), "{msg}");
                    assert!(msg.contains(annotations::PROMOTION_EVIDENCE), "{msg}");
                    assert!(msg.contains("canary"), "{msg}");
                }
            }
        }
    }

    #[test]
    fn blocked_message_names_trigger_and_bad_value() {
        let m = model(&[G, FAILED], true, 1, Some(WarmPolicy::Primary));
        let GateDecision::Blocked { message } = gate(&m, None) else {
            panic!("expected Blocked");
        };
        assert!(
            message.contains("spec.serverless.minReplicas=1"),
            "{message}"
        );
        assert!(
            message.contains("spec.config.warmPolicy=primary"),
            "{message}"
        );
        assert!(message.contains("\"failed\""), "{message}");
    }

    #[test]
    fn canary_spec_scales_to_zero_and_idles_within_the_cap() {
        let mut m = model(&[G], false, 3, Some(WarmPolicy::Primary));
        m.spec.serverless.idle_timeout = "72h".into();
        let c = as_canary(&m.spec, DEFAULT_CANARY_MAX_IDLE);
        assert!(c.serverless.enabled);
        assert_eq!(c.serverless.min_replicas, 0);
        assert!(!wants_warm_primary(&c));
        assert_eq!(c.serverless.idle_timeout(), DEFAULT_CANARY_MAX_IDLE);
        // A gated canary asking for less keeps its own; an ungated Model is never capped.
        let mut short = model(&[G], true, 0, None);
        short.spec.serverless.idle_timeout = "2m".into();
        let e = effective_spec(&short, &gate(&short, None), DEFAULT_CANARY_MAX_IDLE);
        assert_eq!(e.serverless.idle_timeout(), Duration::from_secs(120));
        let mut long = model(&[G], true, 0, None);
        long.spec.serverless.idle_timeout = "1000h".into();
        let e = effective_spec(&long, &gate(&long, None), Duration::from_secs(600));
        assert_eq!(e.serverless.idle_timeout(), Duration::from_secs(600));
        let mut free = model(&[], true, 0, None);
        free.spec.serverless.idle_timeout = "1000h".into();
        let e = effective_spec(&free, &gate(&free, None), DEFAULT_CANARY_MAX_IDLE);
        assert_eq!(e.serverless.idle_timeout, "1000h");
    }

    const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn with_recorded(mut m: Model, recorded: Option<&str>) -> Model {
        m.status = Some(flexinfer_api::ModelStatus {
            validated_artifact: recorded.map(str::to_string),
            ..Default::default()
        });
        m
    }

    #[test]
    fn validation_is_bound_to_the_served_artifact() {
        let bare1 = D1.trim_start_matches("sha256:");
        let ev = |v: &str| (annotations::PROMOTION_EVIDENCE, v.to_string());
        // (annotations, recorded artifact, served artifact, expected reason, recorded after)
        type Case = (
            Vec<(&'static str, String)>,
            Option<&'static str>,
            Option<&'static str>,
            &'static str,
            Option<String>,
        );
        let p = (PASSED.0, PASSED.1.to_string());
        let g = (G.0, G.1.to_string());
        let cases: Vec<Case> = vec![
            // Nothing known about the artifact: as before, nothing recorded.
            (vec![g.clone(), p.clone()], None, None, "Validated", None),
            // passed binds to what is served when first accepted, and keeps it.
            (
                vec![g.clone(), p.clone()],
                None,
                Some(D1),
                "Validated",
                Some(D1.into()),
            ),
            (
                vec![g.clone(), p.clone()],
                Some(D1),
                Some(D1),
                "Validated",
                Some(D1.into()),
            ),
            (
                vec![g.clone(), p.clone()],
                Some(bare1),
                Some(D1),
                "Validated",
                Some(D1.into()),
            ),
            // A new generation closes the gate again.
            (
                vec![g.clone(), p.clone()],
                Some(D1),
                Some(D2),
                "Blocked",
                None,
            ),
            (
                vec![g.clone(), ev("https://ci/run/7")],
                Some(D1),
                Some(D2),
                "Blocked",
                None,
            ),
            // Evidence naming the served digest opens it (bare or prefixed, anywhere in the text).
            (
                vec![g.clone(), p.clone(), ev(&format!("run 8 validated {D2}"))],
                Some(D1),
                Some(D2),
                "Validated",
                Some(D2.into()),
            ),
            (
                vec![g.clone(), ev(&format!("https://ci/run/9#{bare1}"))],
                None,
                Some(D1),
                "Validated",
                Some(D1.into()),
            ),
            // Evidence naming another digest does not.
            (
                vec![g.clone(), p.clone(), ev(D1)],
                None,
                Some(D2),
                "Blocked",
                None,
            ),
            // Not a digest (63 hex digits): treated as plain evidence.
            (
                vec![g.clone(), ev(&D2[1..])],
                None,
                Some(D2),
                "Validated",
                Some(D2.into()),
            ),
        ];
        for (i, (annos, recorded, served, want, after)) in cases.into_iter().enumerate() {
            let refs: Vec<(&str, &str)> = annos.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let m = with_recorded(model(&refs, true, 1, None), recorded);
            let d = gate(&m, served);
            let (_, reason, msg) = d
                .condition()
                .unwrap_or_else(|| panic!("case {i}: no condition"));
            assert_eq!(reason, want, "case {i}: {msg}");
            match &d {
                GateDecision::Validated { artifact, .. } => {
                    assert_eq!(artifact, &after, "case {i}")
                }
                GateDecision::Blocked { message } => {
                    assert!(
                        message.contains(served.unwrap_or_default()),
                        "case {i}: {message}"
                    );
                    assert!(
                        message.contains(annotations::PROMOTION_EVIDENCE),
                        "case {i}: {message}"
                    );
                }
                _ => panic!("case {i}: {d:?}"),
            }
        }
    }
}
