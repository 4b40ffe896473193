//! The controller's Event recorder on the real API server (`scripts/testenv/up.sh api`; needs `KUBECONFIG`):
//! a repeat of an event within the series TTL is one `events.k8s.io/v1` Event with `series.count` (a merge
//! patch the API server accepts), a different reason or object is its own Event, and an Event deleted
//! meanwhile is created again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_controller::events::Recorder;
use flexinfer_e2e::TestNamespace;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::Client;

#[tokio::test]
async fn repeats_become_one_event_with_a_series() {
    if std::env::var_os("KUBECONFIG").is_none() {
        panic!("KUBECONFIG is not set: run with the local control plane (make test)");
    }
    let c = Client::try_default().await.unwrap();
    let ns = TestNamespace::new(&c, "events").await.unwrap();
    let rec = Recorder::new(
        c.clone(),
        Reporter {
            controller: "flexinfer-test".into(),
            instance: None,
        },
    );
    let obj = |name: &str| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("ConfigMap".into()),
        namespace: Some(ns.name.clone()),
        name: Some(name.into()),
        uid: Some(format!("uid-{name}")),
        ..Default::default()
    };
    let ev = |reason: &str, note: &str| Event {
        type_: EventType::Normal,
        reason: reason.into(),
        note: Some(note.into()),
        action: "Test".into(),
        secondary: None,
    };
    for i in 0..3 {
        rec.publish(&ev("Repeated", &format!("time {i}")), &obj("a"))
            .await
            .unwrap();
    }
    rec.publish(&ev("Other", "x"), &obj("a")).await.unwrap();
    rec.publish(&ev("Repeated", "x"), &obj("b")).await.unwrap();
    let api: Api<K8sEvent> = Api::namespaced(c.clone(), &ns.name);
    let list = |reason: &'static str, name: &'static str| {
        let api = api.clone();
        async move {
            api.list(&ListParams::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .filter(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                })
                .collect::<Vec<_>>()
        }
    };
    let repeated = list("Repeated", "a").await;
    assert_eq!(repeated.len(), 1, "{repeated:?}");
    assert_eq!(
        repeated[0].series.as_ref().map(|s| s.count),
        Some(3),
        "{:?}",
        repeated[0]
    );
    assert_eq!(list("Other", "a").await.len(), 1);
    let b = list("Repeated", "b").await;
    assert_eq!(b.len(), 1);
    assert!(b[0].series.is_none(), "{:?}", b[0]);
    // Deleted meanwhile: the next occurrence creates a new Event.
    api.delete(
        repeated[0].metadata.name.as_deref().unwrap(),
        &DeleteParams::default(),
    )
    .await
    .unwrap();
    rec.publish(&ev("Repeated", "again"), &obj("a"))
        .await
        .unwrap();
    let again = list("Repeated", "a").await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_ne!(again[0].metadata.name, repeated[0].metadata.name);
}
