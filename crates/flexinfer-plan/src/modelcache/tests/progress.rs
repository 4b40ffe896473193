//! Progress of running Jobs and the results of finished ones.

use super::*;
use flexinfer_api::contract::{self, reasons};

#[test]
fn progress_is_monotonic_and_keeps_last_value_on_log_failure() {
    let mc = downloaded();
    let log = |pct: f64| {
        Some(LogTail::Read(format!(
            "noise\n{{\"ts\":\"2026-01-01T00:00:00Z\",\"event\":\"progress\",\"phase\":\"quantization\",\"percent\":{pct},\"detail\":\"layer\",\"layer\":3,\"layers\":10}}\n"
        )))
    };
    let (p, _) = running_quantize(log(40.0), &mc, 60);
    let q = p.status.quantization.clone().expect("quant status");
    assert_eq!(q.progress, Some(40));
    assert_eq!(q.progress_source.as_deref(), Some("telemetry"));
    let mc40 = applied(mc.clone(), &p);
    let c = cfg();
    let job = |mc: &ModelCache| {
        let mut j = job_from(
            &plan(&downloaded(), &obs(vec![]), &c, t(0)),
            JobPhase::Quantize,
            t(0),
            JobState::Active,
        );
        j.pod = Some(ObservedPod {
            name: "p".into(),
            running: true,
            ..Default::default()
        });
        let _ = mc;
        j
    };
    // Lower telemetry: never backwards.
    let mut o = obs(vec![job(&mc40)]);
    o.log_tail = log(30.0);
    let p = plan(&mc40, &o, &c, t(120));
    assert_eq!(
        p.status.quantization.as_ref().and_then(|q| q.progress),
        Some(40)
    );
    assert!(!p.status_changed, "no change, no write");
    // Failed log read: keeps the last trustworthy value and source.
    o.log_tail = Some(LogTail::Unreadable);
    let p = plan(&mc40, &o, &c, t(180));
    let q = p.status.quantization.clone().expect("quant");
    assert_eq!(
        (q.progress, q.progress_source.as_deref()),
        (Some(40), Some("telemetry"))
    );
    assert!(!p.status_changed);
    // Higher telemetry moves forward.
    o.log_tail = log(55.5);
    let p = plan(&mc40, &o, &c, t(240));
    assert_eq!(
        p.status.quantization.as_ref().and_then(|q| q.progress),
        Some(55)
    );
    assert_eq!(p.status.progress, Some(55));
    assert_eq!(p.outcome.telemetry.as_ref().and_then(|t| t.layer), Some(3));
}

#[test]
fn elapsed_estimate_without_telemetry_is_capped_at_99() {
    let mc = downloaded();
    // Quantize deadline defaults to 86400 s: 8640 s elapsed = 10 %.
    let (p, _) = running_quantize(None, &mc, 8640);
    let q = p.status.quantization.clone().expect("quant");
    assert_eq!(q.progress, Some(10));
    assert_eq!(q.progress_source.as_deref(), Some("elapsed-estimate"));
    let (p, _) = running_quantize(Some(LogTail::Unreadable), &mc, 200_000);
    assert_eq!(p.status.quantization.and_then(|q| q.progress), Some(99));
    assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
}

#[test]
fn results_come_from_the_termination_message() {
    let c = cfg();
    let mc = cache(FULL);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let mut dl = job_from(&p, JobPhase::Download, t(0), JobState::Succeeded);
    dl.pod = Some(ObservedPod {
        termination_message: Some(
            r#"{"type":"download","sizeBytes":1000,"fileCount":7,"revision":"abc123"}"#.into(),
        ),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone()]), &c, t(1));
    let d = p.status.download.clone().expect("download status");
    assert_eq!(
        (d.size_bytes, d.file_count, d.revision.as_deref()),
        (Some(1000), Some(7), Some("abc123"))
    );
    let mut ab = job_from(&p, JobPhase::Abliterate, t(1), JobState::Succeeded);
    ab.pod = Some(ObservedPod {
        termination_message: Some(r#"{"type":"abliterate","layersModified":40,"refusalDirNorm":12.5,"layer":20,"perplexityBefore":7.25,"perplexityAfter":7.5}"#.into()),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone(), ab.clone()]), &c, t(2));
    let a = p.status.abliteration.clone().expect("abliteration status");
    assert_eq!(a.layers_modified, Some(40));
    assert_eq!(a.perplexity_after.as_deref(), Some("7.500"));
    assert_eq!(
        a.output_dir,
        Some(format!(
            "mc/abliterated.{}",
            a.generations.generation.clone().unwrap_or_default()
        ))
    );
    let mut q = job_from(&p, JobPhase::Quantize, t(2), JobState::Succeeded);
    q.pod = Some(ObservedPod {
        termination_message: Some(r#"{"type":"gptq-w4-g128","originalSizeBytes":4000,"compressedSizeBytes":1000,"quantizationTimeSeconds":3723,"outputDir":"/cache/mc/gptq-w4-g128","quality":{"gptqModules":400,"rtnFallbackModules":4,"rtnFallbackPercent":1.0,"maxRtnFallbackPercent":10.0,"minimumModules":100,"gate":"passed"}}"#.into()),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone(), ab.clone(), q.clone()]), &c, t(3));
    let qs = p.status.quantization.clone().expect("quantization status");
    assert_eq!(qs.compression_ratio, Some(4.0));
    assert_eq!(qs.quantization_time.as_deref(), Some("1h2m3s"));
    assert_eq!(qs.output_dir.as_deref(), Some("mc/gptq-w4-g128"));
    assert_eq!(qs.quality.and_then(|g| g.gate).as_deref(), Some("passed"));
    assert_eq!(qs.format.as_deref(), Some("GPTQ"));
    // Publish: digest, tags; an earlier digest moves to previousDigests.
    let mut pb = job_from(&p, JobPhase::Publish, t(3), JobState::Succeeded);
    pb.pod = Some(ObservedPod {
        termination_message: Some(
            r#"{"type":"publish","digest":"sha256:new","tags":["latest","stable"]}"#.into(),
        ),
        ..Default::default()
    });
    let mut mc = applied(mc, &p);
    if let Some(ps) = mc.status.as_mut().and_then(|s| s.publish.as_mut()) {
        ps.oci_digest = Some("sha256:old".into());
    }
    let p = plan(&mc, &obs(vec![dl, ab, q, pb]), &c, t(4));
    let ps = p.status.publish.clone().expect("publish status");
    assert_eq!(ps.oci_digest.as_deref(), Some("sha256:new"));
    assert_eq!(ps.previous_digests, Some(vec!["sha256:old".to_string()]));
    assert_eq!(
        ps.published_tags,
        Some(vec!["latest".to_string(), "stable".to_string()])
    );
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
}

/// A `useGPU` quantization that ran on the CPU (the termination message's `gptqDevice`) gets a Warning event
/// with the worker's reason; not when the worker was told `GPTQ_DEVICE=cpu`, ran on a GPU, reported no device
/// (an older worker), or the cache did not ask for a GPU. The device is `status.quantization.gptqDevice`; the
/// setting stays in `status.quantization.applied`.
#[test]
fn a_gpu_quantization_on_the_cpu_is_a_warning_with_the_worker_s_reason() {
    let c = cfg();
    let term = |requested: &str, kind: &str| {
        format!(
            r#"{{"type":"gptq-w4-g128","outputDir":"/cache/mc/gptq-w4-g128","applied":{{"bits":"4","gptqDevice":"{requested}"}},"gptqDevice":{{"requested":"{requested}","device":"{}","kind":"{kind}","reason":"auto: no usable GPU (hip: libamdhip64.so.5: hipInit/hipGetDeviceCount returned hipError 101; no /dev/kfd in this container)"}}}}"#,
            if kind == "cpu" {
                "cpu-faer"
            } else {
                "hip:0 AMD Radeon RX 7900 XTX"
            }
        )
    };
    let finish = |use_gpu: bool, message: Option<String>| {
        let mut mc = downloaded();
        if let Some(q) = mc.spec.quantization.as_mut() {
            q.use_gpu = use_gpu;
        }
        let p = plan(&mc, &obs(vec![]), &c, t(0));
        let mut j = job_from(&p, JobPhase::Quantize, t(0), JobState::Succeeded);
        j.pod = Some(ObservedPod {
            termination_message: message,
            ..Default::default()
        });
        let mc = applied(mc, &p);
        plan(&mc, &obs(vec![j]), &c, t(1))
    };
    let warned = |p: &Plan| -> Vec<String> {
        p.actions
            .iter()
            .filter_map(|a| match a {
                Action::Event {
                    warning: true,
                    reason,
                    note,
                    ..
                } if reason == reasons::QUANTIZED_ON_CPU => Some(note.clone()),
                _ => None,
            })
            .collect()
    };
    let p = finish(true, Some(term("auto", "cpu")));
    assert_eq!(
        warned(&p),
        ["useGPU is set, but the GPTQ solves run on the CPU: auto: no usable GPU (hip: libamdhip64.so.5: \
          hipInit/hipGetDeviceCount returned hipError 101; no /dev/kfd in this container)"]
    );
    assert!(events(&p).contains(&reasons::QUANTIZATION_COMPLETE.to_string()));
    let q = p.status.quantization.clone().unwrap_or_default();
    assert_eq!(q.gptq_device.as_deref(), Some("cpu-faer"));
    assert!(
        q.gptq_device_reason
            .as_deref()
            .is_some_and(|r| r.starts_with("auto: no usable GPU")),
        "{q:?}"
    );
    let applied_keys = q.applied.unwrap_or_default();
    assert_eq!(
        applied_keys.get("gptqDevice").map(String::as_str),
        Some("auto")
    );
    for (why, use_gpu, message) in [
        ("told to use the CPU", true, Some(term("cpu", "cpu"))),
        ("ran on the GPU", true, Some(term("auto", "hip"))),
        ("no GPU asked for", false, Some(term("auto", "cpu"))),
        (
            "older worker",
            true,
            Some(r#"{"type":"gptq-w4-g128","applied":{"bits":"4"}}"#.to_string()),
        ),
        ("no message", true, None),
    ] {
        assert!(warned(&finish(use_gpu, message)).is_empty(), "{why}");
    }
    // A worker that does not bound its reason does not fill the status with it.
    let long = format!(
        r#"{{"type":"gptq-w4-g128","gptqDevice":{{"requested":"auto","device":"cpu-faer","kind":"cpu","reason":"{}"}}}}"#,
        "x".repeat(5000)
    );
    let p = finish(true, Some(long));
    let reason = p
        .status
        .quantization
        .clone()
        .and_then(|q| q.gptq_device_reason)
        .unwrap_or_default();
    assert!(
        (100..=contract::GptqDeviceReport::REASON_MAX_BYTES).contains(&reason.len()),
        "{}",
        reason.len()
    );
    assert_eq!(warned(&p).len(), 1);
}

/// While the quantize Job runs, its `gptq_device_selected` event (read from the log tail with the progress)
/// sets `status.quantization.gptqDevice` and, on the CPU with `useGPU`, the Warning event at once; the next
/// reconcile and the end of the run do not repeat it.
#[test]
fn the_device_is_reported_while_the_quantization_runs_and_warned_once() {
    let c = cfg();
    let mut mc = downloaded();
    if let Some(q) = mc.spec.quantization.as_mut() {
        q.use_gpu = true;
    }
    let line = r#"{"ts":"2026-01-01T00:00:00Z","event":"gptq_device_selected","requested":"auto","device":"cpu-faer","kind":"cpu","reason":"auto: no usable GPU (hip: no /dev/kfd in this container)","probes":[]}"#;
    let log = Some(LogTail::Read(format!("noise\n{line}\nnot json\n")));
    let (p, j) = running_quantize(log.clone(), &mc, 60);
    let q = p.status.quantization.clone().unwrap_or_default();
    assert_eq!(q.gptq_device.as_deref(), Some("cpu-faer"));
    assert_eq!(
        q.gptq_device_reason.as_deref(),
        Some("auto: no usable GPU (hip: no /dev/kfd in this container)")
    );
    let on_cpu = |p: &Plan| {
        events(p)
            .iter()
            .filter(|r| *r == reasons::QUANTIZED_ON_CPU)
            .count()
    };
    assert_eq!(on_cpu(&p), 1);
    assert_eq!(p.outcome.gptq_on_cpu, Some(true));
    // The next poll sees the same event: nothing new.
    let mc2 = applied(applied(mc.clone(), &plan(&mc, &obs(vec![]), &c, t(0))), &p);
    let mut o = obs(vec![j.clone()]);
    o.log_tail = log;
    let p2 = plan(&mc2, &o, &c, t(90));
    assert_eq!(on_cpu(&p2), 0);
    // ... but the metric's condition is reported on every read (a restarted controller sets it again).
    assert_eq!(p2.outcome.gptq_on_cpu, Some(true));
    let q2 = mc2
        .status
        .clone()
        .and_then(|s| s.quantization)
        .unwrap_or_default();
    assert_eq!(
        (
            q2.gptq_device_kind.as_deref(),
            q2.gptq_device_requested.as_deref()
        ),
        (Some("cpu"), Some("auto"))
    );
    // Once the event has left the log tail (a long run, a restarted controller), the report in the status
    // keeps the condition; an empty tail or none read gives the same.
    for tail in [Some(LogTail::Read("later progress only\n".into())), None] {
        let mut o = obs(vec![j.clone()]);
        o.log_tail = tail.clone();
        let p = plan(&mc2, &o, &c, t(95));
        assert_eq!(p.outcome.gptq_on_cpu, Some(true), "{tail:?}");
        assert_eq!(on_cpu(&p), 0, "{tail:?}: no second warning");
    }
    // A status written before kind and setting were recorded: no condition from it (it cannot be told).
    let mut old = mc2.clone();
    if let Some(q) = old.status.as_mut().and_then(|s| s.quantization.as_mut()) {
        q.gptq_device_kind = None;
        q.gptq_device_requested = None;
    }
    let mut o = obs(vec![j.clone()]);
    o.log_tail = None;
    assert_eq!(plan(&old, &o, &c, t(95)).outcome.gptq_on_cpu, None);
    // The same report in the status with the setting `cpu`, or a GPU: false.
    for (requested, kind) in [("cpu", "cpu"), ("auto", "hip")] {
        let mut m = mc2.clone();
        if let Some(q) = m.status.as_mut().and_then(|s| s.quantization.as_mut()) {
            q.gptq_device_requested = Some(requested.into());
            q.gptq_device_kind = Some(kind.into());
        }
        let mut o = obs(vec![j.clone()]);
        o.log_tail = None;
        assert_eq!(
            plan(&m, &o, &c, t(95)).outcome.gptq_on_cpu,
            Some(false),
            "{requested} {kind}"
        );
    }
    // The run ends with the same device in its termination message: no second warning.
    let mut done = j.clone();
    done.state = JobState::Succeeded;
    done.pod = Some(ObservedPod {
        termination_message: Some(r#"{"type":"gptq-w4-g128","outputDir":"/cache/mc/gptq-w4-g128","applied":{"gptqDevice":"auto"},"gptqDevice":{"requested":"auto","device":"cpu-faer","kind":"cpu","reason":"auto: no usable GPU"}}"#.into()),
        ..Default::default()
    });
    let p3 = plan(&mc2, &obs(vec![done]), &c, t(120));
    assert_eq!(on_cpu(&p3), 0);
    assert!(events(&p3).contains(&reasons::QUANTIZATION_COMPLETE.to_string()));
    // Without the event in the tail (an image without it, or not read yet): no device, no warning.
    let (p4, _) = running_quantize(Some(LogTail::Read("noise\n".into())), &mc, 60);
    assert_eq!(
        p4.status.quantization.clone().and_then(|q| q.gptq_device),
        None
    );
    assert_eq!(on_cpu(&p4), 0);
    assert_eq!(p4.outcome.gptq_on_cpu, None);
    // On a GPU, or on the CPU because told so, or without useGPU: the condition is false.
    for (line, use_gpu) in [
        (
            line.replace(
                r#""device":"cpu-faer","kind":"cpu""#,
                r#""device":"hip:0 card","kind":"hip""#,
            ),
            true,
        ),
        (
            line.replace(r#""requested":"auto""#, r#""requested":"cpu""#),
            true,
        ),
        (line.to_string(), false),
    ] {
        let mut mc = mc.clone();
        if let Some(q) = mc.spec.quantization.as_mut() {
            q.use_gpu = use_gpu;
        }
        let (p, _) = running_quantize(Some(LogTail::Read(format!("{line}\n"))), &mc, 60);
        assert_eq!(
            p.outcome.gptq_on_cpu,
            Some(false),
            "{line} useGPU {use_gpu}"
        );
        assert_eq!(on_cpu(&p), 0, "{line}");
    }
}
