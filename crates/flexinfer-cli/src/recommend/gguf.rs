//! The GGUF recommendation: the llama.cpp type that fits the card, for targets vLLM does not serve (gfx906).

use serde::Serialize;

use super::GpuTarget;
use crate::footprint::Footprint;

/// The GGUF types considered, best first, with the bits per weight of their base ggml type (the block
/// layouts: Q6_K 6.5625, Q5_K 5.5, Q4_K 4.5, Q3_K 3.4375, Q2_K 2.625).
const TYPES: &[(&str, f64)] = &[
    ("Q6_K", 6.5625),
    ("Q5_K_M", 5.5),
    ("Q4_K_M", 4.5),
    ("Q3_K_M", 3.4375),
    ("Q2_K", 2.625),
];

/// The default type (the guide's): chosen whenever it fits.
pub const DEFAULT_TYPE: &str = "Q4_K_M";

/// Share of the weights a preset keeps at a higher type than its base one (attn_v, half of ffn_down, the
/// output matrix): the estimate adds 15 % to the base type's size.
const MIX_MARGIN: f64 = 1.15;

/// Whether `recommend` picks GGUF by default for this target: the cards vLLM does not support (gfx906).
pub fn default_for(gpu: &GpuTarget) -> bool {
    gpu.arch.as_deref() == Some("gfx906")
}

/// What `--apply` sets, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GgufRecommendation {
    pub format: &'static str,
    pub gguf_type: &'static str,
    #[serde(rename = "useGPU")]
    pub use_gpu: bool,
    #[serde(rename = "maxMemoryGB")]
    pub max_memory_gb: i32,
    /// Estimated file size in GB (10^9 bytes).
    pub estimated_artifact_gb: f64,
    /// Whether the file is expected to fit the card's weight budget; `None` without a known GPU.
    pub fits: Option<bool>,
    pub reasons: Vec<String>,
}

impl GgufRecommendation {
    /// The JSON merge patch for `spec.quantization`: GGUF and its type; the GPTQ-only fields removed.
    pub fn spec_patch(&self) -> serde_json::Value {
        serde_json::json!({"spec": {"quantization": {
            "format": self.format,
            "ggufType": self.gguf_type,
            "useGPU": self.use_gpu,
            "maxMemoryGB": self.max_memory_gb,
            "bits": null,
            "groupSize": null,
            "sym": null,
            "descAct": null,
            "dynamicExclusion": null,
            "calibration": null,
            "actGroupAware": null,
            "clipSearch": null,
            "refineScales": null,
            "dampPercent": null,
        }}})
    }
}

fn size_gb(params: f64, bpw: f64) -> f64 {
    params * bpw * MIX_MARGIN / 8.0 / 1e9
}

/// The GGUF recommendation for a model on a GPU.
pub fn recommend(model: &Footprint, gpu: &GpuTarget) -> GgufRecommendation {
    let b = model.params / 1e9;
    let mut reasons = vec![format!("model: {b:.1}B parameters ({})", model.source)];
    if default_for(gpu) {
        reasons.push(
            "format GGUF: vLLM does not support gfx906; llama.cpp (backend llamacpp) serves GGUF there with the \
             llama.cpp ROCm or Vulkan image"
                .into(),
        );
    } else {
        reasons.push(
            "format GGUF (--format GGUF): served by llama.cpp (backend llamacpp) or Ollama".into(),
        );
    }
    let budget = gpu
        .vram_mb
        .map(|m| m as f64 / 1024.0 * 1.073_741_824 * 0.85);
    let default_size = size_gb(model.params, 4.5);
    let (gguf_type, size, fits) = match budget {
        None => {
            reasons.push("no target GPU known: the default type, fit not checked".into());
            (DEFAULT_TYPE, default_size, None)
        }
        Some(bud) if default_size <= bud => {
            reasons.push(format!(
                "ggufType {DEFAULT_TYPE}: ~{default_size:.1} GB within {bud:.1} GB of weight budget (85% of VRAM)"
            ));
            (DEFAULT_TYPE, default_size, Some(true))
        }
        Some(bud) => {
            let smaller = TYPES
                .iter()
                .skip_while(|(t, _)| *t != DEFAULT_TYPE)
                .skip(1)
                .map(|(t, bpw)| (*t, size_gb(model.params, *bpw)))
                .find(|(_, s)| *s <= bud);
            match smaller {
                Some((t, s)) => {
                    reasons.push(format!(
                        "ggufType {t}: {DEFAULT_TYPE} (~{default_size:.1} GB) does not fit {bud:.1} GB of weight \
                         budget; {t} (~{s:.1} GB) does"
                    ));
                    (t, s, Some(true))
                }
                None => {
                    let q2 = size_gb(model.params, 2.625);
                    reasons.push(format!(
                        "WARNING: even Q2_K (~{q2:.1} GB) exceeds this GPU's {bud:.1} GB weight budget; llama.cpp \
                         can keep some layers on the CPU (fewer --n-gpu-layers), or use a larger GPU"
                    ));
                    ("Q2_K", q2, Some(false))
                }
            }
        }
    };
    reasons.push(format!(
        "size estimate: {gguf_type}'s base type bits per weight plus {:.0}% for the tensors its preset keeps at a \
         higher type",
        (MIX_MARGIN - 1.0) * 100.0
    ));
    reasons.push(
        "useGPU false: the GGUF engine runs on the CPU (no calibration, no GPU needed to quantize)"
            .into(),
    );
    // Host memory: room for the whole BF16 source (a conservative bound for the Job's limit).
    let gb = (b * 2.2).ceil();
    let max_memory_gb = if gb.is_finite() {
        gb.clamp(8.0, 1024.0) as i32
    } else {
        1024
    };
    reasons.push(format!(
        "maxMemoryGB {max_memory_gb}: the BF16 model's size plus 10%, at least 8"
    ));
    GgufRecommendation {
        format: "GGUF",
        gguf_type,
        use_gpu: false,
        max_memory_gb,
        estimated_artifact_gb: (size * 10.0).round() / 10.0,
        fits,
        reasons,
    }
}
