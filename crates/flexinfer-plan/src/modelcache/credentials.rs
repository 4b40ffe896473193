//! Which registries may receive the registry credentials of a cache's Secret (pure).
//!
//! A ModelCache names a Secret (`spec.secretRef`, `spec.publish.secretRef`) and the registry its
//! Jobs log in to (`spec.publish.ociRef`, an `oci://` `spec.source`). Anyone who may write
//! ModelCaches in a namespace could otherwise send that namespace's registry credentials to a
//! registry of their own, so the controller only passes them to the registries it is configured
//! with (`FLEXINFER_CREDENTIAL_REGISTRIES`), and refuses the cache before its next Job otherwise
//! (phases already done at the current spec stay done, so a Ready cache is not failed by a new
//! setting; a rerun or a changed spec is checked).

use std::collections::BTreeSet;

use flexinfer_api::contract::{env, reasons, source, JobPhase};
use flexinfer_api::modelcache::ModelCache;

use super::problem::SpecProblem;

/// `FLEXINFER_CREDENTIAL_REGISTRIES`: the registries that may receive a Secret's credentials.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CredentialRegistries {
    /// None (unset or empty): a cache that would send credentials anywhere is refused.
    #[default]
    None,
    /// `*`: every registry (no restriction).
    Any,
    /// These hosts (`host` or `host:port`, lower-case), matched exactly.
    Hosts(BTreeSet<String>),
}

/// What wildcard entry lets credentials go to every registry.
const ANY: &str = "*";

/// Why a credential-registry list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistriesError {
    #[error("{ANY} (every registry) cannot be listed with other registries")]
    AnyWithOthers,
    #[error(
        "{0:?} is not a registry host (host or host:port, e.g. ghcr.io or registry.local:5000; no scheme or path)"
    )]
    NotAHost(String),
}

impl CredentialRegistries {
    /// Parse a comma-separated list of `host[:port]` entries, or `*`; the error names the entry.
    pub fn parse(text: &str) -> Result<Self, RegistriesError> {
        let entries: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        if entries.is_empty() {
            return Ok(Self::None);
        }
        if entries.contains(&ANY) {
            if entries.len() > 1 {
                return Err(RegistriesError::AnyWithOthers);
            }
            return Ok(Self::Any);
        }
        let mut hosts = BTreeSet::new();
        for e in entries {
            let valid = e
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
                && e.bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'[');
            if !valid {
                return Err(RegistriesError::NotAHost(e.to_string()));
            }
            hosts.insert(e.to_ascii_lowercase());
        }
        Ok(Self::Hosts(hosts))
    }

    pub fn allows(&self, registry: &str) -> bool {
        match self {
            Self::None => false,
            Self::Any => true,
            Self::Hosts(h) => h.contains(&registry.to_ascii_lowercase()),
        }
    }

    /// The configured list, for messages.
    fn describe(&self) -> String {
        match self {
            Self::None => "none".into(),
            Self::Any => ANY.into(),
            Self::Hosts(h) => h.iter().cloned().collect::<Vec<_>>().join(", "),
        }
    }
}

/// The registry host of an OCI reference as the worker reads it (`[oci://]registry/repo[:tag][@digest]`):
/// the text before the first `/` (of the part before any `@`), lower-cased. `None` when there is no `/`
/// (the worker then refuses the reference and contacts nothing).
pub fn registry_of(reference: &str) -> Option<String> {
    let s = source::oci_reference(reference);
    let before_digest = s.split('@').next().unwrap_or_default();
    let (registry, _) = before_digest.split_once('/')?;
    Some(registry.to_ascii_lowercase())
}

/// Where one of the cache's Secrets would send registry credentials.
struct Login<'a> {
    /// The field that names the registry.
    field: &'static str,
    reference: &'a str,
    /// The field that names the Secret, and the Secret.
    secret_field: &'static str,
    secret: &'a str,
    phase: JobPhase,
}

fn logins(mc: &ModelCache) -> Vec<Login<'_>> {
    let s = &mc.spec;
    let mut out = Vec::new();
    // The download logs in to an `oci://` source with `spec.secretRef` (jobs::worker_env).
    if let Some(secret) = &s.secret_ref {
        let src = s.source.trim();
        if source::strip_scheme(src, source::OCI).is_some() {
            out.push(Login {
                field: "spec.source",
                reference: src,
                secret_field: "spec.secretRef",
                secret,
                phase: JobPhase::Download,
            });
        }
    }
    // The publish logs in with `spec.publish.secretRef`, else `spec.secretRef`.
    if let Some(p) = &s.publish {
        let secret = match (&p.secret_ref, &s.secret_ref) {
            (Some(sec), _) => Some(("spec.publish.secretRef", sec)),
            (None, Some(sec)) => Some(("spec.secretRef", sec)),
            (None, None) => None,
        };
        if let (Some((secret_field, secret)), Some(reference)) = (secret, &p.oci_ref) {
            out.push(Login {
                field: "spec.publish.ociRef",
                reference,
                secret_field,
                secret,
                phase: JobPhase::Publish,
            });
        }
    }
    out
}

/// The first registry one of the phases `ahead` would send a Secret's credentials to that
/// `allowed` does not list, as the problem that fails the cache.
pub(super) fn credentials_problem(
    mc: &ModelCache,
    allowed: &CredentialRegistries,
    ahead: &[JobPhase],
) -> Option<SpecProblem> {
    for login in logins(mc).into_iter().filter(|l| ahead.contains(&l.phase)) {
        let registry = registry_of(login.reference);
        if registry.as_deref().is_some_and(|r| allowed.allows(r)) {
            continue;
        }
        let what = match &registry {
            Some(r) => format!("registry {r}"),
            None => format!("{:?} (no registry host in it)", login.reference),
        };
        let message = format!(
            "{}: {what} may not receive the credentials of Secret {} ({}): the controller passes registry \
             credentials only to the registries in {} (chart value credentialRegistries; now: {}). Use a \
             registry of that list, drop {}, or ask the cluster operator to add the registry",
            login.field,
            login.secret,
            login.secret_field,
            env::controller::CREDENTIAL_REGISTRIES,
            allowed.describe(),
            login.secret_field,
        );
        return Some(SpecProblem {
            reason: reasons::CREDENTIAL_REGISTRY_NOT_ALLOWED,
            message,
            phase: Some(login.phase),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_of_references() {
        let cases = [
            ("oci://ghcr.io/o/m:v1", Some("ghcr.io")),
            (
                "  OCI://Registry.Local:5000/o/m",
                Some("registry.local:5000"),
            ),
            ("oci://oci://evil.example/o/m", Some("evil.example")),
            ("ghcr.io/o/m@sha256:abc", Some("ghcr.io")),
            ("evil.example@ghcr.io/o/m", None),
            ("model:v1", None),
            ("", None),
        ];
        for (reference, want) in cases {
            assert_eq!(registry_of(reference).as_deref(), want, "{reference:?}");
        }
    }

    #[test]
    fn allow_lists_parse() {
        let hosts =
            |h: &[&str]| CredentialRegistries::Hosts(h.iter().map(|s| s.to_string()).collect());
        let cases: [(&str, Result<CredentialRegistries, &str>); 8] = [
            ("", Ok(CredentialRegistries::None)),
            (" , ", Ok(CredentialRegistries::None)),
            ("*", Ok(CredentialRegistries::Any)),
            (
                "ghcr.io, Registry.Local:5000",
                Ok(hosts(&["ghcr.io", "registry.local:5000"])),
            ),
            ("[::1]:5000", Ok(hosts(&["[::1]:5000"]))),
            ("*,ghcr.io", Err("cannot be listed with other registries")),
            (
                "https://ghcr.io",
                Err("\"https://ghcr.io\" is not a registry host"),
            ),
            ("ghcr.io/org", Err("\"ghcr.io/org\" is not a registry host")),
        ];
        for (text, want) in cases {
            match (CredentialRegistries::parse(text), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{text:?}"),
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{text:?}: {e}"),
                (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
            }
        }
        let list = hosts(&["ghcr.io"]);
        assert!(list.allows("GHCR.io") && !list.allows("ghcr.io:443"));
        assert!(!CredentialRegistries::None.allows("ghcr.io"));
        assert!(CredentialRegistries::Any.allows("anything"));
    }
}
