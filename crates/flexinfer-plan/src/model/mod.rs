//! The Model controller's planner (docs/dev/architecture.md, "The Model controller"): a Model
//! becomes a Deployment and a Service for its backend, scaled by the replica policy and guarded by
//! the quantized-artifact promotion gate. [`plan`] uses `gate`, `replicas`, `render` and `status`;
//! the reconciler that applies a plan is `flexinfer_controller::model`.

pub mod backends;
pub mod gate;
pub mod images;
pub mod plan;
pub mod problem;
pub mod render;
pub mod replicas;
pub mod shared;
/// A Model's `spec.source` (shared with the ModelCache planner, which reads which Models use a claim).
pub use crate::model_source as source;
pub mod status;

pub use plan::{plan, ModelPlan, Observed};

#[cfg(test)]
mod images_tests;
#[cfg(test)]
mod plan_tests;
#[cfg(test)]
mod render_tests;
