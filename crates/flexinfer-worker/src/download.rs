//! `flexinfer-worker download`: fetch a model or dataset into `MODEL_DIR` (docs/dev/architecture.md, "The controller–worker contract" and "The artifact lifecycle").
//!
//! Sources: Hugging Face Hub (`HF://org/m`, `huggingface://org/m`, `org/m`), `oci://` artifacts
//! (the layout `publish` writes) and `local://` paths under `FLEXINFER_LOCAL_SOURCE_ROOT`.
//! Every file is verified (LFS sha256, git blob sha1, or OCI digest) before it is renamed into
//! place; `.source-integrity.json` and `.download_complete` are written last.

pub mod fetch;
mod generation;
mod local;
mod reuse;
mod source;
mod state;

pub use source::{hub_dataset_id, PatternFilter, Source};

pub use crate::common::IN_PROGRESS_FILE;
pub use crate::flags::{parse_bool_arg, NotABool};
pub use crate::http::build_http_client;
pub use crate::remote::RemoteFile;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flexinfer_contract::{self as contract, env, events, files, ProgressEvent, TerminationSuccess};

use crate::common::{self, DownloadError, Events, ExitKind, WorkerError};
use crate::hf::{self, RepoType};
use crate::oci;
use fetch::{FetchCtx, FetchError};
use generation::fetch_all;

/// How a download or node copy transfers files (shared by `download` and `node-copy`).
#[derive(clap::Args, Debug, Clone)]
pub struct TransferArgs {
    /// Files fetched in parallel.
    #[arg(long, env = env::transfer::DOWNLOAD_CONCURRENCY, default_value_t = 4)]
    pub concurrency: usize,
    /// Consecutive failed attempts per file (without progress) before giving up.
    #[arg(long, env = env::transfer::DOWNLOAD_RETRIES, default_value_t = 8)]
    pub retries: u32,
    /// Seconds between progress events.
    #[arg(long, env = env::transfer::PROGRESS_INTERVAL_SECONDS, default_value_t = 5.0)]
    pub progress_interval: f64,
}

impl TransferArgs {
    /// Bad input when no file could ever be fetched.
    pub fn check(&self) -> Result<(), WorkerError> {
        if self.concurrency == 0 {
            return Err(DownloadError::NoConcurrency.into());
        }
        Ok(())
    }
}

/// Flags of `flexinfer-worker download` (each also read from its env variable; flags win).
#[derive(Clone, clap::Args)] // Debug (the token redacted): download/fetch.rs
pub struct DownloadArgs {
    /// `HF://org/model`, `huggingface://org/model`, `org/model`, `oci://registry/repo:tag`, `local://path`.
    #[arg(long, env = env::SOURCE)]
    pub source: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long, env = env::REVISION, default_value = "main")]
    pub revision: String,
    /// `model` or `dataset`.
    #[arg(long, env = env::REPO_TYPE, default_value = "model")]
    pub repo_type: String,
    /// Comma-separated globs; only matching files are fetched (empty: all).
    #[arg(long, env = env::ALLOW_PATTERNS, default_value = "")]
    pub allow_patterns: String,
    /// Comma-separated globs of files to skip.
    #[arg(long, env = env::IGNORE_PATTERNS, default_value = "")]
    pub ignore_patterns: String,
    /// The cache's model directory (`<modelPath>`): hub datasets go to its `.datasets/`, and the model's
    /// files too unless `--out-dir` is given.
    #[arg(long, env = env::MODEL_DIR)]
    pub model_dir: PathBuf,
    /// Directory of this run's files: a new generation `<modelPath>/source.<generation>` (the
    /// controller sets it). Files an earlier complete download under `--model-dir` already holds with
    /// the same digest are hard-linked and re-verified instead of fetched again.
    #[arg(long, env = env::OUT_DIR)]
    pub out_dir: Option<PathBuf>,
    /// Hub endpoint.
    #[arg(long, env = env::HF_ENDPOINT, default_value = hf::DEFAULT_ENDPOINT)]
    pub hf_endpoint: String,
    /// Hub token (prefer the env variable; it is never logged).
    #[arg(long, env = env::HF_TOKEN, hide_env_values = true)]
    pub hf_token: Option<String>,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Calibration dataset: a hub dataset id is fetched into `MODEL_DIR/.datasets/<id>` after the
    /// model; a local file path is left alone.
    #[arg(long, env = env::DATASET)]
    pub dataset: Option<String>,
    /// Abliteration refusal prompt set: a hub dataset id is fetched like `--dataset`.
    #[arg(long, env = env::REFUSAL_DATASET)]
    pub refusal_dataset: Option<String>,
    /// Abliteration harmless prompt set: a hub dataset id is fetched like `--dataset`.
    #[arg(long, env = env::HARMLESS_DATASET)]
    pub harmless_dataset: Option<String>,
    /// Root that `local://` sources must stay inside.
    #[arg(long, env = contract::env::controller::LOCAL_SOURCE_ROOT)]
    pub local_source_root: Option<PathBuf>,
    /// Registry flags of `oci://` sources.
    #[command(flatten)]
    pub registry: oci::RegistryArgs,
    /// Contract version expected by the controller.
    #[arg(long, env = env::SCRIPT_VERSION)]
    pub script_version: Option<String>,
}

/// Where the files come from.
/// Run the subcommand; returns the process exit code.
pub fn run(args: DownloadArgs) -> i32 {
    let events = Arc::new(Events::new(contract::JobPhase::Download.status_name()));
    let result = runtime().and_then(|rt| rt.block_on(run_async(&args, events.clone())));
    common::finish(&events, result.map_err(|e| redact(e, &args)))
}

/// Never let a secret reach the termination message.
fn redact(e: WorkerError, args: &DownloadArgs) -> WorkerError {
    let secrets: Vec<&str> = [
        args.hf_token.as_deref(),
        args.registry.oci_password.as_deref(),
    ]
    .into_iter()
    .flatten()
    .filter(|s| s.len() >= 4)
    .collect();
    if secrets.is_empty() {
        return e;
    }
    e.map_message(|m| secrets.iter().fold(m, |m, s| m.replace(s, "<redacted>")))
}

/// A multi-threaded runtime for the transfer subcommands.
pub fn runtime() -> Result<tokio::runtime::Runtime, WorkerError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(WorkerError::io(
            ExitKind::Failure,
            "cannot start the async runtime",
        ))
}

/// HTTP client: rustls with the ring provider, system roots; `insecure` disables verification.
pub fn http_client(insecure: bool) -> Result<reqwest::Client, WorkerError> {
    build_http_client(insecure).map_err(WorkerError::HttpClient)
}

/// A transfer failure: exit 2 when retrying cannot help, else 1 ([`WorkerError::kind`]).
pub fn fetch_error(e: FetchError) -> WorkerError {
    WorkerError::Fetch(e)
}

async fn run_async(
    args: &DownloadArgs,
    events: Arc<Events>,
) -> Result<TerminationSuccess, WorkerError> {
    common::check_version(args.script_version.as_deref())?;
    let source = Source::parse(&args.source)?;
    let filter = PatternFilter::new(&args.allow_patterns, &args.ignore_patterns)?;
    args.transfer.check()?;
    events.emit(
        events::START,
        &serde_json::json!({
            "phase": events.phase(),
            "source": args.source,
            "revision": args.revision,
            "modelDir": args.model_dir.display().to_string(),
            "outDir": args.out_dir.as_ref().map(|d| d.display().to_string()),
        }),
    );
    let out = args
        .out_dir
        .clone()
        .unwrap_or_else(|| args.model_dir.clone());
    for d in [&args.model_dir, &out] {
        std::fs::create_dir_all(d).map_err(WorkerError::io(
            ExitKind::Failure,
            format!("cannot create {}", d.display()),
        ))?;
    }
    // One writer per directory (a replaced Job's pod may still be running): the model directory (its
    // datasets) and this run's generation.
    let _lock = crate::generations::lock_output(&args.model_dir, &events)?;
    let _out_lock = (out != args.model_dir)
        .then(|| crate::generations::lock_output(&out, &events))
        .transpose()?;
    let model = fetch_source(args, source, &filter, &out, &events).await?;
    let mut fetched = Vec::new();
    for id in [&args.dataset, &args.refusal_dataset, &args.harmless_dataset]
        .into_iter()
        .filter_map(|d| d.as_deref().and_then(hub_dataset_id))
    {
        if !fetched.contains(&id) {
            fetch_dataset(args, &events, &id).await?;
            fetched.push(id);
        }
    }
    if out != args.model_dir {
        crate::generations::collect_garbage(
            &out,
            std::env::var(env::KEEP_DIRS).ok().as_deref(),
            &events,
        );
    }
    Ok(model)
}

/// The model's files from its source (hub, registry or a local directory) into the generation `out`.
async fn fetch_source(
    args: &DownloadArgs,
    source: Source,
    filter: &PatternFilter,
    out: &Path,
    events: &Arc<Events>,
) -> Result<TerminationSuccess, WorkerError> {
    match source {
        Source::Hub { repo } => {
            let kind = RepoType::parse(&args.repo_type).ok_or_else(|| DownloadError::RepoType {
                repo_type: args.repo_type.clone(),
            })?;
            let (files, ctx) = hub_files(args, kind, &repo, &args.revision, filter).await?;
            let canonical = format!("hf://{repo}");
            fetch_all(args, out, events, &ctx, &canonical, &args.revision, files).await
        }
        Source::Oci { reference } => {
            let reference = oci::Reference::parse(&reference).map_err(WorkerError::Oci)?;
            fetch_oci(args, &reference, Some(filter), out, events)
                .await
                .map(|f| f.done)
        }
        Source::Local { path } => local::run(args, out, events, &path).await,
    }
}

/// What [`fetch_oci`] fetched.
pub struct OciFetch {
    /// The manifest digest the reference resolved to.
    pub digest: String,
    /// The artifact's files as its manifest lists them (path, size, sha256).
    pub files: Vec<RemoteFile>,
    pub done: TerminationSuccess,
}

/// The files of the OCI artifact `reference` into `out`, each verified against its layer digest.
/// `filter` selects them and refuses files the pipeline writes itself (a download). Without one, the
/// whole published tree is taken, the pipeline's records (`.save-complete`, the quality summary)
/// included, except the download's own markers, which this fetch writes anew (a node copy).
pub async fn fetch_oci(
    args: &DownloadArgs,
    reference: &oci::Reference,
    filter: Option<&PatternFilter>,
    out: &Path,
    events: &Arc<Events>,
) -> Result<OciFetch, WorkerError> {
    let creds = args
        .registry
        .credentials(&reference.registry)
        .map_err(WorkerError::Oci)?;
    let reg = oci::Registry::connect(reference, creds, args.registry.insecure)
        .await
        .map_err(WorkerError::Oci)?;
    let (digest, listed) = reg
        .artifact_files(reference)
        .await
        .map_err(WorkerError::Oci)?;
    let wanted = match filter {
        Some(filter) => select(listed.clone(), filter)?,
        None => listed
            .iter()
            .filter(|f| !is_marker(&f.path))
            .cloned()
            .collect(),
    };
    if wanted.is_empty() {
        return Err(DownloadError::NoOciFiles {
            reference: reference.to_string(),
        }
        .into());
    }
    let ctx = new_ctx(
        reg.client().clone(),
        reg.authorization().await,
        args.transfer.retries,
    );
    let done = fetch_all(
        args,
        out,
        events,
        &ctx,
        &format!("oci://{reference}"),
        &digest,
        wanted,
    )
    .await?;
    Ok(OciFetch {
        digest,
        files: listed,
        done,
    })
}

/// Fetch the calibration dataset into `MODEL_DIR/.datasets/<id>` (own markers, own resume).
async fn fetch_dataset(
    args: &DownloadArgs,
    events: &Arc<Events>,
    id: &str,
) -> Result<(), WorkerError> {
    let dir = args.model_dir.join(contract::DATASETS_SUBDIR).join(id);
    std::fs::create_dir_all(&dir).map_err(WorkerError::io(
        ExitKind::Failure,
        format!("cannot create {}", dir.display()),
    ))?;
    events.log(&format!("fetching dataset {id} into {}", dir.display()));
    let all = PatternFilter::new("", "")?;
    let (files, ctx) = hub_files(args, RepoType::Dataset, id, "main", &all).await?;
    fetch_all(
        args,
        &dir,
        events,
        &ctx,
        &format!("hf://datasets/{id}"),
        "main",
        files,
    )
    .await?;
    Ok(())
}

/// The files of a hub repository at `revision` that `filter` selects, and the fetch context (the
/// hub token goes only to the configured endpoint).
async fn hub_files(
    args: &DownloadArgs,
    kind: RepoType,
    repo: &str,
    revision: &str,
    filter: &PatternFilter,
) -> Result<(Vec<RemoteFile>, FetchCtx), WorkerError> {
    let client = http_client(false)?;
    let token = args.hf_token.as_deref().filter(|t| !t.is_empty());
    let listed = hf::list_files(&client, &args.hf_endpoint, token, kind, repo, revision)
        .await
        .map_err(fetch_error)?;
    let files = select(listed, filter)?;
    Ok((
        files,
        new_ctx(client, hub_auth(args, token), args.transfer.retries),
    ))
}

/// The hub token, bound to the configured endpoint.
fn hub_auth(args: &DownloadArgs, token: Option<&str>) -> Option<crate::http::ScopedAuth> {
    token.and_then(|t| crate::http::ScopedAuth::new(format!("Bearer {t}"), &args.hf_endpoint))
}

fn new_ctx(
    client: reqwest::Client,
    authorization: Option<crate::http::ScopedAuth>,
    retries: u32,
) -> FetchCtx {
    FetchCtx {
        client,
        authorization,
        done: Arc::new(AtomicU64::new(0)),
        max_retries: retries,
        received: Arc::new(AtomicU64::new(0)),
    }
}

fn select(listed: Vec<RemoteFile>, filter: &PatternFilter) -> Result<Vec<RemoteFile>, WorkerError> {
    let n = listed.len();
    let files: Vec<RemoteFile> = listed
        .into_iter()
        .filter(|f| filter.matches(&f.path))
        .collect();
    // A source must not pre-seed what the pipeline writes (completion markers, a passed quality gate,
    // a layer cache, an output directory): that would skip quantization and its gate.
    if let Some((f, what)) = files
        .iter()
        .find_map(|f| files::is_reserved_path(&f.path).map(|w| (f, w)))
    {
        return Err(DownloadError::Reserved {
            path: f.path.clone(),
            what,
        }
        .into());
    }
    if files.is_empty() {
        return Err(DownloadError::NoneMatch { listed: n }.into());
    }
    Ok(files)
}

/// Our own marker files are never taken from a source.
fn is_marker(p: &str) -> bool {
    [files::DOWNLOAD_COMPLETE, files::SOURCE_INTEGRITY].contains(&p)
}

/// Weight files counted in `weightBytes`.
pub fn is_weight_file(name: &str) -> bool {
    [
        ".safetensors",
        ".bin",
        ".gguf",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".onnx",
    ]
    .iter()
    .any(|ext| name.ends_with(ext))
}

/// A `progress` event in bytes with rate and ETA in `detail`.
pub fn bytes_progress(done: u64, total: u64, rate: f64, what: &str) -> ProgressEvent {
    let percent = if total == 0 {
        100.0
    } else {
        done as f64 * 100.0 / total as f64
    };
    let eta = if rate > 0.0 && done < total {
        format!(", ETA {:.0}s", total.saturating_sub(done) as f64 / rate)
    } else {
        String::new()
    };
    ProgressEvent {
        percent: (percent * 100.0).round() / 100.0,
        detail: Some(format!(
            "{what}: {:.1}/{:.1} MiB at {:.1} MiB/s{eta}",
            done as f64 / 1048576.0,
            total as f64 / 1048576.0,
            rate / 1048576.0
        )),
        unit: Some("bytes".into()),
        done: Some(done as f64),
        total: Some(total as f64),
        ..Default::default()
    }
}

/// Every `interval` seconds (clamped to 0.05–3600), emit the `progress` event that `progress`
/// builds from the seconds elapsed since the start. Shared by `download` and `publish`.
pub fn spawn_progress_ticker(
    events: Arc<Events>,
    interval: f64,
    progress: impl Fn(f64) -> ProgressEvent + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let interval = Duration::from_secs_f64(interval.clamp(0.05, 3600.0));
    tokio::spawn(async move {
        let start = Instant::now();
        loop {
            tokio::time::sleep(interval).await;
            let secs = start.elapsed().as_secs_f64().max(1e-3);
            events.progress(progress(secs));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_detail() {
        let p = bytes_progress(50 << 20, 100 << 20, (10 << 20) as f64, "downloading");
        assert_eq!(p.percent, 50.0);
        assert_eq!(p.unit.as_deref(), Some("bytes"));
        let d = p.detail.unwrap();
        assert!(d.contains("50.0/100.0 MiB at 10.0 MiB/s, ETA 5s"), "{d}");
    }
}
