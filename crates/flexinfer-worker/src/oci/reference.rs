//! OCI references: `registry[:port]/repository[:tag][@sha256:…]`.

use super::{OciError, ReferenceProblem};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, OciError> {
        let bad = |problem: ReferenceProblem| OciError::Reference {
            reference: s.to_string(),
            problem,
        };
        let s = flexinfer_contract::source::oci_reference(s);
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !is_sha256_digest(d) {
                    return Err(bad(ReferenceProblem::Digest));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (registry, path) = rest
            .split_once('/')
            .ok_or_else(|| bad(ReferenceProblem::NoRepository))?;
        if !(registry.contains('.') || registry.contains(':') || registry == "localhost") {
            return Err(bad(ReferenceProblem::NoRegistry));
        }
        let (repository, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, Some(t.to_string())),
            _ => (path, None),
        };
        let repo_ok = !repository.is_empty()
            && repository.split('/').all(|c| {
                !c.is_empty()
                    && c.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    })
            });
        if !repo_ok {
            return Err(bad(ReferenceProblem::Repository));
        }
        if let Some(t) = &tag {
            check_tag(t).map_err(|e| bad(e.into()))?;
        }
        Ok(Reference {
            registry: registry.to_string(),
            repository: repository.to_string(),
            tag,
            digest,
        })
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// A tag outside the OCI tag grammar.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid tag {0:?} (allowed: [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")]
pub struct InvalidTag(pub String);

/// OCI tag grammar `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
pub fn check_tag(t: &str) -> Result<(), InvalidTag> {
    let ok = !t.is_empty()
        && t.len() <= 128
        && t.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(InvalidTag(t.to_string()))
    }
}

pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = Reference::parse("oci://localhost:5000/org/model:v1").unwrap();
        assert_eq!(r.registry, "localhost:5000");
        assert_eq!(r.repository, "org/model");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("ghcr.io/o/m@{d}")).unwrap();
        assert_eq!(r.digest.as_deref(), Some(d.as_str()));
        assert_eq!(r.tag, None);
        assert!(Reference::parse("model:v1").is_err());
        assert!(Reference::parse("ghcr.io/O/M").is_err());
        assert!(Reference::parse("ghcr.io/o/m@sha256:xyz").is_err());
        assert!(Reference::parse("ghcr.io/o/m:-bad").is_err());
        assert_eq!(
            Reference::parse("ghcr.io/o/m:v1").unwrap().to_string(),
            "ghcr.io/o/m:v1"
        );
    }
}
