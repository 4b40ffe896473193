//! `flexinfer-worker publish`: push a model directory as a CNCF ModelPack artifact
//! (docs/user/download-and-publish.md).
//!
//! Layout (model-spec v0.0.7): artifactType `application/vnd.cncf.model.manifest.v1+json`, the model
//! config (`application/vnd.cncf.model.config.v1+json`: format, architecture, precision,
//! quantization, parameter count, derived from the files by [`modelpack`]), one raw layer per file
//! (`application/vnd.cncf.model.{weight,weight.config,doc,code,dataset}.v1.raw`, the file's bytes as
//! they are) annotated with its relative path both as `org.cncf.model.filepath` and as
//! `org.opencontainers.image.title` (so `oras pull` reproduces the tree). Files are hashed, then
//! streamed; blobs the registry already has are skipped, so a re-run after an interruption only
//! uploads what is missing, and the same tree always gives the same manifest digest.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use flexinfer_contract::{self as contract, env, events, oci_artifact, TerminationSuccess};
use futures::{StreamExt, TryStreamExt};

use crate::common::{self, Events, ExitKind, PublishError, WorkerError};
use crate::download::{bytes_progress, spawn_progress_ticker};
use crate::oci::{self, Descriptor, Manifest, Reference, Registry};

pub mod modelpack;

/// Flags of `flexinfer-worker publish` (each also read from its env variable; flags win).
#[derive(Debug, Clone, clap::Args)]
pub struct PublishArgs {
    /// Directory to push (`MODEL_DIR`; `OUT_DIR` when `MODEL_DIR` is unset).
    #[arg(long, env = env::MODEL_DIR)]
    pub model_dir: Option<PathBuf>,
    #[arg(long, env = env::OUT_DIR)]
    pub out_dir: Option<PathBuf>,
    /// `registry/repository[:tag]` (an `oci://` prefix is accepted).
    #[arg(long, env = env::OCI_REF)]
    pub oci_ref: String,
    /// `overwrite`, `timestamp` or `digest-suffix`.
    #[arg(long, env = env::OCI_TAG_POLICY, default_value = "overwrite")]
    pub tag_policy: String,
    /// Comma-separated extra tags for the same manifest.
    #[arg(long, env = env::OCI_ADDITIONAL_TAGS, default_value = "")]
    pub additional_tags: String,
    #[command(flatten)]
    pub registry: crate::oci::RegistryArgs,
    /// Blobs uploaded in parallel.
    #[arg(long, env = env::transfer::PUBLISH_CONCURRENCY, default_value_t = 4)]
    pub concurrency: usize,
    #[arg(long, env = env::transfer::PROGRESS_INTERVAL_SECONDS, default_value_t = 5.0)]
    pub progress_interval: f64,
    #[arg(long, env = env::SCRIPT_VERSION)]
    pub script_version: Option<String>,
}

/// The tag policy of `spec.publish.tagPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagPolicy {
    /// Push `<tag>` (moving it if it exists).
    Overwrite,
    /// Push `<tag>-<UTC YYYYMMDDhhmmss>`.
    Timestamp,
    /// Push `<tag>-<first 12 hex of the manifest digest>`.
    DigestSuffix,
}

impl TagPolicy {
    pub fn parse(s: &str) -> Result<TagPolicy, WorkerError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | oci_artifact::TAG_POLICY_OVERWRITE => Ok(TagPolicy::Overwrite),
            oci_artifact::TAG_POLICY_TIMESTAMP => Ok(TagPolicy::Timestamp),
            oci_artifact::TAG_POLICY_DIGEST_SUFFIX => Ok(TagPolicy::DigestSuffix),
            _ => Err(PublishError::TagPolicy {
                policy: s.to_string(),
            }
            .into()),
        }
    }

    /// The primary tag for `base` under this policy.
    pub fn tag(self, base: &str, manifest_digest: &str, now: jiff::Timestamp) -> String {
        match self {
            TagPolicy::Overwrite => base.to_string(),
            TagPolicy::Timestamp => format!("{base}-{}", now.strftime("%Y%m%d%H%M%S")),
            TagPolicy::DigestSuffix => {
                let hex = manifest_digest.trim_start_matches("sha256:");
                format!("{base}-{}", &hex[..hex.len().min(12)])
            }
        }
    }
}

/// A file to push.
#[derive(Debug, Clone)]
struct LocalFile {
    rel: String,
    path: PathBuf,
    size: u64,
    digest: String,
}

pub fn run(args: PublishArgs) -> i32 {
    let events = Arc::new(Events::new(contract::JobPhase::Publish.status_name()));
    let result =
        crate::download::runtime().and_then(|rt| rt.block_on(run_async(&args, events.clone())));
    // Never let the password reach the termination message.
    let result = result.map_err(|e| match &args.registry.oci_password {
        Some(p) if p.len() >= 4 => e.map_message(|m| m.replace(p, "<redacted>")),
        _ => e,
    });
    common::finish(&events, result)
}

/// What `publish` was asked to push, checked before anything is read or sent.
struct Target {
    dir: PathBuf,
    reference: Reference,
    policy: TagPolicy,
    base_tag: String,
    extra: Vec<String>,
}

async fn run_async(
    args: &PublishArgs,
    events: Arc<Events>,
) -> Result<TerminationSuccess, WorkerError> {
    common::check_version(args.script_version.as_deref())?;
    let Target {
        dir,
        reference,
        policy,
        base_tag,
        extra,
    } = check_target(args)?;
    events.emit(
        events::START,
        &serde_json::json!({"phase": events.phase(), "ociRef": reference.to_string(), "dir": dir.display().to_string()}),
    );
    let listed = list_dir(&dir).await?;
    let total: u64 = listed.iter().map(|(_, _, s)| *s).sum();
    let hashed = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let ticker = spawn_ticker(
        events.clone(),
        hashed.clone(),
        sent.clone(),
        total,
        args.progress_interval,
    );

    // Reach the registry first: a TLS or auth problem must not wait for hashing.
    let reg = connect_registry(args, &reference).await?;
    // 1. Digests (the registry must be asked by digest before anything is uploaded).
    let files = hash_files(listed, &hashed, args.concurrency).await?;
    // What is pushed must be what the pipeline recorded: the layer digests are the files' sha256, so
    // they are checked against `.save-complete` / `.source-integrity.json` before any upload.
    check_records(&dir, &files)?;
    // The ModelPack config, from the files (a file that cannot be read fails here, before any upload).
    let described = {
        let (dir, files) = (dir.clone(), files.clone());
        tokio::task::spawn_blocking(move || modelpack::describe(&dir, &files)).await??
    };
    let config = described.config_blob(files.iter().map(|f| f.digest.clone()).collect())?;

    // 2. Blobs: the files, then the config that lists them.
    let skipped = push_blobs(&reg, &files, &sent, args.concurrency).await?;
    let config_digest = reg.push_bytes(&config).await.map_err(WorkerError::Oci)?;

    // 3. Manifest and tags.
    let manifest = build_manifest(&files, &config_digest, config.len(), &described);
    let (digest, tags) = push_manifest(&reg, &manifest, policy, &base_tag, extra).await?;
    ticker.abort();
    let published = Published {
        file_count: files.len(),
        total,
        skipped,
        digest,
        tags,
    };
    Ok(published.report(&events, &reference, started))
}

/// Connects to the reference's registry with the configured credentials and asks it for a blob, so
/// that TLS, a refused connection or missing credentials fail before any file is hashed.
async fn connect_registry(
    args: &PublishArgs,
    reference: &Reference,
) -> Result<Arc<Registry>, WorkerError> {
    let creds = args
        .registry
        .credentials(&reference.registry)
        .map_err(WorkerError::Oci)?;
    let reg = Arc::new(
        Registry::connect(reference, creds, args.registry.insecure)
            .await
            .map_err(WorkerError::Oci)?,
    );
    reg.blob_exists(&oci::sha256_digest(oci::EMPTY_CONFIG))
        .await
        .map_err(WorkerError::Oci)?;
    Ok(reg)
}

/// What a finished publish pushed.
struct Published {
    file_count: usize,
    /// Bytes of all files.
    total: u64,
    /// Blobs the registry already had.
    skipped: u64,
    /// Manifest digest.
    digest: String,
    tags: Vec<String>,
}

impl Published {
    /// Reports the publish (final progress, a summary log line) and returns its result.
    fn report(
        self,
        events: &Events,
        reference: &Reference,
        started: Instant,
    ) -> TerminationSuccess {
        let Published {
            file_count,
            total,
            skipped,
            digest,
            tags,
        } = self;
        let secs = started.elapsed().as_secs_f64().max(1e-3);
        events.progress(bytes_progress(
            total,
            total,
            total as f64 / secs,
            "published",
        ));
        events.log(&format!(
            "published {} file(s), {total} bytes ({} already in the registry) as {}/{}@{digest} tags {:?} in {secs:.1}s",
            file_count,
            skipped,
            reference.registry,
            reference.repository,
            tags
        ));
        TerminationSuccess {
            kind: contract::JobPhase::Publish.as_str().to_string(),
            size_bytes: Some(total),
            file_count: Some(file_count as u64),
            output_dir: Some(format!("{}/{}", reference.registry, reference.repository)),
            digest: Some(digest),
            tags,
            ..Default::default()
        }
    }
}

/// Checks the flags (in this order: the directory is named, the reference is a tag not a digest,
/// the tag policy, the extra tags, the concurrency, the directory exists) and returns what to push.
/// Every refusal is a bad-input error; nothing is read or sent yet.
fn check_target(args: &PublishArgs) -> Result<Target, WorkerError> {
    let dir = args
        .model_dir
        .clone()
        .or_else(|| args.out_dir.clone())
        .ok_or(PublishError::NoModelDir)?;
    let reference = Reference::parse(&args.oci_ref).map_err(WorkerError::Oci)?;
    if reference.digest.is_some() {
        return Err(PublishError::DigestReference {
            reference: args.oci_ref.clone(),
        }
        .into());
    }
    let policy = TagPolicy::parse(&args.tag_policy)?;
    let base_tag = reference
        .tag
        .clone()
        .unwrap_or_else(|| "latest".to_string());
    let extra: Vec<String> = args
        .additional_tags
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(String::from)
        .collect();
    for t in &extra {
        oci::check_tag(t).map_err(WorkerError::wrap(ExitKind::BadInput))?;
    }
    if args.concurrency == 0 {
        return Err(PublishError::NoConcurrency.into());
    }
    if !dir.is_dir() {
        return Err(PublishError::NotADirectory { dir }.into());
    }
    Ok(Target {
        dir,
        reference,
        policy,
        base_tag,
        extra,
    })
}

/// Lists the files under `dir` (relative path, path, size); an empty directory is bad input.
async fn list_dir(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>, WorkerError> {
    let dir2 = dir.to_path_buf();
    let listed = tokio::task::spawn_blocking(move || list_files(&dir2))
        .await?
        .map_err(WorkerError::io(
            ExitKind::Failure,
            format!("reading {}", dir.display()),
        ))?;
    if listed.is_empty() {
        return Err(PublishError::NoFiles {
            dir: dir.to_path_buf(),
        }
        .into());
    }
    Ok(listed)
}

/// Hashes the listed files (at most 4 at a time, counting the bytes into `hashed`) and returns
/// them sorted by relative path, so the manifest does not depend on which hash finished first.
async fn hash_files(
    listed: Vec<(String, PathBuf, u64)>,
    hashed: &Arc<AtomicU64>,
    concurrency: usize,
) -> Result<Vec<LocalFile>, WorkerError> {
    let mut files: Vec<LocalFile> =
        futures::stream::iter(listed.into_iter().map(|(rel, path, size)| {
            let hashed = hashed.clone();
            async move {
                let p = path.clone();
                let sha = tokio::task::spawn_blocking(move || flexinfer_fsutil::sha256_file(&p))
                    .await?
                    .map_err(WorkerError::io(
                        ExitKind::Failure,
                        format!("hashing {}", path.display()),
                    ))?;
                hashed.fetch_add(size, Ordering::Relaxed);
                Ok::<_, WorkerError>(LocalFile {
                    rel,
                    path,
                    size,
                    digest: format!("sha256:{sha}"),
                })
            }
        }))
        .buffer_unordered(concurrency.min(4))
        .try_collect()
        .await?;
    files.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(files)
}

/// Uploads every blob the registry does not already have (counting bytes into `sent`, skipped
/// blobs included) and returns how many were skipped.
async fn push_blobs(
    reg: &Arc<Registry>,
    files: &[LocalFile],
    sent: &Arc<AtomicU64>,
    concurrency: usize,
) -> Result<u64, WorkerError> {
    let skipped = Arc::new(AtomicU64::new(0));
    futures::stream::iter(files.iter().map(|f| {
        let (reg, sent, skipped) = (reg.clone(), sent.clone(), skipped.clone());
        async move {
            if reg.blob_exists(&f.digest).await? {
                sent.fetch_add(f.size, Ordering::Relaxed);
                skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            reg.push_file(&f.path, &f.digest, f.size, sent).await
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await
    .map_err(WorkerError::Oci)?;
    Ok(skipped.load(Ordering::Relaxed))
}

/// Encodes the manifest and puts it under the policy's primary tag, then each extra tag not
/// already pushed; a registry that stores a different digest than the one computed here fails the
/// publish. Returns the manifest digest and the tags pushed.
async fn push_manifest(
    reg: &Registry,
    manifest: &Manifest,
    policy: TagPolicy,
    base_tag: &str,
    extra: Vec<String>,
) -> Result<(String, Vec<String>), WorkerError> {
    let body = serde_json::to_vec(manifest).map_err(WorkerError::json(
        ExitKind::Failure,
        "encoding the OCI manifest",
    ))?;
    let digest = oci::sha256_digest(&body);
    let mut tags = vec![policy.tag(base_tag, &digest, jiff::Timestamp::now())];
    for t in extra {
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    for t in &tags {
        oci::check_tag(t).map_err(WorkerError::wrap(ExitKind::BadInput))?;
        let got = reg.put_manifest(t, &body).await.map_err(WorkerError::Oci)?;
        if got != digest {
            return Err(PublishError::TagDigest {
                tag: t.clone(),
                got,
                expected: digest,
            }
            .into());
        }
    }
    Ok((digest, tags))
}

/// Every file that the directory's `.save-complete` (quantized artifacts) or `.source-integrity.json`
/// (downloads) records is among the files to publish with the recorded size and sha256. A mismatch
/// (a changed or truncated shard) refuses the push with exit 2: publishing cannot repair it; the
/// artifact has to be made again.
fn check_records(dir: &Path, files: &[LocalFile]) -> Result<(), WorkerError> {
    let mut recorded: Vec<(&'static str, String, u64, String)> = Vec::new();
    let read = |name: &str| -> Result<Option<Vec<u8>>, WorkerError> {
        let p = dir.join(name);
        match std::fs::symlink_metadata(&p) {
            Err(_) => Ok(None),
            Ok(_) => flexinfer_fsutil::read_regular(&p, flexinfer_fsutil::limits::CONFIG_JSON)
                .map(Some)
                .map_err(WorkerError::io(
                    ExitKind::BadInput,
                    format!("cannot read {}", p.display()),
                )),
        }
    };
    if let Some(b) = read(contract::files::SAVE_COMPLETE)? {
        let sc: contract::SaveComplete = serde_json::from_slice(&b).map_err(WorkerError::json(
            ExitKind::BadInput,
            format!(
                "{} in {} is not valid",
                contract::files::SAVE_COMPLETE,
                dir.display()
            ),
        ))?;
        for sh in sc.shards {
            recorded.push((
                contract::files::SAVE_COMPLETE,
                sh.name,
                sh.size_bytes,
                sh.sha256,
            ));
        }
    }
    if let Some(b) = read(contract::files::SOURCE_INTEGRITY)? {
        let si: contract::SourceIntegrity =
            serde_json::from_slice(&b).map_err(WorkerError::json(
                ExitKind::BadInput,
                format!(
                    "{} in {} is not valid",
                    contract::files::SOURCE_INTEGRITY,
                    dir.display()
                ),
            ))?;
        for f in si.files {
            recorded.push((contract::files::SOURCE_INTEGRITY, f.name, f.size, f.sha256));
        }
    }
    for (record, name, size, sha) in recorded {
        let want = format!("sha256:{sha}");
        match files.iter().find(|f| f.rel == name) {
            Some(f) if f.size == size && f.digest == want => {}
            Some(f) => {
                return Err(PublishError::RecordMismatch {
                    dir: dir.to_path_buf(),
                    name,
                    record,
                    size,
                    recorded: want,
                    disk_size: f.size,
                    disk_digest: f.digest.clone(),
                }
                .into())
            }
            None => {
                return Err(PublishError::RecordedMissing {
                    dir: dir.to_path_buf(),
                    name,
                    record,
                }
                .into())
            }
        }
    }
    Ok(())
}

/// The ModelPack manifest: the config descriptor, one raw layer per file (sorted by path) with its
/// media type and path annotations, and the annotations [`modelpack::describe`] found.
fn build_manifest(
    files: &[LocalFile],
    config_digest: &str,
    config_size: usize,
    described: &modelpack::Described,
) -> Manifest {
    Manifest {
        schema_version: 2,
        media_type: Some(oci_artifact::MANIFEST_MEDIA_TYPE.to_string()),
        artifact_type: Some(oci_artifact::MODELPACK_ARTIFACT_TYPE.to_string()),
        config: Descriptor {
            media_type: oci_artifact::MODELPACK_CONFIG_MEDIA_TYPE.to_string(),
            digest: config_digest.to_string(),
            size: config_size as u64,
            annotations: Default::default(),
        },
        layers: files
            .iter()
            .map(|f| {
                let (media_type, guessed) = modelpack::layer_media_type(&f.rel);
                let mut annotations: std::collections::BTreeMap<String, String> = [
                    (oci_artifact::TITLE_ANNOTATION, f.rel.clone()),
                    (oci_artifact::MODELPACK_FILEPATH_ANNOTATION, f.rel.clone()),
                    (
                        oci_artifact::MODELPACK_FILE_METADATA_ANNOTATION,
                        modelpack::file_metadata(&f.rel, f.size),
                    ),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
                if guessed {
                    annotations.insert(
                        oci_artifact::MODELPACK_MEDIATYPE_UNTESTED_ANNOTATION.to_string(),
                        "true".to_string(),
                    );
                }
                Descriptor {
                    media_type: media_type.to_string(),
                    digest: f.digest.clone(),
                    size: f.size,
                    annotations,
                }
            })
            .collect(),
        annotations: described.annotations.clone(),
    }
}

/// Files to publish: every regular file, skipping partial downloads, resume caches, hub datasets
/// and nested derived artifacts (published on their own).
fn list_files(dir: &Path) -> std::io::Result<Vec<(String, PathBuf, u64)>> {
    Ok(crate::common::model_files(dir)?
        .into_iter()
        .map(|f| (f.rel, f.path, f.size))
        .collect())
}

fn spawn_ticker(
    events: Arc<Events>,
    hashed: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
    total: u64,
    interval: f64,
) -> tokio::task::JoinHandle<()> {
    spawn_progress_ticker(events, interval, move |secs| {
        let (h, s) = (hashed.load(Ordering::Relaxed), sent.load(Ordering::Relaxed));
        // Hashing and uploading each count for half of the work.
        let mut p = bytes_progress(
            h.saturating_add(s) / 2,
            total,
            s as f64 / secs,
            if s == 0 { "hashing" } else { "uploading" },
        );
        p.done = Some(s as f64);
        p
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_policies() {
        let now: jiff::Timestamp = "2026-03-04T05:06:07Z".parse().unwrap();
        let d = format!("sha256:{}", "0123456789abcdef".repeat(4));
        assert_eq!(
            TagPolicy::parse("overwrite").unwrap().tag("v1", &d, now),
            "v1"
        );
        assert_eq!(
            TagPolicy::parse("timestamp").unwrap().tag("v1", &d, now),
            "v1-20260304050607"
        );
        assert_eq!(
            TagPolicy::parse("Digest-Suffix")
                .unwrap()
                .tag("v1", &d, now),
            "v1-0123456789ab"
        );
        assert!(TagPolicy::parse("latest").is_err());
    }

    #[test]
    fn manifest_is_modelpack_deterministic_and_titled() {
        let f = |rel: &str| LocalFile {
            rel: rel.into(),
            path: rel.into(),
            size: 3,
            digest: oci::sha256_digest(rel.as_bytes()),
        };
        let described = modelpack::Described {
            annotations: [(oci_artifact::BITS_ANNOTATION.to_string(), "4".to_string())].into(),
            ..Default::default()
        };
        let config = described.config_blob(vec![]).unwrap();
        let m = build_manifest(
            &[f("a/b.json"), f("c.safetensors"), f("weird.bin2")],
            &oci::sha256_digest(&config),
            config.len(),
            &described,
        );
        let j = serde_json::to_value(&m).unwrap();
        assert_eq!(j["artifactType"], oci_artifact::MODELPACK_ARTIFACT_TYPE);
        assert_eq!(
            j["config"]["mediaType"],
            oci_artifact::MODELPACK_CONFIG_MEDIA_TYPE
        );
        assert_eq!(j["config"]["size"], config.len());
        let l0 = &j["layers"][0];
        assert_eq!(l0["mediaType"], oci_artifact::MODELPACK_WEIGHT_CONFIG_RAW);
        assert_eq!(
            l0["annotations"][oci_artifact::TITLE_ANNOTATION],
            "a/b.json"
        );
        assert_eq!(
            l0["annotations"][oci_artifact::MODELPACK_FILEPATH_ANNOTATION],
            "a/b.json"
        );
        assert_eq!(
            j["layers"][1]["mediaType"],
            oci_artifact::MODELPACK_WEIGHT_RAW
        );
        assert!(l0["annotations"]
            .get(oci_artifact::MODELPACK_MEDIATYPE_UNTESTED_ANNOTATION)
            .is_none());
        assert_eq!(
            j["layers"][2]["annotations"][oci_artifact::MODELPACK_MEDIATYPE_UNTESTED_ANNOTATION],
            "true"
        );
        assert_eq!(j["annotations"][oci_artifact::BITS_ANNOTATION], "4");
        assert_eq!(
            serde_json::to_vec(&m).unwrap(),
            serde_json::to_vec(&m.clone()).unwrap()
        );
        // What download reads back: the same paths, in order.
        let back = crate::oci::artifact::file_layers("r", &m).unwrap();
        assert_eq!(
            back.iter().map(|l| l.path.as_str()).collect::<Vec<_>>(),
            ["a/b.json", "c.safetensors", "weird.bin2"]
        );
    }
}
