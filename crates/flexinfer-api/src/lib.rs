//! FlexInfer API: the custom resources (`ai.flexinfer`), their defaults and validation, and the
//! contract between the controller and the worker images.
//!
//! Everything that more than one binary must agree on lives here: CRD types, annotation keys,
//! environment variable names, event names, marker-file names and their serde types.

pub mod conditions;
pub mod contract;
pub mod crdgen;
pub mod formats;
pub mod gpuprofile;
pub mod model;
pub mod modelcache;

pub use gpuprofile::{GPUProfile, GPUProfileSpec, GPUProfileStatus};
pub use model::{Model, ModelSpec, ModelStatus};
pub use modelcache::{ModelCache, ModelCacheSpec, ModelCacheStatus};

/// API group of every FlexInfer resource.
pub const GROUP: &str = "ai.flexinfer";
