//! Model controller (docs/dev/architecture.md, "The Model controller"): a Model becomes a Deployment and a Service for its backend,
//! scaled by the replica policy and guarded by the quantized-artifact promotion gate.
//!
//! The decisions live in the pure crate `flexinfer-plan` ([`plan`], which uses `gate`, `replicas`,
//! `render` and `status`; re-exported here); [`reconcile`] only observes the cluster, calls the
//! planner and applies its result.

pub use flexinfer_plan::model::{
    backends, gate, images, plan, problem, render, replicas, shared, source, status,
};
mod reconcile;

use std::sync::Arc;

use crate::events::Recorder;
use flexinfer_api::contract::controller::FIELD_MANAGER;
use flexinfer_api::contract::{env, labels, serving};
use flexinfer_api::model::ModelPhase;
use flexinfer_api::{GPUProfile, Model, ModelCache};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::Reporter;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Client, ResourceExt};
use tracing::warn;

use crate::metrics::Metrics;
use crate::supervise::Guard;
pub use plan::{ModelPlan, Observed};
use reconcile::reconcile;
pub use reconcile::write_status;
use render::{ProfileRef, RenderConfig};

/// Errors of one reconcile (all retried with backoff).
pub use crate::reconcile_error::Error;

/// Settings of the Model controller.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Watch only this namespace (all namespaces when `None`).
    pub namespace: Option<String>,
    /// Namespace searched for GPUProfiles not found in the Model's own namespace
    /// (`FLEXINFER_NAMESPACE`, the controller's namespace).
    pub profile_namespace: Option<String>,
    pub render: RenderConfig,
    /// How long a preempted Model of a shared GPU group may finish in-flight requests
    /// (`FLEXINFER_PREEMPTION_GRACE_SECONDS`; `None`: [`shared::DEFAULT_PREEMPTION_GRACE`]).
    pub preemption_grace: Option<std::time::Duration>,
}

impl Options {
    /// Settings from the controller environment.
    /// From the process environment; a set value that does not parse is an error naming the
    /// variable.
    pub fn from_env() -> Result<Self, crate::settings::SettingError> {
        let s = crate::settings::process_env();
        Ok(Self {
            namespace: None,
            profile_namespace: s.text(env::controller::NAMESPACE),
            render: RenderConfig::from_settings(&s)?,
            preemption_grace: s
                .seconds(
                    env::controller::PREEMPTION_GRACE_SECONDS,
                    shared::DEFAULT_PREEMPTION_GRACE,
                    std::time::Duration::from_secs(86_400),
                )
                .map(Some)?,
        })
    }
}

struct Ctx {
    client: Client,
    metrics: Metrics,
    recorder: Recorder,
    opts: Options,
    /// Consecutive reconcile failures per Model (error requeue backoff, shared with ModelCache).
    failures: crate::backoff::Failures,
}

/// Label selector of the serving Deployments, Services and pods this controller makes.
fn serving_selector() -> String {
    format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::COMPONENT,
        serving::COMPONENT
    )
}

/// Run the Model controller until its stream ends.
pub async fn run(client: Client, metrics: Metrics) -> anyhow::Result<()> {
    run_with(client, metrics, Options::from_env()?).await
}

/// Run the Model controller with explicit settings (tests scope it to one namespace).
pub async fn run_with(client: Client, metrics: Metrics, opts: Options) -> anyhow::Result<()> {
    run_until(client, metrics, opts, futures::future::pending()).await
}

/// Run the Model controller until `shutdown` resolves (in-flight reconciles finish first).
pub async fn run_until(
    client: Client,
    metrics: Metrics,
    opts: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    use crate::kube_client::api_in as api;
    let ns = opts.namespace.clone();
    let ns = ns.as_deref();
    let ctx = context(&client, metrics, opts);
    let guard = Guard::new("model", ctx.metrics.clone(), Some(ctx.recorder.clone()));
    // Deleted Models leave no metric series behind.
    let forget = forget_deleted_models(api::<Model>(&client, ns), ctx.metrics.clone());
    let controller = Controller::new(api::<Model>(&client, ns), watcher::Config::default());
    let controller = watch_related(controller, &client, ns).graceful_shutdown_on(shutdown);
    let running = guard
        .run(controller, reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                warn!(error = %flexinfer_api::contract::error::chain(&e), "model reconcile failed");
            }
        });
    // The controller decides when we stop; the cleanup watch only runs alongside it.
    futures::pin_mut!(running, forget);
    futures::future::select(running, forget).await;
    Ok(())
}

/// The reconcile context: the client, the metrics, an event recorder reporting as the controller's
/// field manager (and its pod, `POD_NAME`), the settings and no failures yet.
fn context(client: &Client, metrics: Metrics, opts: Options) -> Arc<Ctx> {
    let reporter = Reporter {
        controller: FIELD_MANAGER.to_string(),
        instance: std::env::var(env::controller::POD_NAME).ok(),
    };
    Arc::new(Ctx {
        client: client.clone(),
        metrics,
        recorder: Recorder::new(client.clone(), reporter),
        opts,
        failures: Default::default(),
    })
}

/// What else makes a Model reconcile: the Deployments and Services it owns, the other members of
/// its shared GPU group (their status, Deployments and pods), its serving pods, its ModelCache and
/// the GPUProfiles it may use; the children are the serving ones ([`serving_selector`]).
fn watch_related(
    controller: Controller<Model>,
    client: &Client,
    ns: Option<&str>,
) -> Controller<Model> {
    use crate::kube_client::api_in as api;
    let children = watcher::Config::default().labels(&serving_selector());
    let store = controller.store();
    controller
        .owns(api::<Deployment>(client, ns), children.clone())
        // A shared GPU group hands its lane over between Models: a member's change of demand
        // (its status) or of running pods (its Deployment) is news for every other member.
        .watches(
            api::<Model>(client, ns),
            watcher::Config::default(),
            peers_of_model(store.clone()),
        )
        .watches(
            api::<Deployment>(client, ns),
            children.clone(),
            peers_of_deployment(store.clone()),
        )
        .owns(api::<Service>(client, ns), children.clone())
        .watches(
            api::<Pod>(client, ns),
            children,
            models_of_pod(store.clone()),
        )
        .watches(
            api::<ModelCache>(client, ns),
            watcher::Config::default(),
            users_of_cache(store.clone()),
        )
        .watches(
            api::<GPUProfile>(client, ns),
            watcher::Config::default(),
            users_of_profile(store),
        )
}

/// A Model's change is news for the other members of its shared GPU group.
fn peers_of_model(store: Store<Model>) -> impl Fn(Model) -> Vec<ObjectRef<Model>> {
    move |m: Model| {
        group_members(
            &store.state(),
            m.namespace(),
            m.spec.gpu.shared.as_deref(),
            &m.name_any(),
        )
    }
}

/// A serving Deployment's change is news for the other members of its Model's shared GPU group.
fn peers_of_deployment(store: Store<Model>) -> impl Fn(Deployment) -> Vec<ObjectRef<Model>> {
    move |d: Deployment| {
        let ns = d.namespace();
        let name = d.name_any();
        let all = store.state();
        let group = shared_group(&all, &ns, &name);
        group_members(&all, ns, group.as_deref(), &name)
    }
}

/// A serving pod's change is news for its own Model (its `MODEL` label) and for the members of that
/// Model's shared GPU group waiting for its GPU to be released; a pod without the label for none.
fn models_of_pod(store: Store<Model>) -> impl Fn(Pod) -> Vec<ObjectRef<Model>> {
    move |pod: Pod| {
        let ns = pod.namespace();
        let Some(model) = pod.labels().get(labels::MODEL).cloned() else {
            return Vec::new();
        };
        let all = store.state();
        let group = shared_group(&all, &ns, &model);
        let mut refs = group_members(&all, ns.clone(), group.as_deref(), &model);
        refs.push(ObjectRef::<Model>::new(&model).within(ns.as_deref().unwrap_or_default()));
        refs
    }
}

/// A ModelCache's change is news for the Models of its namespace that use it.
fn users_of_cache(store: Store<Model>) -> impl Fn(ModelCache) -> Vec<ObjectRef<Model>> {
    move |cache: ModelCache| {
        let name = cache.name_any();
        let ns = cache.namespace();
        store
            .state()
            .into_iter()
            .filter(|m| m.namespace() == ns && render::cache_name(m).as_deref() == Some(&name))
            .map(|m| ObjectRef::from_obj(&*m))
            .collect::<Vec<_>>()
    }
}

/// A GPUProfile's change is news for the Models that name it, ask for its architecture or take any
/// profile.
fn users_of_profile(store: Store<Model>) -> impl Fn(GPUProfile) -> Vec<ObjectRef<Model>> {
    move |profile: GPUProfile| {
        let name = profile.name_any();
        let arch = profile.spec.architecture.clone();
        store
            .state()
            .into_iter()
            .filter(|m| match render::profile_ref(m) {
                ProfileRef::Named(n) => n == name,
                ProfileRef::Arch(a) => a == arch,
                ProfileRef::Any => true,
                ProfileRef::None(_) => false,
            })
            .map(|m| ObjectRef::from_obj(&*m))
            .collect::<Vec<_>>()
    }
}

/// The shared GPU group of the Model `name` in `ns`, when the store has it and it has one.
fn shared_group(all: &[Arc<Model>], ns: &Option<String>, name: &str) -> Option<String> {
    all.iter()
        .find(|m| m.namespace() == *ns && m.name_any() == name)
        .and_then(|m| m.spec.gpu.shared.clone())
}

/// The other Models of `name`'s shared GPU group (none when it has no group).
fn group_members(
    all: &[Arc<Model>],
    ns: Option<String>,
    group: Option<&str>,
    name: &str,
) -> Vec<ObjectRef<Model>> {
    let Some(group) = group else {
        return Vec::new();
    };
    all.iter()
        .filter(|m| {
            m.namespace() == ns
                && m.name_any() != name
                && m.spec.gpu.shared.as_deref() == Some(group)
        })
        .map(|m| ObjectRef::from_obj(&**m))
        .collect()
}

/// Remove the metric series of Models as they are deleted, and after a re-list (a watch gap) those
/// of Models that are gone, so no alert or dashboard keeps showing a Model that no longer exists.
async fn forget_deleted_models(api: Api<Model>, metrics: Metrics) {
    use std::collections::BTreeSet;
    let key = |m: &Model| (m.name_any(), m.namespace().unwrap_or_default());
    let mut listing: BTreeSet<(String, String)> = BTreeSet::new();
    watcher(api, watcher::Config::default())
        .default_backoff()
        .for_each(|ev| {
            match ev {
                Ok(watcher::Event::Delete(m)) => {
                    let (name, ns) = key(&m);
                    forget_model_series(&metrics, &name, &ns);
                }
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(m)) => {
                    listing.insert(key(&m));
                }
                Ok(watcher::Event::InitDone) => {
                    for (name, ns) in model_series_keys(&metrics) {
                        if !listing.contains(&(name.clone(), ns.clone())) {
                            forget_model_series(&metrics, &name, &ns);
                        }
                    }
                }
                _ => {}
            }
            futures::future::ready(())
        })
        .await;
}

/// `(model, namespace)` of every Model series the controller exports.
fn model_series_keys(metrics: &Metrics) -> std::collections::BTreeSet<(String, String)> {
    use prometheus::core::Collector;
    let mut out = std::collections::BTreeSet::new();
    let families = metrics
        .model_phase
        .collect()
        .into_iter()
        .chain(metrics.model_phase_transitions_total.collect())
        .chain(metrics.model_preemptions_total.collect());
    for fam in families {
        for m in fam.get_metric() {
            let label = |n: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == n)
                    .map(|l| l.value().to_string())
            };
            if let (Some(name), Some(ns)) = (label("model"), label("namespace")) {
                out.insert((name, ns));
            }
        }
    }
    out
}

/// Drop every series of one Model (phase, transitions, preemptions in any group).
fn forget_model_series(metrics: &Metrics, name: &str, ns: &str) {
    use prometheus::core::Collector;
    for to in ModelPhase::ALL {
        let _ = metrics
            .model_phase
            .remove_label_values(&[name, ns, to.as_str()]);
        for from in ModelPhase::ALL.iter().map(|p| p.as_str()).chain(["None"]) {
            let _ = metrics.model_phase_transitions_total.remove_label_values(&[
                name,
                ns,
                from,
                to.as_str(),
            ]);
        }
    }
    let groups: Vec<String> = metrics
        .model_preemptions_total
        .collect()
        .iter()
        .flat_map(|f| f.get_metric().iter())
        .filter_map(|m| {
            let label = |n: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == n)
                    .map(|l| l.value())
            };
            (label("model") == Some(name) && label("namespace") == Some(ns))
                .then(|| label("group").unwrap_or_default().to_string())
        })
        .collect();
    for g in groups {
        let _ = metrics
            .model_preemptions_total
            .remove_label_values(&[name, ns, g.as_str()]);
    }
}

fn error_policy(model: Arc<Model>, err: &Error, ctx: Arc<Ctx>) -> Action {
    crate::reconcile_error::error_policy("model", model.as_ref(), err, &ctx.metrics, &ctx.failures)
}

#[cfg(test)]
mod series_tests {
    use super::*;

    #[test]
    fn forgetting_a_model_drops_its_phase_transition_and_preemption_series_only() {
        let m = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        for model in ["a", "b"] {
            m.model_phase
                .with_label_values(&[model, "ns", "Ready"])
                .set(1);
            m.model_phase_transitions_total
                .with_label_values(&[model, "ns", "None", "Ready"])
                .inc();
            m.model_preemptions_total
                .with_label_values(&[model, "ns", "gpu0"])
                .inc();
        }
        m.model_preemptions_total
            .with_label_values(&["a", "ns", "gpu1"])
            .inc();
        forget_model_series(&m, "a", "ns");
        let text = m.render();
        assert!(!text.contains("model=\"a\""), "{text}");
        assert_eq!(
            text.matches("model=\"b\"").count(),
            3,
            "b's series stay: {text}"
        );
        assert_eq!(
            model_series_keys(&m).into_iter().collect::<Vec<_>>(),
            vec![("b".to_string(), "ns".to_string())]
        );
    }
}
