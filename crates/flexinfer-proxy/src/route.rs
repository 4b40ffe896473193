//! Which Model a request's `model` names (pure).
//!
//! Only Models of the caller's scope (the namespaces its API key may reach) are considered: a
//! Model elsewhere neither matches nor makes a name ambiguous. Then, in order: `<namespace>/<name>` of a Model; a Model's name (its served model name); one of a
//! Model's `spec.aliases`. Within one rank a single Model must match, else the request is
//! ambiguous (several namespaces use the name) and must say `<namespace>/<name>`. Models being
//! deleted are not routed to.

use std::collections::BTreeSet;
use std::sync::Arc;

use flexinfer_api::Model;
use kube::ResourceExt;

use crate::auth::Scope;
use crate::openai::{ModelEntry, ModelList};

/// Why no single Model matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    NotFound,
    /// `<namespace>/<name>` of each candidate, sorted.
    Ambiguous(Vec<String>),
}

/// The Model a request goes to.
#[derive(Debug, Clone)]
pub struct Route {
    pub model: Arc<Model>,
    pub namespace: String,
    pub name: String,
    /// Whether the request named the Model by something other than its served name (the
    /// proxy then rewrites `model` to the served name before forwarding).
    pub rewrite: bool,
}

fn live(m: &&Arc<Model>) -> bool {
    m.metadata.deletion_timestamp.is_none()
}

fn key(m: &Model) -> String {
    format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any())
}

fn one(requested: &str, matches: Vec<&Arc<Model>>) -> Option<Result<Route, RouteError>> {
    match matches.as_slice() {
        [] => None,
        [m] => {
            let name = m.name_any();
            Some(Ok(Route {
                model: Arc::clone(m),
                namespace: m.namespace().unwrap_or_default(),
                rewrite: name != requested,
                name,
            }))
        }
        many => {
            let mut c: Vec<String> = many.iter().map(|m| key(m)).collect();
            c.sort();
            Some(Err(RouteError::Ambiguous(c)))
        }
    }
}

fn in_scope(scope: &Scope) -> impl Fn(&&Arc<Model>) -> bool + '_ {
    move |m| scope.allows(m.namespace().as_deref().unwrap_or_default())
}

/// Resolve `requested` against the known Models of `scope`.
pub fn resolve(models: &[Arc<Model>], requested: &str, scope: &Scope) -> Result<Route, RouteError> {
    if requested.is_empty() {
        return Err(RouteError::NotFound);
    }
    let models: Vec<Arc<Model>> = models
        .iter()
        .filter(live)
        .filter(in_scope(scope))
        .cloned()
        .collect();
    if let Some((ns, name)) = requested.split_once('/') {
        let exact: Vec<_> = models
            .iter()
            .filter(live)
            .filter(|m| m.namespace().as_deref() == Some(ns) && m.name_any() == name)
            .collect();
        if let Some(r) = one(requested, exact) {
            return r;
        }
    }
    let by_name: Vec<_> = models
        .iter()
        .filter(live)
        .filter(|m| m.name_any() == requested)
        .collect();
    if let Some(r) = one(requested, by_name) {
        return r;
    }
    let by_alias: Vec<_> = models
        .iter()
        .filter(live)
        .filter(|m| m.spec.aliases.iter().any(|a| a == requested))
        .collect();
    one(requested, by_alias).unwrap_or(Err(RouteError::NotFound))
}

/// `GET /v1/models`: every name a request of `scope` may use (Model names and aliases), once
/// each, sorted.
pub fn model_list(models: &[Arc<Model>], scope: &Scope) -> ModelList {
    let mut seen = BTreeSet::new();
    let mut data = Vec::new();
    let mut sorted: Vec<&Arc<Model>> = models.iter().filter(live).filter(in_scope(scope)).collect();
    sorted.sort_by_key(|m| key(m));
    for m in sorted {
        let created = m
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second())
            .unwrap_or(0);
        let owner = m.namespace().unwrap_or_default();
        for id in std::iter::once(m.name_any()).chain(m.spec.aliases.iter().cloned()) {
            if seen.insert(id.clone()) {
                data.push(ModelEntry {
                    id,
                    object: "model",
                    created,
                    owned_by: owner.clone(),
                });
            }
        }
    }
    data.sort_by(|a, b| a.id.cmp(&b.id));
    ModelList {
        object: "list",
        data,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn model(ns: &str, name: &str, aliases: &[&str]) -> Arc<Model> {
        let m: Model = serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"backend": "vllm", "source": "pvc://c/p", "aliases": aliases}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        Arc::new(m)
    }

    #[test]
    fn resolution_table() {
        let mut deleting = (*model("a", "gone", &["old"])).clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let models = vec![
            model("a", "llama", &["meta-llama/Llama-3.1-8B", "default"]),
            model("a", "qwen", &["chat"]),
            model("b", "qwen", &[]),
            model("b", "mistral", &["chat", "llama"]),
            model("a", "x", &["a/qwen"]),
            Arc::new(deleting),
        ];
        // (requested, Ok((namespace, name, rewrite)) or Err)
        type Want = Result<(&'static str, &'static str, bool), RouteError>;
        let amb = |v: &[&str]| {
            Err(RouteError::Ambiguous(
                v.iter().map(|s| s.to_string()).collect(),
            ))
        };
        let cases: Vec<(&str, Want)> = vec![
            ("llama", Ok(("a", "llama", false))), // a name beats b/mistral's alias
            ("meta-llama/Llama-3.1-8B", Ok(("a", "llama", true))),
            ("default", Ok(("a", "llama", true))),
            ("a/qwen", Ok(("a", "qwen", true))), // namespace/name beats x's alias
            ("b/qwen", Ok(("b", "qwen", true))),
            ("qwen", amb(&["a/qwen", "b/qwen"])),
            ("chat", amb(&["a/qwen", "b/mistral"])),
            ("mistral", Ok(("b", "mistral", false))),
            ("b/llama", Err(RouteError::NotFound)),
            ("gone", Err(RouteError::NotFound)),
            ("old", Err(RouteError::NotFound)),
            ("", Err(RouteError::NotFound)),
            ("/", Err(RouteError::NotFound)),
            ("nope", Err(RouteError::NotFound)),
            ("LLAMA", Err(RouteError::NotFound)),
        ];
        for (req, want) in cases {
            let got = resolve(&models, req, &Scope::All)
                .map(|r| (r.namespace.clone(), r.name.clone(), r.rewrite));
            let want = want.map(|(n, m, r)| (n.to_string(), m.to_string(), r));
            assert_eq!(got, want, "{req:?}");
        }
    }

    #[test]
    fn model_list_names_every_routable_id_once() {
        let models = vec![
            model("a", "llama", &["default"]),
            model("b", "llama", &["other"]),
        ];
        let ids: Vec<String> = model_list(&models, &Scope::All)
            .data
            .into_iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(ids, vec!["default", "llama", "other"]);
    }

    fn scope(names: &[&str]) -> Scope {
        Scope::Namespaces(names.iter().map(|n| n.to_string()).collect())
    }

    #[test]
    fn another_namespace_cannot_capture_a_scoped_name() {
        let models = vec![
            model("team", "llama", &["default", "chat"]),
            model("evil", "default", &[]),
            model("evil", "llama", &["chat"]),
            model("other", "embed", &[]),
        ];
        // (scope, requested, Ok((namespace, name)) or Err)
        type Want = Result<(&'static str, &'static str), RouteError>;
        let team = scope(&["team"]);
        let two = scope(&["team", "other"]);
        let nobody = scope(&["nobody"]);
        let cases: Vec<(&Scope, &str, Want)> = vec![
            // evil/default's name would beat team's alias; evil/llama would make `llama` and
            // `chat` ambiguous: neither exists for a key of `team`.
            (&team, "default", Ok(("team", "llama"))),
            (&team, "llama", Ok(("team", "llama"))),
            (&team, "chat", Ok(("team", "llama"))),
            // Out of scope is not found, also by `<namespace>/<name>` (nothing says it exists).
            (&team, "evil/default", Err(RouteError::NotFound)),
            (&team, "embed", Err(RouteError::NotFound)),
            (&two, "embed", Ok(("other", "embed"))),
            (&two, "other/embed", Ok(("other", "embed"))),
            // A key without namespaces keeps the all-namespace rules.
            (&Scope::All, "default", Ok(("evil", "default"))),
            (
                &Scope::All,
                "llama",
                Err(RouteError::Ambiguous(vec![
                    "evil/llama".into(),
                    "team/llama".into(),
                ])),
            ),
            (&nobody, "llama", Err(RouteError::NotFound)),
        ];
        for (sc, req, want) in cases {
            let got = resolve(&models, req, sc).map(|r| (r.namespace.clone(), r.name.clone()));
            let want = want.map(|(n, m)| (n.to_string(), m.to_string()));
            assert_eq!(got, want, "{sc:?} {req:?}");
        }
        let ids: Vec<String> = model_list(&models, &team)
            .data
            .into_iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(ids, vec!["chat", "default", "llama"]);
    }
}
