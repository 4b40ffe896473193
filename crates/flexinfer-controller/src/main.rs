//! `flexinfer-controller`: the controller-manager binary: JSON logs, leader election,
//! `/metrics` on :8080, `/healthz` and `/readyz` on :8081, and the ModelCache and Model controllers.
#![deny(clippy::arithmetic_side_effects)]

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use flexinfer_api::contract::env;
use flexinfer_controller::http::{self, Health};
use flexinfer_controller::leader::{Leadership, LeaseConfig};
use flexinfer_controller::metrics::Metrics;
use flexinfer_controller::model;
use flexinfer_controller::modelcache::{self, Config};
use flexinfer_controller::supervise::{supervise, Shutdown};
use flexinfer_runtime::process;
use tokio::task::JoinHandle;
use tracing::info;

#[derive(Parser, Debug)]
#[command(
    name = "flexinfer-controller", // not-contract: the binary name
    version,
    about = "FlexInfer controller-manager"
)]
struct Args {
    /// Address of the Prometheus `/metrics` endpoint.
    #[arg(long, env = env::controller::METRICS_ADDR, default_value = "0.0.0.0:8080")]
    metrics_bind_address: SocketAddr,
    /// Address of `/healthz` and `/readyz`.
    #[arg(long, env = env::controller::HEALTH_ADDR, default_value = "0.0.0.0:8081")]
    health_probe_bind_address: SocketAddr,
    /// Run leader election on a Lease so only one replica reconciles.
    #[arg(long, env = env::controller::LEADER_ELECT, default_value = "true", action = clap::ArgAction::Set)]
    leader_elect: String,
    /// Namespace of the Lease (default: the watch namespace, else `flexinfer-system`).
    #[arg(long, env = env::controller::NAMESPACE)]
    namespace: Option<String>,
    /// Only watch these namespaces, comma-separated (default: all).
    #[arg(long, env = env::controller::WATCH_NAMESPACE)]
    watch_namespace: Option<String>,
    /// Lease name.
    #[arg(long, env = env::controller::LEASE_NAME, default_value = "flexinfer-controller-leader")]
    lease_name: String,
    /// Lease duration in seconds.
    #[arg(long, env = env::controller::LEASE_DURATION_SECONDS, default_value_t = 15)]
    lease_duration_seconds: u64,
    /// Plain-text logs instead of JSON (for humans at a terminal).
    #[arg(long)]
    log_text: bool,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    process::init_logging(args.log_text);
    process::exit_on_error("controller", run(args).await);
}

async fn run(args: Args) -> anyhow::Result<()> {
    // Settings are read once, strictly and before anything else: a value that does not parse stops
    // the start-up here, naming the variable.
    let watch =
        flexinfer_api::namespaces::parse_list(args.watch_namespace.as_deref().unwrap_or(""))
            .map_err(|e| anyhow::anyhow!("{}: {e}", env::controller::WATCH_NAMESPACE))?;
    // One controller per watched namespace (a namespace-scoped install may not list cluster-wide).
    let scopes: Vec<Option<String>> = if watch.is_empty() {
        vec![None]
    } else {
        watch.iter().cloned().map(Some).collect()
    };
    let config = Config::from_env()?;
    let model_opts = model::Options::from_env()?;
    let leader_elect =
        flexinfer_api::contract::parse_bool(&args.leader_elect).ok_or_else(|| {
            anyhow::anyhow!(
                "{}={:?}: expected true or false",
                env::controller::LEADER_ELECT,
                args.leader_elect
            )
        })?;
    let metrics = Metrics::new()?;
    let health = Health::default();
    let client = flexinfer_controller::kube_client::counting_client(&metrics).await?;
    // Both listeners are bound before anything else runs: a port in use stops the start.
    let metrics_listener =
        http::bind(args.metrics_bind_address, env::controller::METRICS_ADDR).await?;
    let health_listener =
        http::bind(args.health_probe_bind_address, env::controller::HEALTH_ADDR).await?;
    tokio::spawn(http::serve(
        metrics_listener,
        Some(metrics.clone()),
        health.clone(),
    ));
    tokio::spawn(http::serve(health_listener, None, health.clone()));
    // Ready once the API server answers; a standby replica is ready too (it serves probes).
    client.apiserver_version().await?;
    health.set_ready(true);

    info!(worker_image = ?config.worker_image, drift_grace_s = config.drift_grace.as_secs(), retry_base_s = config.retry_base.as_secs_f64(), watch_namespaces = ?watch, "starting");
    let leadership = elect(&args, leader_elect, watch.first(), &client).await?;
    // Each controller is its own supervised task: one that stops (an error, a panic, a stream
    // that ends) is restarted while the other keeps running, and /healthz reports it meanwhile.
    let shutdown = Shutdown::default();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            process::shutdown_signal().await;
            info!("shutdown signal received");
            shutdown.trigger();
        }
    });
    let (caches, models) = spawn_controllers(
        &scopes, &client, &metrics, &health, &shutdown, config, model_opts,
    );
    match &leadership {
        Some(l) => {
            tokio::select! {
                () = shutdown.wait() => {}
                // Lost, or not renewed within the renew deadline: stop reconciling at once.
                _ = l.keep() => { anyhow::bail!("leadership lost; exiting so a fresh process re-elects"); }
            }
        }
        None => shutdown.wait().await,
    }
    // The supervisors give their controllers a grace period to finish in-flight reconciles.
    let _ = caches.await;
    let _ = models.await;
    if let Some(l) = &leadership {
        l.release().await;
    }
    info!("shut down");
    Ok(())
}

/// Acquire the Lease when leader election is on (`None` when it is off).
async fn elect(
    args: &Args,
    leader_elect: bool,
    first_watched: Option<&String>,
    client: &kube::Client,
) -> anyhow::Result<Option<Leadership>> {
    if !leader_elect {
        return Ok(None);
    }
    let identity = std::env::var(flexinfer_api::contract::env::controller::POD_NAME)
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "flexinfer-controller".into()); // not-contract: lease identity
    let identity = format!("{identity}-{}", std::process::id());
    let namespace = args
        .namespace
        .clone()
        .or_else(|| first_watched.cloned())
        .unwrap_or_else(|| "flexinfer-system".into());
    let cfg = LeaseConfig::new(
        namespace,
        args.lease_name.clone(),
        identity,
        Duration::from_secs(args.lease_duration_seconds.max(1)),
    );
    Ok(Some(Leadership::acquire(client.clone(), cfg).await?))
}

/// The ModelCache and Model controllers, each under its own supervisor task; each runs one
/// kube-runtime Controller per watched namespace (`None`: all namespaces).
fn spawn_controllers(
    scopes: &[Option<String>],
    client: &kube::Client,
    metrics: &Metrics,
    health: &Health,
    shutdown: &Shutdown,
    config: Config,
    model_opts: model::Options,
) -> (JoinHandle<()>, JoinHandle<()>) {
    let caches = tokio::spawn(supervise("modelcache", health.clone(), shutdown.clone(), {
        let (client, metrics, scopes) = (client.clone(), metrics.clone(), scopes.to_vec());
        // The ModelCache controller stops on SIGTERM/SIGINT by itself (`shutdown_on_signal`).
        move || {
            let runs = scopes.iter().map(|ns| {
                Box::pin(modelcache::run(
                    client.clone(),
                    metrics.clone(),
                    config.clone(),
                    ns.clone(),
                ))
            });
            let all = futures::future::select_all(runs);
            async move { all.await.0 }
        }
    }));
    let models = tokio::spawn(supervise("model", health.clone(), shutdown.clone(), {
        let (client, metrics, shutdown, scopes) = (
            client.clone(),
            metrics.clone(),
            shutdown.clone(),
            scopes.to_vec(),
        );
        move || {
            let runs = scopes.iter().map(|ns| {
                let shutdown = shutdown.clone();
                let opts = model::Options {
                    namespace: ns.clone(),
                    ..model_opts.clone()
                };
                Box::pin(model::run_until(
                    client.clone(),
                    metrics.clone(),
                    opts,
                    async move { shutdown.wait().await },
                ))
            });
            let all = futures::future::select_all(runs);
            async move { all.await.0 }
        }
    }));
    (caches, models)
}
