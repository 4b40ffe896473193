//! The series every cache keeps for as long as it exists — its phase, its quantization count and
//! its compression ratio — as one compact row per cache, turned into metric families only when
//! `/metrics` is read.
//!
//! The `prometheus` crate keeps each series as its own child with a copy of the metric's
//! description and its label pairs (about 0.45 KB per series, measured with heaptrack at 1,000
//! caches); three such series per finished cache were a tenth of the controller's memory at
//! thousands of caches. The exposition is the same: names, help, types, labels and values.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use flexinfer_api::modelcache::CachePhase;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::Registry;

const PHASE: &str = "flexinfer_modelcache_phase";
const PHASE_HELP: &str = "Current phase of each ModelCache (one series per cache, value 1)";
const JOBS: &str = "flexinfer_quantization_jobs_total";
const JOBS_HELP: &str = "Finished quantization Jobs by outcome";
const RATIO: &str = "flexinfer_quantization_compression_ratio";
const RATIO_HELP: &str = "Original size / quantized size";

/// `(cache, namespace)`.
type Key = (Box<str>, Box<str>);

/// One cache's values; a series exists when its value does (a counter once it counted).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Row {
    phase: Option<CachePhase>,
    quantizations_succeeded: u64,
    quantizations_failed: u64,
    compression_ratio: Option<f64>,
}

/// `flexinfer_modelcache_phase{cache,namespace,phase}`,
/// `flexinfer_quantization_jobs_total{model,namespace,status}` and
/// `flexinfer_quantization_compression_ratio{model,namespace}`, by `(cache, namespace)`.
pub struct CacheSeries {
    rows: Mutex<HashMap<Key, Row>>,
    descs: Vec<Desc>,
}

/// What the registry holds: the rows are shared with the controller that sets them.
struct Registered(Arc<CacheSeries>);

impl Collector for Registered {
    fn desc(&self) -> Vec<&Desc> {
        self.0.desc()
    }
    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect()
    }
}

impl CacheSeries {
    /// New rows, registered in `registry`.
    pub fn registered(registry: &Registry) -> Result<Arc<Self>, prometheus::Error> {
        let rows = Arc::new(Self::new()?);
        registry.register(Box::new(Registered(rows.clone())))?;
        Ok(rows)
    }

    fn new() -> Result<Self, prometheus::Error> {
        let labels = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Ok(Self {
            rows: Mutex::default(),
            descs: vec![
                Desc::new(
                    PHASE.into(),
                    PHASE_HELP.into(),
                    labels(&["cache", "namespace", "phase"]),
                    HashMap::new(),
                )?,
                Desc::new(
                    JOBS.into(),
                    JOBS_HELP.into(),
                    labels(&["model", "namespace", "status"]),
                    HashMap::new(),
                )?,
                Desc::new(
                    RATIO.into(),
                    RATIO_HELP.into(),
                    labels(&["model", "namespace"]),
                    HashMap::new(),
                )?,
            ],
        })
    }

    fn with_row(&self, cache: &str, ns: &str, f: impl FnOnce(&mut Row)) {
        if let Ok(mut rows) = self.rows.lock() {
            f(rows.entry((cache.into(), ns.into())).or_default());
        }
    }

    /// The cache's current phase (its one phase series).
    pub fn set_phase(&self, cache: &str, ns: &str, phase: CachePhase) {
        self.with_row(cache, ns, |r| r.phase = Some(phase));
    }

    /// One more finished quantization Job of the cache.
    pub fn count_quantization(&self, cache: &str, ns: &str, succeeded: bool) {
        self.with_row(cache, ns, |r| {
            if succeeded {
                r.quantizations_succeeded = r.quantizations_succeeded.saturating_add(1);
            } else {
                r.quantizations_failed = r.quantizations_failed.saturating_add(1);
            }
        });
    }

    /// The cache's compression ratio.
    pub fn set_compression_ratio(&self, cache: &str, ns: &str, ratio: f64) {
        self.with_row(cache, ns, |r| r.compression_ratio = Some(ratio));
    }

    /// Drop every series of the cache.
    pub fn forget(&self, cache: &str, ns: &str) {
        if let Ok(mut rows) = self.rows.lock() {
            rows.remove(&(Box::<str>::from(cache), Box::<str>::from(ns)));
        }
    }

    /// `(cache, namespace)` of every cache with a row.
    pub fn keys(&self) -> Vec<(String, String)> {
        self.rows
            .lock()
            .map(|rows| {
                rows.keys()
                    .map(|(c, ns)| (c.to_string(), ns.to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Rows (for the memory bound in tests).
    pub fn len(&self) -> usize {
        self.rows.lock().map(|r| r.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    pairs
        .iter()
        .map(|(n, v)| {
            let mut l = LabelPair::default();
            l.set_name(n.to_string());
            l.set_value(v.to_string());
            l
        })
        .collect()
}

fn gauge(labels: Vec<LabelPair>, v: f64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(v);
    let mut m = Metric::default();
    m.set_label(labels);
    m.set_gauge(g);
    m
}

fn counter(labels: Vec<LabelPair>, v: u64) -> Metric {
    let mut c = Counter::default();
    c.set_value(v as f64);
    let mut m = Metric::default();
    m.set_label(labels);
    m.set_counter(c);
    m
}

fn family(name: &str, help: &str, t: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(t);
    f.set_metric(metrics);
    f
}

impl Collector for CacheSeries {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let (mut phase, mut jobs, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        if let Ok(rows) = self.rows.lock() {
            for ((cache, ns), r) in rows.iter() {
                if let Some(p) = r.phase {
                    let l = labels(&[("cache", cache), ("namespace", ns), ("phase", p.as_str())]);
                    phase.push(gauge(l, 1.0));
                }
                for (status, n) in [
                    ("succeeded", r.quantizations_succeeded),
                    ("failed", r.quantizations_failed),
                ] {
                    if n > 0 {
                        let l = labels(&[("model", cache), ("namespace", ns), ("status", status)]);
                        jobs.push(counter(l, n));
                    }
                }
                if let Some(v) = r.compression_ratio {
                    let l = labels(&[("model", cache), ("namespace", ns)]);
                    ratio.push(gauge(l, v));
                }
            }
        }
        // A family without series is left out, as the crate's own vectors do.
        [
            family(PHASE, PHASE_HELP, MetricType::GAUGE, phase),
            family(JOBS, JOBS_HELP, MetricType::COUNTER, jobs),
            family(RATIO, RATIO_HELP, MetricType::GAUGE, ratio),
        ]
        .into_iter()
        .filter(|f| !f.get_metric().is_empty())
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, TextEncoder};

    fn text(r: &Registry) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&r.gather(), &mut buf)
            .expect("encode");
        String::from_utf8(buf).expect("utf8")
    }

    /// The compact rows expose exactly what the crate's own vectors exposed for the same values.
    #[test]
    fn the_exposition_is_the_crate_vectors_one() {
        let r = Registry::new();
        let rows = CacheSeries::registered(&r).expect("register");
        let theirs = Registry::new();
        let phase = IntGaugeVec::new(
            Opts::new(PHASE, PHASE_HELP),
            &["cache", "namespace", "phase"],
        )
        .unwrap();
        let jobs = IntCounterVec::new(
            Opts::new(JOBS, JOBS_HELP),
            &["model", "namespace", "status"],
        )
        .unwrap();
        let ratio =
            prometheus::GaugeVec::new(Opts::new(RATIO, RATIO_HELP), &["model", "namespace"])
                .unwrap();
        theirs.register(Box::new(phase.clone())).unwrap();
        theirs.register(Box::new(jobs.clone())).unwrap();
        theirs.register(Box::new(ratio.clone())).unwrap();
        assert_eq!(text(&r), text(&theirs), "nothing yet");

        for (c, ns) in [("b", "ns1"), ("a", "ns2"), ("a", "ns1")] {
            rows.set_phase(c, ns, CachePhase::Downloading);
            phase.with_label_values(&[c, ns, "Downloading"]).set(1);
        }
        rows.set_phase("a", "ns1", CachePhase::Ready);
        let _ = phase.remove_label_values(&["a", "ns1", "Downloading"]);
        phase.with_label_values(&["a", "ns1", "Ready"]).set(1);
        rows.count_quantization("a", "ns1", true);
        jobs.with_label_values(&["a", "ns1", "succeeded"]).inc();
        rows.count_quantization("b", "ns1", false);
        rows.count_quantization("b", "ns1", false);
        jobs.with_label_values(&["b", "ns1", "failed"]).inc_by(2);
        rows.set_compression_ratio("a", "ns1", 3.25);
        ratio.with_label_values(&["a", "ns1"]).set(3.25);
        let got = text(&r);
        assert_eq!(got, text(&theirs));
        assert!(
            got.contains(
                "flexinfer_modelcache_phase{cache=\"a\",namespace=\"ns1\",phase=\"Ready\"} 1"
            ),
            "{got}"
        );
        assert!(got.contains("flexinfer_quantization_jobs_total{model=\"b\",namespace=\"ns1\",status=\"failed\"} 2"), "{got}");

        rows.forget("a", "ns1");
        let _ = phase.remove_label_values(&["a", "ns1", "Ready"]);
        let _ = jobs.remove_label_values(&["a", "ns1", "succeeded"]);
        let _ = ratio.remove_label_values(&["a", "ns1"]);
        assert_eq!(text(&r), text(&theirs), "after forgetting a cache");
        assert_eq!(rows.len(), 2);
        let mut keys = rows.keys();
        keys.sort();
        assert_eq!(
            keys,
            vec![("a".into(), "ns2".into()), ("b".into(), "ns1".into())]
        );
    }
}
