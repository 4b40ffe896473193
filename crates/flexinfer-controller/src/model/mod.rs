//! Model controller (docs/dev/architecture.md §4): a Model becomes a Deployment and a Service for its backend,
//! scaled by the replica policy and guarded by the quantized-artifact promotion gate.
//!
//! The decisions live in pure modules (`gate`, `replicas`, `render`, `status`); this file only
//! observes the cluster, calls them, and applies their results.

pub mod backends;
pub mod gate;
pub mod problem;
pub mod render;
pub mod replicas;
pub mod source;
pub mod status;

#[cfg(test)]
mod render_tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flexinfer_api::contract::controller::FIELD_MANAGER;
use flexinfer_api::contract::{env, labels, reasons, serving};
use flexinfer_api::model::ModelPhase;
use flexinfer_api::{GPUProfile, Model, ModelCache};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::metrics::Metrics;
use render::{ProfileRef, RenderConfig};
use status::{DeploymentObservation, Outcome};

/// Errors of one reconcile (all retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Internal(String),
}

/// Settings of the Model controller.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Watch only this namespace (all namespaces when `None`).
    pub namespace: Option<String>,
    /// Namespace searched for GPUProfiles not found in the Model's own namespace
    /// (`FLEXINFER_NAMESPACE`, the controller's namespace).
    pub profile_namespace: Option<String>,
    pub render: RenderConfig,
}

impl Options {
    /// Settings from the controller environment.
    pub fn from_env() -> Self {
        Self {
            namespace: None,
            profile_namespace: std::env::var(env::controller::NAMESPACE)
                .ok()
                .filter(|s| !s.is_empty()),
            render: RenderConfig::from_env(),
        }
    }
}

struct Ctx {
    client: Client,
    metrics: Metrics,
    recorder: Recorder,
    opts: Options,
    failures: Mutex<HashMap<(String, String), u32>>,
}

/// Run the Model controller until its stream ends.
pub async fn run(client: Client, metrics: Metrics) -> anyhow::Result<()> {
    run_with(client, metrics, Options::from_env()).await
}

/// Run the Model controller with explicit settings (tests scope it to one namespace).
pub async fn run_with(client: Client, metrics: Metrics, opts: Options) -> anyhow::Result<()> {
    fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let ns = opts.namespace.clone();
    let ns = ns.as_deref();
    let children = watcher::Config::default().labels(&format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::COMPONENT,
        serving::COMPONENT
    ));
    let reporter = Reporter {
        controller: FIELD_MANAGER.to_string(),
        instance: std::env::var(env::controller::POD_NAME).ok(),
    };
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        metrics,
        recorder: Recorder::new(client.clone(), reporter),
        opts,
        failures: Mutex::new(HashMap::new()),
    });

    // Deleted Models leave no metric series behind.
    let forget = forget_deleted_models(api::<Model>(&client, ns), ctx.metrics.clone());
    let controller = Controller::new(api::<Model>(&client, ns), watcher::Config::default());
    let store = controller.store();
    let cache_store = store.clone();
    let profile_store = store.clone();
    let running = controller
        .owns(api::<Deployment>(&client, ns), children.clone())
        .owns(api::<Service>(&client, ns), children.clone())
        .watches(api::<Pod>(&client, ns), children, |pod: Pod| {
            let ns = pod.namespace();
            pod.labels()
                .get(labels::MODEL)
                .map(|m| ObjectRef::<Model>::new(m).within(ns.as_deref().unwrap_or_default()))
        })
        .watches(
            api::<ModelCache>(&client, ns),
            watcher::Config::default(),
            move |cache: ModelCache| {
                let name = cache.name_any();
                let ns = cache.namespace();
                cache_store
                    .state()
                    .into_iter()
                    .filter(|m| {
                        m.namespace() == ns && render::cache_name(m).as_deref() == Some(&name)
                    })
                    .map(|m| ObjectRef::from_obj(&*m))
                    .collect::<Vec<_>>()
            },
        )
        .watches(
            api::<GPUProfile>(&client, ns),
            watcher::Config::default(),
            move |profile: GPUProfile| {
                let name = profile.name_any();
                let arch = profile.spec.architecture.clone();
                profile_store
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
            },
        )
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                warn!(error = %e, "model reconcile failed");
            }
        });
    // The controller decides when we stop; the cleanup watch only runs alongside it.
    futures::pin_mut!(running, forget);
    futures::future::select(running, forget).await;
    Ok(())
}

/// Remove the metric series of Models as they are deleted.
async fn forget_deleted_models(api: Api<Model>, metrics: Metrics) {
    watcher(api, watcher::Config::default())
        .default_backoff()
        .for_each(|ev| {
            if let Ok(watcher::Event::Delete(m)) = ev {
                let (name, ns) = (m.name_any(), m.namespace().unwrap_or_default());
                for to in ModelPhase::ALL {
                    let _ = metrics.model_phase.remove_label_values(&[
                        name.as_str(),
                        ns.as_str(),
                        to.as_str(),
                    ]);
                    for from in ModelPhase::ALL.iter().map(|p| p.as_str()).chain(["None"]) {
                        let _ = metrics.model_phase_transitions_total.remove_label_values(&[
                            name.as_str(),
                            ns.as_str(),
                            from,
                            to.as_str(),
                        ]);
                    }
                }
            }
            futures::future::ready(())
        })
        .await;
}

fn error_policy(model: Arc<Model>, err: &Error, ctx: Arc<Ctx>) -> Action {
    ctx.metrics
        .reconcile_errors_total
        .with_label_values(&["model"])
        .inc();
    let key = (model.namespace().unwrap_or_default(), model.name_any());
    let n = match ctx.failures.lock() {
        Ok(mut f) => {
            let n = f.entry(key).or_insert(0);
            *n = n.saturating_add(1);
            *n
        }
        Err(_) => 1,
    };
    let delay = Duration::from_secs(2u64.saturating_pow(n.min(9)).min(300));
    warn!(model = %model.name_any(), error = %err, retry_in_s = delay.as_secs(), "model reconcile error");
    Action::requeue(delay)
}

async fn get_profile(ctx: &Ctx, model: &Model, ns: &str) -> Result<Option<GPUProfile>, Error> {
    let mut namespaces = vec![ns.to_string()];
    if let Some(p) = ctx.opts.profile_namespace.as_ref().filter(|p| *p != ns) {
        namespaces.push(p.clone());
    }
    let reference = render::profile_ref(model);
    for pns in namespaces {
        let api: Api<GPUProfile> = Api::namespaced(ctx.client.clone(), &pns);
        let found = match &reference {
            ProfileRef::None(_) => return Ok(None),
            ProfileRef::Any => {
                let mut all = api.list(&ListParams::default()).await?.items;
                if all.len() == 1 {
                    all.pop()
                } else {
                    None
                }
            }
            ProfileRef::Named(n) => api.get_opt(n).await?,
            ProfileRef::Arch(a) => api
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .find(|p| p.spec.architecture == *a),
        };
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

async fn reconcile(model: Arc<Model>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let ns = model
        .namespace()
        .ok_or_else(|| Error::Internal("Model without namespace".into()))?;
    let name = model.name_any();
    let client = &ctx.client;

    let cache = match render::cache_name(&model) {
        Some(c) => {
            Api::<ModelCache>::namespaced(client.clone(), &ns)
                .get_opt(&c)
                .await?
        }
        None => None,
    };
    let profile = get_profile(&ctx, &model, &ns).await?;

    let decision = gate::gate(&model);
    let effective = if decision.is_blocked() {
        gate::as_canary(&model.spec)
    } else {
        model.spec.clone()
    };
    let now = Timestamp::now();
    let last_active = model
        .status
        .as_ref()
        .and_then(|s| s.last_active_time.as_ref())
        .map(|t| t.0);
    let wanted = replicas::desired_replicas(&effective, last_active, now);

    let outcome = match render::render(&model, cache.as_ref(), profile.as_ref(), &ctx.opts.render) {
        Ok(mut r) => {
            if let Some(spec) = r.deployment.spec.as_mut() {
                spec.replicas = Some(wanted.replicas);
            }
            let pp = PatchParams::apply(FIELD_MANAGER).force();
            let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            let applied = deployments
                .patch(&name, &pp, &Patch::Apply(&r.deployment))
                .await?;
            let services: Api<Service> = Api::namespaced(client.clone(), &ns);
            services
                .patch(&name, &pp, &Patch::Apply(&r.service))
                .await?;
            let st = applied.status.clone().unwrap_or_default();
            let mut observed = DeploymentObservation {
                desired: wanted.replicas,
                ready: st.ready_replicas.unwrap_or(0),
                updated: st.updated_replicas.unwrap_or(0),
                current: st.observed_generation.is_some()
                    && st.observed_generation >= applied.metadata.generation,
                scheduled: 0,
            };
            if observed.desired > 0 && observed.ready < observed.desired {
                let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
                let lp = ListParams::default().labels(&format!("{}={}", labels::MODEL, name));
                observed.scheduled = pods
                    .list(&lp)
                    .await?
                    .items
                    .iter()
                    .filter(|p| {
                        p.metadata.deletion_timestamp.is_none()
                            && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                    })
                    .count()
                    .try_into()
                    .unwrap_or(i32::MAX);
            }
            Outcome::Deployed {
                observed,
                cached: r.cached,
                served_path: r.served_path,
                endpoint: render::endpoint(&name, &ns),
            }
        }
        Err(problem) => {
            info!(model = %name, namespace = %ns, reason = problem.reason(), problem = %problem, "model not deployed");
            Outcome::Problem(problem)
        }
    };

    let old = model.status.as_ref();
    let old_phase = old.and_then(|s| s.phase);
    let new = status::next_status(
        old,
        model.metadata.generation,
        &outcome,
        &decision,
        &Time(now),
    );
    let new_phase = new.phase.unwrap_or(ModelPhase::Pending);
    // Metrics first (they describe the phase just computed), then the status, then Events.
    for p in ModelPhase::ALL {
        ctx.metrics
            .model_phase
            .with_label_values(&[name.as_str(), ns.as_str(), p.as_str()])
            .set(i64::from(p == new_phase));
    }
    if old_phase != Some(new_phase) {
        let from = old_phase.map(|p| p.as_str()).unwrap_or("None");
        ctx.metrics
            .model_phase_transitions_total
            .with_label_values(&[name.as_str(), ns.as_str(), from, new_phase.as_str()])
            .inc();
    }
    if status::owned_differs(old, &new) {
        let patch = json!({
            "apiVersion": Model::api_version(&()),
            "kind": Model::kind(&()),
            "status": {
                "phase": new.phase,
                "conditions": new.conditions,
                "endpoint": new.endpoint,
                "replicas": new.replicas,
                "observedGeneration": new.observed_generation,
                "servedPath": new.served_path,
            }
        });
        Api::<Model>::namespaced(client.clone(), &ns)
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
    }

    if old_phase != Some(new_phase) {
        let from = old_phase.map(|p| p.as_str()).unwrap_or("None");
        let note = match &outcome {
            Outcome::Problem(p) => format!("{from} -> {}: {p}", new_phase.as_str()),
            Outcome::Deployed { .. } => format!("{from} -> {}", new_phase.as_str()),
        };
        // The recorder folds events with the same (type, reason, action) into one series, so
        // the action names the transition: repeats of one transition count up, others are new.
        let action = format!("{from}To{}", new_phase.as_str());
        publish(
            &ctx,
            &model,
            if new_phase == ModelPhase::Failed {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reasons::PHASE_CHANGED,
            &action,
            note,
        )
        .await;
    }
    let was_blocked = old
        .and_then(|s| {
            flexinfer_api::conditions::find(
                &s.conditions,
                flexinfer_api::conditions::types::PROMOTION_GATE,
            )
        })
        .is_some_and(|c| c.reason == gate::reasons::BLOCKED);
    if let (gate::GateDecision::Blocked { message }, false) = (&decision, was_blocked) {
        publish(
            &ctx,
            &model,
            EventType::Warning,
            reasons::PROMOTION_BLOCKED,
            "PromotionGate",
            message.clone(),
        )
        .await;
    }

    if let Ok(mut f) = ctx.failures.lock() {
        f.remove(&(ns.clone(), name.clone()));
    }
    ctx.metrics
        .reconcile_duration_seconds
        .with_label_values(&["model"])
        .observe(started.elapsed().as_secs_f64());

    let mut next = match (&outcome, new_phase) {
        (Outcome::Problem(_), ModelPhase::Failed) => Duration::from_secs(120),
        (Outcome::Problem(_), _) => Duration::from_secs(60),
        (_, ModelPhase::Loading | ModelPhase::Pending) => Duration::from_secs(15),
        _ => Duration::from_secs(300),
    };
    if let Some(r) = wanted.recheck_after {
        next = next.min(r + Duration::from_secs(1));
    }
    Ok(Action::requeue(next))
}

async fn publish(
    ctx: &Ctx,
    model: &Model,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.to_string(),
        note: Some(note.chars().take(1000).collect()),
        action: action.to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &model.object_ref(&())).await {
        warn!(model = %model.name_any(), error = %e, "cannot publish event");
    }
}
