//! `flexinfer-standin`: OpenAI-compatible stand-in for vLLM on clusters without it (see
//! `flexinfer_standin`). In the stand-in image it is also installed as `python3`, so the Model
//! controller's `python3 -m vllm.entrypoints.openai.api_server …` command starts it unchanged.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = match flexinfer_standin::parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "flexinfer-standin: {}",
                flexinfer_contract::error::chain(&e)
            );
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("flexinfer-standin: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(flexinfer_standin::serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "flexinfer-standin: {}",
                flexinfer_contract::error::chain(&e)
            );
            ExitCode::from(2)
        }
    }
}
