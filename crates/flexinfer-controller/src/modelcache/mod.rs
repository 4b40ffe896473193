//! ModelCache pipeline controller (docs/dev/architecture.md §3): pure planning ([`plan`]), Job builders ([`jobs`]),
//! and the thin reconciler ([`reconcile`]).

pub mod config;
mod failures;
pub mod jobs;
pub mod observe;
pub mod plan;
pub mod reconcile;
mod results;
pub mod target;

pub use config::Config;
pub use plan::{plan, Action, Observed, Plan};
pub use reconcile::run;

#[cfg(test)]
mod tests;
