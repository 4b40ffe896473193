//! FP8 output: E4M3 weights with per-channel or per-tensor f32 scales in compressed-tensors'
//! `float-quantized` layout ([`artifact`]): the code ([`e4m3`]), one weight's scales and codes
//! ([`quantize`]). Activations are dynamic by default (per token, computed by the serving engine, no
//! calibration); `FP8_ACTIVATIONS=static` calibrates one per-tensor `input_scale` per quantized linear
//! ([`calibrate`]).

pub mod artifact;
pub mod calibrate;
pub mod e4m3;
pub mod quantize;

pub use artifact::{
    plan_fp8, quantization_config, write_fp8_artifact, Fp8Job, Fp8Outcome, Fp8Plan,
};
pub use calibrate::{ActivationScheme, Fp8Activations};
pub use quantize::{quantize_weight, Fp8Weight, ScaleStrategy};
