//! Reading a source model: the safetensors store ([`tensors`]), the architecture's `config.json`
//! ([`config`]), the modules of a decoder layer ([`modules`]), one decoder layer's weights
//! ([`weights`]), the f32 calibration forward ([`llama`], [`moe`], [`gdn`], and the parts they share in
//! [`nn`]), the calibration data ([`calib`]) and the dataset reader every use shares ([`dataset`]).

pub mod calib;
pub mod config;
pub mod dataset;
pub mod gdn;
pub mod llama;
pub mod modules;
pub mod moe;
pub mod nn;
pub mod tensors;
pub mod weights;

pub use config::*;
pub use weights::*;
