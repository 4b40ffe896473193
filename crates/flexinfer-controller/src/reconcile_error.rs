//! What the two reconcilers (ModelCache, Model) share when a reconcile does not finish: one error
//! type and one error policy. A stale object (the conditional write's 409) or a Job store that does
//! not show our last write yet is re-planned shortly, uncounted; any other error is counted in
//! `flexinfer_reconcile_errors_total{controller}` and retried after the object's exponential backoff
//! ([`crate::backoff::Failures`], keyed by `namespace/name`, reset by a reconcile that succeeds).

use std::time::Duration;

use kube::runtime::controller::Action;
use kube::ResourceExt;
use tracing::{debug, warn};

use crate::backoff::Failures;
use crate::metrics::Metrics;

/// Why a reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API")]
    Kube(#[from] kube::Error),
    #[error("object without {0}")]
    Missing(&'static str),
    #[error("serialize")]
    Json(#[from] serde_json::Error),
    /// The conditional write found a newer object than the one planned from.
    #[error("object changed while reconciling; planning again")]
    Conflict,
    #[error("reconcile took longer than {0} s (an API request hung); retrying")]
    TimedOut(u64),
    /// A Job this controller wrote is not in the Job store yet.
    #[error("waiting for the watch to show our last Job change; retrying")]
    StoreBehind,
}

impl Error {
    /// The error of a conditional write (one carrying the resourceVersion the plan was made from):
    /// 409, the object changed since it was read, is [`Error::Conflict`].
    pub fn of_write(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(ref s) if s.code == 409 => Self::Conflict,
            e => Self::Kube(e),
        }
    }

    /// The short, uncounted requeue of an error that is no failure of the object, and why.
    /// `(requeue, why, the retries metric's reason)`.
    fn quick_retry(&self) -> Option<(Duration, &'static str, &'static str)> {
        match self {
            Self::Conflict => Some((Duration::from_millis(300), "stale object", "conflict")),
            Self::StoreBehind => Some((
                Duration::from_millis(100),
                "Job store behind our write",
                "store_behind",
            )),
            _ => None,
        }
    }
}

/// `namespace/name` of an object, the key of its failure count.
pub fn failure_key(object: &impl ResourceExt) -> String {
    format!(
        "{}/{}",
        object.namespace().unwrap_or_default(),
        object.name_any()
    )
}

/// The requeue after `err` in `controller` (`modelcache`, `model`: the metric's label) for `object`.
pub fn error_policy(
    controller: &'static str,
    object: &impl ResourceExt,
    err: &Error,
    metrics: &Metrics,
    failures: &Failures,
) -> Action {
    let (name, namespace) = (object.name_any(), object.namespace());
    if let Some((after, why, reason)) = err.quick_retry() {
        metrics
            .reconcile_retries_total
            .with_label_values(&[controller, reason])
            .inc();
        debug!(controller, name, namespace, "{why}; requeue");
        return Action::requeue(after);
    }
    metrics
        .reconcile_errors_total
        .with_label_values(&[controller])
        .inc();
    let delay = failures.failed(&failure_key(object));
    warn!(controller, name, namespace, error = %flexinfer_api::contract::error::chain(err),
          retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), "reconcile failed");
    Action::requeue(delay)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexinfer_api::Model;

    fn model() -> Model {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"backend": "vllm", "source": "org/model"},
        }))
        .expect("model")
    }

    /// A stale object or a store behind our write is re-planned shortly and counts as no failure;
    /// other errors are counted and back off per object.
    #[test]
    fn quick_retries_are_not_failures() {
        let (m, failures, obj) = (
            Metrics::new().expect("metrics"),
            Failures::default(),
            model(),
        );
        let errors = |m: &Metrics| m.reconcile_errors_total.with_label_values(&["model"]).get();
        assert_eq!(
            error_policy("model", &obj, &Error::Conflict, &m, &failures),
            Action::requeue(Duration::from_millis(300))
        );
        assert_eq!(
            error_policy("model", &obj, &Error::StoreBehind, &m, &failures),
            Action::requeue(Duration::from_millis(100))
        );
        assert_eq!(errors(&m), 0);
        assert_eq!(failures.count("ns/m"), 0);
        let retries = |r: &str| {
            m.reconcile_retries_total
                .with_label_values(&["model", r])
                .get()
        };
        assert_eq!((retries("conflict"), retries("store_behind")), (1, 1));
        error_policy("model", &obj, &Error::Missing("namespace"), &m, &failures);
        error_policy("model", &obj, &Error::TimedOut(60), &m, &failures);
        assert_eq!(errors(&m), 2);
        assert_eq!(failures.count(&failure_key(&obj)), 2, "counted per ns/name");
    }

    /// A conditional write's 409 re-plans (Conflict); any other API error stays a Kube error.
    #[test]
    fn a_409_of_a_write_is_a_conflict() {
        let api = |code: u16| {
            let status: kube::core::Status =
                serde_json::from_value(serde_json::json!({"code": code, "message": "m"}))
                    .expect("status");
            kube::Error::Api(Box::new(status))
        };
        assert!(matches!(Error::of_write(api(409)), Error::Conflict));
        assert!(matches!(Error::of_write(api(404)), Error::Kube(_)));
        assert!(matches!(Error::of_write(api(500)), Error::Kube(_)));
    }
}
