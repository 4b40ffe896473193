//! One failure never stops the rest: a panic inside one reconcile becomes an
//! error for that object, and each controller runs as its own supervised task.

use std::any::Any;
use std::fmt::Debug;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::events::Recorder;
use futures::future::BoxFuture;
use futures::{FutureExt, Stream};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::http::Health;
use crate::metrics::Metrics;

/// Event reason of a reconcile that panicked.
pub const RECONCILE_PANICKED: &str = "ReconcilePanicked";

/// A reconcile error, or a panic caught inside the reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Guarded<E: std::error::Error + 'static> {
    #[error(transparent)]
    Failed(E),
    #[error("reconcile panicked: {0}")]
    Panicked(String),
}

/// One item of a guarded controller's stream ([`Guard::run`]).
pub type ControllerResult<K, E> =
    Result<(ObjectRef<K>, Action), controller::Error<Guarded<E>, watcher::Error>>;

/// Await `fut`; a panic while polling it becomes [`Guarded::Panicked`].
pub async fn catch_panic<F, T, E>(fut: F) -> Result<T, Guarded<E>>
where
    F: Future<Output = Result<T, E>>,
    E: std::error::Error + 'static,
{
    match AssertUnwindSafe(fut).catch_unwind().await {
        Ok(r) => r.map_err(Guarded::Failed),
        Err(payload) => Err(Guarded::Panicked(panic_message(payload.as_ref()))),
    }
}

/// The message of a panic payload (`panic!` with a literal or a formatted string).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        return (*s).to_string();
    }
    match payload.downcast_ref::<String>() {
        Some(s) => s.clone(),
        None => "panic with a non-string payload".to_string(),
    }
}

/// Requeue delay after the `n`th panic in a row of one object: 5 s, doubling, at most 5 min.
pub fn panic_backoff(n: u32) -> Duration {
    let secs = 5u64.saturating_mul(2u64.saturating_pow(n.saturating_sub(1).min(6)));
    Duration::from_secs(secs.min(300))
}

/// Wraps a controller's reconcile and error policy so a panic is caught per object.
pub struct Guard {
    controller: &'static str,
    metrics: Metrics,
    recorder: Option<Recorder>,
    /// Panics in a row per object (reset by a successful reconcile).
    strikes: crate::backoff::Failures,
}

fn key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

impl Guard {
    /// `recorder`, when given, publishes a Warning Event on the object whose reconcile panicked.
    pub fn new(
        controller: &'static str,
        metrics: Metrics,
        recorder: Option<Recorder>,
    ) -> Arc<Self> {
        Arc::new(Self {
            controller,
            metrics,
            recorder,
            strikes: Default::default(),
        })
    }

    /// `reconcile` with panics caught (pass the result to `Controller::run`).
    pub fn reconcile<K, C, E, F, Fut>(
        self: &Arc<Self>,
        reconcile: F,
    ) -> impl FnMut(Arc<K>, Arc<C>) -> BoxFuture<'static, Result<Action, Guarded<E>>>
    where
        K: Resource<DynamicType = ()> + Send + Sync + 'static,
        C: Send + Sync + 'static,
        E: std::error::Error + Send + 'static,
        F: Fn(Arc<K>, Arc<C>) -> Fut,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
    {
        let guard = self.clone();
        move |obj: Arc<K>, ctx: Arc<C>| {
            let guard = guard.clone();
            let fut = reconcile(obj.clone(), ctx);
            async move {
                let res = catch_panic(fut).await;
                // Every finished call counts, success, error or panic (tests wait on it).
                guard
                    .metrics
                    .reconciles_total
                    .with_label_values(&[guard.controller])
                    .inc();
                let key = key(&*obj);
                match &res {
                    Ok(_) => guard.strikes.succeeded(&key),
                    Err(Guarded::Panicked(msg)) => guard.panicked(&*obj, &key, msg).await,
                    Err(Guarded::Failed(_)) => {}
                }
                res
            }
            .boxed()
        }
    }

    async fn panicked<K: Resource<DynamicType = ()>>(&self, obj: &K, key: &str, msg: &str) {
        let n = self.strikes.hit(key);
        error!(controller = self.controller, object = %key, panic = %msg, in_a_row = n, "reconcile panicked; the object is retried with backoff");
        let Some(recorder) = &self.recorder else {
            return;
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: RECONCILE_PANICKED.into(),
            note: Some(
                format!("internal error while reconciling (retried with backoff): {msg}")
                    .chars()
                    .take(1000)
                    .collect(),
            ),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&ev, &obj.object_ref(&())).await {
            warn!(object = %key, error = %e, "cannot publish event");
        }
    }

    /// `controller` run with `reconcile` and `error_policy` guarded ([`Guard::reconcile`],
    /// [`Guard::error_policy`]): a panic in one object's reconcile is an error of that object, not
    /// of the process. The stream's items are the caller's to log.
    pub fn run<K, C, E, F, Fut, P>(
        self: &Arc<Self>,
        controller: Controller<K>,
        reconcile: F,
        error_policy: P,
        ctx: Arc<C>,
    ) -> impl Stream<Item = ControllerResult<K, E>>
    where
        K: Clone + Resource<DynamicType = ()> + DeserializeOwned + Debug + Send + Sync + 'static,
        C: Send + Sync + 'static,
        E: std::error::Error + Send + 'static,
        F: Fn(Arc<K>, Arc<C>) -> Fut,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        P: Fn(Arc<K>, &E, Arc<C>) -> Action,
    {
        controller.run(
            self.reconcile(reconcile),
            self.error_policy(error_policy),
            ctx,
        )
    }

    /// `error_policy` for [`Guarded`] errors: panics back off per object, the rest go to `inner`.
    pub fn error_policy<K, C, E, P>(
        self: &Arc<Self>,
        inner: P,
    ) -> impl Fn(Arc<K>, &Guarded<E>, Arc<C>) -> Action
    where
        K: Resource<DynamicType = ()>,
        E: std::error::Error + 'static,
        P: Fn(Arc<K>, &E, Arc<C>) -> Action,
    {
        let guard = self.clone();
        move |obj: Arc<K>, err: &Guarded<E>, ctx: Arc<C>| match err {
            Guarded::Failed(e) => inner(obj, e, ctx),
            Guarded::Panicked(_) => {
                guard
                    .metrics
                    .reconcile_errors_total
                    .with_label_values(&[guard.controller])
                    .inc();
                Action::requeue(panic_backoff(guard.strikes.count(&key(&*obj)).max(1)))
            }
        }
    }
}

/// Set once the process is shutting down (a signal, or leadership lost).
#[derive(Clone)]
pub struct Shutdown {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::channel(false).0),
        }
    }
}

impl Shutdown {
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }
    pub fn is_triggered(&self) -> bool {
        *self.tx.borrow()
    }
    /// Resolves once [`trigger`](Self::trigger) was called.
    pub async fn wait(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }
}

/// How long a controller may take to stop after the shutdown signal before it is aborted.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Restart delay after the `n`th early end in a row of a controller: 1 s, doubling, at most 30 s.
pub fn restart_backoff(n: u32) -> Duration {
    Duration::from_secs(2u64.saturating_pow(n.saturating_sub(1).min(5)).min(30))
}

/// Run a controller as its own task and restart it (with backoff) whenever it ends, errs or
/// panics before `shutdown`. While it is down, `health` reports it (`/healthz` answers 503).
/// Returns once `shutdown` is triggered and the controller stopped (or [`SHUTDOWN_GRACE`] passed).
pub async fn supervise<F, Fut>(name: &'static str, health: Health, shutdown: Shutdown, start: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let mut failures = 0u32;
    loop {
        health.set_controller(name, None);
        let started = Instant::now();
        let mut task = tokio::spawn(start());
        let ended = tokio::select! {
            r = &mut task => r,
            () = shutdown.wait() => {
                // Time to finish in-flight reconciles (the controllers stop on the signal too).
                if tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await.is_err() {
                    task.abort();
                }
                return;
            }
        };
        // A controller that stops on the shutdown signal itself may end just before we hear of it.
        if tokio::time::timeout(Duration::from_secs(1), shutdown.wait())
            .await
            .is_ok()
        {
            return;
        }
        let why = match ended {
            Ok(Ok(())) => "its watch stream ended".to_string(),
            Ok(Err(e)) => format!("it failed: {e:#}"),
            Err(e) if e.is_panic() => format!("it panicked: {}", panic_message(&*e.into_panic())),
            Err(e) => format!("its task ended: {e}"),
        };
        failures = if started.elapsed() > Duration::from_secs(300) {
            1
        } else {
            failures.saturating_add(1)
        };
        let delay = restart_backoff(failures);
        error!(controller = name, reason = %why, restart_in_s = delay.as_secs(), "controller stopped; restarting it (the other controllers keep running)");
        health.set_controller(name, Some(why));
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.wait() => return,
        }
        info!(controller = name, "restarting controller");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[derive(Debug, thiserror::Error)]
    #[error("plain failure")]
    struct Plain;

    fn cm(name: &str) -> Arc<ConfigMap> {
        let mut c = ConfigMap::default();
        c.metadata.name = Some(name.into());
        c.metadata.namespace = Some("ns".into());
        Arc::new(c)
    }

    async fn reconcile(cm: Arc<ConfigMap>, calls: Arc<AtomicU32>) -> Result<Action, Plain> {
        calls.fetch_add(1, Ordering::SeqCst);
        match cm.name_any().as_str() {
            "boom" => panic!("index out of range for {}", cm.name_any()),
            "str" => std::panic::panic_any("literal payload"),
            "fail" => Err(Plain),
            _ => Ok(Action::requeue(Duration::from_secs(7))),
        }
    }

    #[tokio::test]
    async fn a_panic_is_an_error_of_that_object_only() {
        let guard = Guard::new(
            "test",
            Metrics::new().unwrap_or_else(|e| panic!("{e}")),
            None,
        );
        let mut run = guard.reconcile(reconcile);
        let policy = guard.error_policy(|_: Arc<ConfigMap>, _: &Plain, _: Arc<AtomicU32>| {
            Action::requeue(Duration::from_secs(1))
        });
        let calls = Arc::new(AtomicU32::new(0));
        // (object, want: Ok / Failed / Panicked(message part), want requeue secs from the policy)
        let cases: Vec<(&str, &str, u64)> = vec![
            ("ok", "Ok", 0),
            ("boom", "index out of range for boom", 5),
            ("ok", "Ok", 0),
            ("boom", "index out of range for boom", 10),
            ("fail", "Failed", 1),
            ("str", "literal payload", 5),
            ("boom", "index out of range for boom", 20),
            ("other", "Ok", 0),
        ];
        for (i, (name, want, requeue)) in cases.into_iter().enumerate() {
            let res = run(cm(name), calls.clone()).await;
            match (&res, want) {
                (Ok(a), "Ok") => {
                    assert_eq!(*a, Action::requeue(Duration::from_secs(7)), "case {i}")
                }
                (Err(e @ Guarded::Failed(_)), "Failed") => {
                    assert_eq!(
                        policy(cm(name), e, calls.clone()),
                        Action::requeue(Duration::from_secs(requeue)),
                        "case {i}"
                    )
                }
                (Err(e @ Guarded::Panicked(msg)), part) => {
                    assert!(msg.contains(part), "case {i}: {msg}");
                    assert_eq!(
                        policy(cm(name), e, calls.clone()),
                        Action::requeue(Duration::from_secs(requeue)),
                        "case {i}"
                    );
                }
                (r, w) => panic!("case {i} ({name}): got {r:?}, want {w}"),
            }
        }
        assert_eq!(calls.load(Ordering::SeqCst), 8, "every call ran");
        let errors = guard
            .metrics
            .reconcile_errors_total
            .with_label_values(&["test"])
            .get();
        assert_eq!(errors, 4, "each panic counts as a reconcile error");
        let calls_counted = guard
            .metrics
            .reconciles_total
            .with_label_values(&["test"])
            .get();
        assert_eq!(calls_counted, 8, "every call counts as a reconcile");
    }

    #[test]
    fn backoffs() {
        let p: Vec<u64> = (1..=9).map(|n| panic_backoff(n).as_secs()).collect();
        assert_eq!(p, vec![5, 10, 20, 40, 80, 160, 300, 300, 300]);
        let r: Vec<u64> = (1..=8).map(|n| restart_backoff(n).as_secs()).collect();
        assert_eq!(r, vec![1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(panic_backoff(u32::MAX).as_secs(), 300);
        assert_eq!(restart_backoff(0).as_secs(), 1);
    }

    #[tokio::test]
    async fn a_stopped_controller_is_restarted_and_reported_while_down() {
        let health = Health::default();
        let shutdown = Shutdown::default();
        let starts = Arc::new(AtomicU32::new(0));
        let (s, stop) = (starts.clone(), shutdown.clone());
        let sup = tokio::spawn(supervise(
            "flaky",
            health.clone(),
            shutdown.clone(),
            move || {
                let n = s.fetch_add(1, Ordering::SeqCst);
                let stop = stop.clone();
                async move {
                    match n {
                        0 => anyhow::bail!("watch failed"),
                        1 => panic!("bug"),
                        // Runs until the shutdown, then stops by itself (as the controllers do).
                        _ => {
                            stop.wait().await;
                            Ok(())
                        }
                    }
                }
            },
        ));
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut saw_down = Vec::new();
        while starts.load(Ordering::SeqCst) < 3 {
            if let Some(why) = health.down().into_iter().next() {
                if !saw_down.contains(&why) {
                    saw_down.push(why);
                }
            }
            assert!(Instant::now() < deadline, "not restarted: {saw_down:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            health.down().is_empty(),
            "running again: {:?}",
            health.down()
        );
        assert!(
            saw_down.iter().any(|w| w.contains("watch failed")),
            "{saw_down:?}"
        );
        assert!(
            saw_down.iter().any(|w| w.contains("panicked: bug")),
            "{saw_down:?}"
        );
        shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(5), sup)
            .await
            .unwrap_or_else(|_| panic!("supervisor ignored the shutdown"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}
