//! Annotation keys on FlexInfer objects, their pipeline Jobs and the serving pods.

/// `"true"`: re-run quantization (and what follows). Removed once acted on.
pub const REQUANTIZE: &str = "flexinfer.ai/requantize";
/// `"true"`: re-run abliteration (and what follows). Removed once acted on.
pub const REABLITERATE: &str = "flexinfer.ai/reabliterate";
/// `"true"`: re-download the source (and re-run everything). Removed once acted on.
pub const REDOWNLOAD: &str = "flexinfer.ai/redownload";
/// `"true"`: replace a running quantize Job whose image drifted, even outside the grace window.
pub const FORCE_IMAGE_UPDATE: &str = "flexinfer.ai/force-image-update";
/// `"true"`: clear the retry state of a Failed cache and retry the failed phase. Removed once acted on.
pub const RESET_RETRIES: &str = "flexinfer.ai/reset-retries";
/// Model: opt into the quantized-artifact promotion gate (`quantized-artifact-v1`).
pub const PROMOTION_GATE: &str = "flexinfer.ai/promotion-gate";
/// Value of [`PROMOTION_GATE`] for the quantized-artifact promotion gate (validation evidence before warm-primary service).
pub const PROMOTION_GATE_V1: &str = "quantized-artifact-v1";
/// Model: `passed` once the artifact passed validation.
pub const PROMOTION_VALIDATION: &str = "flexinfer.ai/promotion-validation";
/// Model: reference to validation evidence (artifact or runbook run).
pub const PROMOTION_EVIDENCE: &str = "flexinfer.ai/promotion-evidence";
/// Model: informational promotion state (e.g. `canary-reference-only`).
pub const PROMOTION_STATE: &str = "flexinfer.ai/promotion-state";
/// Pod template annotation: the artifact path a serving Deployment was rendered for.
pub const SERVED_PATH: &str = "flexinfer.ai/served-path";
/// Pod template annotation: `gpu.priority` of the Model (shared-group arbitration).
pub const GPU_PRIORITY: &str = "flexinfer.ai/gpu-priority";
/// Pod template annotation: `gpu.shared` group of the Model.
pub const GPU_SHARED_GROUP: &str = "flexinfer.ai/gpu-shared-group";
/// Value of [`PROMOTION_VALIDATION`] that counts as validated.
pub const PROMOTION_VALIDATION_PASSED: &str = "passed";
/// On a pipeline Job: the phase spec hash (spec + image) it was created for.
pub const JOB_SPEC_HASH: &str = "flexinfer.ai/spec-hash";
/// On a node-copy Job (`storageStrategy: NodeLocal`): the node it fills or cleans.
pub const NODE_COPY_NODE: &str = "flexinfer.ai/node-copy-node";
/// On a node-copy Job: the digest it fills, or the one its cleanup keeps (empty: none).
pub const NODE_COPY_DIGEST: &str = "flexinfer.ai/node-copy-digest";

// Extra pod labels/annotations for pipeline Jobs, set as ModelCache annotations whose values are
// JSON objects of strings (e.g. cost-allocation labels, service-mesh opt-out annotations).
/// JSON object: labels added to the pods of every pipeline Job of the cache.
pub const JOB_POD_LABELS: &str = "flexinfer.ai/job-pod-labels";
/// JSON object: annotations added to the pods of every pipeline Job of the cache.
pub const JOB_POD_ANNOTATIONS: &str = "flexinfer.ai/job-pod-annotations";
/// `flexinfer.ai/<phase>-pod-labels` (phase = `download`, `abliterate`, `quantize`, `publish`):
/// labels for the pods of that phase only; they win over [`JOB_POD_LABELS`].
pub fn phase_pod_labels(phase: &str) -> String {
    format!("flexinfer.ai/{phase}-pod-labels")
}
/// `flexinfer.ai/<phase>-pod-annotations`: annotations for the pods of that phase only.
pub fn phase_pod_annotations(phase: &str) -> String {
    format!("flexinfer.ai/{phase}-pod-annotations")
}
