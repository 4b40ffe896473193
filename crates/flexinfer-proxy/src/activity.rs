//! In-flight requests per Model, and the keepalive loop that turns them into
//! `status.lastActiveTime` writes: at request start, every keepalive interval while requests are
//! in flight (held for a cold start or streaming), and once more after the last one ends. The
//! writes themselves are throttled by [`crate::cluster::Cluster::touch`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::warn;

use crate::cluster::{Cluster, ModelKey};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Entry {
    in_flight: usize,
    /// Activity not yet covered by a write.
    dirty: bool,
    /// Bumped on every start and end, so a write only clears what it covered.
    generation: u64,
}

/// In-flight bookkeeping, shared by all requests.
#[derive(Clone, Default)]
pub struct Activity {
    inner: Arc<Mutex<HashMap<ModelKey, Entry>>>,
}

/// Held for the life of one request (including the response body); dropping it ends it.
pub struct InFlight {
    activity: Activity,
    key: ModelKey,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut m) = self.activity.inner.lock() {
            let e = m.entry(self.key.clone()).or_default();
            e.in_flight = e.in_flight.saturating_sub(1);
            e.dirty = true;
            e.generation = e.generation.wrapping_add(1);
        }
    }
}

impl Activity {
    /// A request for `key` starts.
    pub fn begin(&self, key: &ModelKey) -> InFlight {
        if let Ok(mut m) = self.inner.lock() {
            let e = m.entry(key.clone()).or_default();
            e.in_flight = e.in_flight.saturating_add(1);
            e.dirty = true;
            e.generation = e.generation.wrapping_add(1);
        }
        InFlight {
            activity: self.clone(),
            key: key.clone(),
        }
    }

    /// Requests in flight for `key`.
    pub fn in_flight(&self, key: &ModelKey) -> usize {
        self.inner
            .lock()
            .ok()
            .and_then(|m| m.get(key).map(|e| e.in_flight))
            .unwrap_or(0)
    }

    /// Models with requests in flight, and how many.
    pub fn snapshot(&self) -> Vec<(ModelKey, usize)> {
        self.inner
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, e)| e.in_flight > 0)
                    .map(|(k, e)| (k.clone(), e.in_flight))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Requests in flight over all Models.
    pub fn total_in_flight(&self) -> usize {
        self.inner
            .lock()
            .map(|m| m.values().map(|e| e.in_flight).sum())
            .unwrap_or(0)
    }

    /// Models that need a keepalive check now, with the generation seen. Forgets Models with
    /// nothing in flight and nothing unwritten.
    fn due(&self) -> Vec<(ModelKey, u64)> {
        let Ok(mut m) = self.inner.lock() else {
            return Vec::new();
        };
        m.retain(|_, e| e.in_flight > 0 || e.dirty);
        m.iter().map(|(k, e)| (k.clone(), e.generation)).collect()
    }

    /// A write covered the activity of `key` up to `generation` (or the Model is gone).
    fn covered(&self, key: &ModelKey, generation: u64) {
        if let Ok(mut m) = self.inner.lock() {
            if let Some(e) = m.get_mut(key) {
                if e.generation == generation {
                    e.dirty = false;
                }
            }
        }
    }

    /// Check every active Model once: write `lastActiveTime` where the throttle allows.
    pub async fn tick(&self, cluster: &Cluster, default_interval: Duration) {
        for (key, generation) in self.due() {
            if cluster.model(&key).is_none() {
                self.covered(&key, generation);
                continue;
            }
            match cluster.touch_once(&key, default_interval).await {
                Ok(true) => self.covered(&key, generation),
                Ok(false) => {}
                Err(e) => {
                    warn!(namespace = %key.0, model = %key.1, error = %flexinfer_api::contract::error::chain(&e), "cannot write lastActiveTime")
                }
            }
        }
    }

    /// Run [`Self::tick`] every `period` forever.
    pub async fn run(self, cluster: Cluster, default_interval: Duration, period: Duration) {
        let mut t = tokio::time::interval(period);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            t.tick().await;
            self.tick(&cluster, default_interval).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> ModelKey {
        ("ns".into(), n.into())
    }

    #[test]
    fn bookkeeping() {
        let a = Activity::default();
        let g1 = a.begin(&key("m"));
        let g2 = a.begin(&key("m"));
        assert_eq!(a.in_flight(&key("m")), 2);
        assert_eq!(a.total_in_flight(), 2);
        let due = a.due();
        assert_eq!(due.len(), 1);
        // A write covers what it saw, but an in-flight Model stays due for keepalives.
        a.covered(&key("m"), due[0].1);
        assert_eq!(a.due().len(), 1);
        drop(g1);
        drop(g2);
        assert_eq!(a.in_flight(&key("m")), 0);
        // Ended after the last write: still due (the end must be written).
        let due = a.due();
        assert_eq!(due.len(), 1);
        // A write that raced with a newer start/end does not clear it.
        let stale = due[0].1;
        let g3 = a.begin(&key("m"));
        drop(g3);
        a.covered(&key("m"), stale);
        let due = a.due();
        assert_eq!(due.len(), 1);
        a.covered(&key("m"), due[0].1);
        assert!(a.due().is_empty(), "forgotten once written and idle");
    }
}
