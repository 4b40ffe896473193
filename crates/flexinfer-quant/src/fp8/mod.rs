//! FP8 output: E4M3 weights with per-channel or per-tensor f32 scales in compressed-tensors'
//! `float-quantized` layout ([`artifact`]): the code ([`e4m3`]), one weight's scales and codes
//! ([`quantize`]). No calibration: activation scales are dynamic (per token, computed by the serving
//! engine).

pub mod artifact;
pub mod e4m3;
pub mod quantize;

pub use artifact::{
    plan_fp8, quantization_config, write_fp8_artifact, Fp8Job, Fp8Outcome, Fp8Plan,
};
pub use quantize::{quantize_weight, Fp8Weight, ScaleStrategy};
