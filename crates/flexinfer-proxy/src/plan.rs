//! The proxy's decisions, pure: whether a request is forwarded, held for a cold start or
//! refused; how long it may wait; when `status.lastActiveTime` is written.

use std::time::Duration;

use flexinfer_api::conditions::{self, types};
use flexinfer_api::duration::parse_duration;
use flexinfer_api::model::ModelPhase;
use flexinfer_api::Model;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

/// `serverless.coldStartTimeout` when it cannot be parsed (the CRD rejects bad values).
pub const DEFAULT_COLD_START_TIMEOUT: Duration = Duration::from_secs(60);
pub use flexinfer_api::model::{
    DEFAULT_IDLE_TIMEOUT, DEFAULT_KEEPALIVE_INTERVAL, MIN_KEEPALIVE_INTERVAL,
};

/// What to do with a request for a resolved Model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// A ready backend exists.
    Forward,
    /// No ready backend yet: mark the Model active (that scales it up) and hold the request
    /// until one is ready or the cold-start timeout passes.
    Wait,
    /// The Model cannot start: answer 503 with this reason.
    Reject(String),
}

/// Decide from the Model and whether it has a ready backend.
pub fn admit(model: &Model, has_ready_backend: bool) -> Admission {
    if has_ready_backend {
        // Also for a Model whose new configuration is invalid: the controller keeps the
        // running Deployment, so its pods still serve.
        return Admission::Forward;
    }
    let conds = model
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    if let Some(c) = conditions::find(conds, types::CONFIG_VALID).filter(|c| c.status == "False") {
        return Admission::Reject(format!(
            "Model {}/{} cannot be served: {}: {}",
            model.namespace().unwrap_or_default(),
            model.name_any(),
            c.reason,
            c.message
        ));
    }
    Admission::Wait
}

/// How long a request may wait for a ready backend.
pub fn cold_start_timeout(model: &Model) -> Duration {
    parse_duration(&model.spec.serverless.cold_start_timeout).unwrap_or(DEFAULT_COLD_START_TIMEOUT)
}

/// When a wait of `timeout` from `now` ends. A `coldStartTimeout` past what the clock can
/// represent (e.g. `4999999999999999h`) waits a year instead of overflowing.
pub fn deadline(now: tokio::time::Instant, timeout: Duration) -> tokio::time::Instant {
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 86_400)))
        .unwrap_or(now)
}

/// Interval of `lastActiveTime` refreshes for a Model (the rule lives with the spec, so the
/// controller's notion of "busy" uses the same one).
pub fn keepalive_interval(model: &Model, default: Duration) -> Duration {
    model.spec.serverless.keepalive_interval(default)
}

/// Whether to write `lastActiveTime = now`, given the newest value known (from the API server or
/// this replica's own last write). At most once per `interval`: a value written by any proxy
/// replica within the interval suppresses the write. A value slightly in the future (another
/// writer's clock ahead) counts as fresh; one more than an interval ahead cannot be clock skew
/// and is repaired.
pub fn should_write(current: Option<Timestamp>, now: Timestamp, interval: Duration) -> bool {
    let Some(cur) = current else { return true };
    if cur <= now {
        let since = Duration::try_from(now.duration_since(cur)).unwrap_or(Duration::MAX);
        since >= interval
    } else {
        let ahead = Duration::try_from(cur.duration_since(now)).unwrap_or(Duration::MAX);
        ahead > interval
    }
}

/// The latest moment a `lastActiveTime` read from the API server may stand for: the server keeps
/// whole seconds, so the write happened within the second after the value. Throttling on this
/// bound never writes early because of the truncation.
pub fn written_at_most(server_value: Timestamp) -> Timestamp {
    server_value
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(1))
        .unwrap_or(server_value)
}

/// The newest of two optional timestamps.
pub fn newest(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Why a Model has no ready backend, for the 504 a timed-out cold start gets.
pub fn not_ready_reason(model: &Model, waited: Duration) -> String {
    let st = model.status.as_ref();
    let phase = st
        .and_then(|s| s.phase)
        .map(ModelPhase::as_str)
        .unwrap_or("unknown");
    let ready = st.and_then(|s| conditions::find(&s.conditions, types::READY));
    let detail = match ready {
        Some(c) if !c.message.is_empty() => format!("{}: {}", c.reason, c.message),
        Some(c) => c.reason.clone(),
        None => "no status yet".to_string(),
    };
    format!(
        "Model {}/{} has no ready backend after {}s (coldStartTimeout); phase {phase}, {detail}",
        model.namespace().unwrap_or_default(),
        model.name_any(),
        waited.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_cold_start_timeout_does_not_overflow_the_clock() {
        let now = tokio::time::Instant::now();
        let d = parse_duration("4999999999999999h").unwrap_or(Duration::MAX);
        let until = deadline(now, d);
        assert!(until > now);
        assert_eq!(deadline(now, Duration::MAX), until);
        assert_eq!(
            deadline(now, Duration::from_secs(60)),
            now + Duration::from_secs(60)
        );
    }
    use crate::route::tests::model;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap_or_else(|e| panic!("{e}"))
    }

    fn with_status(conds: serde_json::Value, phase: &str) -> Model {
        let mut m = (*model("a", "m", &[])).clone();
        m.status = Some(
            serde_json::from_value(serde_json::json!({"phase": phase, "conditions": conds}))
                .unwrap_or_else(|e| panic!("{e}")),
        );
        m
    }

    fn cond(t: &str, s: &str, reason: &str, msg: &str) -> serde_json::Value {
        serde_json::json!({"type": t, "status": s, "reason": reason, "message": msg,
                           "lastTransitionTime": "2026-01-01T00:00:00Z"})
    }

    #[test]
    fn admission_table() {
        let invalid = with_status(
            serde_json::json!([cond(
                "ConfigValid",
                "False",
                "BackendUnsupported",
                "no gguf on vllm"
            )]),
            "Failed",
        );
        let idle = with_status(
            serde_json::json!([
                cond("ConfigValid", "True", "Valid", ""),
                cond("Ready", "True", "Idle", "")
            ]),
            "Idle",
        );
        let fresh = (*model("a", "m", &[])).clone();
        let cases: Vec<(&Model, bool, Admission)> = vec![
            (&idle, true, Admission::Forward),
            (&invalid, true, Admission::Forward),
            (&idle, false, Admission::Wait),
            (&fresh, false, Admission::Wait),
            (
                &invalid,
                false,
                Admission::Reject(
                    "Model a/m cannot be served: BackendUnsupported: no gguf on vllm".into(),
                ),
            ),
        ];
        for (i, (m, ready, want)) in cases.into_iter().enumerate() {
            assert_eq!(admit(m, ready), want, "case {i}");
        }
    }

    #[test]
    fn write_throttle_table() {
        let i = Duration::from_secs(30);
        let now = ts(1_000);
        // (current, want write)
        let cases = [
            (None, true),
            (Some(ts(1_000)), false),
            (Some(ts(990)), false),
            (Some(ts(971)), false),
            (Some(ts(970)), true),
            (Some(ts(0)), true),
            (Some(ts(1_010)), false), // a writer slightly ahead: fresh
            (Some(ts(1_030)), false),
            (Some(ts(1_031)), true), // far ahead: repaired
            (Some(ts(4_000_000_000)), true),
        ];
        for (cur, want) in cases {
            assert_eq!(should_write(cur, now, i), want, "{cur:?}");
        }
    }

    #[test]
    fn keepalive_interval_table() {
        let d = DEFAULT_KEEPALIVE_INTERVAL;
        // (idleTimeout, keepaliveInterval, want secs)
        let cases = [
            ("5m", None, 30.0),
            ("5m", Some("10s"), 10.0),
            ("5m", Some("10m"), 150.0), // capped at idle/2
            ("40s", None, 20.0),        // default capped at idle/2
            ("1s", None, 1.0),          // floor
            ("5m", Some("100ms"), 1.0), // floor
            ("garbage", Some("garbage"), 30.0),
        ];
        for (idle, ka, want) in cases {
            let mut m = (*model("a", "m", &[])).clone();
            m.spec.serverless.idle_timeout = idle.into();
            m.spec.serverless.keepalive_interval = ka.map(String::from);
            assert_eq!(
                keepalive_interval(&m, d).as_secs_f64(),
                want,
                "{idle} {ka:?}"
            );
        }
    }

    #[test]
    fn cold_start_timeouts_and_reasons() {
        let mut m = with_status(
            serde_json::json!([cond(
                "Ready",
                "False",
                "Unschedulable",
                "no node with a free GPU"
            )]),
            "Pending",
        );
        assert_eq!(cold_start_timeout(&m), Duration::from_secs(60));
        m.spec.serverless.cold_start_timeout = "2m30s".into();
        assert_eq!(cold_start_timeout(&m), Duration::from_secs(150));
        m.spec.serverless.cold_start_timeout = "99999999999999999999h".into();
        assert_eq!(cold_start_timeout(&m), DEFAULT_COLD_START_TIMEOUT);
        let r = not_ready_reason(&m, Duration::from_secs(60));
        assert!(
            r.contains("a/m") && r.contains("60s") && r.contains("Pending"),
            "{r}"
        );
        assert!(r.contains("no node with a free GPU"), "{r}");
        assert!(not_ready_reason(&model("a", "m", &[]), Duration::ZERO).contains("no status yet"));
    }

    #[test]
    fn server_values_are_read_as_the_end_of_their_second() {
        let i = Duration::from_secs(2);
        // Written at 100.9 and stored as 100: at 101.5 a second replica must not write again.
        let stored = ts(100);
        let now = Timestamp::from_millisecond(101_500).unwrap_or_else(|e| panic!("{e}"));
        // The truncated value alone would allow a write 1.1 s after the real one.
        assert!(should_write(Some(stored), ts(102), i));
        assert!(!should_write(Some(written_at_most(stored)), now, i));
        assert!(!should_write(Some(written_at_most(stored)), ts(102), i));
        assert!(should_write(Some(written_at_most(stored)), ts(103), i));
    }

    #[test]
    fn newest_of_two() {
        assert_eq!(newest(None, None), None);
        assert_eq!(newest(Some(ts(1)), None), Some(ts(1)));
        assert_eq!(newest(None, Some(ts(2))), Some(ts(2)));
        assert_eq!(newest(Some(ts(3)), Some(ts(2))), Some(ts(3)));
    }
}
