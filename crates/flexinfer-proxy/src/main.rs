//! `flexinfer-proxy`: the OpenAI-compatible gateway binary (JSON logs, `/healthz` + `/readyz`).
#![deny(clippy::arithmetic_side_effects)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use flexinfer_api::contract::env;
use flexinfer_api::duration::parse_duration;
use flexinfer_proxy::auth::ApiKeys;
use flexinfer_proxy::{limits, server, Cluster, Config, Proxy};
use flexinfer_runtime::process;
use tracing::info;

#[derive(Parser, Debug)]
#[command(
    name = "flexinfer-proxy", // not-contract: the binary name
    version,
    about = "FlexInfer's OpenAI-compatible gateway"
)]
struct Args {
    /// Address of the OpenAI-compatible front.
    #[arg(long, env = env::proxy::LISTEN_ADDR, default_value = "0.0.0.0:8000")]
    listen: SocketAddr,
    /// Address of `/healthz` and `/readyz`.
    #[arg(long, env = env::proxy::HEALTH_ADDR, default_value = "0.0.0.0:8081")]
    health: SocketAddr,
    /// Only route to Models of these namespaces, comma-separated (default: all namespaces).
    #[arg(long, env = env::proxy::WATCH_NAMESPACE)]
    watch_namespace: Option<String>,
    /// Accepted bearer tokens (comma/newline separated). Prefer the file.
    #[arg(long, env = env::proxy::API_KEYS, hide_env_values = true)]
    api_keys: Option<String>,
    /// File with accepted bearer tokens, one per line (a mounted Secret key).
    #[arg(long, env = env::proxy::API_KEYS_FILE)]
    api_keys_file: Option<std::path::PathBuf>,
    /// Largest request body accepted, in bytes (default: the body budget / 8, at most 8 MiB).
    #[arg(long, env = env::proxy::MAX_BODY_BYTES)]
    max_body_bytes: Option<usize>,
    /// Bytes all request bodies in memory may hold together (default: half the container's
    /// memory limit, 128 MiB without one).
    #[arg(long, env = env::proxy::BODY_MEMORY_BYTES)]
    body_memory_bytes: Option<usize>,
    /// Client connections open at once on the OpenAI port.
    #[arg(long, env = env::proxy::MAX_CONNECTIONS, default_value_t = 2048)]
    max_connections: usize,
    /// Requests admitted at once, all Models together.
    #[arg(long, env = env::proxy::MAX_REQUESTS, default_value_t = 1024)]
    max_requests: usize,
    /// Requests that may wait for admission (429 beyond).
    #[arg(long, env = env::proxy::MAX_QUEUED_REQUESTS, default_value_t = 1024)]
    max_queued_requests: usize,
    /// Requests admitted at once for one Model, cold-start waiters included (429 beyond).
    #[arg(long, env = env::proxy::MAX_REQUESTS_PER_MODEL, default_value_t = 512)]
    max_requests_per_model: usize,
    /// Requests released at once to a Model that just became ready.
    #[arg(long, env = env::proxy::COLD_START_RELEASE, default_value_t = 16)]
    cold_start_release: usize,
    /// Longest wait for a request head, on every port.
    #[arg(long, env = env::proxy::HEADER_READ_TIMEOUT, default_value = "30s")]
    header_read_timeout: String,
    /// Longest time to receive a request body (408 beyond).
    #[arg(long, env = env::proxy::BODY_READ_TIMEOUT, default_value = "30s")]
    body_read_timeout: String,
    /// Longest wait for a backend's response headers (504 beyond).
    #[arg(long, env = env::proxy::BACKEND_HEADER_TIMEOUT, default_value = "10m")]
    backend_header_timeout: String,
    /// Keepalive interval of Models that set no `serverless.keepaliveInterval`.
    #[arg(long, env = env::proxy::KEEPALIVE_INTERVAL, default_value = "30s")]
    keepalive_interval: String,
    /// Plain-text logs instead of JSON.
    #[arg(long)]
    log_text: bool,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    process::init_logging(args.log_text);
    process::exit_on_error("proxy", run(args).await);
}

/// A duration setting, or an error naming it.
fn duration(name: &str, value: &str) -> anyhow::Result<Duration> {
    let d = parse_duration(value)
        .with_context(|| format!("{name}: {value:?} is not a duration such as 30s"))?;
    anyhow::ensure!(!d.is_zero(), "{name}: must be more than 0s");
    Ok(d)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let keepalive = parse_duration(&args.keepalive_interval).with_context(|| {
        format!(
            "{}: {:?} is not a duration such as 30s",
            env::proxy::KEEPALIVE_INTERVAL,
            args.keepalive_interval
        )
    })?;
    let memory_limit = limits::container_memory_limit();
    let body_memory_bytes = args
        .body_memory_bytes
        .unwrap_or_else(|| limits::default_body_memory_bytes(memory_limit));
    let max_body_bytes = args
        .max_body_bytes
        .unwrap_or_else(|| limits::default_max_body_bytes(body_memory_bytes));
    limits::check(max_body_bytes, body_memory_bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} / {}: {e}",
            env::proxy::MAX_BODY_BYTES,
            env::proxy::BODY_MEMORY_BYTES
        )
    })?;
    for (name, n) in [
        (env::proxy::MAX_CONNECTIONS, args.max_connections),
        (env::proxy::MAX_REQUESTS, args.max_requests),
        (
            env::proxy::MAX_REQUESTS_PER_MODEL,
            args.max_requests_per_model,
        ),
        (env::proxy::COLD_START_RELEASE, args.cold_start_release),
    ] {
        anyhow::ensure!(n > 0, "{name}: must be at least 1");
    }
    let header_read_timeout = duration(env::proxy::HEADER_READ_TIMEOUT, &args.header_read_timeout)?;
    let body_read_timeout = duration(env::proxy::BODY_READ_TIMEOUT, &args.body_read_timeout)?;
    let backend_header_timeout = duration(
        env::proxy::BACKEND_HEADER_TIMEOUT,
        &args.backend_header_timeout,
    )?;
    info!(
        memory_limit = memory_limit.unwrap_or(0),
        body_memory_bytes, max_body_bytes, "request body limits"
    );
    let mut keys = ApiKeys::parse(args.api_keys.as_deref().unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("{}: {e}", env::proxy::API_KEYS))?;
    if let Some(f) = &args.api_keys_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("read API keys from {}", f.display()))?;
        let from_file = ApiKeys::parse(&text)
            .map_err(|e| anyhow::anyhow!("{} ({}): {e}", env::proxy::API_KEYS_FILE, f.display()))?;
        anyhow::ensure!(
            from_file.is_enabled(),
            "{} holds no API key; remove {} to run without auth",
            f.display(),
            env::proxy::API_KEYS_FILE
        );
        keys = keys.extend(from_file);
    }
    info!(auth = keys.is_enabled(), keys = keys.len(), listen = %args.listen, "starting");
    let client = kube::Client::try_default()
        .await
        .context("build a Kubernetes client")?;
    let namespaces =
        flexinfer_api::namespaces::parse_list(args.watch_namespace.as_deref().unwrap_or(""))
            .map_err(|e| anyhow::anyhow!("{}: {e}", env::proxy::WATCH_NAMESPACE))?;
    let cluster = Cluster::start(client, &namespaces);
    let config = Config {
        api_keys: keys,
        max_body_bytes,
        body_memory_bytes,
        max_connections: args.max_connections,
        max_requests: args.max_requests,
        max_queued_requests: args.max_queued_requests,
        max_requests_per_model: args.max_requests_per_model,
        cold_start_release: args.cold_start_release,
        header_read_timeout,
        body_read_timeout,
        backend_header_timeout,
        keepalive_interval: keepalive,
        ..Config::default()
    };
    let proxy = Proxy::new(cluster.clone(), config).context("register metrics")?;
    let health = server::bind(args.health).await.context("bind health")?;
    tokio::spawn(server::serve_health(health, proxy.clone()));
    tokio::spawn(
        proxy
            .activity
            .clone()
            .run(cluster.clone(), keepalive, Duration::from_secs(1)),
    );
    let listener = server::bind_backlog(args.listen, args.max_connections)
        .with_context(|| format!("bind listener {}", args.listen))?;
    server::serve(listener, proxy, process::shutdown_signal()).await?;
    info!("stopped");
    Ok(())
}
