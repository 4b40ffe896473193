//! The metric series a cache keeps: bounded per cache (thousands of caches share one controller).

use super::*;
use crate::metrics::Metrics;
use crate::modelcache::series::update_metrics;

/// Series of the registry that name `cache` (label `cache` or `model`).
fn series_of(m: &Metrics, cache: &str) -> Vec<String> {
    let mut out = Vec::new();
    for fam in m.registry.gather() {
        for metric in fam.get_metric() {
            let labels: Vec<(String, String)> = metric
                .get_label()
                .iter()
                .map(|l| (l.name().to_string(), l.value().to_string()))
                .collect();
            if labels
                .iter()
                .any(|(k, v)| (k == "cache" || k == "model") && v == cache)
            {
                out.push(format!("{}{labels:?}", fam.name()));
            }
        }
    }
    out
}

/// Download → quantize → Ready: the phase gauge is one series (the current phase, 1), and a Ready cache
/// keeps 3 series (its phase, its quantization count and compression ratio): no progress of Jobs that
/// have ended; the quantization time histogram is per namespace, not per cache.
#[test]
fn a_ready_cache_keeps_few_series() {
    let m = Metrics::new().expect("metrics");
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    update_metrics(&mc, &m, "ns", &p);
    let dl = job_from(&p, JobPhase::Download, t(1), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone()]), &c, t(10));
    update_metrics(&mc, &m, "ns", &p);
    let phase_series = |m: &Metrics| {
        series_of(m, "mc")
            .into_iter()
            .filter(|s| s.starts_with("flexinfer_modelcache_phase"))
            .collect::<Vec<_>>()
    };
    assert_eq!(phase_series(&m).len(), 1, "{:?}", phase_series(&m));
    let q = job_from(&p, JobPhase::Quantize, t(11), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl, q]), &c, t(20));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    update_metrics(&mc, &m, "ns", &p);
    let phase = phase_series(&m);
    assert_eq!(phase.len(), 1, "{phase:?}");
    assert!(phase[0].contains("\"Ready\""), "{phase:?}");
    let all = series_of(&m, "mc");
    assert!(
        all.len() <= 3,
        "{} series for one Ready cache: {all:#?}",
        all.len()
    );
    assert!(
        !all.iter()
            .any(|s| s.starts_with("flexinfer_job_progress_percent")),
        "{all:#?}"
    );
    let text = {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&m.registry.gather(), &mut buf)
            .expect("encode");
        String::from_utf8(buf).expect("utf8")
    };
    assert!(
        text.contains(
            "flexinfer_modelcache_phase{cache=\"mc\",namespace=\"ns\",phase=\"Ready\"} 1"
        ),
        "{text}"
    );
    assert!(!text.contains("phase=\"Pending\""), "{text}");
}
