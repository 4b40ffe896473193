//! `flexinfer quantize recommend`: pick quantization settings that fit the model and the target
//! GPU. Pure code; the command gathers the inputs (footprint, GPUProfile) and applies the result.
//!
//! Baseline: the measured memory requirements and calibration recipes for 24 GB cards (8B/14B/27B on
//! 24 GB cards). A smaller card moves a model one size class up (tighter calibration).

use serde::Serialize;

use crate::footprint::Footprint;

pub mod awq;
pub mod gguf;

/// The GPU the artifact is built on and served from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuTarget {
    pub arch: Option<String>,
    /// `amd` or `nvidia`.
    pub vendor: Option<String>,
    pub vram_mb: Option<i64>,
    /// Where this came from (GPUProfile name, nodeSelector, flag).
    pub source: String,
}

/// Built-in facts for the architectures named in the spec, used when no GPUProfile is found.
pub fn known_arch(arch: &str) -> Option<(&'static str, i64)> {
    match arch {
        "gfx1100" => Some(("amd", 24576)),
        "gfx906" => Some(("amd", 16384)),
        "gfx90a" => Some(("amd", 65536)),
        "gfx942" => Some(("amd", 196608)),
        "sm_86" => Some(("nvidia", 24576)),
        "sm_89" => Some(("nvidia", 24576)),
        "sm_90" => Some(("nvidia", 81920)),
        _ => None,
    }
}

/// Recommended calibration.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CalibrationRec {
    pub max_seq_len: i32,
    pub max_samples: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_parallel_calib_samples: Option<i32>,
}

/// The recommendation: exactly the `spec.quantization` fields it sets, plus reasons.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Recommendation {
    pub format: &'static str,
    pub bits: i32,
    pub group_size: i32,
    pub sym: bool,
    pub desc_act: bool,
    pub dynamic_exclusion: &'static str,
    pub gpu_memory_fraction: String,
    #[serde(rename = "useGPU")]
    pub use_gpu: bool,
    #[serde(rename = "maxMemoryGB")]
    pub max_memory_gb: i32,
    pub timeout_seconds: i64,
    pub calibration: CalibrationRec,
    /// Estimated artifact size in GB (10^9 bytes).
    pub estimated_artifact_gb: f64,
    /// Estimated quantization wall time in minutes.
    pub estimated_minutes: f64,
    /// Whether the artifact is expected to fit in the target GPU's VRAM with room for KV cache;
    /// `None` without a known GPU.
    pub fits: Option<bool>,
    pub reasons: Vec<String>,
}

impl Recommendation {
    /// The JSON merge patch for `spec.quantization`.
    pub fn spec_patch(&self) -> serde_json::Value {
        let cal = serde_json::json!({
            "maxSeqLen": self.calibration.max_seq_len,
            "maxSamples": self.calibration.max_samples,
            // null removes a previously set value (merge patch) so the engine chooses.
            "nParallelCalibSamples": self.calibration.n_parallel_calib_samples,
        });
        serde_json::json!({"spec": {"quantization": {
            "format": self.format,
            "bits": self.bits,
            "groupSize": self.group_size,
            "sym": self.sym,
            "descAct": self.desc_act,
            "dynamicExclusion": self.dynamic_exclusion,
            "gpuMemoryFraction": self.gpu_memory_fraction,
            "useGPU": self.use_gpu,
            "maxMemoryGB": self.max_memory_gb,
            "timeoutSeconds": self.timeout_seconds,
            "ggufType": null,
            "calibration": cal,
        }}})
    }
}

/// Size class of the baseline tables (8B / 14B / 27B+ on a 24 GB card).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    /// ~8B: defaults.
    Small,
    /// ~14B: nParallel 32, maxMemoryGB 56.
    Medium,
    /// 27B+: 128 @ 2048, nParallel 16, gpuMemoryFraction 0.80, 96 GiB.
    Large,
}

/// Artifact size (bytes) of a GPTQ model: quantized linears at `bits` plus per-group fp16 scales
/// and packed zeros; hybrid models with `auto` keep attention in 16 bit (measured: ~1.95x vs ~3.5x).
fn artifact_bytes(params: f64, bits: i32, group: i32, hybrid_auto: bool) -> f64 {
    let bf16 = params * 2.0;
    if hybrid_auto {
        // measured: auto ≈ 1.95x compression at 4 bit; scale the quantized share with bits.
        return bf16 / 1.95 * (0.55 + 0.45 * bits as f64 / 4.0);
    }
    let g = if group <= 0 { 4096.0 } else { group as f64 };
    let bits_per_weight = bits as f64 + (16.0 + bits as f64) / g;
    // ~5% of a dense model's weights (embeddings, norms, lm_head) stay 16-bit.
    params * 0.95 * bits_per_weight / 8.0 + params * 0.05 * 2.0
}

/// The recommendation for a model on a GPU.
pub fn recommend(model: &Footprint, gpu: &GpuTarget) -> Recommendation {
    let b = model.params / 1e9;
    let vram_gb = gpu.vram_mb.map(|m| m as f64 / 1024.0);
    let arch = gpu.arch.as_deref().unwrap_or("");
    let mut reasons = describe(model, gpu, b, vram_gb);

    // Format: GPTQ, the fast serving path on ROCm; AWQ and GGUF only when asked for (`--format`).
    let format = "GPTQ";
    reasons.push(format_reason(arch));

    let (size_class, class) = size_classes(b, vram_gb, &mut reasons);
    let fit = fit_bits(model, vram_gb, &mut reasons);
    let (mut cal, frac) = calibration_recipe(class, &mut reasons);
    let max_mem = host_memory(size_class, b, &mut reasons);
    if model.moe {
        cal.max_samples = cal.max_samples.max(512);
        reasons.push(
            "maxSamples 512: mixture of experts needs enough tokens routed to every expert".into(),
        );
    }
    let (minutes, timeout) = time_estimate(b, model.moe, &cal, &mut reasons);

    Recommendation {
        format,
        bits: fit.bits,
        group_size: fit.group_size,
        sym: true,
        desc_act: false,
        dynamic_exclusion: fit.exclusion,
        gpu_memory_fraction: frac.to_string(),
        use_gpu: gpu.vram_mb.is_some() || gpu.arch.is_some(),
        max_memory_gb: max_mem,
        timeout_seconds: timeout,
        calibration: cal,
        estimated_artifact_gb: (fit.size * 10.0).round() / 10.0,
        estimated_minutes: minutes.round(),
        fits: fit.fits,
        reasons,
    }
}

/// The first reasons: what the model and the target GPU are.
fn describe(model: &Footprint, gpu: &GpuTarget, b: f64, vram_gb: Option<f64>) -> Vec<String> {
    let mut reasons = vec![format!(
        "model: {:.1}B parameters ({}){}{}",
        b,
        model.source,
        if model.moe {
            ", mixture of experts"
        } else {
            ""
        },
        if model.hybrid {
            ", hybrid linear-attention/attention"
        } else {
            ""
        }
    )];
    match (&gpu.arch, vram_gb) {
        (Some(a), Some(v)) => reasons.push(format!("target GPU: {a}, {v:.0} GB VRAM ({})", gpu.source)),
        (None, Some(v)) => reasons.push(format!("target GPU: {v:.0} GB VRAM ({})", gpu.source)),
        (Some(a), None) => reasons.push(format!("target GPU: {a}, VRAM unknown ({})", gpu.source)),
        (None, None) => reasons.push(
            "no target GPU known (no --gpu-profile, no flexinfer.ai/gpu.arch nodeSelector): fit not checked"
                .into(),
        ),
    }
    reasons
}

fn format_reason(arch: &str) -> String {
    if arch == "gfx1100" {
        "format GPTQ sym=true descAct=false: on gfx1100 this routes through the HIP ExLlama kernels \
         (~7x AWQ decode); AWQ (--format AWQ) is the other format vLLM serves there; GGUF would leave vLLM \
         for llama.cpp"
            .into()
    } else {
        "format GPTQ: served by vLLM (Marlin/ExLlama need sym=true); --format AWQ or GGUF for those formats"
            .into()
    }
}

/// The model's size class, and the class whose calibration is used: the baseline tables are for 24 GB
/// cards; a smaller card moves one class up.
fn size_classes(b: f64, vram_gb: Option<f64>, reasons: &mut Vec<String>) -> (Class, Class) {
    let size_class = if b <= 10.0 {
        Class::Small
    } else if b <= 20.0 {
        Class::Medium
    } else {
        Class::Large
    };
    let mut class = size_class;
    if let Some(v) = vram_gb {
        if v < 20.0 && class < Class::Large {
            class = if class == Class::Small {
                Class::Medium
            } else {
                Class::Large
            };
            reasons.push(format!(
                "{v:.0} GB VRAM is below the 24 GB the calibration recipes are made for: using the next size class's calibration"
            ));
        }
    }
    (size_class, class)
}

/// Bits, group size and exclusion, and the artifact size they give (GB).
struct Fit {
    bits: i32,
    group_size: i32,
    exclusion: &'static str,
    size: f64,
    fits: Option<bool>,
}

/// Bits and exclusion: 4-bit g128 unless the artifact does not fit next to a KV cache.
fn fit_bits(model: &Footprint, vram_gb: Option<f64>, reasons: &mut Vec<String>) -> Fit {
    let budget = vram_gb.map(|v| v * 1.073_741_824 * 0.85); // GB (10^9) usable for weights
    let group_size = 128;
    let mut bits = 4;
    let mut exclusion = "auto";
    let mut size = artifact_bytes(model.params, bits, group_size, model.hybrid) / 1e9;
    let mut fits = budget.map(|bud| size <= bud);
    if model.hybrid && fits == Some(false) {
        let none = artifact_bytes(model.params, bits, group_size, false) / 1e9;
        reasons.push(format!(
            "dynamicExclusion none: auto keeps attention in 16 bit (~{size:.1} GB), which does not fit; none gives ~{none:.1} GB"
        ));
        exclusion = "none";
        size = none;
        fits = budget.map(|bud| size <= bud);
    } else if model.hybrid {
        reasons.push(format!(
            "dynamicExclusion auto: keeps attention/shared-expert modules in 16 bit and still fits (~{size:.1} GB)"
        ));
    } else {
        reasons.push(
            "dynamicExclusion auto: dense architecture, every decoder linear is quantized".into(),
        );
    }
    if fits == Some(false) {
        let three = artifact_bytes(model.params, 3, group_size, false) / 1e9;
        if budget.is_some_and(|bud| three <= bud) {
            reasons.push(format!(
                "bits 3: the 4-bit artifact (~{size:.1} GB) does not fit; 3-bit ~{three:.1} GB does (runs on the gptq kernel, not Marlin)"
            ));
            bits = 3;
            exclusion = "none";
            size = three;
            fits = Some(true);
        } else {
            reasons.push(format!(
                "WARNING: even a 3-bit artifact (~{three:.1} GB) exceeds this GPU; use a larger GPU or tensor parallelism"
            ));
        }
    } else {
        reasons.push(format!(
            "bits {bits}, groupSize {group_size}: ~{size:.1} GB artifact{}",
            match budget {
                Some(bud) => format!(" within {bud:.1} GB of weight budget (85% of VRAM)"),
                None => String::new(),
            }
        ));
    }
    Fit {
        bits,
        group_size,
        exclusion,
        size,
        fits,
    }
}

/// Calibration and the GPU memory fraction from the baseline recipes.
fn calibration_recipe(class: Class, reasons: &mut Vec<String>) -> (CalibrationRec, &'static str) {
    let (cal, _, frac) = match class {
        Class::Small => (
            CalibrationRec {
                max_seq_len: 4096,
                max_samples: 256,
                n_parallel_calib_samples: None,
            },
            32,
            "0.80",
        ),
        Class::Medium => (
            CalibrationRec {
                max_seq_len: 4096,
                max_samples: 256,
                n_parallel_calib_samples: Some(32),
            },
            56,
            "0.80",
        ),
        Class::Large => (
            CalibrationRec {
                max_seq_len: 2048,
                max_samples: 128,
                n_parallel_calib_samples: Some(16),
            },
            96,
            "0.80",
        ),
    };
    reasons.push(match class {
        Class::Small => "calibration defaults (256 @ 4096): the 8B recipe for a 24 GB card".to_string(),
        Class::Medium => "calibration 256 @ 4096 with nParallelCalibSamples 32: the 14B-on-24GB recipe".to_string(),
        Class::Large => "calibration 128 @ 2048 with nParallelCalibSamples 16, gpuMemoryFraction 0.80: the 27B+ single-GPU recipe".to_string(),
    });
    (cal, frac)
}

/// Host memory follows the model size (8B 32Gi, 14B 56, 27B 96), and beyond the table about
/// 3.5 GB per billion parameters.
fn host_memory(size_class: Class, b: f64, reasons: &mut Vec<String>) -> i32 {
    let mut max_mem = match size_class {
        Class::Small => 32,
        Class::Medium => 56,
        Class::Large => 96,
    };
    reasons.push(format!(
        "maxMemoryGB {max_mem}: the host-memory recipe for this model size"
    ));
    let scaled = ((b * 3.5 / 8.0).ceil() * 8.0) as i32;
    if scaled > max_mem {
        max_mem = scaled.min(1024);
        reasons.push(format!(
            "maxMemoryGB {max_mem}: scaled with the model size beyond the 27B row"
        ));
    }
    max_mem
}

/// Estimated minutes and the timeout: an 8B takes ≈ 30 min, a 14B ≈ 73 min at full calibration; fewer
/// tokens shorten calibration.
fn time_estimate(b: f64, moe: bool, cal: &CalibrationRec, reasons: &mut Vec<String>) -> (f64, i64) {
    let tokens = (cal.max_samples as f64 * cal.max_seq_len as f64) / (256.0 * 4096.0);
    let mut minutes = 30.0 * (b / 8.0).max(0.05).powf(1.6) * (0.5 + 0.5 * tokens.min(2.0));
    if moe {
        minutes *= 2.0;
    }
    // Whole hours, 1 to 48, computed in floating point so that an absurd estimate (a hub's or a
    // config's size) cannot overflow the integer conversion.
    let hours = (minutes * 3.0 / 60.0).ceil();
    let hours = if hours.is_finite() {
        hours.clamp(1.0, 48.0)
    } else {
        48.0
    };
    let timeout = hours as i64 * 3600;
    reasons.push(format!(
        "timeoutSeconds {timeout}: about 3x the estimated {:.0} min",
        minutes
    ));
    (minutes, timeout)
}

#[cfg(test)]
mod tests;
