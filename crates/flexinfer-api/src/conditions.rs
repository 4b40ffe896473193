//! Helpers for standard `metav1.Condition` lists.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Condition type names.
pub mod types {
    pub const READY: &str = "Ready";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
    pub const DOWNLOADED: &str = "Downloaded";
    pub const ABLITERATED: &str = "Abliterated";
    pub const QUANTIZED: &str = "Quantized";
    pub const PUBLISHED: &str = "Published"; // not-contract: a condition type
    pub const CONFIG_VALID: &str = "ConfigValid";
    pub const CACHED: &str = "Cached";
    pub const PROMOTION_GATE: &str = "PromotionGate";
}

/// Find a condition by type.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition `type_` is `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

/// Set (insert or update) a condition. `lastTransitionTime` only moves when the status changes,
/// so re-applying the same condition is a no-op. Returns whether anything changed.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    now: &Time,
) -> bool {
    let status_s = if status { "True" } else { "False" };
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        let changed_status = c.status != status_s;
        let changed = changed_status
            || c.reason != reason
            || c.message != message
            || c.observed_generation != observed_generation;
        if changed_status {
            c.last_transition_time = now.clone();
        }
        c.status = status_s.to_string();
        c.reason = reason.to_string();
        c.message = message.to_string();
        c.observed_generation = observed_generation;
        changed
    } else {
        conditions.push(Condition {
            type_: type_.to_string(),
            status: status_s.to_string(),
            reason: reason.to_string(),
            message: message.to_string(),
            observed_generation,
            last_transition_time: now.clone(),
        });
        true
    }
}

/// Remove a condition. Returns whether it was present.
pub fn remove(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    before != conditions.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap_or_default())
    }

    #[test]
    fn set_keeps_transition_time_when_status_unchanged() {
        let mut c = Vec::new();
        assert!(set(&mut c, "Ready", false, "A", "m", Some(1), &t(10)));
        assert!(!set(&mut c, "Ready", false, "A", "m", Some(1), &t(20)));
        assert_eq!(c[0].last_transition_time, t(10));
        assert!(set(&mut c, "Ready", false, "B", "m2", Some(1), &t(30)));
        assert_eq!(c[0].last_transition_time, t(10));
        assert!(set(&mut c, "Ready", true, "B", "m2", Some(1), &t(40)));
        assert_eq!(c[0].last_transition_time, t(40));
        assert!(is_true(&c, "Ready"));
        assert!(remove(&mut c, "Ready"));
        assert!(!remove(&mut c, "Ready"));
        assert!(find(&c, "Ready").is_none());
    }
}
