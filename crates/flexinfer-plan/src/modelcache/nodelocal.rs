//! Node-local copies of a `storageStrategy: NodeLocal` cache, as one pure function:
//! [`plan_nodes`] decides, per node, which copy to fill, which node label to set or remove, and which
//! copies to clean up; it also gives the per-node status. No I/O happens here.
//!
//! What a node holds is read from its label [`label_key`] (the digest of the verified copy, set only
//! after the fill Job verified `.save-complete`): the label survives controller restarts and is what a
//! node-local volume's node affinity would require. Fill and cleanup Jobs are observed as [`Task`]s.
//! `node_step` calls it and `node_jobs` builds the Jobs it starts.

use std::collections::{BTreeMap, BTreeSet};

use flexinfer_api::contract::labels;
use sha2::{Digest, Sha256};

/// Hex characters of the digest kept in a node label value (a label value has at most 63).
const LABEL_DIGEST_HEX: usize = 40;
/// Hex characters of `sha256(namespace/name)` in the label key's name part (at most 63).
const KEY_HASH_HEX: usize = 20;

/// The node label that says which copy of the cache `namespace/name` a node holds.
pub fn label_key(namespace: &str, name: &str) -> String {
    let mut h = Sha256::new();
    h.update(namespace.as_bytes());
    h.update(b"/");
    h.update(name.as_bytes());
    let hex = hex::encode(h.finalize());
    format!(
        "{}c-{}",
        labels::NODE_LOCAL_PREFIX,
        &hex[..KEY_HASH_HEX.min(hex.len())]
    )
}

/// The label value of a copy: the digest's hex, shortened to fit a label value. `None` when `digest`
/// is not `sha256:<64 lowercase hex>` (the publish status is untrusted input).
pub fn label_value(digest: &str) -> Option<String> {
    let hex = digest.strip_prefix("sha256:")?;
    let valid = hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    valid.then(|| hex[..LABEL_DIGEST_HEX].to_string())
}

/// A node as the planner sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The node is being deleted or is cordoned: it gets no new copy.
    pub unschedulable: bool,
}

/// What a fill or cleanup Job does.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum TaskKind {
    /// Download the published artifact `digest` onto the node and verify it.
    Fill { digest: String },
    /// Remove the cache's copies on the node except `keep` (`None`: all of them).
    Cleanup { keep: Option<String> },
}

/// How a fill or cleanup Job stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskState {
    Running,
    Succeeded,
    Failed { message: String },
}

/// A fill or cleanup Job of this cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub node: String,
    pub kind: TaskKind,
    pub state: TaskState,
    /// Bytes of the verified copy (a succeeded fill's report).
    pub bytes: Option<i64>,
    /// The Job is being deleted: it counts as gone, and no Job of the same kind is created on its
    /// node until it is.
    pub terminating: bool,
}

/// Everything [`plan_nodes`] decides from.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    /// [`label_key`] of the cache.
    pub label_key: &'a str,
    /// The published digest the nodes should hold: `Some` once the cache is Ready and published.
    pub want: Option<&'a str>,
    /// Nodes whose labels match all of these get a copy.
    pub selector: &'a BTreeMap<String, String>,
    pub nodes: &'a [NodeView],
    pub tasks: &'a [Task],
    /// The cache is being deleted: every copy is removed.
    pub deleting: bool,
    /// With `deleting`: the bound on waiting for cleanups has passed (a node whose kubelet is gone
    /// never runs its cleanup Job); the deletion is done regardless and the copies left are reported.
    pub deletion_deadline_passed: bool,
}

/// One side effect on the nodes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum NodeAction {
    /// Start a Job of this kind on the node.
    Start { node: String, kind: TaskKind },
    /// Delete the node's finished Job of this kind (its outcome no longer describes the node).
    Forget { node: String, kind: TaskKind },
    /// Set the cache's label on the node to this value; `None` removes it.
    Label { node: String, value: Option<String> },
}

/// Phase of a node's copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPhase {
    /// Selected, waiting for a published artifact.
    Pending,
    Filling,
    Ready,
    Failed,
}

/// One node's copy, for the status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCopy {
    pub node: String,
    /// The digest being filled, or held when nothing newer is.
    pub digest: Option<String>,
    pub phase: CopyPhase,
    pub bytes: Option<i64>,
    pub message: Option<String>,
    /// The verified copy the node serves meanwhile (label value), while a newer one fills.
    pub serving: Option<String>,
}

/// What [`plan_nodes`] decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePlan {
    /// Sorted, without duplicates.
    pub actions: Vec<NodeAction>,
    /// Selected nodes, by name.
    pub nodes: Vec<NodeCopy>,
    /// Selected nodes whose copy of `want` is verified.
    pub ready_nodes: usize,
    /// No schedulable node matches the selector (a condition says so).
    pub no_matching_nodes: bool,
    /// With `deleting`: every copy on an existing node is removed (or its cleanup failed, which the
    /// status reports); the finalizer may go. Nodes that no longer exist never block it.
    pub deletion_done: bool,
}

fn matches(selector: &BTreeMap<String, String>, node: &NodeView) -> bool {
    selector
        .iter()
        .all(|(k, v)| node.labels.get(k).is_some_and(|have| have == v))
}

fn task<'a>(tasks: &'a [Task], node: &str, kind: &TaskKind) -> Option<&'a Task> {
    tasks.iter().find(|t| t.node == node && &t.kind == kind)
}

/// Plan the node-local copies of one cache.
pub fn plan_nodes(input: &Input<'_>) -> NodePlan {
    let mut actions = BTreeSet::new();
    let mut nodes = Vec::new();
    let mut deletion_done = true;
    let want = input.want.and_then(|d| label_value(d).map(|v| (d, v)));
    let mut any_selected = false;
    for node in input.nodes {
        let held = node.labels.get(input.label_key).cloned();
        let selected = !input.deleting && !node.unschedulable && matches(input.selector, node);
        let on_node: Vec<&Task> = input.tasks.iter().filter(|t| t.node == node.name).collect();
        if !selected {
            // A node leaving the selection keeps its copy while it is cordoned (pods may still run
            // there); one deselected by its labels, or any node of a deleted cache, loses it.
            if node.unschedulable && !input.deleting && matches(input.selector, node) {
                continue;
            }
            if !remove_copies(node, held.as_ref(), &on_node, &mut actions) {
                deletion_done = false;
            }
            continue;
        }
        any_selected = true;
        let Some((digest, value)) = want.as_ref() else {
            nodes.push(NodeCopy {
                node: node.name.clone(),
                digest: None,
                phase: if held.is_some() {
                    CopyPhase::Ready
                } else {
                    CopyPhase::Pending
                },
                bytes: None,
                message: None,
                serving: held,
            });
            continue;
        };
        let fill = TaskKind::Fill {
            digest: digest.to_string(),
        };
        let fill_task = task(input.tasks, &node.name, &fill).filter(|t| !t.terminating);
        let mut copy = NodeCopy {
            node: node.name.clone(),
            digest: Some(digest.to_string()),
            phase: CopyPhase::Filling,
            bytes: fill_task.and_then(|t| t.bytes),
            message: None,
            serving: held.clone().filter(|h| h != value),
        };
        if held.as_ref() == Some(value) {
            copy.phase = CopyPhase::Ready;
            // Older copies on the node go once the new one serves (a no-op on a first fill).
            let keep = TaskKind::Cleanup {
                keep: Some(digest.to_string()),
            };
            // Finished Jobs of earlier copies no longer describe the node.
            for t in &on_node {
                let current = t.kind == fill || t.kind == keep;
                if !current && !t.terminating && t.state != TaskState::Running {
                    actions.insert(NodeAction::Forget {
                        node: node.name.clone(),
                        kind: t.kind.clone(),
                    });
                }
            }
            if task(input.tasks, &node.name, &keep).is_none() {
                actions.insert(NodeAction::Start {
                    node: node.name.clone(),
                    kind: keep,
                });
            }
        } else {
            match fill_task.map(|t| &t.state) {
                None => {
                    let fill_gone = task(input.tasks, &node.name, &fill).is_none();
                    // A remove-all cleanup that already ran would otherwise never run again when the
                    // node leaves the selection after this fill: it is deleted first.
                    let stale_removal = on_node
                        .iter()
                        .find(|t| t.kind == TaskKind::Cleanup { keep: None });
                    if let Some(t) = stale_removal {
                        if !t.terminating {
                            if t.state == TaskState::Running {
                                copy.message =
                                    Some("waiting for the removal of the old copy".into());
                            } else {
                                actions.insert(NodeAction::Forget {
                                    node: node.name.clone(),
                                    kind: t.kind.clone(),
                                });
                            }
                        }
                    } else if fill_gone {
                        actions.insert(NodeAction::Start {
                            node: node.name.clone(),
                            kind: fill,
                        });
                    }
                }
                Some(TaskState::Running) => {}
                Some(TaskState::Succeeded) => {
                    copy.phase = CopyPhase::Ready;
                    actions.insert(NodeAction::Label {
                        node: node.name.clone(),
                        value: Some(value.clone()),
                    });
                }
                Some(TaskState::Failed { message }) => {
                    copy.phase = CopyPhase::Failed;
                    copy.message = Some(message.clone());
                }
            }
        }
        nodes.push(copy);
    }
    // Ready for the published digest (a node still holding an older copy before anything is published
    // has no digest).
    let ready_nodes = nodes
        .iter()
        .filter(|n| n.phase == CopyPhase::Ready && n.digest.is_some())
        .count();
    NodePlan {
        actions: actions.into_iter().collect(),
        nodes,
        ready_nodes,
        no_matching_nodes: !input.deleting && !any_selected,
        deletion_done: input.deleting && (deletion_done || input.deletion_deadline_passed),
    }
}

/// Remove the cache's label and copies from `node`: the label first (no new pod is placed there), the
/// files by a remove-all cleanup. Fill Jobs on the node are forgotten, so a later selection fills
/// again. Returns whether the node holds nothing of the cache any more (or its cleanup failed).
fn remove_copies(
    node: &NodeView,
    held: Option<&String>,
    on_node: &[&Task],
    actions: &mut BTreeSet<NodeAction>,
) -> bool {
    let remove_all = TaskKind::Cleanup { keep: None };
    if held.is_some() {
        actions.insert(NodeAction::Label {
            node: node.name.clone(),
            value: None,
        });
    }
    for t in on_node {
        if matches!(t.kind, TaskKind::Fill { .. }) && !t.terminating {
            actions.insert(NodeAction::Forget {
                node: node.name.clone(),
                kind: t.kind.clone(),
            });
        }
    }
    let had_copy = held.is_some()
        || on_node
            .iter()
            .any(|t| matches!(t.kind, TaskKind::Fill { .. }));
    let existing = on_node.iter().find(|t| t.kind == remove_all).copied();
    match existing {
        Some(t) if t.terminating => false,
        Some(t) => t.state != TaskState::Running,
        None if had_copy => {
            actions.insert(NodeAction::Start {
                node: node.name.clone(),
                kind: remove_all,
            });
            false
        }
        None => true,
    }
}
