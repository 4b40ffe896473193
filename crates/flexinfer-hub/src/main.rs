//! `flexinfer-hub`: a local Hugging Face Hub-compatible file server over a directory of repositories
//! (the end-to-end tests, `make demo`, the transfer benchmark).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flexinfer_hub::{repo, HubState, RepoId, Repos};

const USAGE: &str = "\
usage: flexinfer-hub --root ROOT [--host 127.0.0.1] [--port 0] [--ready-file FILE]
       flexinfer-hub DIR REPO PORT     (one model repository REPO with the files under DIR, on 127.0.0.1)

Serves, read-only, every repository under ROOT as the Hugging Face Hub's HTTP API does:
  ROOT/models/<org>/<name>/...     model repositories    (/api/models/<repo>/..., /<repo>/resolve/<rev>/<path>)
  ROOT/datasets/<org>/<name>/...   dataset repositories  (/api/datasets/<repo>/..., /datasets/<repo>/resolve/<rev>/<path>)
Each repository's commit id is derived from its files; every revision name resolves to its current files.
Prints \"ready <port>\" once listening (and writes the port to --ready-file, atomically).";

struct Args {
    repos: Box<dyn FnOnce() -> std::io::Result<Repos>>,
    host: String,
    port: u16,
    ready_file: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Args, String> {
    if args.len() == 3 && !args[0].starts_with('-') {
        let (dir, repo) = (PathBuf::from(&args[0]), args[1].clone());
        let port = args[2]
            .parse()
            .map_err(|_| format!("invalid PORT {:?}", args[2]))?;
        return Ok(Args {
            repos: Box::new(move || {
                let files = repo::describe(&dir)?;
                Ok(Repos::from([(
                    RepoId::model(&repo),
                    flexinfer_hub::Repo::current(files),
                )]))
            }),
            host: "127.0.0.1".into(),
            port,
            ready_file: None,
        });
    }
    let (mut root, mut host, mut port, mut ready_file) = (None, "127.0.0.1".to_string(), 0, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if a.starts_with("--") => (f, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "--root" => root = Some(PathBuf::from(value()?)),
            "--host" => host = value()?,
            "--port" => {
                let v = value()?;
                port = v.parse().map_err(|_| format!("invalid --port {v:?}"))?;
            }
            "--ready-file" => ready_file = Some(PathBuf::from(value()?)),
            _ => return Err(format!("unexpected argument {a:?}")),
        }
    }
    let root = root.ok_or("--root is required")?;
    Ok(Args {
        repos: Box::new(move || repo::load_root(&root)),
        host,
        port,
        ready_file,
    })
}

/// Write the port to `path` through a temporary file, so a reader never sees a partial one.
fn write_ready(path: &Path, port: u16) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, port.to_string())?;
    std::fs::rename(&tmp, path)
}

async fn run(args: Args) -> Result<(), String> {
    let repos = (args.repos)().map_err(|e| format!("reading the repositories: {e}"))?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| format!("listening on {}:{}: {e}", args.host, args.port))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("listening: {e}"))?
        .port();
    if let Some(f) = &args.ready_file {
        write_ready(f, port).map_err(|e| format!("writing {}: {e}", f.display()))?;
    }
    println!("ready {port}");
    flexinfer_hub::serve(listener, Arc::new(HubState::new(repos))).await;
    Ok(())
}

#[tokio::main]
async fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&argv) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("flexinfer-hub: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args).await {
        eprintln!("flexinfer-hub: {e}");
        std::process::exit(1);
    }
}
