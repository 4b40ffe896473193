//! Planning step of a `storageStrategy: NodeLocal` cache: the copies on its nodes (after the
//! pipeline), and their removal before the cache goes. Calls [`plan_nodes`] and turns its decisions
//! into the reconciler's actions and `status.nodeLocal`.

use std::time::Duration;

use flexinfer_api::modelcache::{CachePhase, ModelCache, ModelCacheStatus, StorageStrategy};
use k8s_openapi::jiff::Timestamp;

use super::config::Config;
use super::node_jobs::{build_job, job_name, status_of};
use super::nodelocal::{label_key, plan_nodes, Input, NodeAction, NodePlan};
use super::types::Action;
pub use super::types::NodeLocalObserved;

/// How long a deleted cache waits for its cleanups before it goes regardless (a node whose kubelet
/// is gone never runs its cleanup).
pub const DELETION_WAIT: Duration = Duration::from_secs(600);
/// How often a NodeLocal cache looks at its nodes again (a node that joins gets its copy then).
pub const NODE_RESYNC: Duration = Duration::from_secs(60);

/// The cache has been deleted for [`DELETION_WAIT`] or longer.
pub fn deletion_deadline_passed(mc: &ModelCache, now: Timestamp) -> bool {
    mc.metadata.deletion_timestamp.as_ref().is_some_and(|t| {
        now.as_second().saturating_sub(t.0.as_second())
            >= i64::try_from(DELETION_WAIT.as_secs()).unwrap_or(i64::MAX)
    })
}

pub fn is_node_local(mc: &ModelCache) -> bool {
    mc.spec.storage_strategy == StorageStrategy::NodeLocal
}

/// The digest the nodes should hold: the published one, once the cache is Ready.
pub fn wanted_digest(st: &ModelCacheStatus) -> Option<String> {
    if st.phase != Some(CachePhase::Ready) {
        return None;
    }
    st.publish.as_ref().and_then(|p| p.oci_digest.clone())
}

/// The node plan and its actions.
pub struct NodeStep {
    pub plan: NodePlan,
    pub actions: Vec<Action>,
}

/// Plan the node copies of `mc`; `remove_all`: every copy goes (the cache is being deleted, or is no
/// longer NodeLocal).
pub fn node_step(
    mc: &ModelCache,
    obs: &NodeLocalObserved,
    want: Option<&str>,
    config: &Config,
    now: Timestamp,
    remove_all: bool,
) -> NodeStep {
    let ns = mc.metadata.namespace.clone().unwrap_or_default();
    let name = mc.metadata.name.clone().unwrap_or_default();
    let key = label_key(&ns, &name);
    let empty = Default::default();
    let selector = mc.spec.node_local_selector().unwrap_or(&empty);
    let deleting = remove_all;
    let deadline_passed = deletion_deadline_passed(mc, now);
    let plan = plan_nodes(&Input {
        label_key: &key,
        want,
        selector,
        nodes: &obs.nodes,
        tasks: &obs.tasks,
        deleting,
        deletion_deadline_passed: deadline_passed,
    });
    let mut actions = Vec::new();
    if obs.problem.is_none() {
        for a in &plan.actions {
            match a {
                NodeAction::Start { node, kind } => {
                    if let Some(job) = build_job(mc, node, kind, config) {
                        actions.push(Action::CreateJob(Box::new(job)));
                    }
                }
                NodeAction::Forget { node, kind } => {
                    actions.push(Action::DeleteJob(job_name(&name, node, kind)));
                }
                NodeAction::Label { node, value } => actions.push(Action::LabelNode {
                    node: node.clone(),
                    key: key.clone(),
                    value: value.clone(),
                }),
            }
        }
    }
    NodeStep { plan, actions }
}

/// `status.nodeLocal` for `step`, with what keeps the copies from being made.
pub fn node_status(
    step: &NodeStep,
    obs: &NodeLocalObserved,
    want: Option<&str>,
    config: &Config,
) -> flexinfer_api::modelcache::NodeLocalStatus {
    let message = obs.problem.clone().or_else(|| {
        config.worker_image.is_none().then(|| {
            format!(
                "the controller has no worker image ({}): no node copy can be made",
                flexinfer_api::contract::env::controller::WORKER_IMAGE
            )
        })
    });
    status_of(&step.plan, want, message)
}
