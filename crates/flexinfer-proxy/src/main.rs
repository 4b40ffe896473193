//! `flexinfer-proxy`: the OpenAI-compatible gateway binary (JSON logs, `/healthz` + `/readyz`).
#![deny(clippy::arithmetic_side_effects)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use flexinfer_api::contract::env;
use flexinfer_api::duration::parse_duration;
use flexinfer_api::process;
use flexinfer_proxy::auth::ApiKeys;
use flexinfer_proxy::{server, Cluster, Config, Proxy};
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
    /// Largest request body accepted, in bytes.
    #[arg(long, env = env::proxy::MAX_BODY_BYTES, default_value_t = 8 << 20)]
    max_body_bytes: usize,
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

async fn run(args: Args) -> anyhow::Result<()> {
    let keepalive = parse_duration(&args.keepalive_interval).with_context(|| {
        format!(
            "{}: {:?} is not a duration such as 30s",
            env::proxy::KEEPALIVE_INTERVAL,
            args.keepalive_interval
        )
    })?;
    let mut keys = ApiKeys::parse(args.api_keys.as_deref().unwrap_or_default());
    if let Some(f) = &args.api_keys_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("read API keys from {}", f.display()))?;
        let from_file = ApiKeys::parse(&text);
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
        max_body_bytes: args.max_body_bytes,
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
    let listener = server::bind(args.listen).await.context("bind listener")?;
    server::serve(listener, proxy, process::shutdown_signal()).await?;
    info!("stopped");
    Ok(())
}
