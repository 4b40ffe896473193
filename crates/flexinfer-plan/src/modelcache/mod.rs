//! The ModelCache pipeline's planner (docs/dev/architecture.md, "The ModelCache pipeline"): pure
//! planning ([`plan`]) and the Job builders ([`jobs`], [`node_jobs`]). The reconciler that applies
//! a plan is `flexinfer_controller::modelcache::reconcile`.

pub mod advance;
pub mod conditions;
pub mod config;
pub mod credentials;
pub mod ctx;
pub mod deletion;
pub mod failures;
pub mod jobs;
pub mod node_jobs;
pub mod node_step;
pub mod nodelocal;
pub mod observe;
pub mod phase;
pub mod plan;
pub mod problem;
pub mod results;
pub mod stored_job;
pub mod target;
pub mod triggers;
pub mod types;
pub mod validation;

pub use config::Config;
pub use plan::{plan, Action, Observed, Plan};

#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

#[cfg(test)]
mod tests;
