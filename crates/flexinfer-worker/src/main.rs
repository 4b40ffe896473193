//! `flexinfer-worker <download|abliterate|quantize|publish>`: runs one pipeline phase inside a Job.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "flexinfer-worker", version, about = "FlexInfer pipeline worker")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the worker contract version.
    Version,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Version => {
            println!("{}", flexinfer_api::contract::SCRIPT_VERSION);
            ExitCode::SUCCESS
        }
    }
}
