//! Ready backends of a Model from the EndpointSlices of its Service (pure).
//!
//! Which addresses are trusted: a backend address is used only when it comes from the Model's own
//! Service (named after the Model, controlled by the Model: an owner reference with
//! `controller: true` and the Model's uid, as the Model controller writes it) through a slice that
//! Kubernetes' EndpointSlice controller computed from that Service's pods (the slice's
//! `endpointslice.kubernetes.io/managed-by` label names that controller and its controller owner
//! reference is that Service, by uid). A hand-made Service or slice carrying the serving labels,
//! a slice of a Service someone else made under the Model's name, and FQDN slices are ignored.
//! Labels alone prove nothing: anyone who may create a Service or an EndpointSlice in the
//! namespace can set them; uids are assigned by the API server.
//!
//! Only endpoints whose `ready` condition is true or unset (the API says to read unset as ready)
//! are used, on the slice's `http` port (the only port when unnamed), and only addresses that
//! parse as an IP of the slice's address type.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use flexinfer_api::contract::{proxy, serving};
use flexinfer_api::Model;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

/// The controller owner reference of an object, if it has one.
fn controller_of(meta: &ObjectMeta) -> Option<&OwnerReference> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
}

/// The group of an owner reference's `apiVersion` (`""` for the core group).
fn group_of(api_version: &str) -> &str {
    api_version
        .rsplit_once('/')
        .map(|(g, _)| g)
        .unwrap_or_default()
}

/// The uid of `service` when it is the Service the Model controller made for `model`: same
/// namespace and name, not being deleted, controlled by this Model (by uid).
pub fn model_service_uid<'a>(model: &Model, service: &'a Service) -> Option<&'a str> {
    let model_uid = model.metadata.uid.as_deref().filter(|u| !u.is_empty())?;
    let owner = controller_of(&service.metadata)?;
    let owned = owner.uid == model_uid
        && owner.kind == Model::kind(&())
        && group_of(&owner.api_version) == Model::group(&())
        && owner.name == model.name_any();
    (owned
        && service.namespace() == model.namespace()
        && service.name_any() == model.name_any()
        && service.metadata.deletion_timestamp.is_none())
    .then_some(service.metadata.uid.as_deref())
    .flatten()
    .filter(|u| !u.is_empty())
}

/// Whether `slice` is one that `slice_manager` (Kubernetes' EndpointSlice controller in a
/// cluster) computed for the Service `name` of `namespace` whose uid is `service_uid`.
pub fn is_service_slice(
    slice: &EndpointSlice,
    namespace: &str,
    name: &str,
    service_uid: &str,
    slice_manager: &str,
) -> bool {
    let label = |k: &str| slice.labels().get(k).map(String::as_str);
    let owned = controller_of(&slice.metadata).is_some_and(|o| {
        o.uid == service_uid
            && o.kind == Service::kind(&())
            && o.api_version == Service::api_version(&())
            && o.name == name
    });
    owned
        && slice.namespace().as_deref() == Some(namespace)
        && label(proxy::ENDPOINTSLICE_SERVICE_LABEL) == Some(name)
        && label(proxy::ENDPOINTSLICE_MANAGED_BY_LABEL) == Some(slice_manager)
        && slice.metadata.deletion_timestamp.is_none()
}

/// `host:port` of every ready endpoint of `model`, sorted, deduplicated: from the slices of
/// `service` (the Service named after the Model, if any) that pass [`model_service_uid`] and
/// [`is_service_slice`]; nothing otherwise.
pub fn ready_backends(
    model: &Model,
    service: Option<&Service>,
    slices: &[Arc<EndpointSlice>],
    slice_manager: &str,
) -> Vec<String> {
    let Some(service_uid) = service.and_then(|s| model_service_uid(model, s)) else {
        return Vec::new();
    };
    let (namespace, name) = (model.namespace().unwrap_or_default(), model.name_any());
    let mut out = Vec::new();
    for s in slices {
        if !is_service_slice(s, &namespace, &name, service_uid, slice_manager) {
            continue;
        }
        let ipv6 = match s.address_type.as_str() {
            "IPv4" => false,
            "IPv6" => true,
            _ => continue, // FQDN (a name anyone may point anywhere) or unknown
        };
        let ports = s.ports.as_deref().unwrap_or_default();
        let port = ports
            .iter()
            .find(|p| p.name.as_deref() == Some(serving::PORT_NAME))
            .or(match ports {
                [only] => Some(only),
                _ => None,
            })
            .and_then(|p| p.port)
            .filter(|p| (1..=65535).contains(p));
        let Some(port) = port else { continue };
        for ep in &s.endpoints {
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if !ready {
                continue;
            }
            for addr in &ep.addresses {
                if ipv6 && addr.parse::<Ipv6Addr>().is_ok() {
                    out.push(format!("[{addr}]:{port}"));
                } else if !ipv6 && addr.parse::<Ipv4Addr>().is_ok() {
                    out.push(format!("{addr}:{port}"));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Round-robin over a Model's backends.
#[derive(Debug, Default)]
pub struct RoundRobin(AtomicUsize);

impl RoundRobin {
    /// The backends in the order to try them: the next one first, then the others.
    pub fn order<'a>(&self, backends: &'a [String]) -> Vec<&'a String> {
        if backends.is_empty() {
            return Vec::new();
        }
        let start = self
            .0
            .fetch_add(1, Ordering::Relaxed)
            .checked_rem(backends.len())
            .unwrap_or(0);
        let (head, tail) = backends.split_at(start);
        tail.iter().chain(head).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const MODEL_UID: &str = "model-uid";
    const SVC_UID: &str = "svc-uid";
    const KCM: &str = proxy::ENDPOINTSLICE_CONTROLLER;

    fn model(ns: &str, name: &str, uid: Option<&str>) -> Model {
        serde_json::from_value(json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": name, "namespace": ns, "uid": uid},
            "spec": {"backend": "vllm", "source": "pvc://c/p"}
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The Service the Model controller makes: named after the Model, controlled by it.
    fn service(ns: &str, name: &str, uid: &str, owner: Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": uid, "ownerReferences": owner,
                         "labels": {"app.kubernetes.io/managed-by": "flexinfer",
                                    "app.kubernetes.io/component": "inference-server"}},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn model_owner(name: &str, uid: &str) -> Value {
        json!([{"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model", "name": name,
                "uid": uid, "controller": true, "blockOwnerDeletion": true}])
    }

    /// A slice as Kubernetes' EndpointSlice controller writes it for Service `svc` (uid
    /// `svc_uid`), with `patch` merged into its metadata.
    fn kcm_slice(ns: &str, svc: &str, svc_uid: &str, address_type: &str, patch: Value) -> Value {
        let mut s = json!({
            "metadata": {"name": format!("{svc}-abcde"), "namespace": ns,
                         "labels": {"kubernetes.io/service-name": svc,
                                    "endpointslice.kubernetes.io/managed-by": KCM,
                                    "app.kubernetes.io/managed-by": "flexinfer",
                                    "app.kubernetes.io/component": "inference-server"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": svc,
                                              "uid": svc_uid, "controller": true,
                                              "blockOwnerDeletion": true}]},
            "addressType": address_type,
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true}}],
        });
        if let (Some(m), Some(p)) = (s["metadata"].as_object_mut(), patch.as_object()) {
            for (k, v) in p {
                m.insert(k.clone(), v.clone());
            }
        }
        s
    }

    fn parse(v: Value) -> Arc<EndpointSlice> {
        Arc::new(serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}")))
    }

    /// Which slices are trusted for Model `a/m`: only the one Kubernetes computed for the
    /// Service the Model controls.
    #[test]
    fn only_slices_of_the_models_own_service_are_used() {
        let m = model("a", "m", Some(MODEL_UID));
        let own = service("a", "m", SVC_UID, model_owner("m", MODEL_UID));
        let real = kcm_slice("a", "m", SVC_UID, "IPv4", json!({}));
        let labels_only = json!({"kubernetes.io/service-name": "m",
                                 "app.kubernetes.io/managed-by": "flexinfer",
                                 "app.kubernetes.io/component": "inference-server"});
        let with = |patch: Value| kcm_slice("a", "m", SVC_UID, "IPv4", patch);
        let other_svc_owner = json!([{"apiVersion": "v1", "kind": "Service", "name": "m",
                                      "uid": "other-svc", "controller": true}]);
        type Case = (&'static str, Option<Service>, Value, bool);
        let cases: Vec<Case> = vec![
            (
                "the real slice of the Model's Service",
                Some(own.clone()),
                real.clone(),
                true,
            ),
            (
                "IPv6 slice with an IPv4 address",
                Some(own.clone()),
                kcm_slice("a", "m", SVC_UID, "IPv6", json!({})),
                false,
            ), // 10.0.0.1 is not IPv6
            (
                "hand-made slice with the serving labels, no owner",
                Some(own.clone()),
                with(json!({"labels": labels_only, "ownerReferences": null})),
                false,
            ),
            (
                "hand-made slice with every label, no owner",
                Some(own.clone()),
                with(json!({"ownerReferences": null})),
                false,
            ),
            (
                "hand-made slice owned by the Service but another manager",
                Some(own.clone()),
                with(json!({"labels": {"kubernetes.io/service-name": "m",
                                    "endpointslice.kubernetes.io/managed-by": "someone"}})),
                false,
            ),
            (
                "slice owned by another Service of the same name (old uid)",
                Some(own.clone()),
                with(json!({"ownerReferences": other_svc_owner})),
                false,
            ),
            (
                "slice whose Service owner is not the controller reference",
                Some(own.clone()),
                with(
                    json!({"ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "m",
                                              "uid": SVC_UID}]}),
                ),
                false,
            ),
            (
                "slice of the Service in another namespace",
                Some(own.clone()),
                kcm_slice("b", "m", SVC_UID, "IPv4", json!({})),
                false,
            ),
            (
                "slice naming another service",
                Some(own.clone()),
                with(json!({"labels": {"kubernetes.io/service-name": "x",
                                    "endpointslice.kubernetes.io/managed-by": KCM}})),
                false,
            ),
            (
                "FQDN slice",
                Some(own.clone()),
                kcm_slice("a", "m", SVC_UID, "FQDN", json!({})),
                false,
            ),
            (
                "slice being deleted",
                Some(own.clone()),
                with(json!({"deletionTimestamp": "2024-01-01T00:00:00Z"})),
                false,
            ),
            ("no Service", None, real.clone(), false),
            (
                "hand-made Service named after the Model, no owner",
                Some(service("a", "m", SVC_UID, Value::Null)),
                real.clone(),
                false,
            ),
            (
                "Service controlled by another Model of the same name (old uid)",
                Some(service(
                    "a",
                    "m",
                    SVC_UID,
                    model_owner("m", "old-model-uid"),
                )),
                real.clone(),
                false,
            ),
            (
                "Service owned (not controlled) by the Model",
                Some(service(
                    "a",
                    "m",
                    SVC_UID,
                    json!([{"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
                                   "name": "m", "uid": MODEL_UID}]),
                )),
                real.clone(),
                false,
            ),
            (
                "Service controlled by a Deployment with the Model's uid",
                Some(service(
                    "a",
                    "m",
                    SVC_UID,
                    json!([{"apiVersion": "apps/v1", "kind": "Deployment", "name": "m",
                                   "uid": MODEL_UID, "controller": true}]),
                )),
                real.clone(),
                false,
            ),
            (
                "the Model's Service under another name",
                Some(service("a", "x", SVC_UID, model_owner("m", MODEL_UID))),
                real.clone(),
                false,
            ),
        ];
        for (what, svc, slice, used) in cases {
            let got = ready_backends(&m, svc.as_ref(), &[parse(slice)], KCM);
            let want: Vec<String> = if used {
                vec!["10.0.0.1:8000".into()]
            } else {
                vec![]
            };
            assert_eq!(got, want, "{what}");
        }
        // A Model without a uid (not from the API server) trusts nothing.
        assert!(ready_backends(&model("a", "m", None), Some(&own), &[parse(real)], KCM).is_empty());
    }

    #[test]
    fn ready_endpoints_table() {
        let m = model("a", "m", Some(MODEL_UID));
        let own = service("a", "m", SVC_UID, model_owner("m", MODEL_UID));
        let slice = |v6: bool, ports: Value, eps: Value| {
            let mut s = kcm_slice(
                "a",
                "m",
                SVC_UID,
                if v6 { "IPv6" } else { "IPv4" },
                json!({}),
            );
            s["ports"] = ports;
            s["endpoints"] = eps;
            parse(s)
        };
        let http = json!([{"name": "http", "port": 8000}]);
        let slices = vec![
            slice(
                false,
                http.clone(),
                json!([
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
                    {"addresses": ["10.0.0.1"]},                                   // unset: ready
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": false}},   // starting
                    {"addresses": ["10.0.0.4"], "conditions": {"ready": false, "terminating": true}},
                    {"addresses": ["bad/addr"]},
                    {"addresses": ["evil.example.com"]},
                    {"addresses": ["fd00::9"]},                                    // not IPv4
                ]),
            ),
            slice(
                true,
                http.clone(),
                json!([{"addresses": ["fd00::1", "10.0.0.9"]}]),
            ),
            slice(
                false,
                json!([{"port": 9000}]),
                json!([{"addresses": ["10.0.1.1"]}]),
            ),
            // two ports, none named http: unusable
            slice(
                false,
                json!([{"name": "a", "port": 1}, {"name": "b", "port": 2}]),
                json!([{"addresses": ["10.0.2.1"]}]),
            ),
            slice(
                false,
                json!([{"name": "http", "port": 70000}]),
                json!([{"addresses": ["10.0.3.1"]}]),
            ),
        ];
        assert_eq!(
            ready_backends(&m, Some(&own), &slices, KCM),
            vec![
                "10.0.0.1:8000",
                "10.0.0.2:8000",
                "10.0.1.1:9000",
                "[fd00::1]:8000"
            ]
        );
    }

    #[test]
    fn round_robin_visits_each_backend_first_in_turn() {
        let rr = RoundRobin::default();
        let b = vec!["x".to_string(), "y".to_string(), "z".to_string()];
        let firsts: Vec<&str> = (0..6).map(|_| rr.order(&b)[0].as_str()).collect();
        assert_eq!(firsts, vec!["x", "y", "z", "x", "y", "z"]);
        assert_eq!(rr.order(&b).len(), 3);
        assert!(rr.order(&[]).is_empty());
    }
}
