//! AWQ (activation-aware weight quantization) in AutoAWQ's GEMM layout, the checkpoint vLLM's `awq`
//! method and transformers' AWQ loader read: [`search`] (the per-channel scale search over α and the
//! clipping search, on the calibration activations), [`gemm`] (4-bit groups with zero points and their
//! packing), [`gate`] (the quality gate: output error against plain rounding), [`artifact`] (the
//! layer-by-layer run and the checkpoint).

pub mod artifact;
pub mod gate;
pub mod gemm;
pub mod search;

pub use artifact::{quantization_config, write_awq_artifact, AwqJob, AwqOutcome, GROUP_SIZES};
