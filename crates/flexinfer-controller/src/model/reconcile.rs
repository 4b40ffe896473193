//! The thin Model reconciler: observe (the referenced ModelCache and GPUProfile, the existing
//! children), [`plan`](super::plan::plan), apply (children, then status, metrics and Events).

use std::sync::Arc;
use std::time::Instant;

use flexinfer_api::contract::controller::FIELD_MANAGER;
use flexinfer_api::contract::labels;
use flexinfer_api::model::ModelPhase;
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use super::plan::{
    self, Conclusion, Existing, ModelPlan, Observed, PlannedEvent, SharedObservation,
};
use super::render::{self, ProfileRef};
use super::status::DeploymentObservation;
use super::{Ctx, Error};

pub(super) async fn reconcile(model: Arc<Model>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let ns = model.namespace().ok_or(Error::Missing("namespace"))?;
    let observed = observe(&ctx, &model, &ns).await?;
    let now = Timestamp::now();
    let plan = plan::plan(&model, &observed, &ctx.opts.render, now);
    let rollout = apply_children(&ctx, &model, &ns, &plan).await?;
    let conclusion = plan.conclude(&model, rollout, now);
    apply_conclusion(&ctx, &model, &ns, &conclusion).await?;

    ctx.failures
        .succeeded(&crate::reconcile_error::failure_key(model.as_ref()));
    ctx.metrics
        .reconcile_duration_seconds
        .with_label_values(&["model"])
        .observe(started.elapsed().as_secs_f64());
    Ok(Action::requeue(conclusion.requeue))
}

/// Everything the planner needs from the cluster.
async fn observe(ctx: &Ctx, model: &Model, ns: &str) -> Result<Observed, Error> {
    let client = &ctx.client;
    let name = model.name_any();
    let cache = match render::cache_name(model) {
        Some(c) => {
            Api::<ModelCache>::namespaced(client.clone(), ns)
                .get_opt(&c)
                .await?
        }
        None => None,
    };
    let profile = get_profile(ctx, model, ns).await?;
    let deployment = Api::<Deployment>::namespaced(client.clone(), ns)
        .get_metadata_opt(&name)
        .await?
        .map(|d| Existing::of(&d.metadata));
    let service = Api::<Service>::namespaced(client.clone(), ns)
        .get_metadata_opt(&name)
        .await?
        .map(|s| Existing::of(&s.metadata));
    let shared = match model.spec.gpu.shared.as_deref() {
        Some(group) => Some(observe_group(ctx, ns, group).await?),
        None => None,
    };
    Ok(Observed {
        cache,
        profile,
        deployment,
        service,
        shared,
    })
}

/// The Models of the namespace in `group` and what their Deployments run, read from the API
/// server (not the watch cache: the hand-over must see the latest replicas).
async fn observe_group(ctx: &Ctx, ns: &str, group: &str) -> Result<SharedObservation, Error> {
    let models: Vec<Model> = Api::<Model>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|m| m.spec.gpu.shared.as_deref() == Some(group))
        .collect();
    let lp = ListParams::default().labels(&super::serving_selector());
    let deployments = Api::<Deployment>::namespaced(ctx.client.clone(), ns)
        .list(&lp)
        .await?
        .items;
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&lp)
        .await?
        .items;
    let running = plan::running_replicas(&models, &deployments, &pods);
    Ok(SharedObservation {
        models,
        running,
        grace: ctx
            .opts
            .preemption_grace
            .unwrap_or(super::shared::DEFAULT_PREEMPTION_GRACE),
    })
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

/// Server-side apply the planned children; the rollout of the applied Deployment, or `None`
/// when the plan applies nothing.
async fn apply_children(
    ctx: &Ctx,
    model: &Model,
    ns: &str,
    plan: &ModelPlan,
) -> Result<Option<DeploymentObservation>, Error> {
    let name = model.name_any();
    let r = match &plan.children {
        Ok(r) => r,
        Err(problem) => {
            info!(model = %name, namespace = %ns, reason = problem.reason(), problem = %problem, "model not deployed");
            return Ok(None);
        }
    };
    let client = &ctx.client;
    // Force is safe: the planner only lets through children this Model controls or that are absent.
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let applied = Api::<Deployment>::namespaced(client.clone(), ns)
        .patch(&name, &pp, &Patch::Apply(&r.deployment))
        .await?;
    Api::<Service>::namespaced(client.clone(), ns)
        .patch(&name, &pp, &Patch::Apply(&r.service))
        .await?;
    if let Some(policy) = &r.network_policy {
        Api::<NetworkPolicy>::namespaced(client.clone(), ns)
            .patch(&name, &pp, &Patch::Apply(policy))
            .await?;
    }
    let mut rollout = plan::rollout(&applied, plan.replicas.replicas);
    if plan::needs_pod_count(&rollout) {
        let lp = ListParams::default().labels(&format!("{}={}", labels::MODEL, name));
        let pods = Api::<Pod>::namespaced(client.clone(), ns).list(&lp).await?;
        rollout.scheduled = plan::scheduled(&pods.items);
    }
    Ok(Some(rollout))
}

/// The phase gauges first (they describe the phase just computed), then the status (conditional on
/// the resourceVersion planned from), then the counters and Events it records.
async fn apply_conclusion(ctx: &Ctx, model: &Model, ns: &str, c: &Conclusion) -> Result<(), Error> {
    let name = model.name_any();
    for p in ModelPhase::ALL {
        ctx.metrics
            .model_phase
            .with_label_values(&[name.as_str(), ns, p.as_str()])
            .set(i64::from(p == c.phase));
    }
    if let Some(new) = &c.status {
        let api = Api::<Model>::namespaced(ctx.client.clone(), ns);
        write_status(&api, &name, model.resource_version().as_deref(), new).await?;
    }
    // Counted once the status that records them is written (a conflict re-plans and would count
    // them twice).
    if c.previous != Some(c.phase) {
        let from = c.previous.map(|p| p.as_str()).unwrap_or("None");
        ctx.metrics
            .model_phase_transitions_total
            .with_label_values(&[name.as_str(), ns, from, c.phase.as_str()])
            .inc();
    }
    if let Some(group) = &c.preempted_in {
        ctx.metrics
            .model_preemptions_total
            .with_label_values(&[name.as_str(), ns, group.as_str()])
            .inc();
    }
    for ev in &c.events {
        publish(ctx, model, ev).await;
    }
    Ok(())
}

/// Apply the fields of a Model's status the controller owns, conditional on `resource_version`
/// when given: `validatedArtifact` and the shared-group transition time are read-modify-write, so
/// a plan made from a stale object must not overwrite a newer status (409 → [`Error::Conflict`],
/// the reconcile runs again with the fresh object). `lastActiveTime` (the proxy's) is left alone.
pub async fn write_status(
    api: &Api<Model>,
    name: &str,
    resource_version: Option<&str>,
    new: &flexinfer_api::ModelStatus,
) -> Result<(), Error> {
    let status = json!({
        "phase": new.phase,
        "conditions": new.conditions,
        "endpoint": new.endpoint,
        "replicas": new.replicas,
        "observedGeneration": new.observed_generation,
        "servedPath": new.served_path,
        "sharedGroup": new.shared_group,
        "validatedArtifact": new.validated_artifact,
    });
    crate::status_write::apply_status(api, name, resource_version, status).await?;
    Ok(())
}

pub(super) async fn publish(ctx: &Ctx, model: &Model, ev: &PlannedEvent) {
    let event = Event {
        type_: match ev.type_ {
            super::plan::EventType::Normal => EventType::Normal,
            super::plan::EventType::Warning => EventType::Warning,
        },
        reason: ev.reason.to_string(),
        note: Some(ev.note.chars().take(1000).collect()),
        action: ev.action.clone(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &model.object_ref(&())).await {
        warn!(model = %model.name_any(), error = %e, "cannot publish event");
    }
}
