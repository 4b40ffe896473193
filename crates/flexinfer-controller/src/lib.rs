//! FlexInfer controller-manager library: pure planning code, Job/Deployment builders, and the
//! thin reconcilers that observe the cluster, call the planners and apply their results.

pub mod http;
pub mod kube_client;
pub mod leader;
pub mod metrics;
pub mod model;
pub mod modelcache;
