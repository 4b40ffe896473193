//! `flexinfer-worker <download|abliterate|quantize|publish>`: runs one pipeline phase inside a Job;
//! `version` and `devices` print what the worker is and what it finds.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flexinfer_contract::JobPhase;
use flexinfer_worker::common::exit_on_sigterm;

#[derive(Parser)]
#[command(
    name = "flexinfer-worker", // not-contract: the binary name
    version,
    about = "FlexInfer pipeline worker"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the worker contract version.
    Version,
    /// Print, as JSON, the GPU runtimes and vendor BLAS/solver libraries this worker finds here.
    Devices,
    /// Download a model or dataset (Hugging Face Hub, oci://, local://) into MODEL_DIR.
    Download(flexinfer_worker::download::DownloadArgs),
    /// Remove the refusal direction from MODEL_DIR into a new full-precision model (OUT_DIR).
    Abliterate(flexinfer_worker::abliterate::AbliterateArgs),
    /// GPTQ-quantize MODEL_DIR into OUT_DIR (vLLM-loadable `gptq` checkpoint).
    Quantize(flexinfer_worker::quantize::QuantizeArgs),
    /// Publish MODEL_DIR as an OCI artifact.
    Publish(flexinfer_worker::publish::PublishArgs),
    /// A NodeLocal cache's copy on this node: fill it from the published artifact, or clean it up.
    #[command(name = flexinfer_contract::phase::NODE_COPY_SUBCOMMAND)]
    NodeCopy(flexinfer_worker::node_copy::NodeCopyArgs),
}

fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Version => {
            println!("{}", flexinfer_contract::SCRIPT_VERSION);
            ExitCode::SUCCESS
        }
        Cmd::Devices => {
            println!("{}", flexinfer_worker::devices::report());
            ExitCode::SUCCESS
        }
        Cmd::Download(args) => phase(JobPhase::Download, || flexinfer_worker::download::run(args)),
        Cmd::Abliterate(args) => phase(JobPhase::Abliterate, || {
            flexinfer_worker::abliterate::run(args)
        }),
        Cmd::Quantize(args) => phase(JobPhase::Quantize, || flexinfer_worker::quantize::run(args)),
        Cmd::Publish(args) => phase(JobPhase::Publish, || flexinfer_worker::publish::run(args)),
        Cmd::NodeCopy(args) => {
            exit_on_sigterm(flexinfer_worker::node_copy::KIND);
            exit_code(flexinfer_worker::node_copy::run(args))
        }
    }
}

/// `tracing` output (the engine's and the transfers' warnings) as JSON lines on stderr; stdout
/// stays the event stream. `RUST_LOG` sets the level (default `warn`).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .try_init();
}

/// Runs one pipeline phase; SIGTERM ends it at once (`exit_on_sigterm`).
fn phase(p: JobPhase, run: impl FnOnce() -> i32) -> ExitCode {
    exit_on_sigterm(p.status_name());
    exit_code(run())
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
