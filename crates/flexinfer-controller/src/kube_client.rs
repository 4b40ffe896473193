//! The controller's Kubernetes client, with a layer that counts API requests by verb
//! (`flexinfer_kube_api_requests_total{verb}`), so request budgets can be measured and alerted on.

use prometheus::{opts, IntCounterVec};

use crate::metrics::Metrics;

/// Build a client from the environment (in-cluster or KUBECONFIG) that counts its requests.
pub async fn counting_client(metrics: &Metrics) -> anyhow::Result<kube::Client> {
    let counter = IntCounterVec::new(
        opts!(
            "flexinfer_kube_api_requests_total",
            "Requests the controller sent to the Kubernetes API, by verb (WATCH = GET with watch=true) and resource (e.g. jobs, pods/log, modelcaches/status)"
        ),
        &["verb", "resource"],
    )?;
    metrics.registry.register(Box::new(counter.clone()))?;
    let config = kube::Config::infer().await?;
    let layer = tower::util::MapRequestLayer::new(move |req: http::Request<kube::client::Body>| {
        let watch = req.uri().query().is_some_and(|q| q.contains("watch=true"));
        let verb = if watch {
            "WATCH"
        } else {
            req.method().as_str()
        };
        counter
            .with_label_values(&[verb, request_resource(req.uri().path())])
            .inc();
        req
    });
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&layer)
        .build())
}

/// The resource (and subresource) a request path names: `/api/v1/namespaces/ns/pods/p/log` →
/// `pods/log`, `/apis/batch/v1/namespaces/ns/jobs` → `jobs`. Only the known resources of this
/// controller are named (the label's values stay bounded); anything else is `other`.
pub fn request_resource(path: &str) -> &'static str {
    const KNOWN: [&str; 12] = [
        "modelcaches",
        "models",
        "gpuprofiles",
        "jobs",
        "pods",
        "persistentvolumeclaims",
        "deployments",
        "services",
        "events",
        "leases",
        "namespaces",
        "endpointslices",
    ];
    const SUB: [&str; 3] = ["status", "log", "finalizers"];
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // /api/v1/... or /apis/group/version/...
    let rest = match segs.first() {
        Some(&"api") => segs.get(2..),
        Some(&"apis") => segs.get(3..),
        _ => None,
    }
    .unwrap_or_default();
    let rest = match rest {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let Some(resource) = rest.first().and_then(|r| KNOWN.iter().find(|k| *k == r)) else {
        return "other";
    };
    match rest.get(2).and_then(|s| SUB.iter().find(|k| *k == s)) {
        None => resource,
        Some(sub) => match (*resource, *sub) {
            ("modelcaches", "status") => "modelcaches/status",
            ("models", "status") => "models/status",
            ("gpuprofiles", "status") => "gpuprofiles/status",
            ("pods", "log") => "pods/log",
            ("pods", "status") => "pods/status",
            ("jobs", "status") => "jobs/status",
            ("deployments", "status") => "deployments/status",
            _ => resource,
        },
    }
}

/// The API of `K` in namespace `ns`, or across all namespaces when `None` (a controller's watch).
pub fn api_in<K>(client: &kube::Client, ns: Option<&str>) -> kube::Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match ns {
        Some(ns) => kube::Api::namespaced(client.clone(), ns),
        None => kube::Api::all(client.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::request_resource;

    #[test]
    fn request_paths_name_their_resource() {
        let cases = [
            ("/api/v1/namespaces/ns/pods/p-1/log", "pods/log"),
            ("/api/v1/namespaces/ns/pods", "pods"),
            ("/apis/batch/v1/namespaces/ns/jobs/c0-download", "jobs"),
            ("/apis/batch/v1/jobs", "jobs"),
            (
                "/apis/ai.flexinfer/v1alpha1/namespaces/ns/modelcaches/c0/status",
                "modelcaches/status",
            ),
            ("/apis/ai.flexinfer/v1alpha1/modelcaches", "modelcaches"),
            ("/apis/events.k8s.io/v1/namespaces/ns/events/e.1", "events"),
            ("/api/v1/namespaces/ns", "namespaces"),
            ("/api/v1/namespaces", "namespaces"),
            (
                "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l",
                "leases",
            ),
            ("/apis/x/v1/namespaces/ns/secrets/s", "other"),
            ("/version", "other"),
            ("", "other"),
        ];
        for (path, want) in cases {
            assert_eq!(request_resource(path), want, "{path}");
        }
    }
}
