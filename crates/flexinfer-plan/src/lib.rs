//! FlexInfer's pure planners. The ModelCache and Model reconcilers (in `flexinfer-controller`)
//! observe the cluster, call [`modelcache::plan`] / [`model::plan`] here, and apply the result.
//! Nothing in this crate talks to the API server, reads a clock or spawns a task: it depends on
//! the CRD types, the contract and the Kubernetes object types only, so that purity is checked
//! by the compiler (docs/dev/architecture.md, "Pure core, thin glue").
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

/// `app.kubernetes.io/version` of the objects the controller creates (not of their pod
/// templates: an upgrade of the controller must not roll every serving pod).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod model;
pub mod model_source;
pub mod modelcache;
pub mod pod_security;
pub mod settings;
