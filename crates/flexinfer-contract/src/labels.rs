//! Label keys, and the one builder of the recommended `app.kubernetes.io/*` labels that every
//! object the controller creates carries (Jobs, PVCs, Deployments, Services and their pods).

use std::collections::BTreeMap;

pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY_VALUE: &str = "flexinfer";
pub const NAME: &str = "app.kubernetes.io/name";
pub const INSTANCE: &str = "app.kubernetes.io/instance";
pub const COMPONENT: &str = "app.kubernetes.io/component";
pub const PART_OF: &str = "app.kubernetes.io/part-of";
/// Value of [`PART_OF`] on everything FlexInfer creates.
pub const PART_OF_VALUE: &str = "flexinfer";
pub const VERSION: &str = "app.kubernetes.io/version";
/// Value of [`NAME`] on pipeline Jobs (the worker image runs them).
pub const WORKER_NAME: &str = "flexinfer-worker";
/// Name of the ModelCache a pipeline Job/PVC belongs to.
pub const CACHE: &str = "flexinfer.ai/cache";
/// Pipeline phase of a Job: `download`, `abliterate`, `quantize`, `publish`.
pub const PHASE: &str = "flexinfer.ai/phase";
/// Name of the Model a Deployment/Service belongs to.
pub const MODEL: &str = "flexinfer.ai/model";
/// Node label carrying the GPU architecture (`gfx1100`, `gfx906`, `sm_90`).
pub const GPU_ARCH: &str = "flexinfer.ai/gpu.arch";
/// Prefix of the node label that says which verified copy of a `storageStrategy: NodeLocal` cache a
/// node holds: `nodelocal.flexinfer.ai/<hash of namespace/name>` = the copy's digest (shortened).
pub const NODE_LOCAL_PREFIX: &str = "nodelocal.flexinfer.ai/";

/// The recommended `app.kubernetes.io/*` labels. `managed-by` and `part-of` are always set; the
/// others only when given. Add FlexInfer's own keys ([`CACHE`], [`MODEL`], …) with [`Self::with`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recommended {
    labels: BTreeMap<String, String>,
}

impl Recommended {
    pub fn new() -> Self {
        Self {
            labels: BTreeMap::from([
                (MANAGED_BY.to_string(), MANAGED_BY_VALUE.to_string()),
                (PART_OF.to_string(), PART_OF_VALUE.to_string()),
            ]),
        }
    }
    /// `app.kubernetes.io/name`: what runs (the backend, the worker).
    pub fn name(self, v: impl Into<String>) -> Self {
        self.with(NAME, v)
    }
    /// `app.kubernetes.io/instance`: the object this belongs to.
    pub fn instance(self, v: impl Into<String>) -> Self {
        self.with(INSTANCE, v)
    }
    /// `app.kubernetes.io/component`: the role (pipeline phase, inference server).
    pub fn component(self, v: impl Into<String>) -> Self {
        self.with(COMPONENT, v)
    }
    /// `app.kubernetes.io/version`.
    pub fn version(self, v: impl Into<String>) -> Self {
        self.with(VERSION, v)
    }
    /// Any other label.
    pub fn with(mut self, key: &str, v: impl Into<String>) -> Self {
        self.labels.insert(key.to_string(), v.into());
        self
    }
    pub fn build(self) -> BTreeMap<String, String> {
        self.labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn always_managed_by_and_part_of() {
        let l = Recommended::new().instance("c").with(CACHE, "c").build();
        assert_eq!(l.len(), 4);
        assert_eq!(l[MANAGED_BY], "flexinfer");
        assert_eq!(l[PART_OF], "flexinfer");
        assert_eq!(l[INSTANCE], "c");
        assert!(!l.contains_key(VERSION));
        assert_eq!(
            Recommended::new().version("0.1.0").build()[VERSION],
            "0.1.0"
        );
    }
}
