//! The publish phase of a ModelCache: `spec.publish`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Publish phase settings.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!('oci' in self.targets) || (has(self.ociRef) && size(self.ociRef) > 0)",
     "message": "spec.publish.ociRef is required when spec.publish.targets contains 'oci'", "fieldPath": ".ociRef"}
]))]
pub struct PublishSpec {
    /// Where to publish. Only `oci` exists today.
    #[serde(default = "default_publish_targets")]
    #[schemars(length(min = 1, max = 1))]
    pub targets: Vec<PublishTarget>,

    /// Repository to push to, e.g. `registry.example.com/models/llama3-8b` (no scheme, no tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^[a-zA-Z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$')",
         "message": "spec.publish.ociRef must look like registry.example.com[:port]/repo[/path][:tag] (no scheme)"}
    ]))]
    #[schemars(length(max = 512))]
    pub oci_ref: Option<String>,

    /// Secret (dockerconfigjson, or `OCI_USERNAME`/`OCI_PASSWORD` keys) with registry credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub secret_ref: Option<String>,

    /// How the pushed tag is chosen.
    #[serde(default)]
    pub tag_policy: TagPolicy,

    /// Extra tags pushed for the same manifest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[schemars(inner(length(max = 128)))]
    pub additional_tags: Vec<String>,

    /// Skip TLS verification and allow plain HTTP for this registry.
    #[serde(default)]
    pub insecure: bool,

    /// activeDeadlineSeconds of the publish Job.
    #[serde(default = "default_publish_timeout")]
    #[schemars(range(min = 300, max = 172800))]
    pub timeout_seconds: i64,
}

/// Publish target kind.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PublishTarget {
    /// An OCI registry: a CNCF ModelPack artifact (`application/vnd.cncf.model.manifest.v1+json`, raw layers).
    Oci,
}

/// Tag policy for published artifacts.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TagPolicy {
    /// Push the tag of `ociRef` (default `latest`), replacing what it pointed at.
    #[default]
    Overwrite,
    /// Push `<tag>-<UTC yyyymmddhhmmss>`.
    Timestamp,
    /// Push `<tag>-<first 12 hex of the manifest digest>`.
    DigestSuffix,
}

fn default_publish_targets() -> Vec<PublishTarget> {
    vec![PublishTarget::Oci]
}
fn default_publish_timeout() -> i64 {
    7200
}
