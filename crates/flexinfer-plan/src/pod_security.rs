//! The one pod hardening of every pod the controller creates: pipeline Jobs and serving
//! Deployments run as a non-root user, without privilege escalation, with every capability
//! dropped and the runtime's default seccomp profile (docs/user/serving.md, "Pod security").
//!
//! GPU access comes from the device plugin's resource, never from privileged mode. AMD device
//! nodes (`/dev/kfd`, `/dev/dri/renderD*`) are usually group-owned (`render`, `video`) with mode
//! 0660, so a non-root pod on an AMD node needs those groups: `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS`
//! (chart value `gpuSupplementalGroups`) adds them to every pod that requests a GPU.

use k8s_openapi::api::core::v1::{
    Capabilities, PodSecurityContext, SeccompProfile, SecurityContext,
};

use flexinfer_api::contract::env;

/// User and group every FlexInfer pod runs as (the `nonroot` user of distroless-style images).
pub const NONROOT_ID: i64 = 65532;

/// Most supplemental groups accepted from `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS`.
pub const MAX_SUPPLEMENTAL_GROUPS: usize = 16;

fn runtime_default() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".into(),
        localhost_profile: None,
    }
}

/// Pod-level context: non-root user/group, `fsGroup` so the pod can read and write its volumes,
/// seccomp `RuntimeDefault`, and `groups` as supplemental groups (none when empty).
pub fn pod_context(groups: &[i64]) -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NONROOT_ID),
        run_as_group: Some(NONROOT_ID),
        fs_group: Some(NONROOT_ID),
        supplemental_groups: (!groups.is_empty()).then(|| groups.to_vec()),
        seccomp_profile: Some(runtime_default()),
        ..Default::default()
    }
}

/// The supplemental groups of a pod that requests a GPU: the controller's
/// (`FLEXINFER_GPU_SUPPLEMENTAL_GROUPS`), then its GPUProfile's `spec.supplementalGroups`, each once.
/// Ids the API would not admit (0 = root, negative) are dropped: the CRD refuses them already.
pub fn gpu_groups(controller: &[i64], profile: &[i64]) -> Vec<i64> {
    let mut out: Vec<i64> = Vec::new();
    for g in controller.iter().chain(profile).copied() {
        if g > 0 && g <= i64::from(u32::MAX) && !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

/// Container-level context: no privilege escalation, not privileged, every capability dropped.
pub fn container_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        seccomp_profile: Some(runtime_default()),
        ..Default::default()
    }
}

/// The contexts of a node-copy pod (`storageStrategy: NodeLocal`), the one exception to the non-root
/// rule: it writes a host directory that the kubelet creates owned by root (mode 0755), so it runs as
/// user 0 — with every capability dropped (no `CAP_DAC_OVERRIDE`, `CAP_CHOWN`, …), no privilege
/// escalation and the default seccomp profile, it can write only where root owns the directory. The
/// files it writes are world-readable for the serving pods, which run as [`NONROOT_ID`].
pub fn node_copy_contexts() -> (PodSecurityContext, SecurityContext) {
    let pod = PodSecurityContext {
        run_as_non_root: Some(false),
        run_as_user: Some(0),
        run_as_group: Some(0),
        seccomp_profile: Some(runtime_default()),
        ..Default::default()
    };
    let container = SecurityContext {
        run_as_non_root: Some(false),
        ..container_context()
    };
    (pod, container)
}

/// Why `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS` is refused (the text names the variable).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupsError {
    #[error(
        "{var}: {0:?} is not a group id (a number such as the node's `render` gid)",
        var = env::controller::GPU_SUPPLEMENTAL_GROUPS
    )]
    NotAGroupId(String),
    #[error(
        "{}: group 0 (root) is not allowed",
        env::controller::GPU_SUPPLEMENTAL_GROUPS
    )]
    Root,
    #[error(
        "{}: more than {} groups",
        env::controller::GPU_SUPPLEMENTAL_GROUPS,
        MAX_SUPPLEMENTAL_GROUPS
    )]
    TooMany,
}

/// Parses `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS` (comma- or space-separated group ids). Group 0
/// (root) and anything that is not a positive 32-bit id are refused, naming the entry.
pub fn parse_groups(value: &str) -> Result<Vec<i64>, GroupsError> {
    let mut out = Vec::new();
    for part in value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
    {
        let id: u32 = part
            .parse()
            .map_err(|_| GroupsError::NotAGroupId(part.to_string()))?;
        if id == 0 {
            return Err(GroupsError::Root);
        }
        if !out.contains(&i64::from(id)) {
            out.push(i64::from(id));
        }
        if out.len() > MAX_SUPPLEMENTAL_GROUPS {
            return Err(GroupsError::TooMany);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_parse_and_refuse_root_and_junk() {
        assert_eq!(parse_groups("").unwrap(), Vec::<i64>::new());
        assert_eq!(parse_groups("44, 109 44").unwrap(), vec![44, 109]);
        assert!(parse_groups("0").unwrap_err().to_string().contains("root"));
        assert!(parse_groups("render")
            .unwrap_err()
            .to_string()
            .contains("\"render\""));
        assert!(parse_groups("-5").is_err());
        assert!(parse_groups("99999999999").is_err());
        let many = (1..=17)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",");
        assert!(parse_groups(&many)
            .unwrap_err()
            .to_string()
            .contains("more than"));
    }

    #[test]
    fn pod_context_is_non_root_with_groups_only_when_given() {
        let p = pod_context(&[]);
        assert_eq!(p.run_as_non_root, Some(true));
        assert_eq!(p.run_as_user, Some(NONROOT_ID));
        assert_eq!(p.supplemental_groups, None);
        assert_eq!(pod_context(&[44]).supplemental_groups, Some(vec![44]));
        let c = container_context();
        assert_eq!(c.allow_privilege_escalation, Some(false));
        assert_eq!(
            c.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_string()])
        );
    }
}
