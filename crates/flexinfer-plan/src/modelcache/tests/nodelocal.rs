//! The node-local copy planner (`storageStrategy: NodeLocal`), as tables.

use std::collections::BTreeMap;

use super::super::nodelocal::{
    label_key, label_value, plan_nodes, CopyPhase, Input, NodeAction, NodeView, Task, TaskKind,
    TaskState,
};

const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

fn key() -> String {
    label_key("ns", "mc")
}

fn v(d: &str) -> String {
    label_value(d).expect("valid digest")
}

fn gpu() -> BTreeMap<String, String> {
    BTreeMap::from([("gpu".to_string(), "yes".to_string())])
}

/// A GPU node holding `held` (a digest), or nothing.
fn node(name: &str, held: Option<&str>) -> NodeView {
    let mut labels = gpu();
    if let Some(d) = held {
        labels.insert(key(), v(d));
    }
    NodeView {
        name: name.into(),
        labels,
        unschedulable: false,
    }
}

fn cpu_node(name: &str, held: Option<&str>) -> NodeView {
    let mut n = node(name, held);
    n.labels.remove("gpu");
    n
}

fn fill(d: &str) -> TaskKind {
    TaskKind::Fill { digest: d.into() }
}

fn keep(d: Option<&str>) -> TaskKind {
    TaskKind::Cleanup {
        keep: d.map(str::to_string),
    }
}

fn task(node: &str, kind: TaskKind, state: TaskState) -> Task {
    Task {
        node: node.into(),
        kind,
        state,
        bytes: Some(42),
        terminating: false,
    }
}

fn start(node: &str, kind: TaskKind) -> NodeAction {
    NodeAction::Start {
        node: node.into(),
        kind,
    }
}

fn forget(node: &str, kind: TaskKind) -> NodeAction {
    NodeAction::Forget {
        node: node.into(),
        kind,
    }
}

fn label(node: &str, d: Option<&str>) -> NodeAction {
    NodeAction::Label {
        node: node.into(),
        value: d.map(v),
    }
}

struct Case {
    name: &'static str,
    want: Option<&'static str>,
    nodes: Vec<NodeView>,
    tasks: Vec<Task>,
    deleting: bool,
    deadline_passed: bool,
    actions: Vec<NodeAction>,
    /// `(node, phase)` of the status, by node name.
    phases: Vec<(&'static str, CopyPhase)>,
    ready: usize,
    no_match: bool,
    deletion_done: bool,
}

impl Default for Case {
    fn default() -> Self {
        Self {
            name: "",
            want: Some(D1),
            nodes: vec![],
            tasks: vec![],
            deleting: false,
            deadline_passed: false,
            actions: vec![],
            phases: vec![],
            ready: 0,
            no_match: false,
            deletion_done: false,
        }
    }
}

#[test]
fn the_planner_fills_labels_and_cleans_each_node() {
    use CopyPhase::*;
    let ok = TaskState::Succeeded;
    let run = TaskState::Running;
    let cases = vec![
        Case {
            name: "one fill per matching node, none on others",
            nodes: vec![node("a", None), node("b", None), cpu_node("c", None)],
            actions: vec![start("a", fill(D1)), start("b", fill(D1))],
            phases: vec![("a", Filling), ("b", Filling)],
            ..Case::default()
        },
        Case {
            name: "nothing published yet: selected nodes wait",
            want: None,
            nodes: vec![node("a", None)],
            phases: vec![("a", Pending)],
            ..Case::default()
        },
        Case {
            name: "an invalid published digest is never filled",
            want: Some("sha256:../../etc"),
            nodes: vec![node("a", None)],
            phases: vec![("a", Pending)],
            ..Case::default()
        },
        Case {
            name: "a running fill waits",
            nodes: vec![node("a", None)],
            tasks: vec![task("a", fill(D1), run.clone())],
            phases: vec![("a", Filling)],
            ..Case::default()
        },
        Case {
            name: "a verified fill labels its node and counts as ready",
            nodes: vec![node("a", None)],
            tasks: vec![task("a", fill(D1), ok.clone())],
            actions: vec![label("a", Some(D1))],
            phases: vec![("a", Ready)],
            ready: 1,
            ..Case::default()
        },
        Case {
            name: "a labelled node cleans older copies once",
            nodes: vec![node("a", Some(D1))],
            tasks: vec![task("a", fill(D1), ok.clone())],
            actions: vec![start("a", keep(Some(D1)))],
            phases: vec![("a", Ready)],
            ready: 1,
            ..Case::default()
        },
        Case {
            name: "steady state: no action",
            nodes: vec![node("a", Some(D1))],
            tasks: vec![
                task("a", fill(D1), ok.clone()),
                task("a", keep(Some(D1)), ok.clone()),
            ],
            phases: vec![("a", Ready)],
            ready: 1,
            ..Case::default()
        },
        Case {
            name: "a failed fill is reported, not restarted",
            nodes: vec![node("a", None)],
            tasks: vec![task(
                "a",
                fill(D1),
                TaskState::Failed {
                    message: ".save-complete mismatch".into(),
                },
            )],
            phases: vec![("a", Failed)],
            ..Case::default()
        },
        Case {
            name: "new generation: the old copy serves while the new one fills",
            want: Some(D2),
            nodes: vec![node("a", Some(D1))],
            tasks: vec![
                task("a", fill(D1), ok.clone()),
                task("a", keep(Some(D1)), ok.clone()),
            ],
            actions: vec![start("a", fill(D2))],
            phases: vec![("a", Filling)],
            ..Case::default()
        },
        Case {
            name: "new generation verified: relabel, then clean the old copy and its Jobs",
            want: Some(D2),
            nodes: vec![node("a", Some(D2))],
            tasks: vec![
                task("a", fill(D1), ok.clone()),
                task("a", keep(Some(D1)), ok.clone()),
                task("a", fill(D2), ok.clone()),
            ],
            actions: vec![
                start("a", keep(Some(D2))),
                forget("a", fill(D1)),
                forget("a", keep(Some(D1))),
            ],
            phases: vec![("a", Ready)],
            ready: 1,
            ..Case::default()
        },
        Case {
            name: "a node leaving the selection loses label, copy and fill Jobs",
            nodes: vec![cpu_node("a", Some(D1))],
            tasks: vec![task("a", fill(D1), ok.clone())],
            actions: vec![
                start("a", keep(None)),
                forget("a", fill(D1)),
                label("a", None),
            ],
            no_match: true,
            ..Case::default()
        },
        Case {
            name: "a cordoned matching node keeps its copy but gets no new one",
            nodes: vec![
                NodeView {
                    unschedulable: true,
                    ..node("a", Some(D1))
                },
                NodeView {
                    unschedulable: true,
                    ..node("b", None)
                },
            ],
            no_match: true,
            ..Case::default()
        },
        Case {
            name: "a node selected again after its copy was removed: forget the removal, then fill",
            nodes: vec![node("a", None)],
            tasks: vec![task("a", keep(None), ok.clone())],
            actions: vec![forget("a", keep(None))],
            phases: vec![("a", Filling)],
            ..Case::default()
        },
        Case {
            name: "a terminating fill Job is waited for, not recreated",
            nodes: vec![node("a", None)],
            tasks: vec![Task {
                terminating: true,
                ..task("a", fill(D1), run.clone())
            }],
            phases: vec![("a", Filling)],
            ..Case::default()
        },
        Case {
            name: "deletion: label off and remove-all cleanup on every node with a copy",
            deleting: true,
            nodes: vec![node("a", Some(D1)), node("b", None), node("c", None)],
            tasks: vec![task("b", fill(D1), run.clone())],
            actions: vec![
                start("a", keep(None)),
                start("b", keep(None)),
                forget("b", fill(D1)),
                label("a", None),
            ],
            ..Case::default()
        },
        Case {
            name: "deletion waits for a running cleanup",
            deleting: true,
            nodes: vec![node("a", None)],
            tasks: vec![task("a", keep(None), run.clone())],
            ..Case::default()
        },
        Case {
            name: "deletion is done when cleanups finished; a gone node does not block it",
            deleting: true,
            nodes: vec![node("a", None)],
            tasks: vec![
                task("a", keep(None), ok.clone()),
                task("gone", keep(None), run.clone()),
            ],
            deletion_done: true,
            ..Case::default()
        },
        Case {
            name: "deletion is done after its deadline even with a cleanup stuck",
            deleting: true,
            deadline_passed: true,
            nodes: vec![node("a", None)],
            tasks: vec![task("a", keep(None), run.clone())],
            deletion_done: true,
            ..Case::default()
        },
    ];
    let selector = gpu();
    let k = key();
    for c in cases {
        let p = plan_nodes(&Input {
            label_key: &k,
            want: c.want,
            selector: &selector,
            nodes: &c.nodes,
            tasks: &c.tasks,
            deleting: c.deleting,
            deletion_deadline_passed: c.deadline_passed,
        });
        let mut want_actions = c.actions.clone();
        want_actions.sort();
        assert_eq!(p.actions, want_actions, "{}: actions", c.name);
        let phases: Vec<_> = p.nodes.iter().map(|n| (n.node.as_str(), n.phase)).collect();
        assert_eq!(phases, c.phases, "{}: phases", c.name);
        assert_eq!(p.ready_nodes, c.ready, "{}: ready nodes", c.name);
        assert_eq!(p.no_matching_nodes, c.no_match, "{}: no match", c.name);
        assert_eq!(
            p.deletion_done, c.deletion_done,
            "{}: deletion done",
            c.name
        );
    }
}

#[test]
fn status_says_what_a_node_serves_while_it_fills() {
    let k = key();
    let nodes = [node("a", Some(D1))];
    let tasks = [task(
        "a",
        fill(D2),
        TaskState::Failed {
            message: "digest mismatch".into(),
        },
    )];
    let p = plan_nodes(&Input {
        label_key: &k,
        want: Some(D2),
        selector: &gpu(),
        nodes: &nodes,
        tasks: &tasks,
        deleting: false,
        deletion_deadline_passed: false,
    });
    let n = &p.nodes[0];
    assert_eq!(n.digest.as_deref(), Some(D2));
    assert_eq!(n.serving, Some(v(D1)));
    assert_eq!(n.message.as_deref(), Some("digest mismatch"));
    assert_eq!(n.bytes, Some(42));
}

#[test]
fn label_names_fit_kubernetes_limits_and_differ_per_cache() {
    let a = label_key("ns", "mc");
    let (prefix, name) = a.split_once('/').expect("prefixed key");
    assert_eq!(
        format!("{prefix}/"),
        flexinfer_api::contract::labels::NODE_LOCAL_PREFIX
    );
    assert!(name.len() <= 63 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    assert_ne!(a, label_key("ns", "other"));
    assert_ne!(a, label_key("other", "mc"));
    let value = v(D1);
    assert!(value.len() <= 63);
    for bad in [
        "sha256:ABC",
        "sha256:",
        "md5:1111111111111111111111111111111111111111111111111111111111111111",
        "sha256:111111111111111111111111111111111111111111111111111111111111111G",
        "sha256:11111111111111111111111111111111111111111111111111111111111111111",
    ] {
        assert_eq!(label_value(bad), None, "{bad}");
    }
}
