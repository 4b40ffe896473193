//! The AWQ recommendation (`--format AWQ`): 4-bit groups of 128 with zero points in AutoAWQ's GEMM
//! layout, served by vLLM (Marlin on NVIDIA, the ROCm int4 kernels on gfx1100 and the other ROCm cards).
//! Refused, naming why, where the engine cannot make it (mixture of experts, linear attention, Gemma's
//! `1 + w` norms) or vLLM cannot serve it (gfx906).

use serde::Serialize;

use super::{artifact_bytes, host_memory, size_classes, time_estimate, CalibrationRec, GpuTarget};
use crate::footprint::Footprint;

/// The only bit width of the GEMM layout, and the group size AutoAWQ and vLLM default to.
const BITS: i32 = 4;
const GROUP_SIZE: i32 = 128;
/// AutoAWQ's calibration defaults: the scale search measures on 4,096 strided tokens of a module group and
/// the clipping search on 512, so more calibration only lengthens the CPU forward.
const MAX_SAMPLES: i32 = 128;
const MAX_SEQ_LEN: i32 = 512;

/// Why AWQ is not recommended for this model or card.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AwqRefusal {
    #[error("--format AWQ: {arch} is served by llama.cpp only (vLLM has no {arch} kernels); use --format GGUF")]
    NoVllm { arch: String },
    #[error("--format AWQ: the AWQ engine does not fold scales across {what} ({model}); use --format GPTQ")]
    Family { what: &'static str, model: String },
}

/// What `--apply` sets for AWQ, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AwqRecommendation {
    pub format: &'static str,
    pub bits: i32,
    pub group_size: i32,
    #[serde(rename = "useGPU")]
    pub use_gpu: bool,
    #[serde(rename = "maxMemoryGB")]
    pub max_memory_gb: i32,
    pub timeout_seconds: i64,
    pub max_seq_len: i32,
    pub max_samples: i32,
    /// Estimated artifact size in GB (10^9 bytes).
    pub estimated_artifact_gb: f64,
    /// Whether the artifact is expected to fit the card's weight budget; `None` without a known GPU.
    pub fits: Option<bool>,
    pub reasons: Vec<String>,
}

impl AwqRecommendation {
    /// The JSON merge patch for `spec.quantization`: AWQ's fields; GPTQ's and GGUF's that do not apply
    /// removed (`descAct` false, the one value AWQ admits).
    pub fn spec_patch(&self) -> serde_json::Value {
        serde_json::json!({"spec": {"quantization": {
            "format": self.format,
            "bits": self.bits,
            "groupSize": self.group_size,
            "descAct": false,
            "sym": null,
            "dynamicExclusion": null,
            "gpuMemoryFraction": null,
            "useGPU": self.use_gpu,
            "maxMemoryGB": self.max_memory_gb,
            "timeoutSeconds": self.timeout_seconds,
            "ggufType": null,
            "calibration": {
                "maxSeqLen": self.max_seq_len,
                "maxSamples": self.max_samples,
                "nParallelCalibSamples": null,
            },
        }}})
    }
}

/// The family the engine cannot fold scales across, if any (the engine's own check, before any output).
fn unfoldable(model: &Footprint) -> Option<&'static str> {
    if model.moe {
        Some("mixture-of-experts layers")
    } else if model.hybrid {
        Some("linear-attention layers")
    } else if model
        .model_type
        .as_deref()
        .is_some_and(|t| t.to_ascii_lowercase().starts_with("gemma"))
    {
        Some("Gemma's (1 + w) norms")
    } else {
        None
    }
}

/// The AWQ recommendation for a model on a GPU, or why there is none.
pub fn recommend(model: &Footprint, gpu: &GpuTarget) -> Result<AwqRecommendation, AwqRefusal> {
    let arch = gpu.arch.as_deref().unwrap_or("");
    if super::gguf::default_for(gpu) {
        return Err(AwqRefusal::NoVllm { arch: arch.into() });
    }
    if let Some(what) = unfoldable(model) {
        return Err(AwqRefusal::Family {
            what,
            model: model
                .model_type
                .clone()
                .unwrap_or_else(|| model.source.clone()),
        });
    }
    let b = model.params / 1e9;
    let vram_gb = gpu.vram_mb.map(|m| m as f64 / 1024.0);
    let mut reasons = super::describe(model, gpu, b, vram_gb);
    reasons.push(if arch == "gfx1100" {
        "format AWQ (asked for): vLLM serves it on gfx1100 through its ROCm int4 kernels, not Marlin; \
         GPTQ sym=true descAct=false is the faster decode there (the HIP ExLlama kernels)"
            .into()
    } else {
        "format AWQ (asked for): AutoAWQ's GEMM layout (4-bit groups with zero points) that vLLM's awq method \
         and transformers load"
            .into()
    });
    let budget = vram_gb.map(|v| v * 1.073_741_824 * 0.85);
    let size = artifact_bytes(model.params, BITS, GROUP_SIZE, false) / 1e9;
    let fits = budget.map(|bud| size <= bud);
    reasons.push(match (budget, fits) {
        (Some(bud), Some(false)) => format!(
            "WARNING: the 4-bit artifact (~{size:.1} GB) exceeds {bud:.1} GB of weight budget (85% of VRAM) and AWQ has \
             no smaller width; use --format GPTQ (3 bits) or GGUF"
        ),
        (Some(bud), _) => format!(
            "bits 4, groupSize 128: ~{size:.1} GB artifact within {bud:.1} GB of weight budget (85% of VRAM)"
        ),
        (None, _) => format!("bits 4, groupSize 128: ~{size:.1} GB artifact"),
    });
    reasons.push(format!(
        "calibration {MAX_SAMPLES} @ {MAX_SEQ_LEN}: AutoAWQ's defaults; the scale search measures on 4,096 tokens \
         per module group and the clipping search on 512, so more only lengthens the forward"
    ));
    reasons
        .push("useGPU false: the AWQ engine runs on the CPU (the Job requests no GPU)".to_string());
    let (size_class, _) = size_classes(b, vram_gb, &mut Vec::new());
    let max_memory_gb = host_memory(size_class, b, &mut reasons);
    let full = CalibrationRec {
        max_seq_len: 4096,
        max_samples: 256,
        n_parallel_calib_samples: None,
    };
    let (_, timeout_seconds) = time_estimate(b, false, &full, &mut Vec::new());
    reasons.push(format!(
        "timeoutSeconds {timeout_seconds}: no AWQ run of this size was measured; the GPTQ estimate at full \
         calibration, tripled"
    ));
    Ok(AwqRecommendation {
        format: "AWQ",
        bits: BITS,
        group_size: GROUP_SIZE,
        use_gpu: false,
        max_memory_gb,
        timeout_seconds,
        max_seq_len: MAX_SEQ_LEN,
        max_samples: MAX_SAMPLES,
        estimated_artifact_gb: (size * 10.0).round() / 10.0,
        fits,
        reasons,
    })
}
