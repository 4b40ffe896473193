//! `flexinfer` binary entry point.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = flexinfer_cli::Cli::parse();
    let code = match cli.run().await {
        Ok((out, code)) => {
            print!("{out}");
            code
        }
        Err(e) => {
            eprintln!("error: {}", flexinfer_api::contract::error::chain(&e));
            e.exit_code()
        }
    };
    std::process::exit(code);
}
