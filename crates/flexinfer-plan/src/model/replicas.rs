//! Replica policy (docs/dev/architecture.md, "The Model controller"): pure, from the spec, `status.lastActiveTime` and the clock.

use std::time::Duration;

use flexinfer_api::model::{ModelSpec, WarmPolicy};
use k8s_openapi::jiff::Timestamp;

pub use flexinfer_api::model::DEFAULT_IDLE_TIMEOUT;

/// Replicas wanted now, and when to look again because the answer will change by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaDecision {
    pub replicas: i32,
    /// Time until the idle timeout expires (the Model should then scale down).
    pub recheck_after: Option<Duration>,
}

pub use flexinfer_api::duration::parse_duration;

/// `status.lastActiveTime` as the idle computation uses it. A time slightly in the future (a
/// writer's clock ahead of ours) counts as now. One more than `idleTimeout` ahead cannot come from
/// clock skew and would otherwise keep the Model up until that time: it is ignored.
pub fn clamp_last_active(last: Timestamp, now: Timestamp, idle: Duration) -> Option<Timestamp> {
    if last <= now {
        return Some(last);
    }
    let ahead = Duration::try_from(last.duration_since(now)).unwrap_or(Duration::MAX);
    (ahead <= idle).then_some(now)
}

/// Desired replicas: serverless disabled → 1; enabled → `minReplicas`, raised to 1 while the
/// Model was active within `idleTimeout`; `warmPolicy: primary` keeps at least 1.
/// (The promotion gate is applied before: a blocked Model is passed in as its canary spec.)
pub fn desired_replicas(
    spec: &ModelSpec,
    last_active: Option<Timestamp>,
    now: Timestamp,
) -> ReplicaDecision {
    if !spec.serverless.enabled {
        return ReplicaDecision {
            replicas: 1,
            recheck_after: None,
        };
    }
    let mut replicas = spec.serverless.min_replicas.max(0);
    if spec.config.warm_policy == Some(WarmPolicy::Primary) {
        replicas = replicas.max(1);
    }
    let idle = spec.serverless.idle_timeout();
    let mut recheck_after = None;
    if let Some(last) = last_active.and_then(|l| clamp_last_active(l, now, idle)) {
        let since = Duration::try_from(now.duration_since(last)).unwrap_or(Duration::ZERO);
        if since < idle {
            let remaining = idle.saturating_sub(since);
            if replicas < 1 {
                replicas = 1;
                recheck_after = Some(remaining);
            }
        }
    }
    ReplicaDecision {
        replicas,
        recheck_after,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(enabled: bool, min: i32, idle: &str, warm: Option<WarmPolicy>) -> ModelSpec {
        let mut s: ModelSpec = serde_json::from_value(serde_json::json!({
            "backend": "vllm", "source": "pvc://c/p"
        }))
        .unwrap_or_else(|e| panic!("spec: {e}"));
        s.serverless.enabled = enabled;
        s.serverless.min_replicas = min;
        s.serverless.idle_timeout = idle.to_string();
        s.config.warm_policy = warm;
        s
    }

    fn ts(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn replica_table() {
        use WarmPolicy::*;
        let now = ts(10_000);
        // (enabled, min, idle, warm, lastActive seconds ago, want replicas, want recheck secs)
        type Case<'a> = (
            bool,
            i32,
            &'a str,
            Option<WarmPolicy>,
            Option<i64>,
            i32,
            Option<u64>,
        );
        let cases: Vec<Case> = vec![
            (false, 0, "5m", None, None, 1, None),
            (false, 3, "5m", None, None, 1, None),
            (false, 0, "5m", Some(Ondemand), Some(10_000), 1, None),
            (true, 0, "5m", None, None, 0, None),
            (true, 0, "5m", Some(Ondemand), None, 0, None),
            (true, 2, "5m", None, None, 2, None),
            (true, 2, "5m", None, Some(10), 2, None),
            (true, 0, "5m", None, Some(10), 1, Some(290)),
            (true, 0, "5m", None, Some(299), 1, Some(1)),
            (true, 0, "5m", None, Some(300), 0, None),
            (true, 0, "5m", None, Some(3600), 0, None),
            (true, 0, "1h", None, Some(3599), 1, Some(1)),
            (true, 0, "5m", None, Some(-30), 1, Some(300)),
            (true, 0, "5m", None, Some(-300), 1, Some(300)),
            // Far in the future: not clock skew, ignored (else the Model stays up until then).
            (true, 0, "5m", None, Some(-301), 0, None),
            (true, 0, "5m", None, Some(-86_400 * 365), 0, None),
            (true, 2, "5m", None, Some(-86_400), 2, None),
            (true, 0, "5m", Some(Primary), None, 1, None),
            (true, 0, "5m", Some(Primary), Some(10), 1, None),
            (true, 3, "5m", Some(Primary), None, 3, None),
            (true, 0, "garbage", None, Some(200), 1, Some(100)),
        ];
        for (i, (enabled, min, idle, warm, ago, want, recheck)) in cases.into_iter().enumerate() {
            let s = spec(enabled, min, idle, warm);
            let last = ago.map(|a| ts(10_000 - a));
            let d = desired_replicas(&s, last, now);
            assert_eq!(d.replicas, want, "case {i}");
            assert_eq!(d.recheck_after.map(|d| d.as_secs()), recheck, "case {i}");
        }
    }
}
