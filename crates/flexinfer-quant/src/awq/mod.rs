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

/// The AWQ tests' deterministic uniform values in [-0.5, 0.5) (a 64-bit LCG's high bits).
#[cfg(test)]
fn test_rand(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 33) as f32 / (1u64 << 31) as f32 - 0.5
}
