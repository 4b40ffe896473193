//! FlexInfer's GPTQ quantization engine.
//!
//! The folders follow the architecture (docs/dev/architecture.md, "Inside the engine and the CLI"):
//! - [`numerics`]: the maths, bottom-up: [`quantizer`] (min/max grid), [`linalg`] (dense steps behind
//!   the device interface, faer CPU backend), [`hessian`] (preparation + recovery loop), [`gptq`]
//!   (column sweep, RTN), [`pack`] (gptq checkpoint packing);
//! - [`device`]: where the Hessian products and sweeps run (CPU, HIP/CUDA, the fault-injecting fake);
//! - [`model`]: reading a source model: [`tensors`] (safetensors), [`model::config`] (the supported
//!   architectures' `config.json`), [`model::weights`] (one layer's weights), [`llama`] and [`moe`]
//!   (the f32 forward), [`calib`] and [`model::dataset`] (calibration data);
//! - [`job`]: one quantize run: calibrate, quantize each layer, [`cache`] each finished layer,
//!   [`writer`] the checkpoint;
//! - cross-cutting: [`params`], [`exclusion`], [`events`], [`error`], [`fsutil`], [`memory`].
//!
//! The flat module paths (`flexinfer_quant::gptq`, `::tensors`, …) stay as re-exports.

pub mod awq;
pub mod ct;
pub mod device;
pub mod error;
pub mod events;
pub mod exclusion;
pub mod fp8;
pub mod fsutil;
pub mod gguf;
pub mod job;
#[cfg(test)]
mod layering;
pub mod memory;
pub mod model;
pub mod numerics;
pub mod params;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

pub use error::{
    ConfigError, DatasetError, FileError, IndexProblem, NumericError, QuantError, Result,
    SpecError, TensorError, TokenizerError,
};
pub use job::{cache, writer};
pub use model::{calib, llama, moe, tensors};
pub use numerics::{gptq, hessian, linalg, pack, quantizer};
