//! Property tests: whatever a user writes into a ModelCache's or a Model's
//! annotations, source and status, and whatever a pod reports (termination message, log tail,
//! waiting reasons), the pure planners return a plan — they never panic. The planners are where
//! every annotation and JSON-map reader of the controller runs (pod labels/annotations, rerun
//! and reset triggers, force-image-update, the promotion gate's validation and evidence, served
//! paths), so running them over arbitrary values covers those private readers too.
//!
//! 100 000 cases per property by default (`PROPTEST_CASES` overrides).

use std::collections::BTreeMap;

use flexinfer_api::contract::{annotations, JobPhase};
use flexinfer_api::{Model, ModelCache};
use flexinfer_controller::model::render::RenderConfig;
use flexinfer_controller::modelcache::observe::{JobState, ObservedJob, ObservedPod};
use flexinfer_controller::modelcache::plan::LogTail;
use flexinfer_controller::modelcache::Config;
use k8s_openapi::jiff::Timestamp;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap_or_default()
}

/// Strings users put in annotations: arbitrary text, JSON objects with arbitrary keys and values,
/// numbers, booleans, timestamps, digests, and very long or odd Unicode values.
fn user_value() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,80}",
        "[a-z0-9./:-]{0,40}",
        prop::collection::btree_map(".{0,20}", ".{0,20}", 0..4)
            .prop_map(|m| serde_json::to_string(&m).unwrap_or_default()),
        prop::collection::btree_map(
            "[a-z./-]{0,30}",
            prop_oneof![
                any::<i64>().prop_map(serde_json::Value::from),
                any::<f64>().prop_map(serde_json::Value::from),
                any::<bool>().prop_map(serde_json::Value::from),
                Just(serde_json::Value::Null),
                Just(serde_json::json!([1, {"a": 2}])),
            ],
            0..4
        )
        .prop_map(|m| serde_json::to_string(&m).unwrap_or_default()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("passed".to_string()),
        Just("quantized-artifact-v1".to_string()),
        Just(format!("sha256:{}", "a".repeat(64))),
        "[0-9a-fA-F]{60,70}",
        Just("2026-12-01T00:00:00Z".to_string()),
        Just("9999-12-31T23:59:59Z".to_string()),
        "\\PC{0,300}",
    ]
}

/// Every annotation key the controller reads, plus arbitrary ones.
fn annotation_key() -> impl Strategy<Value = String> {
    let mut known: Vec<String> = vec![
        annotations::JOB_POD_LABELS.into(),
        annotations::JOB_POD_ANNOTATIONS.into(),
        annotations::REDOWNLOAD.into(),
        annotations::REABLITERATE.into(),
        annotations::REQUANTIZE.into(),
        annotations::RESET_RETRIES.into(),
        annotations::FORCE_IMAGE_UPDATE.into(),
        annotations::PROMOTION_GATE.into(),
        annotations::PROMOTION_VALIDATION.into(),
        annotations::PROMOTION_EVIDENCE.into(),
        annotations::SERVED_PATH.into(),
        annotations::GPU_PRIORITY.into(),
        annotations::GPU_SHARED_GROUP.into(),
    ];
    for p in JobPhase::ALL {
        known.push(annotations::phase_pod_labels(p.as_str()));
        known.push(annotations::phase_pod_annotations(p.as_str()));
    }
    prop_oneof![
        4 => prop::sample::select(known),
        1 => "[a-z./-]{1,40}",
    ]
}

fn annotation_map() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(annotation_key(), user_value(), 0..6)
}

const CACHE: &str = r#"
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: mc, namespace: ns, uid: u-1, generation: 1, finalizers: [flexinfer.ai/modelcache-cleanup]}
spec:
  source: org/model
  nodeSelector: {flexinfer.ai/gpu.arch: gfx1100}
  maxRetries: 2
  abliteration: {useGPU: true}
  quantization: {format: GPTQ, useGPU: true}
  publish: {ociRef: "reg.local/models/mc"}
"#;

fn job_state() -> impl Strategy<Value = JobState> {
    prop_oneof![
        Just(JobState::Active),
        Just(JobState::Succeeded),
        (".{0,30}", ".{0,80}").prop_map(|(reason, message)| JobState::Failed { reason, message }),
    ]
}

prop_compose! {
    fn observed_job()(
        phase in prop::sample::select(JobPhase::ALL.to_vec()),
        image in ".{0,40}",
        spec_hash in prop::option::of(".{0,70}"),
        created in -100_000i64..100_000,
        state in job_state(),
        running in any::<bool>(),
        exit_code in prop::option::of(any::<i32>()),
        termination in prop::option::of(prop_oneof![
            "\\PC{0,200}",
            Just(r#"{"phase":"download","ok":true,"outputDir":"../../etc","generation":"zz"}"#.to_string()),
            Just(r#"{"ok":false,"reason":"x","message":"y","retryable":true}"#.to_string()),
        ]),
        waiting in prop::option::of(prop::sample::select(vec![
            "ImagePullBackOff".to_string(), "ErrImagePull".to_string(), "ContainerCreating".to_string()
        ])),
        unschedulable in prop::option::of(".{0,40}"),
        deadline in prop::option::of(any::<i64>()),
        out_dir in prop::option::of(prop_oneof![
            "[a-z0-9./-]{0,40}".boxed(),
            Just("/abs/path".to_string()).boxed(),
            Just("mc/../../x".to_string()).boxed(),
        ]),
    ) -> ObservedJob {
        ObservedJob {
            phase,
            name: format!("mc-{}", phase.as_str()),
            image,
            spec_hash,
            created: t(created),
            started: t(created),
            terminating: false,
            state,
            pod: Some(ObservedPod {
                name: "p".into(),
                running,
                terminated_reason: None,
                exit_code,
                termination_message: termination,
                waiting_reason: waiting,
                waiting_message: Some("msg".into()),
                created: Some(t(created)),
                unschedulable,
            }),
            deadline_seconds: deadline,
            out_dir,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// The ModelCache planner over arbitrary annotations, Jobs, pod reports, log tails and
    /// served directories.
    #[test]
    fn modelcache_plan_never_panics(
        ann in annotation_map(),
        jobs in prop::collection::vec(observed_job(), 0..3),
        log in prop::option::of(prop_oneof![
            "\\PC{0,300}".prop_map(LogTail::Read),
            Just(LogTail::Read(r#"{"event":"progress","percent":1e308,"layer":18446744073709551615,"total":0}"#.to_string())),
            Just(LogTail::Unreadable),
        ]),
        served in prop::collection::vec("[a-z0-9./-]{0,40}", 0..3),
        now in -100_000i64..10_000_000,
    ) {
        let mut mc: ModelCache = serde_norway::from_str(CACHE).expect("fixture");
        mc.metadata.annotations = Some(ann);
        let observed = flexinfer_controller::modelcache::Observed {
            jobs: jobs.into_iter().map(|j| (j.phase, j)).collect(),
            pvc_exists: true,
            log_tail: log,
            served_dirs: served,
            ..Default::default()
        };
        let cfg = Config { worker_image: Some("worker:1".into()), ..Config::default() };
        let _ = flexinfer_controller::modelcache::plan(&mc, &observed, &cfg, t(now));
    }

    /// The Model planner (gate, replicas, render) over arbitrary annotations, sources, status
    /// timestamps and recorded artifacts, and an arbitrary referenced cache digest.
    #[test]
    fn model_plan_never_panics(
        ann in annotation_map(),
        source in prop_oneof![
            1 => ".{0,80}",
            1 => "(modelcache|pvc|hf|oci)://[a-z0-9./:@-]{0,60}",
            3 => Just("modelcache://mc".to_string()),
        ],
        gated in any::<bool>(),
        evidence in user_value(),
        idle in prop_oneof![".{0,30}", "[0-9]{1,25}[smhd]?"],
        min_replicas in prop_oneof![0..3i32, any::<i32>()],
        last_active in prop::option::of(any::<i64>()),
        validated in prop::option::of(user_value()),
        digest in prop::option::of(user_value()),
        now in any::<i32>(),
    ) {
        let spec = serde_json::json!({
            "backend": "vllm",
            "source": source,
            "serverless": {"enabled": true, "minReplicas": min_replicas, "idleTimeout": idle},
        });
        let Ok(mut m) = serde_json::from_value::<Model>(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": spec,
        })) else {
            return Ok(());
        };
        let mut ann = ann;
        if gated {
            // Half the cases go through the gate: gated, with arbitrary evidence.
            ann.insert(annotations::PROMOTION_GATE.into(), annotations::PROMOTION_GATE_V1.into());
            ann.insert(annotations::PROMOTION_EVIDENCE.into(), evidence);
        }
        m.metadata.annotations = Some(ann);
        let mut status = serde_json::json!({});
        if let Some(s) = last_active {
            if let Ok(ts) = Timestamp::from_second(s.clamp(-377_705_116_800, 253_402_207_199)) {
                status["lastActiveTime"] = serde_json::json!(ts.to_string());
            }
        }
        if let Some(v) = validated {
            status["validatedArtifact"] = serde_json::json!(v);
        }
        m.status = serde_json::from_value(status).ok();
        let cache = digest.and_then(|d| {
            let mut c: ModelCache = serde_norway::from_str(CACHE).ok()?;
            c.metadata.name = Some(
                m.spec.source.strip_prefix("modelcache://").unwrap_or("mc").to_string(),
            );
            c.status = serde_json::from_value(serde_json::json!({
                "phase": "Ready", "path": "/cache/mc/gptq",
                "quantization": {"configDigest": d},
            })).ok();
            Some(c)
        });
        let observed = flexinfer_controller::model::Observed {
            cache,
            ..Default::default()
        };
        let _ = flexinfer_controller::model::plan(
            &m,
            &observed,
            &RenderConfig::default(),
            Timestamp::from_second(i64::from(now)).unwrap_or_default(),
        );
    }

    /// The node-local copy planner over arbitrary published digests, node labels (the cache's label
    /// with any value) and fill/cleanup Jobs: it never panics, and it never labels a node with a value
    /// that is not a valid label value derived from the published digest.
    #[test]
    fn node_local_plan_never_panics(
        want in prop::option::of(prop_oneof![
            "\\PC{0,80}".boxed(),
            "sha256:[0-9a-f]{64}".boxed(),
            "sha256:[0-9a-fA-F]{60,70}".boxed(),
        ]),
        nodes in prop::collection::vec(
            ("[a-z0-9.-]{0,20}", prop::option::of("\\PC{0,70}"), any::<bool>(), any::<bool>()),
            0..5,
        ),
        tasks in prop::collection::vec(
            ("[a-z0-9.-]{0,20}", prop::option::of("\\PC{0,70}"), any::<bool>(), 0u8..3, any::<bool>()),
            0..6,
        ),
        deleting in any::<bool>(),
        deadline in any::<bool>(),
    ) {
        use flexinfer_controller::modelcache::nodelocal as nl;
        let key = nl::label_key("ns", "mc");
        let selector = BTreeMap::from([("gpu".to_string(), "yes".to_string())]);
        let nodes: Vec<nl::NodeView> = nodes
            .into_iter()
            .map(|(name, held, gpu, unschedulable)| {
                let mut labels = BTreeMap::new();
                if gpu {
                    labels.insert("gpu".to_string(), "yes".to_string());
                }
                if let Some(h) = held {
                    labels.insert(key.clone(), h);
                }
                nl::NodeView { name, labels, unschedulable }
            })
            .collect();
        let tasks: Vec<nl::Task> = tasks
            .into_iter()
            .map(|(node, digest, fill, state, terminating)| nl::Task {
                node,
                kind: if fill {
                    nl::TaskKind::Fill { digest: digest.unwrap_or_default() }
                } else {
                    nl::TaskKind::Cleanup { keep: digest }
                },
                state: match state {
                    0 => nl::TaskState::Running,
                    1 => nl::TaskState::Succeeded,
                    _ => nl::TaskState::Failed { message: "x".into() },
                },
                bytes: None,
                terminating,
            })
            .collect();
        let p = nl::plan_nodes(&nl::Input {
            label_key: &key,
            want: want.as_deref(),
            selector: &selector,
            nodes: &nodes,
            tasks: &tasks,
            deleting,
            deletion_deadline_passed: deadline,
        });
        let allowed = want.as_deref().and_then(nl::label_value);
        for a in &p.actions {
            if let nl::NodeAction::Label { value: Some(v), .. } = a {
                prop_assert_eq!(Some(v), allowed.as_ref());
                prop_assert!(!deleting);
            }
        }
        prop_assert!(p.ready_nodes <= p.nodes.len());
    }

    /// Source and cache-path grammars, and the GPU group list, over arbitrary strings.
    #[test]
    fn source_and_setting_parsers_never_panic(s in "\\PC{0,200}", t in "[a-z0-9:/._@-]{0,120}") {
        for x in [&s, &t] {
            let _ = flexinfer_controller::model::source::parse_source(x);
            let _ = flexinfer_controller::model::source::parse_cache_path(x);
            let _ = flexinfer_controller::pod_security::parse_groups(x);
            // A registry the allow-list accepts is always one the list names (or the list is `*`).
            let list = flexinfer_controller::modelcache::credentials::CredentialRegistries::parse(x);
            if let (Ok(list), Some(registry)) = (
                list,
                flexinfer_controller::modelcache::credentials::registry_of(&t),
            ) {
                use flexinfer_controller::modelcache::credentials::CredentialRegistries as R;
                let named = match &list {
                    R::None => false,
                    R::Any => true,
                    R::Hosts(h) => h.contains(&registry),
                };
                prop_assert_eq!(list.allows(&registry), named);
            }
        }
    }
}
