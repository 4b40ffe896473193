//! Model sources (`pvc://`, `modelcache://`, Hugging Face ids) and the cache path format.

use flexinfer_api::contract::{check_relative_path, SourceUri};

/// A parsed `spec.source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `pvc://<claim>/<path>`.
    Pvc { claim: String, path: String },
    /// `modelcache://<name>`.
    Cache { name: String },
    /// `HF://org/model`, `hf://…`, `huggingface://…` or bare `org/model`: the backend downloads it.
    Hub { repo: String },
}

/// Why a source is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SourceError(pub String);

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// Parse and check `spec.source`. The CRD already rejects most malformed values; this also
/// rejects what a regex cannot (absolute or empty paths inside the claim, `.` segments, …).
pub fn parse_source(source: &str) -> Result<Source, SourceError> {
    if let Some(rest) = source.strip_prefix("pvc://") {
        let Some((claim, path)) = rest.split_once('/') else {
            return Err(SourceError(format!(
                "spec.source {source:?}: pvc:// needs a path inside the claim (pvc://<claim>/<path>)"
            )));
        };
        if !is_dns_label(claim) {
            return Err(SourceError(format!(
                "spec.source {source:?}: {claim:?} is not a valid PersistentVolumeClaim name"
            )));
        }
        check_path(source, path)?;
        let path = path.trim_end_matches('/').to_string();
        return Ok(Source::Pvc {
            claim: claim.to_string(),
            path,
        });
    }
    if let Some(name) = source.strip_prefix("modelcache://") {
        if !is_dns_label(name) {
            return Err(SourceError(format!(
                "spec.source {source:?}: {name:?} is not a valid ModelCache name"
            )));
        }
        return Ok(Source::Cache {
            name: name.to_string(),
        });
    }
    let repo = SourceUri::strip_hub_scheme(source).unwrap_or(source);
    let parts: Vec<&str> = repo.split('/').collect();
    let ok_part = |p: &&str| {
        !p.is_empty()
            && *p != "."
            && *p != ".."
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    };
    if parts.len() == 2 && parts.iter().all(ok_part) {
        return Ok(Source::Hub {
            repo: repo.to_string(),
        });
    }
    Err(SourceError(format!(
        "spec.source {source:?} must be pvc://<claim>/<path>, modelcache://<name> or HF://org/model"
    )))
}

fn check_path(source: &str, path: &str) -> Result<(), SourceError> {
    check_relative_path(path)
        .map_err(|e| SourceError(format!("spec.source {source:?}: {e} inside the claim")))?;
    check_chars(path).map_err(|e| SourceError(format!("spec.source {source:?}: {e}")))?;
    let trimmed = path.trim_end_matches('/');
    if trimmed.split('/').any(|seg| seg.is_empty() || seg == ".") {
        return Err(SourceError(format!(
            "spec.source {source:?}: path {path:?} has an empty or '.' segment"
        )));
    }
    Ok(())
}

/// A path character outside the safe alphabet of [`check_chars`].
#[derive(Debug, thiserror::Error)]
#[error("path {path:?} contains {c:?} (allowed: letters, digits, ._-/+@=)")]
struct UnsafeChar {
    path: String,
    c: char,
}

/// Artifact paths end up in mounts and (quoted) shell arguments: keep them to a safe alphabet.
fn check_chars(path: &str) -> Result<(), UnsafeChar> {
    match path
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "._-/+@=".contains(*c)))
    {
        Some(c) => Err(UnsafeChar {
            path: path.to_string(),
            c,
        }),
        None => Ok(()),
    }
}

/// Split a ModelCache `status.path` (`<pvc>:<subdir>`) into claim and subdirectory.
pub fn parse_cache_path(path: &str) -> Result<(String, String), SourceError> {
    let Some((claim, subdir)) = path.split_once(':') else {
        return Err(SourceError(format!(
            "ModelCache status.path {path:?} is not <pvc>:<subdir>"
        )));
    };
    if !is_dns_label(claim) {
        return Err(SourceError(format!(
            "ModelCache status.path {path:?}: {claim:?} is not a valid PersistentVolumeClaim name"
        )));
    }
    let bad =
        |e: &dyn std::fmt::Display| SourceError(format!("ModelCache status.path {path:?}: {e}"));
    check_relative_path(subdir).map_err(|e| bad(&e))?;
    check_chars(subdir).map_err(|e| bad(&e))?;
    Ok((claim.to_string(), subdir.trim_end_matches('/').to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources() {
        assert_eq!(
            parse_source("pvc://models/gemma/gptq-w4-g128"),
            Ok(Source::Pvc {
                claim: "models".into(),
                path: "gemma/gptq-w4-g128".into()
            })
        );
        assert_eq!(
            parse_source("pvc://models/a.gguf/"),
            Ok(Source::Pvc {
                claim: "models".into(),
                path: "a.gguf".into()
            })
        );
        assert_eq!(
            parse_source("modelcache://gemma4-31b-gptq"),
            Ok(Source::Cache {
                name: "gemma4-31b-gptq".into()
            })
        );
        assert_eq!(
            parse_source("HF://google/gemma-4-31B-it"),
            Ok(Source::Hub {
                repo: "google/gemma-4-31B-it".into()
            })
        );
        assert_eq!(
            parse_source("org/model"),
            Ok(Source::Hub {
                repo: "org/model".into()
            })
        );
        for bad in [
            "pvc://models",
            "pvc://models/",
            "pvc://models//etc/passwd",
            "pvc://models/a/../b",
            "pvc://models/a//b",
            "pvc://models/./a",
            "pvc://Models/a",
            "modelcache://",
            "modelcache://Bad_Name",
            "s3://bucket/key",
            "a/b/c",
        ] {
            let err = parse_source(bad).expect_err(bad);
            assert!(err.0.contains("spec.source"), "{bad}: {err}");
        }
    }

    #[test]
    fn cache_paths() {
        assert_eq!(
            parse_cache_path("gemma-cache:gemma/gptq-w4-g128"),
            Ok(("gemma-cache".into(), "gemma/gptq-w4-g128".into()))
        );
        for bad in [
            "nocolon", "pvc:/abs", "pvc:../x", "Bad:x", "pvc:", "pvc:a b", "pvc:$(x)",
        ] {
            assert!(parse_cache_path(bad).is_err(), "{bad}");
        }
    }
}
