//! FlexInfer's GPTQ quantization engine.
//!
//! The pieces, bottom-up: [`quantizer`] (min/max grid), [`linalg`] (device interface + faer CPU backend),
//! [`hessian`] (preparation + recovery loop), [`gptq`] (column sweep, RTN), [`pack`] (gptq checkpoint packing).

pub mod device;
pub mod error;
pub mod events;
pub mod gptq;
pub mod hessian;
pub mod linalg;
pub mod pack;
pub mod params;
pub mod quantizer;

pub use error::{QuantError, Result};
pub mod cache;
pub mod calib;
pub mod exclusion;
pub mod fsutil;
pub mod llama;
pub mod model;
pub mod moe;
pub mod pipeline;
pub mod tensors;
pub mod testkit;
pub mod writer;
