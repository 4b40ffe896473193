//! Planning step 2: specs the API admitted but no engine or configuration can run.

use std::collections::BTreeMap;

use flexinfer_api::contract::{self, env, reasons, JobPhase};
use flexinfer_api::formats;
use flexinfer_api::modelcache::{ModelCache, QuantFormat, QuantizationSpec, StorageStrategy};

use super::jobs;
pub(super) use super::problem::SpecProblem;
use super::types::Observed;

/// Why compressed-tensors' `pack-quantized` layout cannot hold what the spec asks, if it cannot: bit
/// widths other than 4 and 8 (vLLM's kernels for the layout), and act-order across groups (the
/// `compressed-tensors` library no longer reads a column permutation).
fn compressed_tensors_problem(q: &QuantizationSpec) -> Option<String> {
    let bits = q.effective_bits();
    let allowed = formats::info(QuantFormat::CompressedTensors).bits;
    if !allowed.contains(&bits) {
        return Some(format!(
            "spec.quantization.bits {bits}: format COMPRESSED_TENSORS (pack-quantized) takes {} bits",
            allowed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" or ")
        ));
    }
    if q.desc_act {
        return Some(
            "spec.quantization.descAct true: format COMPRESSED_TENSORS (pack-quantized) has no column \
             permutation (the compressed-tensors library no longer reads weight_g_idx); set descAct to \
             false (the group-aware order, actGroupAware, is on by default and keeps the layout)"
                .to_string(),
        );
    }
    None
}

/// Why the AWQ engine cannot make what the spec asks, if it cannot: 4 bits only (AutoAWQ's GEMM layout that
/// vLLM and transformers load), groups of 32, 64 or 128, and no act-order (AWQ has no column permutation).
fn awq_problem(q: &QuantizationSpec) -> Option<String> {
    let bits = q.effective_bits();
    if !formats::info(QuantFormat::Awq).bits.contains(&bits) {
        return Some(format!(
            "spec.quantization.bits {bits}: format AWQ takes 4 bits (the GEMM layout vLLM and transformers load)"
        ));
    }
    if !usize::try_from(q.group_size).is_ok_and(|g| env::AWQ_GROUP_SIZES.contains(&g)) {
        return Some(format!(
            "spec.quantization.groupSize {}: format AWQ takes groups of 32, 64 or 128",
            q.group_size
        ));
    }
    if q.desc_act {
        return Some(
            "spec.quantization.descAct true: format AWQ has no act-order (no column permutation); set descAct \
             to false"
                .to_string(),
        );
    }
    None
}

/// Why a `storageStrategy: NodeLocal` cache cannot run: the fields its CEL rules require, checked again
/// here for an API server that did not run them.
fn node_local_problem(mc: &ModelCache) -> Option<SpecProblem> {
    if mc.spec.storage_strategy != StorageStrategy::NodeLocal {
        return None;
    }
    let invalid = |message: &str| SpecProblem {
        reason: reasons::INVALID_SPEC,
        message: message.to_string(),
        phase: None,
    };
    if mc.spec.publish.as_ref().is_none_or(|p| p.oci_ref.is_none()) {
        return Some(invalid(
            "spec.publish.ociRef is required with storageStrategy NodeLocal: the copies on the nodes are \
             filled from the published OCI artifact",
        ));
    }
    if mc.spec.node_local_selector().is_none_or(BTreeMap::is_empty) {
        return Some(invalid(
            "spec.nodeLocal.nodeSelector is required with storageStrategy NodeLocal when spec.nodeSelector \
             is unset: a copy on every node of the cluster is never chosen by default",
        ));
    }
    None
}

/// The first problem of the spec, in the order: format, storage strategy, modelPath, pod metadata,
/// claim conflict.
pub(super) fn spec_problem(mc: &ModelCache, observed: &Observed) -> Option<SpecProblem> {
    if let Some(q) = &mc.spec.quantization {
        let info = formats::info(q.format);
        if !info.implemented {
            let message = format!(
                "spec.quantization.format {} has no quantization engine in this FlexInfer version (supported: {}); \
                 change the format or remove spec.quantization",
                info.name,
                formats::implemented_names()
            );
            return Some(SpecProblem {
                reason: reasons::UNSUPPORTED_FORMAT,
                message,
                phase: Some(JobPhase::Quantize),
            });
        }
        let layout_problem = match q.format {
            QuantFormat::CompressedTensors => compressed_tensors_problem(q),
            QuantFormat::Awq => awq_problem(q),
            _ => None,
        };
        if let Some(message) = layout_problem {
            return Some(SpecProblem {
                reason: reasons::UNSUPPORTED_FORMAT,
                message,
                phase: Some(JobPhase::Quantize),
            });
        }
        if q.format == QuantFormat::Gguf {
            let t = q.effective_gguf_type();
            if !env::GGUF_TYPES.iter().any(|g| g.eq_ignore_ascii_case(t)) {
                return Some(SpecProblem {
                    reason: reasons::UNSUPPORTED_FORMAT,
                    message: format!(
                        "spec.quantization.ggufType {t} is not a GGUF type this FlexInfer version writes \
                         (one of {})",
                        env::GGUF_TYPES.join(", ")
                    ),
                    phase: Some(JobPhase::Quantize),
                });
            }
        }
    }
    if let Some(problem) = node_local_problem(mc) {
        return Some(problem);
    }
    let invalid = |message: String| SpecProblem {
        reason: reasons::INVALID_SPEC,
        message,
        phase: None,
    };
    if let Err(e) = contract::check_relative_path(&jobs::model_dir(mc)) {
        return Some(invalid(format!("spec.modelPath: {e}")));
    }
    if let Some(msg) = jobs::invalid_pod_metadata_annotation(mc) {
        return Some(invalid(msg));
    }
    let my_dir = jobs::model_dir(mc);
    let peer = observed
        .claim_peers
        .iter()
        .find(|p| p.older && p.model_dir == my_dir)?;
    let message = format!(
        "ModelCache {} already uses claim {} with modelPath {my_dir:?}: the two would overwrite each \
         other's files; set a different spec.modelPath",
        peer.name,
        jobs::claim_name(mc)
    );
    Some(SpecProblem {
        reason: reasons::CLAIM_CONFLICT,
        message,
        phase: None,
    })
}
