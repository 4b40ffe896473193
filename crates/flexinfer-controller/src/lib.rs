//! FlexInfer controller-manager library: the thin reconcilers that observe the cluster, call the
//! planners of `flexinfer-plan` (pure planning, Job/Deployment builders; re-exported here under
//! the same paths) and apply their results.
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

pub use flexinfer_plan::{model_source, pod_security, settings, VERSION};

pub mod backoff;
pub mod cache_series;
pub mod events;
pub mod http;
pub mod kube_client;
pub mod leader;
pub mod metrics;
pub mod model;
pub mod modelcache;
pub mod reconcile_error;
pub mod status_write;
pub mod supervise;
