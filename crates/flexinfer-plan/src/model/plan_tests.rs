//! Table tests of the Model planner: `plan` then `conclude`, as the reconciler runs them.

use std::time::Duration;

use crate::model::plan::EventType;
use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::annotations;
use flexinfer_api::model::ModelPhase;
use flexinfer_api::modelcache::CachePhase;
use flexinfer_api::{Model, ModelCache};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};

use super::plan::*;
use super::render::RenderConfig;
use super::status::DeploymentObservation;

const UID: &str = "uid-model-1";
const NOW: i64 = 1_800_000_000;

fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap_or_else(|e| panic!("{e}"))
}

fn model(spec: Value, annos: &[(&str, &str)], last_active_ago: Option<i64>) -> Model {
    let annos: serde_json::Map<String, Value> = annos
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let mut m: Model = serde_json::from_value(json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": "m", "namespace": "ns", "uid": UID, "generation": 2, "annotations": annos},
        "spec": spec,
    }))
    .unwrap_or_else(|e| panic!("model: {e}"));
    if let Some(ago) = last_active_ago {
        m.status = Some(flexinfer_api::ModelStatus {
            last_active_time: Some(Time(ts(NOW - ago))),
            ..Default::default()
        });
    }
    m
}

fn pvc(extra: Value) -> Value {
    let mut s =
        json!({"backend": "vllm", "source": "pvc://models/org/awq", "gpu": {"vendor": "amd"}});
    if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    s
}

fn owner(kind: &str, name: &str, uid: &str, controller: Option<bool>) -> OwnerReference {
    OwnerReference {
        api_version: "ai.flexinfer/v1alpha2".into(),
        kind: kind.into(),
        name: name.into(),
        uid: uid.into(),
        controller,
        block_owner_deletion: None,
    }
}

fn existing(refs: Vec<OwnerReference>) -> Option<Existing> {
    Some(Existing {
        owner_references: refs,
    })
}

fn cache(phase: &str) -> ModelCache {
    let mut c: ModelCache = serde_json::from_value(json!({
        "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llm", "namespace": "ns"}, "spec": {"source": "org/llm"},
    }))
    .unwrap_or_else(|e| panic!("cache: {e}"));
    c.status = Some(flexinfer_api::ModelCacheStatus {
        phase: CachePhase::ALL.into_iter().find(|p| p.as_str() == phase),
        path: Some("cache-pvc:llm/gptq".into()),
        ..Default::default()
    });
    c
}

/// The Deployment's answer to the apply: (ready, updated, observed the latest spec, scheduled pods).
type Rollout = (i32, i32, bool, i32);

struct Case {
    name: &'static str,
    model: Model,
    observed: Observed,
    rollout: Rollout,
    // expected
    applies: bool,
    replicas: i32,
    phase: ModelPhase,
    ready: (&'static str, &'static str),
    message_has: &'static [&'static str],
    events: &'static [(&'static str, EventType)],
    requeue_s: u64,
}

const NOT_READY: Rollout = (0, 0, true, 0);
const READY: Rollout = (1, 1, true, 1);
const W: EventType = EventType::Warning;
const N: EventType = EventType::Normal;
const GATE: (&str, &str) = (annotations::PROMOTION_GATE, annotations::PROMOTION_GATE_V1);

fn cases() -> Vec<Case> {
    let on = || Observed::default();
    let foreign_deploy = || Observed {
        deployment: existing(vec![]),
        ..Default::default()
    };
    vec![
        Case {
            name: "new warm model, nothing scheduled yet",
            model: model(pvc(json!({"serverless": {"enabled": false}})), &[], None),
            observed: on(),
            rollout: NOT_READY,
            applies: true,
            replicas: 1,
            phase: ModelPhase::Pending,
            ready: ("False", "Pending"),
            message_has: &["0/1 replicas scheduled"],
            events: &[("PhaseChanged", N)],
            requeue_s: 15,
        },
        Case {
            name: "scheduled, backend still loading",
            model: model(pvc(json!({"serverless": {"minReplicas": 1}})), &[], None),
            observed: on(),
            rollout: (0, 1, true, 1),
            applies: true,
            replicas: 1,
            phase: ModelPhase::Loading,
            ready: ("False", "Loading"),
            message_has: &["0/1 replicas ready"],
            events: &[("PhaseChanged", N)],
            requeue_s: 15,
        },
        Case {
            name: "all replicas ready",
            model: model(pvc(json!({"serverless": {"minReplicas": 1}})), &[], None),
            observed: on(),
            rollout: READY,
            applies: true,
            replicas: 1,
            phase: ModelPhase::Ready,
            ready: ("True", "Ready"),
            message_has: &["1/1 replicas ready at http://m.ns.svc:8000/v1"],
            events: &[("PhaseChanged", N)],
            requeue_s: 300,
        },
        Case {
            name: "ready replicas of an older spec are not Ready",
            model: model(pvc(json!({"serverless": {"minReplicas": 1}})), &[], None),
            observed: on(),
            rollout: (1, 1, false, 1),
            applies: true,
            replicas: 1,
            phase: ModelPhase::Loading,
            ready: ("False", "Loading"),
            message_has: &[],
            events: &[("PhaseChanged", N)],
            requeue_s: 15,
        },
        Case {
            name: "scale-to-zero without traffic is Idle",
            model: model(pvc(json!({})), &[], None),
            observed: on(),
            rollout: (0, 0, true, 0),
            applies: true,
            replicas: 0,
            phase: ModelPhase::Idle,
            ready: ("True", "Idle"),
            message_has: &["scaled to zero"],
            events: &[("PhaseChanged", N)],
            requeue_s: 300,
        },
        Case {
            name: "recent traffic scales up and rechecks when the idle timeout ends",
            model: model(pvc(json!({})), &[], Some(10)),
            observed: on(),
            rollout: READY,
            applies: true,
            replicas: 1,
            phase: ModelPhase::Ready,
            ready: ("True", "Ready"),
            message_has: &[],
            events: &[("PhaseChanged", N)],
            requeue_s: 291,
        },
        Case {
            name: "gated warm primary without validation runs as a canary",
            model: model(
                pvc(json!({"serverless": {"minReplicas": 1}})),
                &[GATE],
                None,
            ),
            observed: on(),
            rollout: (0, 0, true, 0),
            applies: true,
            replicas: 0,
            phase: ModelPhase::Idle,
            ready: ("True", "Idle"),
            message_has: &[],
            events: &[("PhaseChanged", N), ("PromotionBlocked", W)],
            requeue_s: 300,
        },
        Case {
            name: "invalid source: nothing applied",
            model: model(
                json!({"backend": "vllm", "source": "pvc://m//etc", "gpu": {"vendor": "amd"}}),
                &[],
                None,
            ),
            observed: on(),
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "InvalidSource"),
            message_has: &["absolute"],
            events: &[("PhaseChanged", W)],
            requeue_s: 120,
        },
        Case {
            name: "cache not ready: nothing applied, Pending",
            model: model(
                json!({"backend": "vllm", "source": "modelcache://llm", "gpu": {"vendor": "amd"}}),
                &[],
                None,
            ),
            observed: Observed {
                cache: Some(cache("Quantizing")),
                ..Default::default()
            },
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Pending,
            ready: ("False", "CacheNotReady"),
            message_has: &["Quantizing"],
            events: &[("PhaseChanged", N)],
            requeue_s: 60,
        },
        Case {
            name: "cache ready: applied",
            model: model(
                json!({"backend": "vllm", "source": "modelcache://llm", "gpu": {"vendor": "amd"},
                "serverless": {"minReplicas": 1}}),
                &[],
                None,
            ),
            observed: Observed {
                cache: Some(cache("Ready")),
                ..Default::default()
            },
            rollout: READY,
            applies: true,
            replicas: 1,
            phase: ModelPhase::Ready,
            ready: ("True", "Ready"),
            message_has: &[],
            events: &[("PhaseChanged", N)],
            requeue_s: 300,
        },
        Case {
            name: "children controlled by this Model are updated",
            model: model(pvc(json!({"serverless": {"minReplicas": 1}})), &[], None),
            observed: Observed {
                deployment: existing(vec![owner("Model", "m", UID, Some(true))]),
                service: existing(vec![
                    owner("Other", "x", "uid-x", None),
                    owner("Model", "m", UID, Some(true)),
                ]),
                ..Default::default()
            },
            rollout: READY,
            applies: true,
            replicas: 1,
            phase: ModelPhase::Ready,
            ready: ("True", "Ready"),
            message_has: &[],
            events: &[("PhaseChanged", N)],
            requeue_s: 300,
        },
        Case {
            name: "foreign Deployment without owner is not adopted",
            model: model(pvc(json!({"serverless": {"minReplicas": 1}})), &[], None),
            observed: foreign_deploy(),
            rollout: READY,
            applies: false,
            replicas: 1,
            phase: ModelPhase::Failed,
            ready: ("False", "ResourceConflict"),
            message_has: &["Deployment m", "has no owner"],
            events: &[("PhaseChanged", W), ("ResourceConflict", W)],
            requeue_s: 120,
        },
        Case {
            name: "foreign Service controlled by another object is not adopted",
            model: model(pvc(json!({})), &[], None),
            observed: Observed {
                deployment: existing(vec![owner("Model", "m", UID, Some(true))]),
                service: existing(vec![owner("HelmRelease", "web", "uid-h", Some(true))]),
                ..Default::default()
            },
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "ResourceConflict"),
            message_has: &["Service m", "controlled by HelmRelease web (uid uid-h)"],
            events: &[("PhaseChanged", W), ("ResourceConflict", W)],
            requeue_s: 120,
        },
        Case {
            name: "an owner reference to this Model that is not the controller is not enough",
            model: model(pvc(json!({})), &[], None),
            observed: Observed {
                deployment: existing(vec![owner("Model", "m", UID, None)]),
                ..Default::default()
            },
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "ResourceConflict"),
            message_has: &["no controller; owners: Model m"],
            events: &[("PhaseChanged", W), ("ResourceConflict", W)],
            requeue_s: 120,
        },
        Case {
            name: "a Model of the same name but another uid (an earlier one) does not count",
            model: model(pvc(json!({})), &[], None),
            observed: Observed {
                deployment: existing(vec![owner("Model", "m", "uid-old", Some(true))]),
                ..Default::default()
            },
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "ResourceConflict"),
            message_has: &["controlled by Model m (uid uid-old)"],
            events: &[("PhaseChanged", W), ("ResourceConflict", W)],
            requeue_s: 120,
        },
        Case {
            name: "a CUDA image on an AMD Model is refused with a Warning naming the field and the fix",
            model: model(
                pvc(json!({"image": "docker.io/vllm/vllm-openai:v0.18.0"})),
                &[],
                None,
            ),
            observed: on(),
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "ImageVendorMismatch"),
            message_has: &["spec.image", "CUDA build", "AMD GPUs", "vllm-openai-rocm"],
            events: &[("PhaseChanged", W), ("ImageVendorMismatch", W)],
            requeue_s: 120,
        },
        Case {
            name: "vLLM's Marlin kernels on AMD are refused with a Warning",
            model: model(
                pvc(json!({"config": {"extraArgs": ["--quantization=awq_marlin"]}})),
                &[],
                None,
            ),
            observed: on(),
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "UnsupportedCombination"),
            message_has: &["spec.config.extraArgs", "awq_marlin"],
            events: &[("PhaseChanged", W), ("UnsupportedCombination", W)],
            requeue_s: 120,
        },
        Case {
            name: "exllamav2 on AMD without an image is refused with a Warning",
            model: model(
                json!({"backend": "exllamav2", "source": "pvc://models/exl2", "gpu": {"vendor": "amd"}}),
                &[],
                None,
            ),
            observed: on(),
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "ImageNotConfigured"),
            message_has: &["no exllamav2 image for AMD GPUs", "spec.image"],
            events: &[("PhaseChanged", W), ("ImageNotConfigured", W)],
            requeue_s: 120,
        },
        Case {
            name: "a configuration problem is reported before a conflict",
            model: model(
                json!({"backend": "vllm", "source": "pvc://m//etc", "gpu": {"vendor": "amd"}}),
                &[],
                None,
            ),
            observed: foreign_deploy(),
            rollout: READY,
            applies: false,
            replicas: 0,
            phase: ModelPhase::Failed,
            ready: ("False", "InvalidSource"),
            message_has: &[],
            events: &[("PhaseChanged", W)],
            requeue_s: 120,
        },
    ]
}

/// What the reconciler does between `plan` and `conclude`: apply, then read the rollout.
fn run(c: &Case) -> (ModelPlan, Conclusion) {
    let p = plan(&c.model, &c.observed, &RenderConfig::default(), ts(NOW));
    let rollout = p.children.as_ref().ok().map(|_| {
        let (ready, updated, current, scheduled) = c.rollout;
        DeploymentObservation {
            desired: p.replicas.replicas,
            ready,
            updated,
            current,
            scheduled,
        }
    });
    let conclusion = p.conclude(&c.model, rollout, ts(NOW));
    (p, conclusion)
}

#[test]
fn plan_table() {
    for c in cases() {
        let (p, out) = run(&c);
        let n = c.name;
        assert_eq!(
            p.children.is_ok(),
            c.applies,
            "{n}: {:?}",
            p.children.as_ref().err()
        );
        assert_eq!(p.replicas.replicas, c.replicas, "{n}");
        if let Ok(r) = &p.children {
            let spec = r.deployment.spec.as_ref();
            assert_eq!(spec.and_then(|s| s.replicas), Some(c.replicas), "{n}");
        }
        assert_eq!(out.phase, c.phase, "{n}");
        assert_eq!(out.previous, None, "{n}");
        let st = out
            .status
            .clone()
            .unwrap_or_else(|| panic!("{n}: a first status is written"));
        assert_eq!(st.phase, Some(c.phase), "{n}");
        assert_eq!(st.observed_generation, Some(2), "{n}");
        let ready = conditions::find(&st.conditions, types::READY)
            .unwrap_or_else(|| panic!("{n}: no Ready condition"));
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            c.ready,
            "{n}"
        );
        for part in c.message_has {
            assert!(
                ready.message.contains(part),
                "{n}: {:?} lacks {part:?}",
                ready.message
            );
        }
        let events: Vec<_> = out.events.iter().map(|e| (e.reason, e.type_)).collect();
        assert_eq!(events, c.events, "{n}");
        if c.events.get(1).is_some_and(|e| e.0 == c.ready.1) {
            let note = &out.events[1].note;
            assert_eq!(
                note, &ready.message,
                "{n}: the event says what the condition says"
            );
        }
        assert_eq!(out.requeue, Duration::from_secs(c.requeue_s), "{n}");
    }
}

/// A second reconcile that sees the status the first one wrote writes nothing and says nothing.
#[test]
fn settled_models_write_nothing() {
    for mut c in cases() {
        let (_, first) = run(&c);
        let mut st = first
            .status
            .unwrap_or_else(|| panic!("{}: first status", c.name));
        // The proxy's field survives (the controller never writes it).
        st.last_active_time = c
            .model
            .status
            .as_ref()
            .and_then(|s| s.last_active_time.clone());
        c.model.status = Some(st);
        let (_, second) = run(&c);
        assert!(second.status.is_none(), "{}: status rewritten", c.name);
        assert_eq!(second.events, vec![], "{}", c.name);
        assert_eq!(second.previous, Some(c.phase), "{}", c.name);
    }
}

/// A conflict that goes away (the foreign object was removed) deploys and reports it.
#[test]
fn conflict_resolves_once_the_foreign_object_is_gone() {
    let cases = cases();
    let Some(mut c) = cases.into_iter().find(|c| c.ready.1 == "ResourceConflict") else {
        panic!("no conflict case");
    };
    let (_, first) = run(&c);
    c.model.status = first.status;
    c.observed.deployment = None;
    c.observed.service = None;
    let (p, out) = run(&c);
    assert!(p.children.is_ok());
    assert_eq!(out.phase, ModelPhase::Ready);
    let events: Vec<_> = out
        .events
        .iter()
        .map(|e| (e.reason, e.note.clone()))
        .collect();
    assert_eq!(
        events,
        vec![("PhaseChanged", "Failed -> Ready".to_string())]
    );
}

#[test]
fn rollout_and_pod_count() {
    let dep =
        |gen: Option<i64>, observed: Option<i64>, ready: Option<i32>, updated: Option<i32>| {
            let mut d = Deployment::default();
            d.metadata.generation = gen;
            d.status = Some(DeploymentStatus {
                observed_generation: observed,
                ready_replicas: ready,
                updated_replicas: updated,
                ..Default::default()
            });
            d
        };
    // (deployment, desired, want (ready, updated, current), want pods counted)
    let cases = [
        (
            dep(Some(2), Some(2), Some(1), Some(1)),
            1,
            (1, 1, true),
            false,
        ),
        (
            dep(Some(3), Some(2), Some(1), Some(1)),
            1,
            (1, 1, false),
            false,
        ),
        (dep(Some(2), None, None, None), 1, (0, 0, false), true),
        (dep(Some(2), Some(2), None, None), 0, (0, 0, true), false),
        (
            dep(Some(2), Some(2), Some(1), Some(2)),
            2,
            (1, 2, true),
            true,
        ),
    ];
    for (i, (d, desired, (ready, updated, current), count)) in cases.into_iter().enumerate() {
        let o = rollout(&d, desired);
        assert_eq!(
            (o.desired, o.ready, o.updated, o.current),
            (desired, ready, updated, current),
            "case {i}"
        );
        assert_eq!(needs_pod_count(&o), count, "case {i}");
    }
    let pod = |node: Option<&str>, deleting: bool| {
        let mut p = Pod {
            spec: Some(PodSpec {
                node_name: node.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        };
        if deleting {
            p.metadata.deletion_timestamp = Some(Time(ts(NOW)));
        }
        p
    };
    let pods = [
        pod(Some("n1"), false),
        pod(None, false),
        pod(Some("n2"), true),
        pod(Some("n3"), false),
    ];
    assert_eq!(scheduled(&pods), 2);
    assert_eq!(scheduled(&[]), 0);
}

// ---------------------------------------------------------------------------------------------
// Shared GPU groups: a warm primary and a scale-to-zero canary on one group, walked through the planner as two
// reconcilers would run it (each reads the other's status and running replicas).

struct Group {
    models: Vec<Model>,
    running: std::collections::BTreeMap<String, i32>,
    /// (model, event reason) in the order they were planned.
    events: Vec<(String, &'static str)>,
    preemptions: Vec<(String, String)>,
}

fn member(name: &str, priority: i32, min_replicas: i32) -> Model {
    let mut m = model(
        pvc(
            json!({"gpu": {"vendor": "amd", "shared": "gpu0", "priority": priority},
                    "serverless": {"minReplicas": min_replicas, "idleTimeout": "5m",
                                   "keepaliveInterval": "10s"}}),
        ),
        &[],
        None,
    );
    m.metadata.name = Some(name.into());
    m.metadata.uid = Some(format!("uid-{name}"));
    m
}

impl Group {
    fn new(models: Vec<Model>) -> Self {
        Self {
            models,
            running: Default::default(),
            events: Vec::new(),
            preemptions: Vec::new(),
        }
    }

    fn idx(&self, name: &str) -> usize {
        self.models
            .iter()
            .position(|m| m.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no member {name}"))
    }

    /// The proxy saw a request for `name` at `at`.
    fn touch(&mut self, name: &str, at: i64) {
        let i = self.idx(name);
        let st = self.models[i].status.get_or_insert_with(Default::default);
        st.last_active_time = Some(Time(ts(at)));
    }

    /// Reconcile `name` at `at`: plan, apply (its Deployment's replicas, pods follow at once
    /// unless `pods_linger`), conclude, write the status. Returns the replicas applied.
    fn reconcile(&mut self, name: &str, at: i64, pods_linger: bool) -> i32 {
        let i = self.idx(name);
        let observed = Observed {
            shared: Some(SharedObservation {
                models: self.models.clone(),
                running: self.running.clone(),
                grace: Duration::from_secs(30),
            }),
            ..Default::default()
        };
        let m = self.models[i].clone();
        let p = plan(&m, &observed, &RenderConfig::default(), ts(at));
        assert!(p.children.is_ok(), "{name}: {:?}", p.children.err());
        let want = p.replicas.replicas;
        let before = self.running.get(name).copied().unwrap_or(0);
        let now_running = if pods_linger { before.max(want) } else { want };
        self.running.insert(name.into(), now_running);
        let rollout = DeploymentObservation {
            desired: want,
            ready: want,
            updated: want,
            current: true,
            scheduled: want,
        };
        let out = p.conclude(&m, Some(rollout), ts(at));
        for e in &out.events {
            if e.reason.starts_with("SharedGroup") {
                self.events.push((name.into(), e.reason));
            }
        }
        if let Some(g) = out.preempted_in {
            self.preemptions.push((name.into(), g));
        }
        if let Some(st) = out.status {
            self.models[i].status = Some(st);
        }
        want
    }

    fn state(&self, name: &str) -> flexinfer_api::model::SharedGroupStatus {
        self.models[self.idx(name)]
            .status
            .as_ref()
            .and_then(|s| s.shared_group.clone())
            .unwrap_or_else(|| panic!("{name}: no sharedGroup status"))
    }

    fn ready(&self, name: &str) -> (String, String, String) {
        let st = self.models[self.idx(name)]
            .status
            .clone()
            .unwrap_or_default();
        let c = conditions::find(&st.conditions, types::READY)
            .unwrap_or_else(|| panic!("{name}: no Ready"));
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    fn take_events(&mut self) -> Vec<(String, &'static str)> {
        std::mem::take(&mut self.events)
    }
}

#[test]
fn shared_group_canary_preempts_the_primary_and_hands_the_lane_back() {
    use flexinfer_api::model::SharedGroupState::*;
    let s = |x: &str| x.to_string();
    let mut g = Group::new(vec![member("primary", 250, 1), member("canary", 255, 0)]);
    let t0 = NOW;

    // Start: the warm primary takes the lane; the canary has no demand.
    assert_eq!(g.reconcile("primary", t0, false), 1);
    assert_eq!(g.reconcile("canary", t0, false), 0);
    assert_eq!(g.state("primary").state, Active);
    assert_eq!(g.state("canary").state, Idle);
    assert_eq!(g.take_events(), vec![(s("primary"), "SharedGroupActive")]);

    // Validation demand for the canary: it queues first in line while the primary runs; the
    // idle primary is preempted at once, its pod terminates, then the canary starts.
    let t1 = t0 + 600;
    g.touch("canary", t1);
    assert_eq!(g.reconcile("canary", t1, false), 0);
    let c = g.state("canary");
    assert_eq!((c.state, c.queue_position), (Queued, Some(1)));
    assert_eq!(g.ready("canary").1, "Queued");
    assert_eq!(g.reconcile("primary", t1, false), 0);
    let p = g.state("primary");
    assert_eq!(
        (p.state, p.preempted_by.as_deref(), p.queue_position),
        (Preempted, Some("canary"), Some(2))
    );
    let (ready, reason, message) = g.ready("primary");
    assert_eq!((ready.as_str(), reason.as_str()), ("False", "Preempted"));
    assert!(
        message.contains("canary") && message.contains("255 > 250"),
        "{message}"
    );
    assert_eq!(
        g.models[g.idx("primary")]
            .status
            .as_ref()
            .and_then(|s| s.phase),
        Some(ModelPhase::Pending)
    );
    assert_eq!(g.reconcile("canary", t1 + 2, false), 1);
    assert_eq!(g.state("canary").state, Active);
    assert_eq!(
        g.take_events(),
        vec![
            (s("canary"), "SharedGroupQueued"),
            (s("primary"), "SharedGroupPreempted"),
            (s("canary"), "SharedGroupActive"),
        ]
    );
    assert_eq!(g.preemptions, vec![(s("primary"), s("gpu0"))]);
    // Nothing changes while the canary serves: no status write, no event.
    let before = g.models.clone();
    g.touch("canary", t1 + 60);
    assert_eq!(g.reconcile("primary", t1 + 60, false), 0);
    assert_eq!(g.reconcile("canary", t1 + 60, false), 1);
    assert!(g.take_events().is_empty());
    assert_eq!(
        g.state("primary").last_transition_time,
        before[0].status.as_ref().and_then(|s| s
            .shared_group
            .as_ref()?
            .last_transition_time
            .clone())
    );

    // The canary idles out (idleTimeout 5m after its last request): it releases the lane; its
    // pod still terminates, so the primary waits, then comes back.
    let t2 = t1 + 60 + 301;
    assert_eq!(g.reconcile("canary", t2, true), 0);
    assert_eq!(g.state("canary").state, Idle);
    assert_eq!(g.reconcile("primary", t2, false), 0);
    assert_eq!(g.state("primary").state, Queued);
    g.running.insert("canary".into(), 0); // the pod is gone
    assert_eq!(g.reconcile("primary", t2 + 5, false), 1);
    assert_eq!(g.state("primary").state, Active);
    assert_eq!(g.ready("primary").0, "True");
    assert_eq!(
        g.take_events(),
        vec![
            (s("canary"), "SharedGroupIdle"),
            (s("primary"), "SharedGroupQueued"),
            (s("primary"), "SharedGroupActive"),
        ]
    );
    assert_eq!(g.preemptions.len(), 1);
}

#[test]
fn shared_group_busy_primary_drains_within_the_grace_period() {
    use flexinfer_api::model::SharedGroupState::*;
    let mut g = Group::new(vec![member("primary", 250, 1), member("canary", 255, 0)]);
    let t0 = NOW;
    assert_eq!(g.reconcile("primary", t0, false), 1);
    // A request to the primary is in flight (refreshed 3 s ago, keepalive 10 s) when the canary
    // is asked for.
    g.touch("primary", t0 + 97);
    g.touch("canary", t0 + 100);
    assert_eq!(g.reconcile("canary", t0 + 100, false), 0);
    assert_eq!(
        g.reconcile("primary", t0 + 100, false),
        1,
        "keeps serving in flight"
    );
    assert_eq!(g.state("primary").state, Preempted);
    assert_eq!(
        g.ready("primary").1,
        "Ready",
        "still serving while it drains"
    );
    assert_eq!(
        g.reconcile("canary", t0 + 110, false),
        0,
        "waits for the primary"
    );
    // The stream goes on (keepalive every 10 s) but the grace period (30 s) ends.
    g.touch("primary", t0 + 125);
    assert_eq!(g.reconcile("primary", t0 + 125, false), 1);
    g.touch("primary", t0 + 131);
    assert_eq!(
        g.reconcile("primary", t0 + 131, false),
        0,
        "grace period over"
    );
    assert_eq!(g.reconcile("canary", t0 + 132, false), 1);
    assert_eq!(g.state("canary").state, Active);
}

#[test]
fn shared_group_lower_priority_demand_queues_and_says_behind_whom() {
    use flexinfer_api::model::SharedGroupState::*;
    let mut g = Group::new(vec![member("primary", 250, 1), member("batch", 100, 0)]);
    assert_eq!(g.reconcile("primary", NOW, false), 1);
    g.touch("batch", NOW + 10);
    assert_eq!(g.reconcile("batch", NOW + 10, false), 0);
    let b = g.state("batch");
    assert_eq!(
        (b.state, b.queue_position, b.active_model.as_deref()),
        (Queued, Some(2), Some("primary"))
    );
    let (ready, reason, message) = g.ready("batch");
    assert_eq!((ready.as_str(), reason.as_str()), ("False", "Queued"));
    assert!(
        message.contains("behind primary (priority 250)"),
        "{message}"
    );
    // The primary is not disturbed.
    assert_eq!(g.reconcile("primary", NOW + 10, false), 1);
    assert_eq!(g.state("primary").state, Active);
}

#[test]
fn leaving_a_shared_group_clears_its_status() {
    let mut g = Group::new(vec![member("primary", 250, 1)]);
    assert_eq!(g.reconcile("primary", NOW, false), 1);
    assert!(g.models[0]
        .status
        .as_ref()
        .and_then(|s| s.shared_group.as_ref())
        .is_some());
    g.models[0].spec.gpu.shared = None;
    let m = g.models[0].clone();
    let p = plan(
        &m,
        &Observed::default(),
        &RenderConfig::default(),
        ts(NOW + 1),
    );
    assert!(p.shared.is_none());
    let out = p.conclude(&m, None, ts(NOW + 1));
    let st = out
        .status
        .unwrap_or_else(|| panic!("the stale sharedGroup is removed"));
    assert!(st.shared_group.is_none());
}

// ---------------------------------------------------------------------------------------------
// The promotion gate bound to the artifact: a validation covers the artifact served when it was
// accepted; a new generation closes the gate until the evidence names the new digest.

const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

fn cache_with_digest(digest: &str) -> ModelCache {
    let mut c = cache("Ready");
    if let Some(st) = c.status.as_mut() {
        st.quantization = Some(flexinfer_api::modelcache::QuantizationStatus {
            config_digest: Some(digest.into()),
            ..Default::default()
        });
    }
    c
}

#[test]
fn gate_closes_again_when_the_served_artifact_changes() {
    let mut m = model(
        json!({"backend": "vllm", "source": "modelcache://llm", "gpu": {"vendor": "amd"},
               "serverless": {"minReplicas": 1}}),
        &[GATE, (annotations::PROMOTION_VALIDATION, "passed")],
        None,
    );
    let step = |m: &mut Model, digest: &str| {
        let observed = Observed {
            cache: Some(cache_with_digest(digest)),
            ..Default::default()
        };
        let p = plan(m, &observed, &RenderConfig::default(), ts(NOW));
        let out = p.conclude(m, None, ts(NOW));
        if let Some(st) = out.status.clone() {
            m.status = Some(st);
        }
        let st = m.status.clone().unwrap_or_default();
        let gate = conditions::find(&st.conditions, types::PROMOTION_GATE)
            .map(|c| (c.reason.clone(), c.message.clone()))
            .unwrap_or_default();
        (p.replicas.replicas, gate, st.validated_artifact, out.events)
    };
    // First accepted: bound to D1, served warm.
    let (replicas, (reason, _), recorded, _) = step(&mut m, D1);
    assert_eq!((replicas, reason.as_str()), (1, "Validated"));
    assert_eq!(recorded.as_deref(), Some(D1));
    // A new generation (D2) lands: the old validation does not cover it.
    let (replicas, (reason, message), recorded, events) = step(&mut m, D2);
    assert_eq!((replicas, reason.as_str()), (0, "Blocked"), "{message}");
    assert!(message.contains(D1) && message.contains(D2), "{message}");
    assert_eq!(
        recorded.as_deref(),
        Some(D1),
        "the old record is kept while closed"
    );
    assert!(events.iter().any(|e| e.reason == "PromotionBlocked"));
    // Still closed on the next reconcile (the record does not re-bind to D2 by itself).
    let (replicas, (reason, _), _, _) = step(&mut m, D2);
    assert_eq!((replicas, reason.as_str()), (0, "Blocked"));
    // Evidence naming D2 re-opens it.
    m.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            annotations::PROMOTION_EVIDENCE.into(),
            format!("eval run 12, sha256:{D2}"),
        );
    let (replicas, (reason, _), recorded, _) = step(&mut m, D2);
    assert_eq!((replicas, reason.as_str()), (1, "Validated"));
    assert_eq!(recorded.as_deref(), Some(D2));
}
