//! The format table shared by the controller, the CLI and the docs: which formats exist, which
//! backends serve them, and which have a built-in engine.

use crate::model::Backend;
use crate::modelcache::QuantFormat;

/// One row of the format table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormatInfo {
    pub format: QuantFormat,
    /// Spelling used in manifests (`GPTQ`).
    pub name: &'static str,
    /// Spelling used by Model `config.quantization` and vLLM (`gptq`).
    pub model_name: &'static str,
    /// Allowed bit widths.
    pub bits: &'static [i32],
    pub default_bits: i32,
    /// Backends that can serve it.
    pub backends: &'static [Backend],
    /// Whether FlexInfer ships an engine for it today.
    pub implemented: bool,
    /// Whether quantizing needs a calibration dataset.
    pub needs_calibration: bool,
    /// Whether the built-in engine can run on a GPU (`useGPU` puts its Job on a GPU node); `false`: the
    /// quantize Job runs on a CPU node whatever `useGPU` says.
    pub gpu_engine: bool,
}

pub const FORMATS: &[FormatInfo] = &[
    FormatInfo {
        format: QuantFormat::Gguf,
        name: "GGUF",
        model_name: "gguf",
        bits: &[2, 3, 4, 5, 6, 8],
        default_bits: 4,
        backends: &[Backend::Llamacpp, Backend::Ollama],
        implemented: true,
        needs_calibration: false,
        gpu_engine: false,
    },
    FormatInfo {
        format: QuantFormat::Awq,
        name: "AWQ",
        model_name: "awq",
        bits: &[4],
        default_bits: 4,
        backends: &[Backend::Vllm],
        implemented: true,
        needs_calibration: true,
        gpu_engine: false,
    },
    FormatInfo {
        format: QuantFormat::Gptq,
        name: "GPTQ",
        model_name: "gptq",
        bits: &[2, 3, 4, 8],
        default_bits: 4,
        backends: &[Backend::Vllm],
        implemented: true,
        needs_calibration: true,
        gpu_engine: true,
    },
    FormatInfo {
        format: QuantFormat::Exl2,
        name: "EXL2",
        model_name: "exl2",
        bits: &[2, 3, 4, 5, 6, 8],
        default_bits: 4,
        backends: &[Backend::Exllamav2],
        implemented: false,
        needs_calibration: true,
        gpu_engine: false,
    },
    FormatInfo {
        format: QuantFormat::Fp8,
        name: "FP8",
        model_name: "fp8",
        bits: &[8],
        default_bits: 8,
        backends: &[Backend::Vllm],
        implemented: true,
        needs_calibration: false,
        gpu_engine: false,
    },
    FormatInfo {
        format: QuantFormat::CompressedTensors,
        name: "COMPRESSED_TENSORS",
        model_name: "compressed-tensors",
        bits: &[4, 8],
        default_bits: 4,
        backends: &[Backend::Vllm],
        implemented: true,
        needs_calibration: true,
        gpu_engine: true,
    },
];

/// Table row of a format.
pub fn info(format: QuantFormat) -> &'static FormatInfo {
    // FORMATS has one row per enum variant (checked by a test).
    FORMATS
        .iter()
        .find(|f| f.format == format)
        .unwrap_or(&FORMATS[2])
}

/// Row by manifest (`GPTQ`) or model (`gptq`) spelling, case-insensitive.
pub fn by_name(name: &str) -> Option<&'static FormatInfo> {
    FORMATS
        .iter()
        .find(|f| f.name.eq_ignore_ascii_case(name) || f.model_name.eq_ignore_ascii_case(name))
}

/// The formats with an engine, comma-separated (`GGUF, GPTQ`), for messages.
pub fn implemented_names() -> String {
    FORMATS
        .iter()
        .filter(|f| f.implemented)
        .map(|f| f.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `backend` can serve `format`.
pub fn backend_supports(format: QuantFormat, backend: Backend) -> bool {
    info(format).backends.contains(&backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRD refuses at admission exactly the formats without an engine (`implemented: false`), and its
    /// message lists the ones with an engine.
    #[test]
    fn admission_refuses_the_formats_without_an_engine() {
        use kube_core::CustomResourceExt;
        let crd = serde_json::to_value(crate::modelcache::ModelCache::crd()).unwrap_or_default();
        let q = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["quantization"];
        let rules = q["x-kubernetes-validations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let rule = rules
            .iter()
            .find(|r| {
                r["rule"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("self.format != "))
            })
            .unwrap_or_else(|| panic!("no format rule on spec.quantization: {rules:?}"));
        let text = rule["rule"].as_str().unwrap_or_default();
        for f in FORMATS {
            assert_eq!(
                text.contains(&format!("'{}'", f.name)),
                !f.implemented,
                "{} in {text}",
                f.name
            );
        }
        let message = rule["message"].as_str().unwrap_or_default();
        assert!(message.contains(&implemented_names()), "{message}");
    }

    #[test]
    fn one_row_per_format_and_lookup_roundtrips() {
        let all = [
            QuantFormat::Gguf,
            QuantFormat::Awq,
            QuantFormat::Gptq,
            QuantFormat::Exl2,
            QuantFormat::Fp8,
            QuantFormat::CompressedTensors,
        ];
        assert_eq!(FORMATS.len(), all.len());
        for f in all {
            assert_eq!(info(f).format, f);
            assert_eq!(by_name(info(f).name).map(|i| i.format), Some(f));
            assert_eq!(by_name(info(f).model_name).map(|i| i.format), Some(f));
        }
    }

    #[test]
    fn compatibility_matches_spec() {
        use Backend::*;
        assert!(backend_supports(QuantFormat::Gguf, Llamacpp));
        assert!(backend_supports(QuantFormat::Gguf, Ollama));
        assert!(!backend_supports(QuantFormat::Gguf, Vllm));
        assert!(backend_supports(QuantFormat::Gptq, Vllm));
        assert!(!backend_supports(QuantFormat::Gptq, Llamacpp));
        assert!(backend_supports(QuantFormat::Awq, Vllm));
        assert!(backend_supports(QuantFormat::Fp8, Vllm));
        assert!(backend_supports(QuantFormat::Exl2, Exllamav2));
        assert!(!backend_supports(QuantFormat::Exl2, Vllm));
        assert!(backend_supports(QuantFormat::CompressedTensors, Vllm));
        let implemented: Vec<&str> = FORMATS
            .iter()
            .filter(|f| f.implemented)
            .map(|f| f.name)
            .collect();
        assert_eq!(
            implemented,
            ["GGUF", "AWQ", "GPTQ", "FP8", "COMPRESSED_TENSORS"]
        );
        assert_eq!(
            implemented_names(),
            "GGUF, AWQ, GPTQ, FP8, COMPRESSED_TENSORS"
        );
    }
}
