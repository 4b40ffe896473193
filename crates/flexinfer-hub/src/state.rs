//! A hub's mutable state: what it serves, the faults it injects and the file requests it saw.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::repo::Repos;

/// Fault injection knobs (all may be changed while the server runs). Files are named as
/// [`HubState::requests`] names them.
#[derive(Default)]
pub struct Faults {
    /// file → drop the connection once, after this absolute byte offset.
    pub drop_once_at: HashMap<String, u64>,
    /// Files whose content is served with one byte (the middle one) flipped.
    pub corrupt: HashSet<String>,
    /// file → answer the next N requests with HTTP 500.
    pub fail_500: HashMap<String, u32>,
    /// Bytes per second per response (None: unthrottled).
    pub throttle: Option<u64>,
    /// Bearer token every request must carry.
    pub token: Option<String>,
}

/// One `resolve` request seen by the server.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The revision as the request named it; `dataset:<id>@<rev>` for a dataset.
    pub revision: String,
    /// The first byte of the requested range, when the request had one.
    pub range_start: Option<u64>,
    pub status: u16,
}

/// What a running hub serves and what it saw.
pub struct HubState {
    pub repos: Mutex<Repos>,
    pub faults: Mutex<Faults>,
    /// file → the requests for it, in order.
    pub seen: Mutex<BTreeMap<String, Vec<Seen>>>,
    /// Tree listings served.
    pub listings: Mutex<u32>,
}

/// The guarded value, also after a panic elsewhere while it was held (the state stays usable).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HubState {
    pub fn new(repos: Repos) -> HubState {
        HubState {
            repos: Mutex::new(repos),
            faults: Mutex::new(Faults::default()),
            seen: Mutex::new(BTreeMap::new()),
            listings: Mutex::new(0),
        }
    }

    /// The requests for one file: a model file by its path in the repository
    /// (`config.json`), a dataset file as `datasets/<id>/<path>`.
    pub fn requests(&self, file: &str) -> Vec<Seen> {
        lock(&self.seen).get(file).cloned().unwrap_or_default()
    }

    pub fn total_file_requests(&self) -> usize {
        lock(&self.seen).values().map(Vec::len).sum()
    }

    pub fn reset_counts(&self) {
        lock(&self.seen).clear();
        *lock(&self.listings) = 0;
    }

    pub(crate) fn record(&self, file: &str, seen: Seen) {
        lock(&self.seen)
            .entry(file.to_string())
            .or_default()
            .push(seen);
    }
}
