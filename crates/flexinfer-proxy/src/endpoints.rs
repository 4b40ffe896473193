//! Ready backends of a Model from the EndpointSlices of its Service (pure).
//!
//! The Model's Service is named after the Model; Kubernetes' EndpointSlice controller labels each
//! slice with `kubernetes.io/service-name` and copies the Service's labels onto it. Only
//! endpoints whose `ready` condition is true or unset (the API says to read unset as ready) are
//! used, on the slice's `http` port (the only port when unnamed).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use flexinfer_api::contract::{proxy, serving};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

/// `host:port` of every ready endpoint of Service `service` in `namespace`, sorted, deduplicated.
pub fn ready_backends(
    slices: &[Arc<EndpointSlice>],
    namespace: &str,
    service: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    for s in slices {
        if s.namespace().as_deref() != Some(namespace)
            || s.labels()
                .get(proxy::ENDPOINTSLICE_SERVICE_LABEL)
                .map(String::as_str)
                != Some(service)
            || s.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
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
        let ipv6 = s.address_type == "IPv6";
        for ep in &s.endpoints {
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if !ready {
                continue;
            }
            for addr in &ep.addresses {
                if addr.is_empty() || addr.contains(['/', ' ', '@']) {
                    continue;
                }
                out.push(if ipv6 || addr.contains(':') {
                    format!("[{addr}]:{port}")
                } else {
                    format!("{addr}:{port}")
                });
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

    fn slice(
        ns: &str,
        svc: &str,
        v6: bool,
        ports: serde_json::Value,
        eps: serde_json::Value,
    ) -> Arc<EndpointSlice> {
        let s: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{svc}-x"), "namespace": ns,
                         "labels": {"kubernetes.io/service-name": svc}},
            "addressType": if v6 { "IPv6" } else { "IPv4" },
            "ports": ports,
            "endpoints": eps,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        Arc::new(s)
    }

    #[test]
    fn ready_endpoints_table() {
        let http = serde_json::json!([{"name": "http", "port": 8000}]);
        let slices = vec![
            slice(
                "a",
                "m",
                false,
                http.clone(),
                serde_json::json!([
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
                    {"addresses": ["10.0.0.1"]},                                   // unset: ready
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": false}},   // starting
                    {"addresses": ["10.0.0.4"], "conditions": {"ready": false, "terminating": true}},
                    {"addresses": ["bad/addr"]},
                ]),
            ),
            slice(
                "a",
                "m",
                true,
                http.clone(),
                serde_json::json!([{"addresses": ["fd00::1"]}]),
            ),
            slice(
                "a",
                "m",
                false,
                serde_json::json!([{"port": 9000}]),
                serde_json::json!([{"addresses": ["10.0.1.1"]}]),
            ),
            // two ports, none named http: unusable
            slice(
                "a",
                "m",
                false,
                serde_json::json!([{"name": "a", "port": 1}, {"name": "b", "port": 2}]),
                serde_json::json!([{"addresses": ["10.0.2.1"]}]),
            ),
            slice(
                "a",
                "m",
                false,
                serde_json::json!([{"name": "http", "port": 70000}]),
                serde_json::json!([{"addresses": ["10.0.3.1"]}]),
            ),
            slice(
                "b",
                "m",
                false,
                http.clone(),
                serde_json::json!([{"addresses": ["10.9.9.9"]}]),
            ),
            slice(
                "a",
                "other",
                false,
                http,
                serde_json::json!([{"addresses": ["10.8.8.8"]}]),
            ),
        ];
        assert_eq!(
            ready_backends(&slices, "a", "m"),
            vec![
                "10.0.0.1:8000",
                "10.0.0.2:8000",
                "10.0.1.1:9000",
                "[fd00::1]:8000"
            ]
        );
        assert!(ready_backends(&slices, "a", "none").is_empty());
        assert_eq!(ready_backends(&slices, "b", "m"), vec!["10.9.9.9:8000"]);
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
