//! A local Hugging Face Hub-compatible file server. It serves repositories read-only through the
//! hub's HTTP API ([`http`]): what flexinfer-worker lists and downloads, and what
//! `huggingface_hub` (`snapshot_download`, `hf_hub_download`, hf_transfer) needs.
//!
//! Two users:
//! - the `flexinfer-hub` binary serves every repository under a directory ([`repo::load_root`]):
//!   the end-to-end tests and `make demo` (`scripts/e2e/setup.sh`) and the transfer benchmark
//!   (`scripts/bench/transfer`);
//! - flexinfer-worker's transfer tests start a [`HubServer`] in-process over given revisions of a
//!   repository and inject faults ([`Faults`]: dropped connections, corrupted bytes, HTTP 500s, a
//!   throttle, a required token) and read back the file requests it saw ([`HubState::requests`]).

pub mod http;
pub mod repo;
pub mod state;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use flexinfer_runtime::server::{forever, Limits};
use tokio::net::TcpListener;

pub use repo::{describe, Kind, Repo, RepoId, Repos, Revision, ServedFile};
pub use state::{Faults, HubState, Seen};

/// Connections open at once (parallel range readers open many).
const MAX_CONNECTIONS: usize = 4096;

/// Serve `state` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, state: Arc<HubState>) {
    let limits = Limits {
        max_connections: MAX_CONNECTIONS,
        header_read_timeout: None,
        nodelay: false,
    };
    flexinfer_runtime::server::serve(listener, limits, forever(), move || {
        let st = state.clone();
        hyper::service::service_fn(move |req| http::handle(st.clone(), req))
    })
    .await;
}

/// The repositories of `repo`'s revisions, `(name, files)`: a model repository, except names
/// `dataset:<id>@<rev>`, which are revision `rev` of dataset `id`. An unknown revision name is not
/// found.
pub fn repos_from_revisions(repo: &str, revisions: Vec<(&str, Vec<ServedFile>)>) -> Repos {
    let mut repos = Repos::new();
    for (name, files) in revisions {
        let (id, rev) = match name
            .strip_prefix("dataset:")
            .and_then(|d| d.rsplit_once('@'))
        {
            Some((ds, rev)) => (RepoId::dataset(ds), rev),
            None => (RepoId::model(repo), name),
        };
        repos
            .entry(id)
            .or_default()
            .revisions
            .insert(rev.to_string(), Revision::new(files));
    }
    repos
}

/// A hub on a loopback port, served by its own runtime (for synchronous tests); it stops when
/// dropped.
pub struct HubServer {
    pub addr: SocketAddr,
    pub state: Arc<HubState>,
    _rt: tokio::runtime::Runtime,
}

impl HubServer {
    /// Serve `revisions` of `repo` ([`repos_from_revisions`]).
    pub fn start(repo: &str, revisions: Vec<(&str, Vec<ServedFile>)>) -> io::Result<HubServer> {
        HubServer::serve(repos_from_revisions(repo, revisions))
    }

    /// Serve `repos` on `127.0.0.1`, on a free port.
    pub fn serve(repos: Repos) -> io::Result<HubServer> {
        let state = Arc::new(HubState::new(repos));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        rt.spawn(serve(listener, state.clone()));
        Ok(HubServer {
            addr,
            state,
            _rt: rt,
        })
    }

    /// `http://127.0.0.1:<port>`, the `HF_ENDPOINT` of this hub.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}
