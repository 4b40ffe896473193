//! A `storageStrategy: NodeLocal` cache through the whole planner: its pipeline publishes, then each
//! selected node gets a fill Job, a label once the copy is verified, and a cleanup; deletion removes
//! the copies before the finalizer goes; a controller that may not list nodes changes nothing.

use std::collections::BTreeMap;

use super::*;
use crate::modelcache::node_jobs::{self, build_job, task_of};
use crate::modelcache::node_step::NodeLocalObserved;
use crate::modelcache::nodelocal::{label_key, label_value, NodeView, Task, TaskKind, TaskState};

const NODE_LOCAL: &str = r#"
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: mc, namespace: ns, uid: u-1, generation: 1}
spec:
  source: org/model
  maxRetries: 2
  storageStrategy: NodeLocal
  nodeLocal: {nodeSelector: {serve: "yes"}}
  publish: {ociRef: "reg.local:5000/models/mc:v1", insecure: true, secretRef: regcred}
"#;

const DIGEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

/// The test config, with the publish registry allowed to receive the cache's registry login.
fn nl_cfg() -> Config {
    Config {
        credential_registries: crate::modelcache::credentials::CredentialRegistries::parse(
            "reg.local:5000",
        )
        .expect("registry list"),
        ..cfg()
    }
}

fn node(name: &str, labels: &[(&str, &str)]) -> NodeView {
    NodeView {
        name: name.into(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        unschedulable: false,
    }
}

fn with_nodes(nodes: Vec<NodeView>, tasks: Vec<Task>) -> Observed {
    let mut o = obs(vec![]);
    o.node_local = Some(NodeLocalObserved {
        nodes,
        tasks,
        problem: None,
    });
    o
}

/// The NodeLocal cache driven through download and publish to Ready, its digest published.
fn published() -> (ModelCache, Vec<ObservedJob>) {
    let c = nl_cfg();
    let mc = cache(NODE_LOCAL);
    let o = with_nodes(vec![], vec![]);
    let p = plan(&mc, &o, &c, t(0));
    assert!(p.actions.contains(&Action::AddFinalizer), "{:?}", p.actions);
    let dl = job_from(&p, JobPhase::Download, t(1), JobState::Succeeded);
    let mc = applied(mc, &p);
    let mut o = with_nodes(vec![], vec![]);
    o.jobs.insert(JobPhase::Download, dl.clone());
    let p = plan(&mc, &o, &c, t(10));
    let mut pb = job_from(&p, JobPhase::Publish, t(11), JobState::Succeeded);
    pb.pod = Some(ObservedPod {
        termination_message: Some(format!(r#"{{"type":"publish","digest":"{DIGEST}"}}"#)),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let mut o = with_nodes(vec![], vec![]);
    o.jobs.insert(JobPhase::Download, dl.clone());
    o.jobs.insert(JobPhase::Publish, pb.clone());
    let p = plan(&mc, &o, &c, t(20));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    (applied(mc, &p), vec![dl, pb])
}

fn observed(jobs: &[ObservedJob], nodes: Vec<NodeView>, tasks: Vec<Task>) -> Observed {
    let mut o = with_nodes(nodes, tasks);
    for j in jobs {
        o.jobs.insert(j.phase, j.clone());
    }
    o
}

fn label_actions(p: &Plan) -> Vec<(String, Option<String>)> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::LabelNode { node, value, .. } => Some((node.clone(), value.clone())),
            _ => None,
        })
        .collect()
}

fn created(p: &Plan) -> Vec<k8s_openapi::api::batch::v1::Job> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateJob(j) => Some((**j).clone()),
            _ => None,
        })
        .collect()
}

fn task(job: &k8s_openapi::api::batch::v1::Job, state: TaskState) -> Task {
    let mut t = task_of(job).expect("a node-copy Job");
    t.state = state;
    t
}

#[test]
fn each_selected_node_is_filled_from_the_published_digest_then_labelled() {
    let c = nl_cfg();
    let (mc, jobs) = published();
    let key = label_key("ns", "mc");
    let value = label_value(DIGEST).expect("label value");
    let nodes = vec![node("gpu-1", &[("serve", "yes")]), node("cpu-1", &[])];

    // Published: a fill Job on the selected node only.
    let p = plan(&mc, &observed(&jobs, nodes.clone(), vec![]), &c, t(30));
    let fills = created(&p);
    assert_eq!(fills.len(), 1, "{:?}", p.actions);
    let fill = &fills[0];
    let st = p.status.node_local.clone().expect("status.nodeLocal");
    assert_eq!(st.digest.as_deref(), Some(DIGEST));
    assert_eq!((st.selected_nodes, st.ready_nodes), (1, 0));
    assert_eq!(st.nodes[0].node, "gpu-1");
    assert_eq!(st.nodes[0].phase, "Filling");
    assert!(p
        .requeue_after
        .is_some_and(|d| d <= Duration::from_secs(60)));

    // What the fill Job runs, where, as whom.
    let pod = fill.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let term = &pod
        .affinity
        .as_ref()
        .unwrap()
        .node_affinity
        .as_ref()
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()
        .node_selector_terms[0];
    let field = &term.match_fields.as_ref().unwrap()[0];
    assert_eq!(
        (field.key.as_str(), field.values.clone()),
        ("metadata.name", Some(vec!["gpu-1".to_string()]))
    );
    let ctr = &pod.containers[0];
    assert_eq!(ctr.args.clone().unwrap(), vec!["node-copy", "fill"]);
    let env: BTreeMap<String, Option<String>> = ctr
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value))
        .collect();
    assert_eq!(
        env.get("SOURCE").cloned().flatten().as_deref(),
        Some(format!("oci://reg.local:5000/models/mc@{DIGEST}").as_str())
    );
    assert_eq!(
        env.get("NODE_COPY_DIR").cloned().flatten().as_deref(),
        Some("/node-local/mc")
    );
    assert_eq!(
        env.get("OCI_INSECURE").cloned().flatten().as_deref(),
        Some("true")
    );
    assert!(
        env.contains_key("OCI_PASSWORD"),
        "the publish secret's login"
    );
    let host = pod.volumes.as_ref().unwrap()[0].host_path.as_ref().unwrap();
    assert_eq!(host.path, "/var/lib/flexinfer/node-local/ns");
    let sc = ctr.security_context.as_ref().unwrap();
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop,
        Some(vec!["ALL".to_string()])
    );
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.capabilities.as_ref().unwrap().add, None);

    // Running: nothing new. Succeeded: the node gets the label (and only then).
    let running = task(fill, TaskState::Running);
    let p = plan(
        &mc,
        &observed(&jobs, nodes.clone(), vec![running]),
        &c,
        t(40),
    );
    assert!(
        created(&p).is_empty() && label_actions(&p).is_empty(),
        "{:?}",
        p.actions
    );
    let done = task(fill, TaskState::Succeeded);
    let p = plan(
        &mc,
        &observed(&jobs, nodes.clone(), vec![done.clone()]),
        &c,
        t(50),
    );
    assert_eq!(
        label_actions(&p),
        vec![("gpu-1".to_string(), Some(value.clone()))]
    );
    for a in &p.actions {
        if let Action::LabelNode { key: k, .. } = a {
            assert_eq!(k, &key);
        }
    }

    // Labelled: Ready, and a cleanup that keeps this copy.
    let labelled = vec![
        node("gpu-1", &[("serve", "yes"), (key.as_str(), value.as_str())]),
        node("cpu-1", &[]),
    ];
    let p = plan(&mc, &observed(&jobs, labelled, vec![done]), &c, t(60));
    let st = p.status.node_local.clone().unwrap();
    assert_eq!((st.selected_nodes, st.ready_nodes), (1, 1));
    assert_eq!(st.nodes[0].phase, "Ready");
    let cleanups = created(&p);
    assert_eq!(cleanups.len(), 1, "{:?}", p.actions);
    let t_clean = task_of(&cleanups[0]).unwrap();
    assert_eq!(
        t_clean.kind,
        TaskKind::Cleanup {
            keep: Some(DIGEST.to_string())
        }
    );
    let env = cleanups[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .env
        .clone()
        .unwrap();
    assert!(env
        .iter()
        .any(|e| e.name == "NODE_COPY_KEEP" && e.value.as_deref() == Some(DIGEST)));
}

#[test]
fn a_deleted_cache_removes_its_copies_before_its_finalizer_goes() {
    let c = nl_cfg();
    let (mut mc, jobs) = published();
    let key = label_key("ns", "mc");
    let value = label_value(DIGEST).unwrap();
    mc.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(100)));
    let holding = vec![node(
        "gpu-1",
        &[("serve", "yes"), (key.as_str(), value.as_str())],
    )];
    let p = plan(&mc, &observed(&jobs, holding, vec![]), &c, t(101));
    assert!(
        !p.actions.contains(&Action::RemoveFinalizer),
        "{:?}",
        p.actions
    );
    assert_eq!(label_actions(&p), vec![("gpu-1".to_string(), None)]);
    let clean = created(&p);
    assert_eq!(
        task_of(&clean[0]).unwrap().kind,
        TaskKind::Cleanup { keep: None }
    );

    // The label is gone and the cleanup ran: the finalizer goes.
    let bare = vec![node("gpu-1", &[("serve", "yes")])];
    let cleaned = task(&clean[0], TaskState::Succeeded);
    let p = plan(
        &mc,
        &observed(&jobs, bare.clone(), vec![cleaned]),
        &c,
        t(120),
    );
    assert!(
        p.actions.contains(&Action::RemoveFinalizer),
        "{:?}",
        p.actions
    );

    // A node that never runs its cleanup holds the cache back at most DELETION_WAIT.
    let stuck = task(&clean[0], TaskState::Running);
    let p = plan(
        &mc,
        &observed(&jobs, bare.clone(), vec![stuck.clone()]),
        &c,
        t(200),
    );
    assert!(!p.actions.contains(&Action::RemoveFinalizer));
    let p = plan(&mc, &observed(&jobs, bare, vec![stuck]), &c, t(100 + 600));
    assert!(
        p.actions.contains(&Action::RemoveFinalizer),
        "{:?}",
        p.actions
    );
}

#[test]
fn a_controller_that_may_not_list_nodes_touches_no_node_and_says_why() {
    let c = nl_cfg();
    let (mc, jobs) = published();
    let mut o = observed(&jobs, vec![], vec![]);
    o.node_local.as_mut().unwrap().problem = Some("the controller may not list nodes".into());
    let p = plan(&mc, &o, &c, t(30));
    assert!(
        created(&p).is_empty() && label_actions(&p).is_empty(),
        "{:?}",
        p.actions
    );
    let st = p.status.node_local.unwrap();
    assert_eq!(
        st.message.as_deref(),
        Some("the controller may not list nodes")
    );
    assert_eq!(st.ready_nodes, 0);
}

#[test]
fn node_copy_jobs_read_back_as_the_tasks_they_run_and_names_fit_a_label() {
    let c = nl_cfg();
    let mc = cache(NODE_LOCAL);
    let long_node = "n".repeat(200);
    for kind in [
        TaskKind::Fill {
            digest: DIGEST.into(),
        },
        TaskKind::Cleanup {
            keep: Some(DIGEST.into()),
        },
        TaskKind::Cleanup { keep: None },
    ] {
        for n in ["gpu-1", long_node.as_str()] {
            let j = build_job(&mc, n, &kind, &c).expect("job");
            let name = j.metadata.name.clone().unwrap();
            assert!(name.len() <= 63, "{name}");
            assert_eq!(name, node_jobs::job_name("mc", n, &kind));
            let back = task_of(&j).unwrap();
            assert_eq!((back.node.as_str(), &back.kind), (n, &kind));
            assert_eq!(back.state, TaskState::Running);
        }
    }
    // A finished Job reads back as its outcome, by the same conditions as the pipeline's Jobs.
    let mut j = build_job(&mc, "gpu-1", &TaskKind::Cleanup { keep: None }, &c).expect("job");
    let cond = |t: &str, msg: Option<&str>| k8s_openapi::api::batch::v1::JobCondition {
        type_: t.into(),
        status: "True".into(),
        message: msg.map(String::from),
        ..Default::default()
    };
    j.status = Some(k8s_openapi::api::batch::v1::JobStatus {
        conditions: Some(vec![cond("SuccessCriteriaMet", None)]),
        ..Default::default()
    });
    assert_eq!(task_of(&j).unwrap().state, TaskState::Succeeded);
    j.status = Some(k8s_openapi::api::batch::v1::JobStatus {
        conditions: Some(vec![cond(
            "Failed",
            Some("BackoffLimitExceeded: 3 pods failed"),
        )]),
        ..Default::default()
    });
    match task_of(&j).unwrap().state {
        TaskState::Failed { message } => {
            assert!(
                message.contains("BackoffLimitExceeded: 3 pods failed"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Different digests or nodes: different Jobs.
    let a = node_jobs::job_name(
        "mc",
        "gpu-1",
        &TaskKind::Fill {
            digest: DIGEST.into(),
        },
    );
    let b = node_jobs::job_name(
        "mc",
        "gpu-2",
        &TaskKind::Fill {
            digest: DIGEST.into(),
        },
    );
    let d2 = DIGEST.replace('1', "2");
    let c2 = node_jobs::job_name("mc", "gpu-1", &TaskKind::Fill { digest: d2 });
    assert!(a != b && a != c2 && b != c2);
    // No worker image: no Job (the status says why).
    assert!(build_job(
        &mc,
        "gpu-1",
        &TaskKind::Cleanup { keep: None },
        &Config::default()
    )
    .is_none());
}

#[test]
fn copy_paths_and_source_references() {
    assert_eq!(
        node_jobs::copy_dir("/var/lib/x/", "ns", "mc", DIGEST).as_deref(),
        Some("/var/lib/x/ns/mc/1111111111111111111111111111111111111111111111111111111111111111")
    );
    assert_eq!(node_jobs::copy_dir("/r", "ns", "mc", "sha256:abc"), None);
    assert_eq!(
        node_jobs::source_ref("reg.local:5000/a/b:v1", DIGEST).as_deref(),
        Some(format!("oci://reg.local:5000/a/b@{DIGEST}").as_str())
    );
    assert_eq!(
        node_jobs::source_ref("reg.local/a/b", DIGEST).as_deref(),
        Some(format!("oci://reg.local/a/b@{DIGEST}").as_str())
    );
    assert_eq!(node_jobs::source_ref("noslash", DIGEST), None);
}
