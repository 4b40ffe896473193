//! ModelCache pipeline controller (docs/dev/architecture.md, "The ModelCache pipeline"): pure planning ([`plan`]), Job builders ([`jobs`]),
//! and the thin reconciler ([`reconcile`]).

mod advance;
mod conditions;
pub mod config;
pub mod credentials;
mod ctx;
mod deletion;
mod failures;
pub mod jobs;
pub mod node_jobs;
pub mod node_step;
pub mod nodelocal;
pub mod observe;
mod phase;
pub mod plan;
mod problem;
pub mod reconcile;
mod results;
mod series;
pub mod stored_job;
pub mod stores;
pub mod target;
mod triggers;
pub mod types;
mod validation;

pub use config::Config;
pub use plan::{plan, Action, Observed, Plan};
pub use reconcile::run;

#[cfg(test)]
mod tests;
