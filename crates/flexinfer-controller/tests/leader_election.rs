//! Leader election on the real API server (`scripts/testenv/up.sh api`; needs `KUBECONFIG`):
//! expiry is decided on the local monotonic clock from the last change of the lease record, never
//! by comparing another replica's `renewTime` with our clock; a holder that cannot renew (the API
//! server stops answering) gives up within the renew deadline.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flexinfer_controller::leader::{Leadership, LeaseConfig};
use flexinfer_e2e::{client, TestNamespace};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, PostParams};
use kube::Client;

fn cfg(ns: &str, identity: &str, secs: u64) -> LeaseConfig {
    LeaseConfig::new(
        ns.into(),
        "leader".into(),
        identity.into(),
        Duration::from_secs(secs),
    )
}

/// The lease as another replica writes it, with `renew` from its own clock.
fn foreign(renew: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some("leader".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("other".into()),
            lease_duration_seconds: Some(2),
            renew_time: Some(MicroTime(renew)),
            ..Default::default()
        }),
    }
}

#[tokio::test]
async fn expiry_ignores_the_holders_clock_and_follows_changes_of_the_record() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "leader-skew")
        .await
        .expect("namespace");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    // The holder's clock is an hour behind: its renewTime always looks long expired to us.
    let behind = Timestamp::now() - SignedDuration::from_hours(1);
    leases
        .create(&PostParams::default(), &foreign(behind))
        .await
        .unwrap();
    let renewing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (leases, renewing) = (leases.clone(), renewing.clone());
        tokio::spawn(async move {
            let mut renew = behind;
            while renewing.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(400)).await;
                renew += SignedDuration::from_millis(400);
                let mut l = leases.get("leader").await.unwrap();
                l.spec.as_mut().unwrap().renew_time = Some(MicroTime(renew));
                leases
                    .replace("leader", &PostParams::default(), &l)
                    .await
                    .unwrap();
            }
        })
    };
    let c = client.clone();
    let name = ns.name.clone();
    let mut me = tokio::spawn(async move { Leadership::acquire(c, cfg(&name, "me", 2)).await });
    // While the holder keeps renewing, we never take over (old code: at once, by the clocks).
    assert!(
        tokio::time::timeout(Duration::from_secs(4), &mut me)
            .await
            .is_err(),
        "took a lease that its holder was renewing"
    );
    renewing.store(false, Ordering::SeqCst);
    writer.await.unwrap();
    // Unchanged for a lease duration (2 s): ours.
    let held = tokio::time::timeout(Duration::from_secs(6), me)
        .await
        .expect("acquires once the record stops changing")
        .unwrap()
        .unwrap();
    let l = leases.get("leader").await.unwrap();
    assert_eq!(l.spec.unwrap().holder_identity.as_deref(), Some("me"));
    held.release().await;

    // The holder's clock is an hour ahead and it died: its renewTime looks fresh for an hour
    // (old code waited that hour); we take over after one lease duration without changes.
    leases
        .delete("leader", &DeleteParams::default())
        .await
        .unwrap();
    let ahead = Timestamp::now() + SignedDuration::from_hours(1);
    leases
        .create(&PostParams::default(), &foreign(ahead))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let held = tokio::time::timeout(
        Duration::from_secs(8),
        Leadership::acquire(client.clone(), cfg(&ns.name, "me", 2)),
    )
    .await
    .expect("a dead holder with a clock ahead does not block us")
    .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "waited a lease duration"
    );
    held.release().await;
    drop(ns);
}

/// A TCP relay to the API server that can stop answering: existing connections are cut and new
/// ones are accepted but never served (calls hang until their timeout).
struct Relay {
    addr: std::net::SocketAddr,
    frozen: Arc<AtomicBool>,
    cut: Arc<tokio::sync::Notify>,
}

impl Relay {
    async fn start(upstream: String) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(tokio::sync::Notify::new());
        let (f, c) = (frozen.clone(), cut.clone());
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let Ok((mut down, _)) = listener.accept().await else {
                    continue;
                };
                if f.load(Ordering::SeqCst) {
                    held.push(down);
                    continue;
                }
                let (up, c) = (upstream.clone(), c.clone());
                tokio::spawn(async move {
                    let Ok(mut up) = tokio::net::TcpStream::connect(up).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = c.notified() => {}
                    }
                });
            }
        });
        Relay { addr, frozen, cut }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
        self.cut.notify_waiters();
    }
}

#[tokio::test]
async fn a_holder_that_cannot_renew_stops_within_the_renew_deadline() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "leader-deadline")
        .await
        .expect("namespace");
    let mut config = kube::Config::infer().await.unwrap();
    let upstream = config.cluster_url.authority().unwrap().to_string();
    let relay = Relay::start(upstream).await;
    config.cluster_url = format!("https://{}", relay.addr).parse().unwrap();
    let relayed = Client::try_from(config).unwrap();

    let cfg = cfg(&ns.name, "me", 3);
    let deadline = cfg.renew_deadline;
    assert!(deadline < Duration::from_secs(3));
    let held = Leadership::acquire(relayed, cfg).await.unwrap();
    let keep = tokio::spawn(async move { held.keep().await });
    // Renewals succeed: we keep leading.
    flexinfer_e2e::holds_for(
        "leading while renewals succeed",
        Duration::from_secs(3),
        || !keep.is_finished(),
    )
    .await
    .unwrap();
    let frozen_at = std::time::Instant::now();
    relay.freeze();
    tokio::time::timeout(deadline + Duration::from_secs(2), keep)
        .await
        .expect("still leading after the renew deadline with a hung API server")
        .unwrap();
    let took = frozen_at.elapsed();
    assert!(took <= deadline + Duration::from_secs(1), "took {took:?}");
    // Before any standby could consider the lease (3 s) expired.
    assert!(took < Duration::from_secs(3), "took {took:?}");
    drop(ns);
}
