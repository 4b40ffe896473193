//! Copies of caches as the API server returned them to our own writes, until the cache watch shows
//! them.
//!
//! A reconcile that a Job event starts can run before the cache watch delivers the status the
//! previous reconcile of that cache wrote. Planned from the store's older copy, its conditional write
//! is refused (409: [`Error::Conflict`](crate::reconcile_error::Error)) and the cache is planned again
//! 300 ms later: a write wasted on the API server and a hand-off delayed. The copy a write returned is
//! at least as new as every copy whose resourceVersion our writes replaced, so a reconcile handed one
//! of those plans from the written copy instead. resourceVersions are only compared for equality (the
//! API gives them no order).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use flexinfer_api::modelcache::ModelCache;

/// See the module documentation.
#[derive(Clone, Default)]
pub struct WrittenCopies(Arc<Mutex<HashMap<(String, String), Written>>>);

struct Written {
    /// resourceVersions our writes replaced since the watch last showed the cache.
    replaced: Vec<String>,
    /// What the last write returned.
    copy: Arc<ModelCache>,
}

fn key_of(mc: &ModelCache) -> Option<(String, String)> {
    Some((mc.metadata.namespace.clone()?, mc.metadata.name.clone()?))
}

impl WrittenCopies {
    /// The copy of the cache to plan from: `stored` (the watch's), or the copy our last write
    /// returned when `stored` is one our writes replaced.
    pub fn newest(&self, stored: Arc<ModelCache>) -> Arc<ModelCache> {
        let (Some(key), Ok(mut m)) = (key_of(&stored), self.0.lock()) else {
            return stored;
        };
        let Some(w) = m.get(&key) else {
            return stored;
        };
        let rv = stored.metadata.resource_version.as_deref();
        if rv.is_some_and(|rv| w.replaced.iter().any(|r| r == rv)) {
            return w.copy.clone();
        }
        m.remove(&key);
        stored
    }

    /// A write made from resourceVersion `from` returned `copy` (stripped like the store's objects).
    pub fn wrote(&self, from: Option<&str>, copy: ModelCache, lean: impl Fn(&mut ModelCache)) {
        let (Some(from), Some(key)) = (from, key_of(&copy)) else {
            return;
        };
        let mut copy = copy;
        lean(&mut copy);
        let copy = Arc::new(copy);
        if let Ok(mut m) = self.0.lock() {
            match m.entry(key) {
                Entry::Occupied(mut e) => {
                    let w = e.get_mut();
                    w.replaced.push(from.to_string());
                    w.copy = copy;
                }
                Entry::Vacant(e) => {
                    e.insert(Written {
                        replaced: vec![from.to_string()],
                        copy,
                    });
                }
            }
        }
    }

    /// The cache watch delivered `mc`: a copy that none of our writes replaced is as new as ours.
    pub fn seen(&self, mc: &ModelCache) {
        let (Some(key), Ok(mut m)) = (key_of(mc), self.0.lock()) else {
            return;
        };
        let replaced = m.get(&key).is_some_and(|w| {
            mc.metadata
                .resource_version
                .as_deref()
                .is_some_and(|rv| w.replaced.iter().any(|r| r == rv))
        });
        if !replaced {
            m.remove(&key);
        }
    }

    /// Forget a cache (deleted, or its finalizer removed).
    pub fn forget(&self, ns: &str, name: &str) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&(ns.to_string(), name.to_string()));
        }
    }

    /// Caches with a copy held: those written to whose write the watch has not shown yet.
    pub fn held(&self) -> usize {
        self.0.lock().map(|m| m.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(rv: &str, phase: &str) -> ModelCache {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "c", "namespace": "ns", "resourceVersion": rv,
                         "managedFields": [{"manager": "m"}]},
            "spec": {"source": "org/m"},
            "status": {"phase": phase},
        }))
        .expect("cache")
    }
    fn phase(mc: &ModelCache) -> Option<String> {
        serde_json::to_value(mc.status.as_ref()?.phase?)
            .ok()?
            .as_str()
            .map(String::from)
    }
    fn lean(mc: &mut ModelCache) {
        mc.metadata.managed_fields = None;
    }

    #[test]
    fn a_replaced_copy_is_planned_from_the_written_one() {
        let w = WrittenCopies::default();
        let stored = Arc::new(cache("1", "Pending"));
        // Nothing written: the store's copy.
        assert_eq!(phase(&w.newest(stored.clone())).as_deref(), Some("Pending"));
        w.wrote(Some("1"), cache("2", "Downloading"), lean);
        let got = w.newest(stored.clone());
        assert_eq!(phase(&got).as_deref(), Some("Downloading"));
        assert_eq!(got.metadata.resource_version.as_deref(), Some("2"));
        assert!(
            got.metadata.managed_fields.is_none(),
            "stripped like the store's"
        );
        // A second write from the written copy, while the watch still shows "1".
        w.wrote(Some("2"), cache("3", "Quantizing"), lean);
        assert_eq!(
            phase(&w.newest(stored.clone())).as_deref(),
            Some("Quantizing")
        );
        assert_eq!(
            phase(&w.newest(Arc::new(cache("2", "Downloading")))).as_deref(),
            Some("Quantizing")
        );
        assert_eq!(w.held(), 1);
        // The watch catches up (or someone else wrote): its copy, and ours is dropped.
        let newer = Arc::new(cache("4", "Failed"));
        assert_eq!(phase(&w.newest(newer)).as_deref(), Some("Failed"));
        assert_eq!(w.held(), 0);
        assert_eq!(phase(&w.newest(stored)).as_deref(), Some("Pending"));
    }

    #[test]
    fn the_watch_showing_the_write_drops_the_copy() {
        let w = WrittenCopies::default();
        w.wrote(Some("1"), cache("2", "Downloading"), lean);
        w.seen(&cache("1", "Pending"));
        assert_eq!(w.held(), 1, "a replaced copy keeps ours");
        w.seen(&cache("2", "Downloading"));
        assert_eq!(w.held(), 0);
        w.wrote(Some("2"), cache("3", "Quantizing"), lean);
        w.forget("ns", "c");
        assert_eq!(w.held(), 0);
        // A write without the resourceVersion it was made from keeps nothing.
        w.wrote(None, cache("5", "Ready"), lean);
        assert_eq!(w.held(), 0);
    }
}
