//! A panic inside one object's reconcile is an error for that object; the
//! controller keeps reconciling the others and retries the panicking one with backoff.
//! Runs a kube-runtime `Controller` over ConfigMaps of a test namespace on the real API server,
//! with the same `supervise::Guard` the ModelCache and Model controllers use.
//!
//! Needs `KUBECONFIG` from `scripts/testenv/up.sh` (`make test` sets it up).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexinfer_controller::events::Recorder;
use flexinfer_controller::metrics::Metrics;
use flexinfer_controller::supervise::{Guard, RECONCILE_PANICKED};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::Reporter;
use kube::runtime::watcher;
use kube::ResourceExt;

#[derive(Debug, thiserror::Error)]
#[error("never")]
struct Never;

#[derive(Default)]
struct Seen(Mutex<BTreeMap<String, u32>>);

impl Seen {
    fn count(&self, name: &str) -> u32 {
        self.0.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

async fn reconcile(cm: Arc<ConfigMap>, seen: Arc<Seen>) -> Result<Action, Never> {
    let name = cm.name_any();
    *seen.0.lock().unwrap().entry(name.clone()).or_insert(0) += 1;
    if name == "boom" {
        // What a bug on user input looks like: an unwrap deep inside a planner.
        let _ = cm.data.as_ref().and_then(|d| d.get("size")).unwrap();
    }
    Ok(Action::await_change())
}

fn error_policy(_: Arc<ConfigMap>, _: &Never, _: Arc<Seen>) -> Action {
    Action::requeue(Duration::from_secs(1))
}

#[tokio::test]
async fn a_panicking_reconcile_does_not_stop_the_controller() {
    let client = flexinfer_e2e::client().await;
    let ns = flexinfer_e2e::TestNamespace::new(&client, "panic")
        .await
        .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let metrics = Metrics::new().unwrap();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "flexinfer-panic-test".into(),
            instance: None,
        },
    );
    let guard = Guard::new("panic-test", metrics.clone(), Some(recorder));
    let seen = Arc::new(Seen::default());
    let controller = Controller::new(api.clone(), watcher::Config::default())
        .run(
            guard.reconcile(reconcile),
            guard.error_policy(error_policy),
            seen.clone(),
        )
        .for_each(|_| futures::future::ready(()));
    let running = tokio::spawn(controller);

    let cm = |name: &str| -> ConfigMap {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap()
    };
    api.create(&PostParams::default(), &cm("boom"))
        .await
        .unwrap();
    for name in ["a", "b", "c"] {
        api.create(&PostParams::default(), &cm(name)).await.unwrap();
    }
    // The others are reconciled, "boom" is tried again (backoff 5 s after the first panic).
    flexinfer_e2e::wait_for(
        "all reconciled and boom retried",
        Duration::from_secs(40),
        || {
            let seen = seen.clone();
            async move {
                (["a", "b", "c"].iter().all(|n| seen.count(n) >= 1) && seen.count("boom") >= 2)
                    .then_some(())
            }
        },
    )
    .await
    .unwrap();
    assert!(!running.is_finished(), "the controller stopped");
    // Objects created after the panics are still reconciled.
    api.create(&PostParams::default(), &cm("late"))
        .await
        .unwrap();
    flexinfer_e2e::wait_for("late reconciled", Duration::from_secs(20), || {
        let seen = seen.clone();
        async move { (seen.count("late") >= 1).then_some(()) }
    })
    .await
    .unwrap();
    assert!(
        metrics
            .render()
            .contains("flexinfer_reconcile_errors_total{controller=\"panic-test\"}"),
        "the panics count as reconcile errors"
    );
    // The panic is reported on the object.
    let events: Api<Event> = Api::namespaced(client.clone(), &ns.name);
    let ev = flexinfer_e2e::wait_for("ReconcilePanicked event", Duration::from_secs(20), || {
        let events = events.clone();
        async move {
            events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some(RECONCILE_PANICKED)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("boom")
                })
        }
    })
    .await
    .unwrap();
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(
        ev.note.as_deref().is_some_and(|n| n.contains("None")),
        "{:?}",
        ev.note
    );
    running.abort();
}
