//! Why a spec cannot run (the planner's validation and the credential checks both report it).

use flexinfer_api::contract::JobPhase;

/// Why the spec cannot run: the cache fails with `reason` (no retry can fix it).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SpecProblem {
    pub(super) reason: &'static str,
    pub(super) message: String,
    /// The phase whose spec is at fault, when it is one phase's.
    pub(super) phase: Option<JobPhase>,
}
