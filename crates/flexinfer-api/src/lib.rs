//! FlexInfer API: the custom resources (`ai.flexinfer`), their defaults and validation.
//!
//! The controller/worker contract (annotation keys, env names, event names, marker files and
//! their serde types) lives in the serde-only `flexinfer-contract` crate, re-exported here as
//! [`contract`] for the Kubernetes-side crates.
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

pub use flexinfer_contract as contract;

pub mod conditions;
pub mod crdgen;
pub mod duration;
pub mod formats;
pub mod gpuprofile;
pub mod model;
pub mod modelcache;
pub mod namespaces;

pub use gpuprofile::{GPUProfile, GPUProfileSpec, GPUProfileStatus};
pub use model::{Model, ModelSpec, ModelStatus};
pub use modelcache::{ModelCache, ModelCacheSpec, ModelCacheStatus};

/// API group of every FlexInfer resource.
pub const GROUP: &str = "ai.flexinfer";
