//! What to download: the `SOURCE` URI forms, allow/ignore glob filters, and `DATASET` ids.

use std::path::Path;

use flexinfer_contract::source::{self, SourceUri};

use crate::common::{DownloadError, ExitKind, WorkerError};
use crate::hf;
use crate::oci;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Hub { repo: String },
    Oci { reference: String },
    Local { path: String },
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, WorkerError> {
        let s = s.trim();
        let context = || format!("invalid source {s:?}");
        match SourceUri::parse(s) {
            SourceUri::Hub { repo, .. } => {
                hf::check_repo_id(repo)
                    .map_err(WorkerError::caused(ExitKind::BadInput, context()))?;
                Ok(Source::Hub {
                    repo: repo.to_string(),
                })
            }
            SourceUri::Oci(reference) => {
                oci::Reference::parse(reference)
                    .map_err(WorkerError::caused(ExitKind::BadInput, context()))?;
                Ok(Source::Oci {
                    reference: reference.to_string(),
                })
            }
            SourceUri::Local(path) => Ok(Source::Local {
                path: path.to_string(),
            }),
            SourceUri::Unknown { .. } => Err(DownloadError::UnknownScheme {
                source_uri: s.to_string(),
            }
            .into()),
        }
    }
}

/// Allow/ignore glob filter (comma lists, `*` does not cross `/` unless `**`).
pub struct PatternFilter {
    allow: Option<globset::GlobSet>,
    ignore: Option<globset::GlobSet>,
}

impl PatternFilter {
    pub fn new(allow: &str, ignore: &str) -> Result<Self, WorkerError> {
        Ok(Self {
            allow: build_globs(allow)?,
            ignore: build_globs(ignore)?,
        })
    }
    pub fn matches(&self, path: &str) -> bool {
        self.allow.as_ref().is_none_or(|a| a.is_match(path))
            && !self.ignore.as_ref().is_some_and(|i| i.is_match(path))
    }
}

fn build_globs(list: &str) -> Result<Option<globset::GlobSet>, WorkerError> {
    let pats: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if pats.is_empty() {
        return Ok(None);
    }
    let mut b = globset::GlobSetBuilder::new();
    for p in pats {
        // huggingface_hub semantics: a pattern ending in `/` means everything below it.
        let p = if p.ends_with('/') {
            format!("{p}*")
        } else {
            p.to_string()
        };
        let g = globset::GlobBuilder::new(&p)
            .literal_separator(false)
            .build()
            .map_err(|source| WorkerError::Pattern {
                context: format!("invalid pattern {p:?}"),
                source,
            })?;
        b.add(g);
    }
    b.build().map(Some).map_err(|source| WorkerError::Pattern {
        context: "invalid patterns".into(),
        source,
    })
}

/// A `DATASET` value that names a hub dataset (not a local file).
pub fn hub_dataset_id(v: &str) -> Option<String> {
    let v = v.trim();
    let lower = v.to_ascii_lowercase();
    let hf_datasets = format!("{}datasets/", source::HF);
    let v = [hf_datasets.as_str(), source::HF, "datasets/"]
        .iter()
        .find_map(|p| lower.starts_with(p).then(|| &v[p.len()..]))
        .unwrap_or(v);
    let local_looking = v.is_empty()
        || v.starts_with('/')
        || v.starts_with('.')
        || Path::new(v).exists()
        || [".jsonl", ".json", ".txt", ".parquet", ".zst", ".gz", ".csv"]
            .iter()
            .any(|e| v.ends_with(e));
    (!local_looking && v.contains('/') && hf::check_repo_id(v).is_ok()).then(|| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources() {
        assert_eq!(
            Source::parse("HF://org/m").unwrap(),
            Source::Hub {
                repo: "org/m".into()
            }
        );
        assert_eq!(
            Source::parse("huggingface://org/m").unwrap(),
            Source::Hub {
                repo: "org/m".into()
            }
        );
        assert_eq!(
            Source::parse("org/m").unwrap(),
            Source::Hub {
                repo: "org/m".into()
            }
        );
        assert_eq!(
            Source::parse("oci://r.example:5000/a/b:v1").unwrap(),
            Source::Oci {
                reference: "r.example:5000/a/b:v1".into()
            }
        );
        assert_eq!(
            Source::parse("local://x/y").unwrap(),
            Source::Local { path: "x/y".into() }
        );
        assert!(Source::parse("s3://bucket/x").is_err());
        assert!(Source::parse("../etc").is_err());
        assert!(Source::parse("a/b/c").is_err());
    }

    #[test]
    fn dataset_ids() {
        assert_eq!(
            hub_dataset_id("mit-han-lab/pile-val-backup").as_deref(),
            Some("mit-han-lab/pile-val-backup")
        );
        assert_eq!(
            hub_dataset_id("hf://datasets/org/ds").as_deref(),
            Some("org/ds")
        );
        assert_eq!(hub_dataset_id("/cache/calib.jsonl"), None);
        assert_eq!(hub_dataset_id("calib/data.jsonl.zst"), None);
        assert_eq!(hub_dataset_id(""), None);
        assert_eq!(hub_dataset_id("../x/y"), None);
    }

    #[test]
    fn patterns() {
        let f = PatternFilter::new("*.safetensors, *.json,tokenizer/", "*.bin").unwrap();
        assert!(f.matches("model-00001-of-00002.safetensors"));
        assert!(f.matches("config.json"));
        assert!(f.matches("tokenizer/vocab.txt"));
        assert!(!f.matches("pytorch_model.bin"));
        assert!(!f.matches("README.md"));
        let all = PatternFilter::new("", "").unwrap();
        assert!(all.matches("anything"));
        assert!(PatternFilter::new("[", "").is_err());
    }
}
