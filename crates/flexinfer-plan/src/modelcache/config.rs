//! Controller configuration read once from the environment (set by the chart / deployment).

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::contract::env;

use super::credentials::CredentialRegistries;
use crate::settings::{SettingError, Settings};

/// Settings that shape Jobs and timing. Environment lookups happen once, at start-up, so that
/// `plan` and the Job builders stay pure.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `FLEXINFER_WORKER_IMAGE`: download/publish (and CPU) worker image.
    pub worker_image: Option<String>,
    /// Every `FLEXINFER_QUANTIZER_*` image variable that was set (name → image).
    pub image_env: BTreeMap<String, String>,
    /// `FLEXINFER_WORKER_SERVICE_ACCOUNT` (default `flexinfer-worker`).
    pub service_account: String,
    /// Image-drift grace window (default 600 s).
    pub drift_grace: Duration,
    /// Retry backoff base (default 30 s); the delay is `min(base·2^n, 10m)`.
    pub retry_base: Duration,
    /// How often a running Job's log is tailed for progress (default 30 s).
    pub progress_poll: Duration,
    /// `GPTQ_*` tunables with controller-level overrides applied, in contract order.
    pub gptq_tunables: Vec<(String, String)>,
    /// `HF_ENDPOINT` passed through to workers when set on the controller.
    pub hf_endpoint: Option<String>,
    /// `FLEXINFER_KEEP_GENERATIONS`: earlier generations of a phase's output kept on disk besides the
    /// promoted one (default 1; generations a Model serves are always kept).
    pub keep_generations: usize,
    /// `FLEXINFER_STUCK_POD_SECONDS`: how long a pipeline pod may stay unschedulable or unable to
    /// pull its image before the attempt counts as failed (default 300 s).
    pub stuck_pod_after: Duration,
    /// `FLEXINFER_LOG_READS_PER_SECOND`: progress log reads of running pods per second across all
    /// caches (default 20; 0 = none).
    pub log_reads_per_second: u32,
    /// `FLEXINFER_RECONCILE_CONCURRENCY`: ModelCache reconciles that run at once (default 32). Each
    /// holds its cache, the Jobs it renders and the requests in flight; unbounded, thousands of caches
    /// created at once made thousands of reconciles and a memory peak to match.
    pub reconcile_concurrency: u16,
    /// `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS`: supplemental groups of pods that request a GPU.
    pub gpu_supplemental_groups: Vec<i64>,
    /// `FLEXINFER_CREDENTIAL_REGISTRIES`: registries that may receive a cache Secret's registry
    /// credentials (default: none).
    pub credential_registries: CredentialRegistries,
    /// `FLEXINFER_NODE_LOCAL_ROOT`: the nodes' host directory of `storageStrategy: NodeLocal` copies.
    pub node_local_root: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            worker_image: None,
            image_env: BTreeMap::new(),
            service_account: flexinfer_api::contract::controller::DEFAULT_WORKER_SERVICE_ACCOUNT
                .into(),
            drift_grace: Duration::from_secs(600),
            retry_base: Duration::from_secs(30),
            progress_poll: Duration::from_secs(30),
            gptq_tunables: env::GPTQ_TUNABLES
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            hf_endpoint: None,
            keep_generations: 1,
            log_reads_per_second: 20,
            reconcile_concurrency: 32,
            stuck_pod_after: Duration::from_secs(300),
            gpu_supplemental_groups: Vec::new(),
            credential_registries: CredentialRegistries::None,
            node_local_root: env::controller::NODE_LOCAL_ROOT_DEFAULT.to_string(),
        }
    }
}

impl Config {
    /// Read from an environment lookup (`std::env::var` in the binary, a map in tests). A set value
    /// that does not parse is an error naming the variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, SettingError> {
        let s = Settings::new(get);
        let day = Duration::from_secs(86_400);
        let mut image_env = BTreeMap::new();
        let mut names = vec![
            env::controller::QUANTIZER_GPTQ_IMAGE.to_string(),
            env::controller::QUANTIZER_GPTQ_ROCM_IMAGE.to_string(),
        ];
        for arch in [
            "gfx1100", "gfx906", "gfx90a", "gfx942", "gfx1030", "gfx1101", "gfx1201",
        ] {
            names.push(env::controller::quantizer_gptq_rocm_arch_image(arch));
        }
        for f in flexinfer_api::formats::FORMATS {
            names.push(env::controller::quantizer_format_image(f.name));
        }
        for n in names {
            if let Some(v) = s.text(&n) {
                image_env.insert(n, v);
            }
        }
        let gptq_tunables = env::GPTQ_TUNABLES
            .iter()
            .map(|(k, d)| {
                let v = s
                    .text(&env::controller_override(k))
                    .unwrap_or_else(|| d.to_string());
                (k.to_string(), v)
            })
            .collect();
        Ok(Self {
            worker_image: s.text(env::controller::WORKER_IMAGE),
            image_env,
            service_account: s
                .text(env::controller::WORKER_SERVICE_ACCOUNT)
                .unwrap_or_else(|| {
                    flexinfer_api::contract::controller::DEFAULT_WORKER_SERVICE_ACCOUNT.into()
                }),
            drift_grace: s.seconds(
                env::controller::IMAGE_DRIFT_GRACE_SECONDS,
                Duration::from_secs(600),
                day,
            )?,
            retry_base: s.seconds(
                env::controller::RETRY_BASE_SECONDS,
                Duration::from_secs(30),
                Duration::from_secs(600),
            )?,
            stuck_pod_after: s.seconds(
                env::controller::STUCK_POD_SECONDS,
                Duration::from_secs(300),
                day,
            )?,
            progress_poll: s.seconds(
                env::controller::PROGRESS_POLL_SECONDS,
                Duration::from_secs(30),
                Duration::from_secs(3600),
            )?,
            gptq_tunables,
            hf_endpoint: s.text(env::HF_ENDPOINT),
            keep_generations: s.count(env::controller::KEEP_GENERATIONS, 1, 16)?,
            log_reads_per_second: u32::try_from(s.count(
                env::controller::LOG_READS_PER_SECOND,
                20,
                1000,
            )?)
            .unwrap_or(20),
            reconcile_concurrency: u16::try_from(s.count(
                env::controller::RECONCILE_CONCURRENCY,
                32,
                1024,
            )?)
            .unwrap_or(32),
            gpu_supplemental_groups: s
                .parsed(
                    env::controller::GPU_SUPPLEMENTAL_GROUPS,
                    crate::pod_security::parse_groups,
                )?
                .unwrap_or_default(),
            credential_registries: s
                .parsed(
                    env::controller::CREDENTIAL_REGISTRIES,
                    CredentialRegistries::parse,
                )?
                .unwrap_or_default(),
            node_local_root: s
                .parsed(env::controller::NODE_LOCAL_ROOT, parse_node_local_root)?
                .unwrap_or_else(|| env::controller::NODE_LOCAL_ROOT_DEFAULT.to_string()),
        })
    }

    /// Read from the process environment. Arbitrary-arch `FLEXINFER_QUANTIZER_GPTQ_ROCM_<ARCH>_IMAGE`
    /// variables are picked up too.
    pub fn from_env() -> Result<Self, SettingError> {
        let mut c = Self::from_lookup(|k| std::env::var(k).ok())?;
        for (k, v) in std::env::vars() {
            if k.starts_with("FLEXINFER_QUANTIZER_")
                && k.ends_with("_IMAGE")
                && !v.trim().is_empty()
            {
                c.image_env.insert(k, v.trim().to_string());
            }
        }
        Ok(c)
    }

    /// Retry delay after the `n`-th failure (0-based): `min(base·2^n, 10m)`.
    pub fn retry_delay(&self, n: u32) -> Duration {
        let factor = 2u32.saturating_pow(n.min(20));
        self.retry_base
            .saturating_mul(factor)
            .min(Duration::from_secs(600))
    }
}

/// A `FLEXINFER_NODE_LOCAL_ROOT` that is not an absolute host path without `.`/`..`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not an absolute host path without . or .. (e.g. {default})",
    default = env::controller::NODE_LOCAL_ROOT_DEFAULT
)]
pub struct NotAHostPath(pub String);

/// `FLEXINFER_NODE_LOCAL_ROOT`: an absolute host path without `.`/`..` components (it is mounted into
/// node-copy and serving pods).
pub fn parse_node_local_root(v: &str) -> Result<String, NotAHostPath> {
    let ok = v.starts_with('/')
        && v.len() > 1
        && v.split('/')
            .all(|c| c != "." && c != ".." && !c.contains(['\0', '\n']));
    if ok {
        Ok(v.trim_end_matches('/').to_string())
    } else {
        Err(NotAHostPath(v.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_apply() {
        let m: BTreeMap<&str, &str> = BTreeMap::from([
            ("FLEXINFER_WORKER_IMAGE", "w:1"),
            ("FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX906_IMAGE", "q:906"),
            ("FLEXINFER_GPTQ_MAX_RTN_FALLBACK_PERCENT", "5"),
            ("FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS", "3"),
            ("FLEXINFER_RETRY_BASE_SECONDS", "1"),
            ("FLEXINFER_STUCK_POD_SECONDS", "45"),
            (
                "FLEXINFER_CREDENTIAL_REGISTRIES",
                "ghcr.io,registry.local:5000",
            ),
        ]);
        let c = Config::from_lookup(|k| m.get(k).map(|s| s.to_string()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.worker_image.as_deref(), Some("w:1"));
        assert_eq!(
            c.image_env
                .get("FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX906_IMAGE")
                .map(String::as_str),
            Some("q:906")
        );
        assert!(c
            .gptq_tunables
            .contains(&("GPTQ_MAX_RTN_FALLBACK_PERCENT".into(), "5".into())));
        assert!(c
            .gptq_tunables
            .contains(&("GPTQ_RESUME_LAYERS".into(), "true".into())));
        assert_eq!(c.drift_grace, Duration::from_secs(3));
        assert_eq!(c.stuck_pod_after, Duration::from_secs(45));
        assert_eq!(c.progress_poll, Duration::from_secs(30));
        assert_eq!(c.retry_delay(0), Duration::from_secs(1));
        assert_eq!(c.retry_delay(3), Duration::from_secs(8));
        assert!(c.credential_registries.allows("registry.local:5000"));
        assert!(!c.credential_registries.allows("evil.example"));
    }

    /// A typo or an out-of-range value stops the start-up with the variable's name instead of
    /// silently becoming the default.
    #[test]
    fn invalid_settings_are_errors_naming_the_variable() {
        let cases = [
            ("FLEXINFER_PROGRESS_POLL_SECONDS", "1e300"),
            ("FLEXINFER_RETRY_BASE_SECONDS", "30s"),
            ("FLEXINFER_STUCK_POD_SECONDS", "-5"),
            ("FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS", "ten"),
            ("FLEXINFER_KEEP_GENERATIONS", "17"),
            ("FLEXINFER_GPU_SUPPLEMENTAL_GROUPS", "render"),
            ("FLEXINFER_CREDENTIAL_REGISTRIES", "https://ghcr.io"),
        ];
        for (name, value) in cases {
            let e =
                Config::from_lookup(|k| (k == name).then(|| value.to_string())).expect_err(name);
            assert_eq!(e.name, name);
            assert_eq!(e.value, value);
        }
        // Unset and empty values take the defaults.
        let c = Config::from_lookup(|k| (k == "FLEXINFER_RETRY_BASE_SECONDS").then(String::new))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c, Config::default());
    }

    #[test]
    fn retry_delay_is_capped_at_ten_minutes() {
        let c = Config::default();
        assert_eq!(c.retry_delay(0), Duration::from_secs(30));
        assert_eq!(c.retry_delay(1), Duration::from_secs(60));
        assert_eq!(c.retry_delay(4), Duration::from_secs(480));
        assert_eq!(c.retry_delay(5), Duration::from_secs(600));
        assert_eq!(c.retry_delay(40), Duration::from_secs(600));
    }

    #[test]
    fn node_local_root_is_an_absolute_path_without_dot_components() {
        let get = |v: &'static str| {
            Config::from_lookup(move |k| (k == "FLEXINFER_NODE_LOCAL_ROOT").then(|| v.to_string()))
        };
        assert_eq!(
            Config::default().node_local_root,
            "/var/lib/flexinfer/node-local"
        );
        assert_eq!(
            get("/srv/copies/").map(|c| c.node_local_root),
            Ok("/srv/copies".to_string())
        );
        for bad in ["relative/dir", "/", "/srv/../etc", "/srv/./x"] {
            let e = get(bad).expect_err(bad);
            assert_eq!(e.name, "FLEXINFER_NODE_LOCAL_ROOT", "{bad}");
        }
    }
}
