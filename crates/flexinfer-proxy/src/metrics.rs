//! Prometheus metrics of the proxy, served on the health port at `/metrics`. Labels are the
//! resolved Model's namespace and name only (empty for requests that named no known Model), so a
//! client cannot create series by sending model names.

use std::time::Duration;

use prometheus::{
    histogram_opts, opts, Encoder, HistogramVec, IntCounterVec, IntGaugeVec, Registry, TextEncoder,
};

use crate::cluster::ModelKey;

/// How a request that found no ready backend ended its wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdStart {
    /// A backend became ready; the request was forwarded.
    Ready,
    /// `serverless.coldStartTimeout` passed (504).
    Timeout,
    /// The Model could not start or was deleted (503).
    Failed,
}

impl ColdStart {
    fn as_str(self) -> &'static str {
        match self {
            ColdStart::Ready => "ready",
            ColdStart::Timeout => "timeout",
            ColdStart::Failed => "failed",
        }
    }
}

/// Every metric the proxy exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `flexinfer_proxy_requests_total{namespace,model,code}`.
    requests: IntCounterVec,
    /// `flexinfer_proxy_time_to_first_byte_seconds{namespace,model}`: request received → first
    /// byte of the backend's response body passed on (includes any cold-start wait).
    first_byte: HistogramVec,
    /// `flexinfer_proxy_cold_starts_total{namespace,model,result}`.
    cold_starts: IntCounterVec,
    /// `flexinfer_proxy_cold_start_duration_seconds{namespace,model,result}`.
    cold_start_seconds: HistogramVec,
    /// `flexinfer_proxy_waiting_requests{namespace,model}`: requests held for a cold start.
    waiting: IntGaugeVec,
    /// `flexinfer_proxy_in_flight_requests{namespace,model}` (set at scrape time).
    in_flight: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let mn = ["namespace", "model"];
        let m = Self {
            registry: Registry::new(),
            requests: IntCounterVec::new(
                opts!(
                    "flexinfer_proxy_requests_total",
                    "Requests answered by the proxy, by Model and HTTP status"
                ),
                &["namespace", "model", "code"],
            )?,
            first_byte: HistogramVec::new(
                histogram_opts!(
                    "flexinfer_proxy_time_to_first_byte_seconds",
                    "Request received to the first byte of the backend's response body (cold-start waits included)",
                    vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
                ),
                &mn,
            )?,
            cold_starts: IntCounterVec::new(
                opts!(
                    "flexinfer_proxy_cold_starts_total",
                    "Requests that found no ready backend and waited, by how the wait ended (ready, timeout, failed)"
                ),
                &["namespace", "model", "result"],
            )?,
            cold_start_seconds: HistogramVec::new(
                histogram_opts!(
                    "flexinfer_proxy_cold_start_duration_seconds",
                    "How long a request waited for a ready backend",
                    vec![1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0]
                ),
                &["namespace", "model", "result"],
            )?,
            waiting: IntGaugeVec::new(
                opts!(
                    "flexinfer_proxy_waiting_requests",
                    "Requests held while their Model starts (the cold-start queue)"
                ),
                &mn,
            )?,
            in_flight: IntGaugeVec::new(
                opts!(
                    "flexinfer_proxy_in_flight_requests",
                    "Requests in flight per Model (waiting or streaming)"
                ),
                &mn,
            )?,
        };
        m.registry.register(Box::new(m.requests.clone()))?;
        m.registry.register(Box::new(m.first_byte.clone()))?;
        m.registry.register(Box::new(m.cold_starts.clone()))?;
        m.registry
            .register(Box::new(m.cold_start_seconds.clone()))?;
        m.registry.register(Box::new(m.waiting.clone()))?;
        m.registry.register(Box::new(m.in_flight.clone()))?;
        Ok(m)
    }

    pub fn request(&self, key: Option<&ModelKey>, code: u16) {
        let (ns, name) = labels(key);
        self.requests
            .with_label_values(&[ns, name, &code.to_string()])
            .inc();
    }

    pub fn first_byte(&self, key: &ModelKey, after: Duration) {
        self.first_byte
            .with_label_values(&[&key.0, &key.1])
            .observe(after.as_secs_f64());
    }

    pub fn cold_start(&self, key: &ModelKey, result: ColdStart, waited: Duration) {
        let l = [key.0.as_str(), key.1.as_str(), result.as_str()];
        self.cold_starts.with_label_values(&l).inc();
        self.cold_start_seconds
            .with_label_values(&l)
            .observe(waited.as_secs_f64());
    }

    /// A request starts waiting for `key`; the returned guard ends the wait when dropped.
    pub fn waiting(&self, key: &ModelKey) -> Waiting {
        let g = self.waiting.with_label_values(&[&key.0, &key.1]);
        g.inc();
        Waiting(g)
    }

    /// Requests waiting for `key`'s cold start right now.
    pub fn waiting_now(&self, key: &ModelKey) -> i64 {
        self.waiting.with_label_values(&[&key.0, &key.1]).get()
    }

    /// Text exposition, with the in-flight gauges set from `in_flight` (every Model with
    /// requests in flight; others are dropped).
    pub fn render(&self, in_flight: &[(ModelKey, usize)]) -> Vec<u8> {
        self.in_flight.reset();
        for (k, n) in in_flight {
            self.in_flight
                .with_label_values(&[&k.0, &k.1])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        out
    }
}

fn labels(key: Option<&ModelKey>) -> (&str, &str) {
    key.map_or(("", ""), |k| (k.0.as_str(), k.1.as_str()))
}

/// One request in the cold-start queue.
pub struct Waiting(prometheus::IntGauge);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_labelled_by_the_resolved_model_only() -> Result<(), prometheus::Error> {
        let m = Metrics::new()?;
        let k: ModelKey = ("ns".into(), "m".into());
        m.request(Some(&k), 200);
        m.request(None, 404);
        {
            let _w = m.waiting(&k);
            let text = String::from_utf8_lossy(&m.render(&[(k.clone(), 2)])).to_string();
            assert!(
                text.contains(r#"flexinfer_proxy_waiting_requests{model="m",namespace="ns"} 1"#),
                "{text}"
            );
            assert!(
                text.contains(r#"flexinfer_proxy_in_flight_requests{model="m",namespace="ns"} 2"#),
                "{text}"
            );
        }
        m.cold_start(&k, ColdStart::Timeout, Duration::from_secs(3));
        let text = String::from_utf8_lossy(&m.render(&[])).to_string();
        assert!(
            text.contains(
                r#"flexinfer_proxy_requests_total{code="200",model="m",namespace="ns"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"flexinfer_proxy_requests_total{code="404",model="",namespace=""} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"flexinfer_proxy_waiting_requests{model="m",namespace="ns"} 0"#),
            "{text}"
        );
        assert!(
            !text.contains("flexinfer_proxy_in_flight_requests{"),
            "{text}"
        );
        assert!(
            text.contains(
                r#"flexinfer_proxy_cold_starts_total{model="m",namespace="ns",result="timeout"} 1"#
            ),
            "{text}"
        );
        Ok(())
    }
}
