//! The controller's Kubernetes client, with a layer that counts API requests by verb
//! (`flexinfer_kube_api_requests_total{verb}`), so request budgets can be measured and alerted on.

use prometheus::{opts, IntCounterVec};

use crate::metrics::Metrics;

/// Build a client from the environment (in-cluster or KUBECONFIG) that counts its requests.
pub async fn counting_client(metrics: &Metrics) -> anyhow::Result<kube::Client> {
    let counter = IntCounterVec::new(
        opts!(
            "flexinfer_kube_api_requests_total",
            "Requests the controller sent to the Kubernetes API, by verb (WATCH = GET with watch=true)"
        ),
        &["verb"],
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
        counter.with_label_values(&[verb]).inc();
        req
    });
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&layer)
        .build())
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
