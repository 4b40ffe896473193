//! ModelCache pipeline controller (docs/dev/architecture.md, "The ModelCache pipeline"): the pure
//! planner and Job builders live in `flexinfer-plan` (re-exported here under the same paths); this
//! module holds the thin reconciler ([`reconcile`]), the watch stores and the metric series.

pub use flexinfer_plan::modelcache::{
    advance, conditions, config, credentials, ctx, deletion, failures, jobs, node_jobs, node_step,
    nodelocal, observe, phase, plan, problem, results, stored_job, target, triggers, types,
    validation,
};
pub mod reconcile;
mod series;
pub mod stores;
pub mod written;

pub use config::Config;
pub use plan::{Action, Observed, Plan};
pub use reconcile::run;

#[cfg(test)]
mod tests;
