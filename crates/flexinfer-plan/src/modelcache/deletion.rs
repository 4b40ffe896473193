//! Planning step 1: a cache being deleted, and the finalizer and claim of a live one.

use flexinfer_api::contract::{self, reasons};
use flexinfer_api::modelcache::ModelCache;

use super::ctx::event;
use super::jobs;
use super::types::{Action, Observed};

/// Whether the cache carries the cleanup finalizer.
pub(super) fn has_cleanup_finalizer(mc: &ModelCache) -> bool {
    mc.metadata.finalizers.as_ref().is_some_and(|f| {
        f.iter()
            .any(|x| x == contract::controller::FINALIZER_CLEANUP)
    })
}

/// The actions of a cache being deleted, `None` when it is not: clean up the PVC we created (kept
/// while another cache uses it), then let the object go. Jobs go with their owner.
pub(super) fn deletion(mc: &ModelCache, observed: &Observed) -> Option<Vec<Action>> {
    mc.metadata.deletion_timestamp.as_ref()?;
    let mut actions = Vec::new();
    if !has_cleanup_finalizer(mc) {
        return Some(actions);
    }
    let name = mc.metadata.name.clone().unwrap_or_default();
    let owns_pvc = mc.spec.existing_claim_name.is_none();
    if owns_pvc && observed.pvc_exists {
        if observed.claim_peers.is_empty() && observed.claim_models.is_empty() {
            actions.push(Action::DeletePvc(jobs::created_claim_name(&name)));
        } else {
            let mut users: Vec<String> = Vec::new();
            if !observed.claim_peers.is_empty() {
                let names: Vec<&str> = observed
                    .claim_peers
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect();
                users.push(format!("ModelCache {}", names.join(", ")));
            }
            if !observed.claim_models.is_empty() {
                users.push(format!("Model {}", observed.claim_models.join(", ")));
            }
            let note = format!(
                "PersistentVolumeClaim {} is kept: {} use it; delete it once nothing does",
                jobs::created_claim_name(&name),
                users.join(" and ")
            );
            actions.push(event(false, reasons::CLAIM_KEPT, &note, None));
        }
    }
    actions.push(Action::RemoveFinalizer);
    Some(actions)
}

/// A live cache on a claim the controller creates holds the cleanup finalizer, and the claim exists.
pub(super) fn claim_actions(mc: &ModelCache, observed: &Observed) -> Vec<Action> {
    let mut actions = Vec::new();
    // The finalizer guards the claim we create, and a NodeLocal cache's copies on its nodes.
    let node_local = super::node_step::is_node_local(mc);
    if mc.spec.existing_claim_name.is_some() && !node_local {
        return actions;
    }
    if !has_cleanup_finalizer(mc) {
        actions.push(Action::AddFinalizer);
    }
    if mc.spec.existing_claim_name.is_some() {
        return actions;
    }
    if !observed.pvc_exists {
        actions.push(Action::CreatePvc(Box::new(jobs::build_pvc(mc))));
    }
    actions
}
