//! What the reconciler reads: which Jobs' pods, which log tails and how often, which caches share
//! the claim, which directories Models serve, whether the PVC needs a read.

use std::time::Instant;

use flexinfer_api::contract::labels;
use kube_core::ResourceExt;

use flexinfer_api::modelcache::{DownloadStatus, ModelCacheStatus, PhaseProgress};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::modelcache::observe::{
    is_older_peer, log_read_due, model_uses_claim, needs_pods, needs_profiles, pvc_known_to_exist,
    served_dir_on, wants_log_tail,
};

fn job(
    phase: JobPhase,
    state: JobState,
    terminating: bool,
    pod: Option<ObservedPod>,
) -> ObservedJob {
    ObservedJob {
        phase,
        name: format!("mc-{}", phase.status_name()),
        image: "i".into(),
        spec_hash: None,
        created: t(0),
        started: t(0),
        terminating,
        state,
        pod,
        deadline_seconds: None,
        out_dir: None,
    }
}

fn failed() -> JobState {
    JobState::Failed {
        reason: "BackoffLimitExceeded".into(),
        message: String::new(),
    }
}

/// A status whose download completed (and nothing else).
fn download_recorded() -> ModelCacheStatus {
    ModelCacheStatus {
        claim_name: Some("mc-cache".into()),
        download: Some(DownloadStatus {
            run: PhaseProgress {
                completed_at: Some(Time(t(0))),
                ..Default::default()
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn pods_are_read_only_for_jobs_that_matter_now() {
    let recorded = download_recorded();
    let none = ModelCacheStatus::default();
    let cases = [
        // (job, status, pods read, why)
        (
            job(JobPhase::Download, JobState::Active, false, None),
            &none,
            true,
            "running",
        ),
        (
            job(JobPhase::Download, failed(), false, None),
            &recorded,
            true,
            "failed, even if an earlier run is recorded",
        ),
        (
            job(JobPhase::Download, JobState::Succeeded, false, None),
            &none,
            true,
            "success not recorded yet",
        ),
        (
            job(JobPhase::Download, JobState::Succeeded, false, None),
            &recorded,
            false,
            "success already recorded",
        ),
        (
            job(JobPhase::Quantize, JobState::Succeeded, false, None),
            &recorded,
            true,
            "another phase's record does not count",
        ),
        (
            job(JobPhase::Download, JobState::Active, true, None),
            &none,
            false,
            "being deleted",
        ),
    ];
    for (j, st, want, why) in cases {
        assert_eq!(needs_pods(&j, st), want, "{why}");
    }
}

#[test]
fn log_tails_are_read_for_running_pods_and_failures_without_a_message() {
    let running = ObservedPod {
        running: true,
        ..Default::default()
    };
    let pending = ObservedPod::default();
    let with_message = ObservedPod {
        termination_message: Some("{}".into()),
        ..Default::default()
    };
    let cases = [
        // (state, pod, log read, why)
        (
            JobState::Active,
            Some(running.clone()),
            true,
            "progress of a running pod",
        ),
        (
            JobState::Active,
            Some(pending.clone()),
            false,
            "a pod that has not started has no log",
        ),
        (JobState::Active, None, false, "no pod yet"),
        (
            failed(),
            Some(pending.clone()),
            true,
            "failure text from the log",
        ),
        (
            failed(),
            Some(with_message),
            false,
            "the termination message says it",
        ),
        (failed(), None, false, "no pod"),
        (
            JobState::Succeeded,
            Some(running),
            false,
            "results come from the termination message",
        ),
    ];
    for (state, pod, want, why) in cases {
        let j = job(JobPhase::Quantize, state, false, pod);
        assert_eq!(wants_log_tail(&j), want, "{why}");
    }
}

#[test]
fn running_pod_logs_are_read_at_most_once_per_half_poll() {
    let now = Instant::now();
    let poll = Duration::from_secs(10);
    let ago = |s: u64| now.checked_sub(Duration::from_secs(s));
    let cases = [
        // (last read, due, why)
        (None, true, "never read"),
        (ago(1), false, "read 1s ago, half poll is 5s"),
        (ago(4), false, "still inside the half poll"),
        (ago(5), true, "half poll passed"),
        (ago(60), true, "long ago"),
    ];
    for (last, want, why) in cases {
        assert_eq!(log_read_due(last, now, poll), want, "{why}");
    }
    assert!(
        log_read_due(Some(now), now, Duration::ZERO),
        "no throttle without a poll"
    );
}

#[test]
fn the_older_cache_on_a_claim_keeps_the_directory() {
    let cases = [
        // (other (created, name), me (created, name), other is older, why)
        (
            (Some(t(0)), "b"),
            (Some(t(10)), "a"),
            true,
            "created earlier",
        ),
        (
            (Some(t(10)), "a"),
            (Some(t(0)), "b"),
            false,
            "created later",
        ),
        (
            (Some(t(5)), "a"),
            (Some(t(5)), "b"),
            true,
            "same time: the smaller name",
        ),
        (
            (Some(t(5)), "b"),
            (Some(t(5)), "a"),
            false,
            "same time: the larger name",
        ),
        (
            (None, "a"),
            (Some(t(5)), "b"),
            true,
            "unknown time: the smaller name",
        ),
        (
            (Some(t(0)), "b"),
            (None, "a"),
            false,
            "unknown time: the larger name",
        ),
    ];
    for (other, me, want, why) in cases {
        assert_eq!(is_older_peer(other, me), want, "{why}");
    }
}

#[test]
fn served_directories_are_those_on_this_claim() {
    let cases = [
        // (servedPath, directory on claim `mc-cache`)
        ("mc-cache:mc/gptq-w4-g128", Some("mc/gptq-w4-g128")),
        ("mc-cache:mc/gptq-w4-g128/", Some("mc/gptq-w4-g128")),
        ("other:mc/gptq-w4-g128", None),
        ("mc-cache-2:mc", None),
        ("no-colon", None),
    ];
    for (served, want) in cases {
        assert_eq!(
            served_dir_on(served, "mc-cache").as_deref(),
            want,
            "{served}"
        );
    }
}

#[test]
fn the_pvc_is_read_until_the_download_completed_on_it() {
    let with = |status: Option<ModelCacheStatus>, deleting: bool| {
        let mut mc = cache(SIMPLE);
        mc.status = status;
        if deleting {
            mc.metadata.deletion_timestamp = Some(Time(t(0)));
        }
        mc
    };
    let no_claim = ModelCacheStatus {
        claim_name: None,
        ..download_recorded()
    };
    let cases = [
        // (cache, known to exist, why)
        (with(None, false), false, "no status"),
        (
            with(Some(ModelCacheStatus::default()), false),
            false,
            "not downloaded",
        ),
        (
            with(Some(download_recorded()), false),
            true,
            "downloaded on the claim",
        ),
        (
            with(Some(no_claim), false),
            false,
            "downloaded, but no claim recorded",
        ),
        (
            with(Some(download_recorded()), true),
            false,
            "being deleted: read it",
        ),
    ];
    for (mc, want, why) in cases {
        assert_eq!(pvc_known_to_exist(&mc), want, "{why}");
    }
}

#[test]
fn gpu_profiles_are_listed_only_for_live_caches_with_gpu_phases() {
    let mut deleting = cache(FULL);
    deleting.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(0)));
    let cases = [
        (cache(FULL), true, "GPU abliteration and quantization"),
        (cache(SIMPLE), false, "CPU-only phases"),
        (deleting, false, "being deleted"),
    ];
    for (mc, want, why) in cases {
        assert_eq!(needs_profiles(&mc), want, "{why}");
    }
}

fn stored_pod(job: &str, terminated: bool) -> k8s_openapi::api::core::v1::Pod {
    let state = if terminated {
        serde_json::json!({"terminated": {"exitCode": 3, "reason": "Error", "message": "{\"x\":1}"}})
    } else {
        serde_json::json!({"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}})
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{job}-abcde"), "namespace": "ns",
                     "creationTimestamp": "2026-12-01T00:00:02Z",
                     "labels": {"batch.kubernetes.io/job-name": job},
                     "annotations": {"a": "b"},
                     "managedFields": [{"manager": "kubelet"}]},
        "spec": {"containers": [{"name": "worker", "image": "w"}, {"name": "side", "image": "s"}]},
        "status": {"phase": "Pending",
                   "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"},
                                  {"type": "Ready", "status": "False"}],
                   "containerStatuses": [{"name": "worker", "image": "w", "imageID": "", "ready": false, "restartCount": 0, "state": state},
                                         {"name": "side", "image": "s", "imageID": "", "ready": false, "restartCount": 0}]}
    }))
    .unwrap()
}

#[test]
fn pruned_jobs_and_pods_observe_the_same_as_full_ones() {
    use crate::modelcache::observe::{observe_job, prune_job};
    for state in [
        "Complete",
        "Failed",
        "FailureTarget",
        "Running",
        "Failed+FailureTarget",
    ] {
        for terminated in [true, false] {
            let job = match state.split_once('+') {
                // Both failure conditions, each with its own reason: the one read is `Failed`'s.
                Some((a, b)) => {
                    let mut j = stored_job(JobPhase::Download, a);
                    let conds = j.status.as_mut().unwrap().conditions.as_mut().unwrap();
                    let mut other = conds[0].clone();
                    other.type_ = b.to_string();
                    other.reason = Some("PodFailurePolicy".into());
                    other.message = Some("other".into());
                    conds.push(other);
                    j
                }
                None => stored_job(JobPhase::Download, state),
            };
            let pods = vec![stored_pod(
                job.metadata.name.as_deref().unwrap(),
                terminated,
            )];
            let mut pj = job.clone();
            prune_job(&mut pj);
            let full = observe_job(&job, &pods).expect("a pipeline Job");
            assert_eq!(
                observe_job(&pj, &pods),
                Some(full.clone()),
                "{state} {terminated}"
            );
            // The Job store's compact form, as deserialized from the API server's JSON, observes the same.
            let stored: crate::modelcache::stored_job::StoredJob =
                serde_json::from_value(serde_json::to_value(&job).unwrap()).unwrap();
            let stored_pods: Vec<_> = pods
                .iter()
                .map(|p| {
                    let sp: crate::modelcache::stored_job::StoredPod =
                        serde_json::from_value(serde_json::to_value(p).unwrap()).unwrap();
                    sp.to_pod()
                })
                .collect();
            let back = stored.to_job();
            assert_eq!(
                observe_job(&back, &stored_pods),
                Some(full.clone()),
                "stored {state} {terminated}"
            );
            // The owner references stay whole in the stored Job's metadata: the controller maps a
            // Job event to its cache through them (kind, apiVersion, name), not only the uid.
            assert_eq!(
                stored.metadata.owner_references,
                job.metadata.owner_references
            );
            // What the ownership check and the expectations read survives too.
            assert_eq!(
                back.labels().get(labels::CACHE),
                job.labels().get(labels::CACHE)
            );
            assert!(back.labels().contains_key(labels::CACHE));
            assert_eq!(
                back.owner_references()
                    .iter()
                    .map(|o| &o.uid)
                    .collect::<Vec<_>>(),
                job.owner_references()
                    .iter()
                    .map(|o| &o.uid)
                    .collect::<Vec<_>>()
            );
            assert!(!job.owner_references().is_empty());
            assert_eq!(back.metadata.uid, job.metadata.uid);
            assert_eq!(
                back.metadata.deletion_timestamp,
                job.metadata.deletion_timestamp
            );
            // What it reads is really there (the comparison is not of two empty summaries).
            assert!(full.out_dir.is_some() && !full.image.is_empty() && full.spec_hash.is_some());
            assert!(full.pod.as_ref().is_some_and(|p| p.unschedulable.is_some()));
            // And what it does not read is gone.
            assert!(pj.metadata.managed_fields.is_none());
            let c = &pj
                .spec
                .as_ref()
                .unwrap()
                .template
                .spec
                .as_ref()
                .unwrap()
                .containers;
            assert_eq!(c.len(), 1);
            assert!(c[0].resources.is_none() && c[0].env.as_ref().is_some_and(|e| e.len() == 1));
            assert!(
                serde_json::to_vec(&pj).unwrap().len() * 2
                    < serde_json::to_vec(&job).unwrap().len(),
                "a pruned Job is less than half the size"
            );
        }
    }
}

/// A pod that restarted (its termination in the last state, running now) and a scheduled one: the
/// pod store's compact form observes them as the full pods do.
#[test]
fn stored_pods_keep_a_restart_and_a_scheduled_pod() {
    use crate::modelcache::observe::observe_job;
    use crate::modelcache::stored_job::StoredPod;
    let job = stored_job(JobPhase::Download, "Running");
    let name = job.metadata.name.clone().unwrap();
    let restarted: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{name}-x"), "namespace": "ns",
                     "creationTimestamp": "2026-12-01T00:00:02Z",
                     "labels": {"job-name": name}},
        "status": {"phase": "Running",
                   "conditions": [{"type": "PodScheduled", "status": "True"}],
                   "containerStatuses": [{"name": "worker", "image": "w", "imageID": "", "ready": true, "restartCount": 1,
                       "state": {"running": {"startedAt": "2026-12-01T00:00:05Z"}},
                       "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                    "containerID": "containerd://abc"}}}]}
    }))
    .unwrap();
    let full = observe_job(&job, std::slice::from_ref(&restarted)).expect("a pipeline Job");
    let pod = full.pod.clone().expect("the pod is observed");
    assert_eq!(pod.terminated_reason.as_deref(), Some("OOMKilled"));
    assert_eq!(pod.exit_code, Some(137));
    assert!(pod.running && pod.unschedulable.is_none());
    let stored: StoredPod =
        serde_json::from_value(serde_json::to_value(&restarted).unwrap()).unwrap();
    assert_eq!(observe_job(&job, &[stored.to_pod()]), Some(full));
    assert_eq!(stored.job_name().as_deref(), Some(name.as_str()));
}

#[test]
fn the_log_budget_is_a_token_bucket() {
    use crate::modelcache::observe::LogBudget;
    let t0 = Instant::now();
    let mut b = LogBudget::new(2, t0);
    // Starts with one second's worth, refills at the rate, saves up at most two seconds' worth.
    assert!(b.take(t0) && b.take(t0) && !b.take(t0));
    assert!(!b.take(t0 + Duration::from_millis(400)));
    assert!(b.take(t0 + Duration::from_millis(500)));
    let later = t0 + Duration::from_secs(60);
    let taken = (0..10).filter(|_| b.take(later)).count();
    assert_eq!(taken, 4, "burst capped at 2 × per_second");
    let mut off = LogBudget::new(0, t0);
    assert!(!off.take(t0) && !off.take(later));
}

#[test]
fn which_models_read_from_a_claim() {
    let cases = [
        ("pvc://mc-cache/mc/gptq", None, true),
        ("pvc://mc-cache-2/mc/gptq", None, false),
        ("pvc://other/mc-cache/x", None, false),
        ("modelcache://mc", Some("mc-cache:mc/gptq-w4-g128.g1"), true),
        ("modelcache://mc", Some("other:mc/x"), false),
        ("modelcache://mc", None, false),
        ("org/model", None, false),
    ];
    for (source, served, want) in cases {
        assert_eq!(
            model_uses_claim(source, served, "mc-cache"),
            want,
            "{source} {served:?}"
        );
    }
}
