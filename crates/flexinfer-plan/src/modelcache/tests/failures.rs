//! Failed attempts: classification, retries and backoff, exhaustion and recovery, failure text and redaction, pods that cannot start.

use super::*;

#[test]
fn retry_backoff_then_exhaustion_then_recovery() {
    let c = cfg();
    let mc = ready_simple();
    // Run the quantize phase again through a spec-independent trigger.
    let mut mc = mc;
    mc.metadata.annotations = Some(BTreeMap::from([(
        annotations::REQUANTIZE.into(),
        "true".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &c, t(100));
    let mut mc = applied(mc, &p);
    let mut now = 100;
    let mut p = plan(&mc, &obs(vec![]), &c, t(now));
    let mut delays = Vec::new();
    for attempt in 0..3 {
        let failed = job_from(
            &p,
            JobPhase::Quantize,
            t(now),
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: String::new(),
            },
        );
        mc = applied(mc, &p);
        now += 5;
        p = plan(&mc, &obs(vec![failed]), &c, t(now));
        assert_eq!(deleted_jobs(&p), vec!["mc-quantize"], "attempt {attempt}");
        mc = applied(mc, &p);
        if attempt < 2 {
            assert_eq!(p.status.retry_count, Some(attempt + 1));
            assert_eq!(p.status.phase, Some(CachePhase::Quantizing));
            let d = p.requeue_after.expect("requeue");
            delays.push(d.as_secs());
            // Before the backoff elapses: no Job.
            let early = plan(&mc, &obs(vec![]), &c, t(now + d.as_secs() as i64 - 1));
            assert!(created_jobs(&early).is_empty());
            now += d.as_secs() as i64 + 1;
            p = plan(&mc, &obs(vec![]), &c, t(now));
            assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
        } else {
            assert_eq!(p.status.phase, Some(CachePhase::Failed));
            let ready = conditions::find(&p.status.conditions, "Ready").expect("ready cond");
            assert_eq!(ready.status, "False");
            assert_eq!(ready.reason, "QuantizationFailed");
            assert!(
                ready.message.starts_with("BackoffLimitExceeded"),
                "{}",
                ready.message
            );
            assert!(events(&p).contains(&"PhaseFailed".to_string()));
        }
    }
    assert_eq!(delays, vec![30, 60]);
    assert_eq!(
        mc.status
            .as_ref()
            .and_then(|s| s.last_failure_phase.clone())
            .as_deref(),
        Some("quantization")
    );
    // Exhausted: stays Failed, creates nothing, writes nothing.
    let stuck = plan(&mc, &obs(vec![]), &c, t(now + 10_000));
    assert!(created_jobs(&stuck).is_empty());
    assert!(!stuck.status_changed);

    // Recovery 1: reset-retries annotation.
    let mut reset = mc.clone();
    reset.metadata.annotations = Some(BTreeMap::from([(
        annotations::RESET_RETRIES.into(),
        "true".into(),
    )]));
    let r = plan(&reset, &obs(vec![]), &c, t(now + 20));
    assert_eq!(created_jobs(&r), vec!["mc-quantize"]);
    assert!(r.actions.contains(&Action::RemoveAnnotations(vec![
        annotations::RESET_RETRIES.into()
    ])));
    assert_eq!(r.status.retry_count, Some(0));
    assert_eq!(r.status.phase, Some(CachePhase::Quantizing));

    // Recovery 2: the runbook's status merge patch.
    let mut patched = mc.clone();
    if let Some(s) = patched.status.as_mut() {
        s.phase = Some(CachePhase::Quantizing);
        s.retry_count = Some(0);
        s.last_failure_phase = None;
        s.last_failure_time = None;
    }
    let r = plan(&patched, &obs(vec![]), &c, t(now + 20));
    assert_eq!(created_jobs(&r), vec!["mc-quantize"]);
}

#[test]
fn zero_max_retries_fails_at_first_failure() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("maxRetries: 2", "maxRetries: 0"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let j = job_from(
        &p,
        JobPhase::Download,
        t(0),
        JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: String::new(),
        },
    );
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![j]), &c, t(5));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    assert_eq!(
        conditions::find(&p.status.conditions, "Ready").map(|c| c.reason.as_str()),
        Some("DownloadFailed")
    );
}

#[test]
fn failures_are_classified() {
    let base = ObservedJob {
        phase: JobPhase::Quantize,
        name: "mc-quantize".into(),
        image: "i".into(),
        spec_hash: None,
        created: t(0),
        started: t(0),
        terminating: false,
        state: JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: String::new(),
        },
        pod: None,
        deadline_seconds: None,
        out_dir: None,
    };
    let pod = |term: Option<&str>, wait: Option<&str>| {
        Some(ObservedPod {
            terminated_reason: term.map(String::from),
            waiting_reason: wait.map(String::from),
            ..Default::default()
        })
    };
    let cases = vec![
        (
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: String::new(),
            },
            pod(Some("OOMKilled"), None),
            "OOMKilled",
        ),
        (
            JobState::Failed {
                reason: "DeadlineExceeded".into(),
                message: String::new(),
            },
            pod(Some("Error"), None),
            "DeadlineExceeded",
        ),
        (
            JobState::Active,
            pod(None, Some("ImagePullBackOff")),
            "ImagePullBackOff",
        ),
        (
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: String::new(),
            },
            pod(Some("Error"), None),
            "BackoffLimitExceeded",
        ),
        (
            JobState::Failed {
                reason: "PodFailurePolicy".into(),
                message: String::new(),
            },
            None,
            "JobFailed",
        ),
        (
            JobState::Failed {
                reason: "PodFailurePolicy".into(),
                message: String::new(),
            },
            Some(ObservedPod {
                exit_code: Some(3),
                terminated_reason: Some("Error".into()),
                ..Default::default()
            }),
            "QualityGateFailed",
        ),
        (
            JobState::Failed {
                reason: "PodFailurePolicy".into(),
                message: String::new(),
            },
            Some(ObservedPod {
                exit_code: Some(4),
                terminated_reason: Some("Error".into()),
                ..Default::default()
            }),
            "ScriptVersionMismatch",
        ),
    ];
    for (state, pod, want) in cases {
        let j = ObservedJob {
            state,
            pod,
            ..base.clone()
        };
        assert_eq!(classify_failure(&j).as_str(), want);
    }
}

#[test]
fn failure_message_from_termination_message_or_log_tail_is_redacted() {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let mut j = job_from(
        &p,
        JobPhase::Download,
        t(0),
        JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: String::new(),
        },
    );
    let mc = applied(mc, &p);
    j.pod = Some(ObservedPod {
        termination_message: Some(r#"{"error":"401 for token=hf_abcdefghijklmnopqrstu","phase":"download","exitCode":2,"tail":"GET https://hub\nAuthorization: Bearer hf_zzzzzzzzzzzzzzzzzzzz"}"#.into()),
        terminated_reason: Some("Error".into()),
        ..Default::default()
    });
    let p = plan(&mc, &obs(vec![j.clone()]), &c, t(5));
    let msg = p
        .status
        .download
        .and_then(|d| d.run.failure_message)
        .expect("failure message");
    assert!(
        msg.starts_with("BackoffLimitExceeded: exit 2: 401"),
        "{msg}"
    );
    assert!(
        !msg.contains("hf_abc") && !msg.contains("hf_zzz"),
        "secret leaked: {msg}"
    );
    // No termination message: the log tail.
    j.pod = Some(ObservedPod {
        terminated_reason: Some("Error".into()),
        ..Default::default()
    });
    let mut o = obs(vec![j]);
    o.log_tail = Some(LogTail::Read(
        "line1\nFATAL: Script version mismatch (image=v1 controller=v14) password=hunter2\n".into(),
    ));
    let p = plan(&mc, &o, &c, t(5));
    let msg = p
        .status
        .download
        .and_then(|d| d.run.failure_message)
        .expect("failure message");
    assert!(msg.contains("Script version mismatch"), "{msg}");
    assert!(!msg.contains("hunter2"), "{msg}");
}

#[test]
fn redaction_rules() {
    let cases = [
        // (text, redacted)
        ("token=abc def", "token=[REDACTED] def"),
        (
            "Authorization: Bearer xyz ok",
            "Authorization: Bearer [REDACTED] ok",
        ),
        ("using hf_0123456789abcdef now", "using [REDACTED] now"),
        ("HF_TOKEN=hf_x1234567890", "HF_TOKEN=[REDACTED]"),
        ("layer=3 of 10", "layer=3 of 10"),
    ];
    for (text, want) in cases {
        assert_eq!(redact(text), want, "{text}");
    }
}

#[test]
fn spec_change_of_a_failed_phase_tries_again() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("maxRetries: 2", "maxRetries: 0"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let dl = job_from(&p, JobPhase::Download, t(0), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone()]), &c, t(1));
    let q = job_from(
        &p,
        JobPhase::Quantize,
        t(1),
        JobState::Failed {
            reason: "DeadlineExceeded".into(),
            message: String::new(),
        },
    );
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone(), q]), &c, t(2));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    let mut mc = applied(mc, &p);
    assert!(created_jobs(&plan(&mc, &obs(vec![dl.clone()]), &c, t(3))).is_empty());
    // Runbook 6.1 option A: a larger timeout alone retries.
    if let Some(qs) = mc.spec.quantization.as_mut() {
        qs.timeout_seconds = Some(172800);
    }
    let p = plan(&mc, &obs(vec![dl]), &c, t(4));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    assert_eq!(p.status.phase, Some(CachePhase::Quantizing));
    assert_eq!(p.status.retry_count, Some(0));
}

#[test]
fn a_pod_that_cannot_start_fails_the_attempt_after_the_threshold() {
    let c = cfg();
    let limit = c.stuck_pod_after.as_secs() as i64;
    let unschedulable = ObservedPod {
        name: "mc-download-x".into(),
        created: Some(t(0)),
        unschedulable: Some("0/5 nodes are available: 5 node(s) had untolerated taint".into()),
        ..Default::default()
    };
    let backoff = ObservedPod {
        name: "mc-download-x".into(),
        created: Some(t(0)),
        waiting_reason: Some("ImagePullBackOff".into()),
        waiting_message: Some("Back-off pulling image \"worker:1\"".into()),
        ..Default::default()
    };
    let invalid = ObservedPod {
        waiting_reason: Some("InvalidImageName".into()),
        ..backoff.clone()
    };
    // (case, pod, seconds since the pod was created, attempt failed, reason on the conditions)
    let cases = vec![
        (
            "unschedulable, young",
            unschedulable.clone(),
            10,
            false,
            "Unschedulable",
        ),
        (
            "unschedulable, at the limit",
            unschedulable,
            limit,
            true,
            "Unschedulable",
        ),
        (
            "pull back-off, young",
            backoff.clone(),
            limit - 2,
            false,
            "ImagePullBackOff",
        ),
        (
            "pull back-off, old",
            backoff,
            limit + 60,
            true,
            "ImagePullBackOff",
        ),
        (
            "invalid image name fails at once",
            invalid,
            1,
            true,
            "ImagePullBackOff",
        ),
    ];
    for (name, pod, age, fails, reason) in cases {
        let mc = cache(SIMPLE);
        let p0 = plan(&mc, &obs(vec![]), &c, t(0));
        let mut j = job_from(&p0, JobPhase::Download, t(0), JobState::Active);
        j.pod = Some(pod);
        let mc = applied(mc, &p0);
        let p = plan(&mc, &obs(vec![j.clone()]), &c, t(age));
        let st = &p.status;
        if fails {
            assert_eq!(deleted_jobs(&p), vec![j.name.clone()], "{name}");
            assert_eq!(
                conditions::find(&st.conditions, "Degraded").map(|c| c.reason.as_str()),
                Some(reason),
                "{name}"
            );
            assert_eq!(st.retry_count, Some(1), "{name}");
            assert!(events(&p).contains(&"Retrying".to_string()), "{name}");
        } else {
            assert!(deleted_jobs(&p).is_empty(), "{name}");
            let prog = conditions::find(&st.conditions, "Progressing");
            assert_eq!(prog.map(|c| c.reason.as_str()), Some(reason), "{name}");
            assert!(
                prog.is_some_and(|c| c.message.contains("mc-download-x")
                    && c.message.contains(&format!("fails after {limit}s"))),
                "{name}: {prog:?}"
            );
            assert_eq!(
                events(&p).iter().filter(|e| *e == reason).count(),
                1,
                "{name}"
            );
            assert!(
                p.requeue_after.is_some_and(|d| d <= c.progress_poll),
                "{name}"
            );
            // The next reconcile keeps waiting without a second event or a status change.
            let mc2 = applied(mc.clone(), &p);
            let again = plan(&mc2, &obs(vec![j.clone()]), &c, t(age + 1));
            assert!(!events(&again).iter().any(|e| e == reason), "{name}");
            assert!(!again.status_changed, "{name}");
        }
    }
}

#[test]
fn a_pod_waiting_for_node_capacity_or_its_claim_never_fails_the_attempt() {
    use crate::modelcache::observe::waits_for_capacity;
    let table = [
        ("0/4 nodes are available: 4 Too many pods. preemption: 0/4 nodes are available: 4 No preemption victims found for incoming pod.", true),
        ("0/5 nodes are available: 1 Insufficient amd.com/gpu, 4 node(s) didn't match Pod's node affinity/selector. preemption: 0/5 nodes are available: 1 No preemption victims found for incoming pod, 4 Preemption is not helpful for scheduling.", true),
        ("0/3 nodes are available: 3 Insufficient memory.", true),
        ("0/5 nodes are available: 5 node(s) had untolerated taint {dedicated: gpu}.", false),
        ("0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector. preemption: 0/4 nodes are available: 4 Insufficient cpu.", false),
        ("", false),
    ];
    for (msg, want) in table {
        assert_eq!(waits_for_capacity(msg), want, "{msg}");
    }
    use crate::modelcache::observe::waits_for;
    let kinds = [
        (
            "0/4 nodes are available: 4 Too many pods.",
            Some("node capacity"),
        ),
        (
            "0/4 nodes are available: pod has unbound immediate PersistentVolumeClaims. not found",
            Some("its volume claim to be bound"),
        ),
        // No volume fits the claim: a fault, not a queue.
        (
            "0/3 nodes are available: 3 node(s) didn't find available persistent volumes to bind.",
            None,
        ),
        (
            "0/5 nodes are available: 5 node(s) had untolerated taint {dedicated: gpu}.",
            None,
        ),
    ];
    for (msg, want) in kinds {
        assert_eq!(waits_for(msg), want, "{msg}");
    }
    let c = cfg();
    let limit = c.stuck_pod_after.as_secs() as i64;
    let queued = ObservedPod {
        name: "mc-download-x".into(),
        created: Some(t(0)),
        unschedulable: Some("0/4 nodes are available: 4 Too many pods.".into()),
        ..Default::default()
    };
    let mc = cache(SIMPLE);
    let p0 = plan(&mc, &obs(vec![]), &c, t(0));
    let mut j = job_from(&p0, JobPhase::Download, t(0), JobState::Active);
    j.pod = Some(queued);
    let mc = applied(mc, &p0);
    let p = plan(&mc, &obs(vec![j.clone()]), &c, t(limit * 10));
    assert!(deleted_jobs(&p).is_empty(), "{:?}", p.actions);
    assert_eq!(p.status.retry_count.unwrap_or(0), 0);
    let prog = conditions::find(&p.status.conditions, "Progressing").expect("Progressing");
    assert_eq!(prog.reason, "Unschedulable");
    assert!(
        prog.message.contains("node capacity") && !prog.message.contains("fails after"),
        "{prog:?}"
    );
    // Comes back at the poll interval (not at once: no hot loop on an expired window).
    assert_eq!(p.requeue_after, Some(c.progress_poll));
    let again = plan(&applied(mc, &p), &obs(vec![j]), &c, t(limit * 10 + 1));
    assert!(!again.status_changed && deleted_jobs(&again).is_empty());

    // A pod whose claim is not bound yet (the PV controller or a provisioner is behind) waits too.
    let binding = ObservedPod {
        name: "mc-download-y".into(),
        created: Some(t(0)),
        unschedulable: Some(
            "0/4 nodes are available: pod has unbound immediate PersistentVolumeClaims. not found"
                .into(),
        ),
        ..Default::default()
    };
    let mc = cache(SIMPLE);
    let p0 = plan(&mc, &obs(vec![]), &c, t(0));
    let mut j = job_from(&p0, JobPhase::Download, t(0), JobState::Active);
    j.pod = Some(binding);
    let p = plan(&applied(mc, &p0), &obs(vec![j]), &c, t(limit * 10));
    assert!(deleted_jobs(&p).is_empty(), "{:?}", p.actions);
    assert_eq!(p.status.retry_count.unwrap_or(0), 0);
    let prog = conditions::find(&p.status.conditions, "Progressing").expect("Progressing");
    assert!(
        prog.message.contains("its volume claim to be bound")
            && !prog.message.contains("fails after"),
        "{prog:?}"
    );
}
