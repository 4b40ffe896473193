//! What the reconciler reads: which Jobs' pods, which log tails and how often, which caches share
//! the claim, which directories Models serve, whether the PVC needs a read.

use std::time::Instant;

use flexinfer_api::modelcache::{DownloadStatus, ModelCacheStatus, PhaseProgress};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::modelcache::observe::{
    is_older_peer, log_read_due, needs_pods, needs_profiles, pvc_known_to_exist, served_dir_on,
    wants_log_tail,
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
