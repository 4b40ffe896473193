//! Registry credentials (env or dockerconfigjson) and `WWW-Authenticate` challenge parsing.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use flexinfer_contract::env;
use serde::Deserialize;

use super::OciError;
use crate::flags::parse_bool_arg;

#[derive(Clone, Default)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.username)
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: std::collections::BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Registry flags shared by `download` (`oci://` sources) and `publish`. `Debug` redacts the password.
#[derive(Clone, clap::Args)]
pub struct RegistryArgs {
    /// Skip TLS verification and allow plain HTTP.
    #[arg(long, env = env::OCI_INSECURE, value_parser = parse_bool_arg, default_value = "false",
        action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub insecure: bool,
    #[arg(long, env = env::OCI_USERNAME)]
    pub oci_username: Option<String>,
    #[arg(long, env = env::OCI_PASSWORD, hide_env_values = true)]
    pub oci_password: Option<String>,
    /// dockerconfigjson file (or a mounted Secret directory holding `.dockerconfigjson`).
    #[arg(long, env = env::DOCKER_CONFIG_JSON)]
    pub docker_config_json: Option<PathBuf>,
}

impl std::fmt::Debug for RegistryArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryArgs")
            .field("insecure", &self.insecure)
            .field("oci_username", &self.oci_username)
            .field(
                "oci_password",
                &self.oci_password.as_ref().map(|_| "<redacted>"),
            )
            .field("docker_config_json", &self.docker_config_json)
            .finish()
    }
}

impl RegistryArgs {
    /// The credentials these flags give for `registry`.
    pub fn credentials(&self, registry: &str) -> Result<Option<Credentials>, OciError> {
        Credentials::resolve(
            registry,
            self.oci_username.as_deref(),
            self.oci_password.as_deref(),
            self.docker_config_json.as_deref(),
        )
    }
}

impl Credentials {
    /// Env `OCI_USERNAME`/`OCI_PASSWORD` first, then the dockerconfigjson entry for `registry`.
    pub fn resolve(
        registry: &str,
        username: Option<&str>,
        password: Option<&str>,
        docker_config: Option<&Path>,
    ) -> Result<Option<Credentials>, OciError> {
        if let (Some(u), Some(p)) = (username, password) {
            if !u.is_empty() {
                return Ok(Some(Credentials {
                    username: u.into(),
                    password: p.into(),
                }));
            }
        }
        let Some(path) = docker_config.filter(|p| !p.as_os_str().is_empty()) else {
            return Ok(None);
        };
        // A mounted Secret directory holds the file under `.dockerconfigjson` or `config.json`.
        let file = if path.is_dir() {
            [".dockerconfigjson", "config.json"]
                .iter()
                .map(|n| path.join(n))
                .find(|p| p.is_file())
                .unwrap_or_else(|| path.join(".dockerconfigjson"))
        } else {
            path.to_path_buf()
        };
        let text = flexinfer_fsutil::read_regular(&file, flexinfer_fsutil::limits::DOCKER_CONFIG)
            .map_err(|source| OciError::DockerConfigRead {
            path: file.clone(),
            source,
        })?;
        let cfg: DockerConfig =
            serde_json::from_slice(&text).map_err(|source| OciError::DockerConfigJson {
                path: file.clone(),
                source,
            })?;
        let host_of = |k: &str| {
            let k = k
                .trim_start_matches("https://")
                .trim_start_matches("http://");
            k.split('/').next().unwrap_or(k).to_string()
        };
        let Some(entry) = cfg
            .auths
            .iter()
            .find(|(k, _)| host_of(k) == registry)
            .map(|(_, v)| v)
        else {
            return Ok(None);
        };
        if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
            return Ok(Some(Credentials {
                username: u.clone(),
                password: p.clone(),
            }));
        }
        if let Some(a) = &entry.auth {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(a.trim())
                .map_err(|source| OciError::AuthNotBase64 {
                    registry: registry.to_string(),
                    source,
                })?;
            let s = String::from_utf8(raw).map_err(|source| OciError::AuthNotUtf8 {
                registry: registry.to_string(),
                source,
            })?;
            if let Some((u, p)) = s.split_once(':') {
                return Ok(Some(Credentials {
                    username: u.into(),
                    password: p.into(),
                }));
            }
        }
        Err(OciError::NoCredentialsInEntry {
            registry: registry.to_string(),
        })
    }
}

/// `realm="…",service="…",scope="…"` → pairs.
pub(super) fn parse_challenge(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        rest = after;
        let value;
        if let Some(r) = rest.strip_prefix('"') {
            // Up to the closing quote (or the end, when there is none).
            let (v, tail) = r.split_once('"').unwrap_or((r, ""));
            value = v.to_string();
            rest = tail;
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            value = rest[..end].trim().to_string();
            rest = &rest[end..];
        }
        rest = rest.trim_start_matches(',').trim();
        out.push((key, value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        let p = parse_challenge(
            r#" realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(p[0], ("realm".into(), "https://auth.example/token".into()));
        assert_eq!(p[1], ("service".into(), "registry.example".into()));
        assert_eq!(p[2], ("scope".into(), "repository:a/b:pull,push".into()));
    }

    #[test]
    fn docker_config() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("u:p:w");
        std::fs::write(
            &p,
            format!(r#"{{"auths":{{"https://reg.example:5000":{{"auth":"{auth}"}}}}}}"#),
        )
        .unwrap();
        let c = Credentials::resolve("reg.example:5000", None, None, Some(&p))
            .unwrap()
            .unwrap();
        assert_eq!((c.username.as_str(), c.password.as_str()), ("u", "p:w"));
        assert!(Credentials::resolve("other.example", None, None, Some(&p))
            .unwrap()
            .is_none());
        let env = Credentials::resolve("reg.example:5000", Some("a"), Some("b"), Some(&p))
            .unwrap()
            .unwrap();
        assert_eq!(env.username, "a");
        assert!(!format!("{c:?}").contains("p:w"));
    }
}
