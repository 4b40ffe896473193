//! The quantized-artifact promotion gate (docs/user/promotion-gate.md).
//!
//! Pure: takes a Model, returns the decision. The reconciler turns the decision into the
//! `PromotionGate` condition and, when blocked, serves the Model as a scale-to-zero canary.

use flexinfer_api::contract::annotations;
use flexinfer_api::model::{ModelSpec, WarmPolicy};
use flexinfer_api::Model;

/// Outcome of the promotion gate for one Model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateDecision {
    /// Not annotated with the gate: no `PromotionGate` condition (a stale one is removed).
    Ungated,
    /// Gated and asks only for scale-to-zero, on-demand service: allowed (`True`, `Canary`).
    Canary,
    /// Gated, asks for warm-primary service and carries validation: allowed (`True`, `Validated`).
    Validated { message: String },
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
            GateDecision::Validated { message } => {
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

/// The gate decision for a Model.
pub fn gate(model: &Model) -> GateDecision {
    if !is_gated(model) {
        return GateDecision::Ungated;
    }
    if !wants_warm_primary(&model.spec) {
        return GateDecision::Canary;
    }
    let validation = annotation(model, annotations::PROMOTION_VALIDATION);
    let evidence = annotation(model, annotations::PROMOTION_EVIDENCE)
        .map(str::trim)
        .filter(|e| !e.is_empty());
    let passed = validation == Some(annotations::PROMOTION_VALIDATION_PASSED);
    match (passed, evidence) {
        (true, Some(ev)) => GateDecision::Validated {
            message: format!(
                "warm-primary promotion validated ({}: passed, {}: {ev})",
                annotations::PROMOTION_VALIDATION,
                annotations::PROMOTION_EVIDENCE
            ),
        },
        (true, None) => GateDecision::Validated {
            message: format!(
                "warm-primary promotion validated ({}: passed)",
                annotations::PROMOTION_VALIDATION
            ),
        },
        (false, Some(ev)) => GateDecision::Validated {
            message: format!(
                "warm-primary promotion validated by evidence ({}: {ev})",
                annotations::PROMOTION_EVIDENCE
            ),
        },
        (false, None) => {
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

/// The spec a blocked Model is served with: scale-to-zero, on demand.
pub fn as_canary(spec: &ModelSpec) -> ModelSpec {
    let mut s = spec.clone();
    s.serverless.enabled = true;
    s.serverless.min_replicas = 0;
    s.config.warm_policy = Some(WarmPolicy::Ondemand);
    s
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
            let d = gate(&m);
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
        let GateDecision::Blocked { message } = gate(&m) else {
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
    fn canary_spec_scales_to_zero() {
        let m = model(&[G], false, 3, Some(WarmPolicy::Primary));
        let c = as_canary(&m.spec);
        assert!(c.serverless.enabled);
        assert_eq!(c.serverless.min_replicas, 0);
        assert!(!wants_warm_primary(&c));
    }
}
