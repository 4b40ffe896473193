//! `flexinfer-worker node-copy`: the copy of a `storageStrategy: NodeLocal` cache on one node.
//!
//! `fill` pulls the published artifact, pinned by its manifest digest, into `NODE_COPY_DIR`
//! (a host directory of the node): every file is verified against its layer digest, the weights
//! again against the pipeline's own record (`.save-complete`: every shard it names is in the artifact
//! with the same size and sha256), and only then is the staging directory renamed to
//! `<dir>/<digest hex>`. A copy that exists under that name is complete; nothing half-written is
//! ever served. `clean` removes the cache's copies on the node except the one `NODE_COPY_KEEP` names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flexinfer_contract::{self as contract, env, files, source, TerminationSuccess};

use crate::common::{self, Events, ExitKind, NodeCopyError, WorkerError};
use crate::download::{self, DownloadArgs, RemoteFile};
use crate::oci;

/// The kind written in the termination message and the events.
pub const KIND: &str = flexinfer_contract::phase::NODE_COPY_SUBCOMMAND;

/// `flexinfer-worker node-copy`.
#[derive(Clone, Debug, clap::Args)]
pub struct NodeCopyArgs {
    #[command(subcommand)]
    pub cmd: NodeCopyCmd,
}

#[derive(Clone, Debug, clap::Subcommand)]
pub enum NodeCopyCmd {
    /// Pull the published artifact (`SOURCE=oci://registry/repo@sha256:…`) into `NODE_COPY_DIR`.
    #[command(name = flexinfer_contract::labels::NODE_COPY_FILL)]
    Fill(FillArgs),
    /// Remove the copies in `NODE_COPY_DIR` except `NODE_COPY_KEEP`'s.
    #[command(name = flexinfer_contract::labels::NODE_COPY_CLEAN)]
    Clean(CleanArgs),
}

/// Flags of `node-copy fill` (each also read from its env variable).
#[derive(Clone, Debug, clap::Args)]
pub struct FillArgs {
    /// `oci://registry/repository@sha256:<hex>`: a copy is always of one digest.
    #[arg(long, env = env::SOURCE)]
    pub source: String,
    /// The cache's directory on the node.
    #[arg(long, env = env::NODE_COPY_DIR)]
    pub dir: PathBuf,
    #[command(flatten)]
    pub registry: oci::RegistryArgs,
    #[command(flatten)]
    pub transfer: download::TransferArgs,
    /// Contract version expected by the controller.
    #[arg(long, env = env::SCRIPT_VERSION)]
    pub script_version: Option<String>,
}

/// Flags of `node-copy clean`.
#[derive(Clone, Debug, clap::Args)]
pub struct CleanArgs {
    /// The cache's directory on the node.
    #[arg(long, env = env::NODE_COPY_DIR)]
    pub dir: PathBuf,
    /// The digest whose copy stays (`sha256:<hex>`); empty: remove every copy and the directory.
    #[arg(long, env = env::NODE_COPY_KEEP, default_value = "")]
    pub keep: String,
    /// Contract version expected by the controller.
    #[arg(long, env = env::SCRIPT_VERSION)]
    pub script_version: Option<String>,
}

/// Run the subcommand; returns the process exit code.
pub fn run(args: NodeCopyArgs) -> i32 {
    let events = Arc::new(Events::new(KIND));
    let result = match args.cmd {
        NodeCopyCmd::Fill(a) => {
            let password = a.registry.oci_password.clone();
            download::runtime()
                .and_then(|rt| rt.block_on(fill(&a, events.clone())))
                .map_err(|e| match password.filter(|p| p.len() >= 4) {
                    Some(p) => e.map_message(|m| m.replace(&p, "<redacted>")),
                    None => e,
                })
        }
        NodeCopyCmd::Clean(a) => clean(&a, &events),
    };
    common::finish(&events, result)
}

/// The hex of a `sha256:<64 hex>` digest, `None` for anything else.
pub fn digest_hex(digest: &str) -> Option<&str> {
    oci::is_sha256_digest(digest).then(|| &digest["sha256:".len()..])
}

fn staging(dir: &Path, hex: &str) -> PathBuf {
    dir.join(format!("{hex}{}", files::STAGING_SUFFIX))
}

async fn fill(a: &FillArgs, events: Arc<Events>) -> Result<TerminationSuccess, WorkerError> {
    common::check_version(a.script_version.as_deref())?;
    let raw = a.source.trim();
    let Some(rest) = source::strip_scheme(raw, source::OCI) else {
        return Err(NodeCopyError::NotOci { raw: raw.into() }.into());
    };
    let reference = oci::Reference::parse(rest).map_err(WorkerError::Oci)?;
    let Some(want) = reference.digest.clone() else {
        return Err(NodeCopyError::NoDigest { raw: raw.into() }.into());
    };
    let hex = digest_hex(&want)
        .ok_or_else(|| NodeCopyError::BadDigest {
            digest: want.clone(),
        })?
        .to_string();
    a.transfer.check()?;
    std::fs::create_dir_all(&a.dir).map_err(WorkerError::io(
        ExitKind::Failure,
        format!("cannot create {}", a.dir.display()),
    ))?;
    let dest = a.dir.join(&hex);
    if let Some(done) = existing_copy(&dest)? {
        events.log(&format!(
            "{} already holds the verified copy of {want}",
            dest.display()
        ));
        return Ok(done);
    }
    let stage = staging(&a.dir, &hex);
    // One writer per copy (a replaced Job's pod may still be running).
    let _lock = crate::generations::lock_output(&stage, &events)?;
    let dl = DownloadArgs {
        source: raw.to_string(),
        revision: want.clone(),
        repo_type: "model".into(),
        allow_patterns: String::new(),
        ignore_patterns: String::new(),
        model_dir: a.dir.clone(),
        out_dir: Some(stage.clone()),
        hf_endpoint: crate::hf::DEFAULT_ENDPOINT.into(),
        hf_token: None,
        transfer: a.transfer.clone(),
        dataset: None,
        refusal_dataset: None,
        harmless_dataset: None,
        local_source_root: None,
        registry: a.registry.clone(),
        script_version: a.script_version.clone(),
    };
    let fetched = download::fetch_oci(&dl, &reference, None, &stage, &events).await?;
    if fetched.digest != want {
        return Err(NodeCopyError::ManifestMismatch {
            served: fetched.digest.clone(),
            raw: raw.into(),
        }
        .into());
    }
    let shards = verify_save_complete(&stage, &fetched.files)?;
    events.log(&format!(
        "{} file(s) verified against their layer digests; {shards} weight shard(s) against {}",
        fetched.files.len(),
        files::SAVE_COMPLETE
    ));
    readable_by_all(&stage)?;
    std::fs::rename(&stage, &dest).map_err(WorkerError::io(
        ExitKind::Failure,
        format!("cannot rename {} to {}", stage.display(), dest.display()),
    ))?;
    Ok(success(
        &dest,
        fetched.done.size_bytes,
        fetched.done.file_count,
    ))
}

/// A copy renamed into place earlier: it was verified before the rename.
fn existing_copy(dest: &Path) -> Result<Option<TerminationSuccess>, WorkerError> {
    match std::fs::symlink_metadata(dest) {
        Err(_) => Ok(None),
        Ok(m) if m.is_dir() => {
            let (bytes, count) = tree_size(dest);
            Ok(Some(success(dest, Some(bytes), Some(count))))
        }
        Ok(_) => Err(NodeCopyError::NotADirectory {
            dest: dest.to_path_buf(),
        }
        .into()),
    }
}

/// The serving pods run as another user than this one: every file of the copy readable and every
/// directory searchable by all (`a+r`, `a+rx`), nothing writable by others.
fn readable_by_all(dir: &Path) -> Result<(), WorkerError> {
    use std::os::unix::fs::PermissionsExt;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let set = |p: &Path, mode: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(
                WorkerError::io(ExitKind::Failure, format!("cannot chmod {}", p.display())),
            )
        };
        set(&d, 0o755)?;
        let rd = std::fs::read_dir(&d).map_err(WorkerError::io(
            ExitKind::Failure,
            format!("cannot list {}", d.display()),
        ))?;
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => todo.push(e.path()),
                Ok(t) if t.is_file() => set(&e.path(), 0o644)?,
                _ => {}
            }
        }
    }
    Ok(())
}

fn tree_size(dir: &Path) -> (u64, u64) {
    let mut bytes = 0u64;
    let mut count = 0u64;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                todo.push(e.path());
            } else {
                bytes = m.len().saturating_add(bytes);
                count = count.saturating_add(1);
            }
        }
    }
    (bytes, count)
}

fn success(dest: &Path, bytes: Option<u64>, count: Option<u64>) -> TerminationSuccess {
    TerminationSuccess {
        kind: KIND.to_string(),
        size_bytes: bytes,
        file_count: count,
        output_dir: Some(dest.display().to_string()),
        ..Default::default()
    }
}

/// Every shard `.save-complete` names is a file of the artifact with the recorded size and sha256
/// (the fetch verified each file against its layer digest). Returns the number of shards; an artifact
/// without `.save-complete` (a published download or abliteration) is verified by its layers alone.
fn verify_save_complete(stage: &Path, listed: &[RemoteFile]) -> Result<usize, WorkerError> {
    let p = stage.join(files::SAVE_COMPLETE);
    if std::fs::symlink_metadata(&p).is_err() {
        return Ok(0);
    }
    let bytes = flexinfer_fsutil::read_regular(&p, flexinfer_fsutil::limits::CONFIG_JSON).map_err(
        WorkerError::io(ExitKind::BadInput, format!("cannot read {}", p.display())),
    )?;
    let sc: contract::SaveComplete = serde_json::from_slice(&bytes).map_err(WorkerError::json(
        ExitKind::BadInput,
        format!("{} of the artifact is not valid", files::SAVE_COMPLETE),
    ))?;
    let by_path: BTreeMap<&str, &RemoteFile> =
        listed.iter().map(|f| (f.path.as_str(), f)).collect();
    for sh in &sc.shards {
        let Some(f) = by_path.get(sh.name.as_str()) else {
            return Err(NodeCopyError::MissingShard {
                shard: sh.name.clone(),
            }
            .into());
        };
        let same_hash = f
            .sha256
            .as_deref()
            .is_some_and(|h| h.eq_ignore_ascii_case(sh.sha256.trim_start_matches("sha256:")));
        if f.size != sh.size_bytes || !same_hash {
            return Err(NodeCopyError::ShardMismatch {
                shard: sh.name.clone(),
                size: f.size,
                sha256: f.sha256.clone(),
                recorded_size: sh.size_bytes,
                recorded_sha256: sh.sha256.clone(),
            }
            .into());
        }
    }
    Ok(sc.shards.len())
}

fn clean(a: &CleanArgs, events: &Events) -> Result<TerminationSuccess, WorkerError> {
    common::check_version(a.script_version.as_deref())?;
    let keep = a.keep.trim();
    let keep_hex = if keep.is_empty() {
        None
    } else {
        Some(digest_hex(keep).ok_or_else(|| NodeCopyError::BadKeep { keep: keep.into() })?)
    };
    let rd = match std::fs::read_dir(&a.dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            events.log(&format!(
                "{} does not exist: nothing to remove",
                a.dir.display()
            ));
            return Ok(success(&a.dir, Some(0), Some(0)));
        }
        Err(e) => {
            return Err(WorkerError::io(
                ExitKind::Failure,
                format!("cannot list {}", a.dir.display()),
            )(e))
        }
    };
    let mut removed = 0u64;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if keep_hex.is_some_and(|k| name == k || name.starts_with(&format!("{k}."))) {
            continue;
        }
        let p = e.path();
        let res = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&p),
            _ => std::fs::remove_file(&p),
        };
        res.map_err(WorkerError::io(
            ExitKind::Failure,
            format!("cannot remove {}", p.display()),
        ))?;
        events.log(&format!("removed {}", p.display()));
        removed = removed.saturating_add(1);
    }
    if keep_hex.is_none() {
        std::fs::remove_dir(&a.dir).map_err(WorkerError::io(
            ExitKind::Failure,
            format!("cannot remove {}", a.dir.display()),
        ))?;
    }
    Ok(TerminationSuccess {
        kind: KIND.to_string(),
        file_count: Some(removed),
        output_dir: Some(a.dir.display().to_string()),
        ..Default::default()
    })
}
