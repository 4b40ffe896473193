//! FlexInfer controller-manager library: pure planning code, Job/Deployment builders, and the
//! thin reconcilers that observe the cluster, call the planners and apply their results.
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

/// `app.kubernetes.io/version` of the objects this controller creates (not of their pod
/// templates: an upgrade of the controller must not roll every serving pod).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod backoff;
pub mod cache_series;
pub mod events;
pub mod http;
pub mod kube_client;
pub mod leader;
pub mod metrics;
pub mod model;
pub mod model_source;
pub mod modelcache;
pub mod pod_security;
pub mod settings;
pub mod supervise;
