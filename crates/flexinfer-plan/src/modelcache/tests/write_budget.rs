//! What a cache that walks download → quantize → publish without trouble costs the API server: how
//! many reconciles change its status (each one a status write) and how many events it records. The
//! controller benchmark at thousands of caches counts the same writes per cache; this counts them
//! per step of the walk, so a change that adds a write says where.

use super::*;

/// One reconcile per state the watches show a phase's Job in, as a real cluster reports them:
/// created (no pod yet), pod pending, pod running, pod done while the Job is still active, Job
/// succeeded.
fn walk(yaml: &str) -> (Vec<String>, Vec<String>) {
    let c = cfg();
    let mut mc = cache(yaml);
    let mut jobs: Vec<ObservedJob> = Vec::new();
    let (mut writes, mut recorded) = (Vec::new(), Vec::new());
    let mut now = 0;
    let mut step = |mc: &mut ModelCache, jobs: &[ObservedJob], what: &str, now: i64| -> Plan {
        let p = plan(mc, &obs(jobs.to_vec()), &c, t(now));
        if p.status_changed {
            let old =
                serde_json::to_value(mc.status.clone().unwrap_or_default()).unwrap_or_default();
            let new = serde_json::to_value(&p.status).unwrap_or_default();
            writes.push(format!("{what}: {}", diff(&old, &new)));
        }
        recorded.extend(events(&p).into_iter().map(|e| format!("{what}: {e}")));
        *mc = applied(mc.clone(), &p);
        p
    };
    let mut p = step(&mut mc, &jobs, "new cache", now);
    for phase in [JobPhase::Download, JobPhase::Quantize, JobPhase::Publish] {
        let created = job_from(&p, phase, t(now + 1), JobState::Active);
        let states: [(&str, Option<ObservedPod>); 4] = [
            ("created", None),
            (
                "pod pending",
                Some(ObservedPod {
                    name: "p".into(),
                    created: Some(t(now + 1)),
                    ..Default::default()
                }),
            ),
            (
                "pod running",
                Some(ObservedPod {
                    name: "p".into(),
                    running: true,
                    created: Some(t(now + 1)),
                    ..Default::default()
                }),
            ),
            (
                "pod done",
                Some(ObservedPod {
                    name: "p".into(),
                    terminated_reason: Some("Completed".into()),
                    exit_code: Some(0),
                    created: Some(t(now + 1)),
                    ..Default::default()
                }),
            ),
        ];
        for (what, pod) in states {
            now += 1;
            let mut j = created.clone();
            j.pod = pod;
            let mut all = jobs.clone();
            all.push(j);
            step(&mut mc, &all, &format!("{phase:?} {what}"), now);
        }
        now += 1;
        let mut done = created.clone();
        done.state = JobState::Succeeded;
        jobs.push(done);
        p = step(&mut mc, &jobs, &format!("{phase:?} succeeded"), now);
    }
    assert_eq!(
        mc.status.as_ref().and_then(|s| s.phase),
        Some(CachePhase::Ready)
    );
    (writes, recorded)
}

#[test]
fn a_happy_walk_writes_its_status_seven_times_and_records_seven_events() {
    let (writes, events) = walk(
        r#"
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: mc, namespace: ns, uid: u-1, generation: 1, finalizers: [flexinfer.ai/modelcache-cleanup]}
spec:
  source: org/model
  quantization: {format: GPTQ}
  publish: {ociRef: "reg.local/models/mc"}
"#,
    );
    // The first plan; per phase the first sight of its Job (its progress record starts) and its
    // success (recorded with the next phase's start in the same write). A pod that is pending or
    // running changes nothing the status shows.
    let steps: Vec<&str> = writes
        .iter()
        .map(|w| w.split(':').next().unwrap_or_default())
        .collect();
    assert_eq!(
        steps,
        [
            "new cache",
            "Download created",
            "Download succeeded",
            "Quantize created",
            "Quantize succeeded",
            "Publish created",
            "Publish succeeded",
        ],
        "status writes: {writes:#?}"
    );
    assert_eq!(
        events,
        [
            "new cache: JobCreated",
            "Download succeeded: DownloadComplete",
            "Download succeeded: JobCreated",
            "Quantize succeeded: QuantizationComplete",
            "Quantize succeeded: JobCreated",
            "Publish succeeded: Published",
            "Publish succeeded: CacheReady",
        ]
    );
}

fn diff(a: &serde_json::Value, b: &serde_json::Value) -> String {
    let mut out = Vec::new();
    fn go(path: String, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        match (a, b) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                for (k, v) in y {
                    go(
                        format!("{path}.{k}"),
                        x.get(k).unwrap_or(&serde_json::Value::Null),
                        v,
                        out,
                    );
                }
                for k in x.keys().filter(|k| !y.contains_key(*k)) {
                    out.push(format!("-{path}.{k}"));
                }
            }
            _ if a != b => out.push(format!(
                "{path}={}",
                b.to_string().chars().take(60).collect::<String>()
            )),
            _ => {}
        }
    }
    go(String::new(), a, b, &mut out);
    out.join(" ")
}
