//! Kubernetes Events (`events.k8s.io/v1`) with series, from a compact cache.
//!
//! kube-runtime's `Recorder` keeps every event it published in the last 6 minutes as a full `Event` object
//! (its reference, note, metadata: kilobytes each) and scans the whole cache on every publish. At thousands
//! of caches that cache was the largest single allocation of the controller (8.9 MB of a 20 MB heap at 300
//! caches, measured with heaptrack) and the scan grows with the square of the events. This recorder keeps,
//! per series, a 64-bit key, the Event's name, its count and when it was last seen (about 100 bytes), and
//! sweeps expired series at most every [`SWEEP_EVERY`]. What it sends is what kube's recorder sends: a new
//! Event the first time; for a repeat within [`SERIES_TTL`], a merge patch of `series` (count and last
//! observed time) to the same Event.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::Client;

/// A repeat within this time adds to the series; later, a new Event starts (as kube's recorder does).
pub const SERIES_TTL: Duration = Duration::from_secs(6 * 60);
/// Expired series are dropped at most this often (not on every publish).
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// One series: the Event it patches, how many times it was seen, and when last.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    name: Box<str>,
    count: i32,
    last: Instant,
}

/// What to send for one occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Send {
    /// A new Event of this name.
    Create { name: String },
    /// The series of this Event, now at `count`.
    Patch { name: String, count: i32 },
}

/// The series cache, pure: keys in, what to send out.
#[derive(Debug, Default)]
pub struct Series {
    seen: HashMap<u64, Seen>,
    last_sweep: Option<Instant>,
}

impl Series {
    /// An occurrence of series `key` at `now`; `fresh_name` names the Event when a new one starts.
    pub fn observe(&mut self, key: u64, now: Instant, fresh_name: impl FnOnce() -> String) -> Send {
        if self
            .last_sweep
            .is_none_or(|t| now.saturating_duration_since(t) >= SWEEP_EVERY)
        {
            self.seen
                .retain(|_, s| now.saturating_duration_since(s.last) < SERIES_TTL);
            self.last_sweep = Some(now);
        }
        match self.seen.get_mut(&key) {
            Some(s) if now.saturating_duration_since(s.last) < SERIES_TTL => {
                s.count = s.count.saturating_add(1);
                s.last = now;
                Send::Patch {
                    name: s.name.to_string(),
                    count: s.count,
                }
            }
            _ => {
                let name = fresh_name();
                self.seen.insert(
                    key,
                    Seen {
                        name: name.clone().into_boxed_str(),
                        count: 1,
                        last: now,
                    },
                );
                Send::Create { name }
            }
        }
    }

    /// Forget series `key` (its Event is gone: the next occurrence creates a new one).
    pub fn forget(&mut self, key: u64) {
        self.seen.remove(&key);
    }

    /// Series held.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no series is held.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// The series key: what kube's recorder keys on (type, action, reason, reporter, the regarding and related
/// objects' apiVersion/kind/namespace/name/uid), hashed.
fn key(reporter: &Reporter, ev: &Event, regarding: &ObjectReference) -> u64 {
    let mut h = DefaultHasher::new();
    matches!(ev.type_, EventType::Warning).hash(&mut h);
    ev.action.hash(&mut h);
    ev.reason.hash(&mut h);
    reporter.controller.hash(&mut h);
    reporter.instance.hash(&mut h);
    for r in std::iter::once(Some(regarding)).chain(std::iter::once(ev.secondary.as_ref())) {
        match r {
            Some(r) => {
                (&r.api_version, &r.kind, &r.namespace, &r.name, &r.uid).hash(&mut h);
            }
            None => 0u8.hash(&mut h),
        }
    }
    h.finish()
}

/// Publishes Events with series from the compact cache. Cheap to clone (shared cache).
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    series: Arc<Mutex<Series>>,
}

impl Recorder {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            series: Arc::default(),
        }
    }

    fn event(&self, ev: &Event, regarding: &ObjectReference, name: String) -> K8sEvent {
        K8sEvent {
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            event_time: Some(MicroTime(Timestamp::now())),
            regarding: Some(regarding.clone()),
            note: ev.note.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(name),
                ..Default::default()
            },
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            type_: Some(
                match ev.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .into(),
            ),
            related: ev.secondary.clone(),
            ..Default::default()
        }
    }

    /// Publish one occurrence of `ev` about `regarding`.
    pub async fn publish(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let k = key(&self.reporter, ev, regarding);
        let fresh = || {
            format!(
                "{}.{:x}",
                regarding
                    .name
                    .as_deref()
                    .unwrap_or(&self.reporter.controller),
                Timestamp::now().as_nanosecond()
            )
        };
        let send = self
            .series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(k, Instant::now(), fresh);
        let ns = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), ns);
        match send {
            Send::Create { name } => {
                let result = api
                    .create(&PostParams::default(), &self.event(ev, regarding, name))
                    .await
                    .map(|_| ());
                if result.is_err() {
                    // Not created: the next occurrence starts over.
                    self.forget(k);
                }
                result
            }
            Send::Patch { name, count } => {
                let patch = serde_json::json!({"series": {
                    "count": count,
                    "lastObservedTime": MicroTime(Timestamp::now()),
                }});
                match api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => Ok(()),
                    // The Event expired or was deleted: start a new one.
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        self.forget(k);
                        let name = fresh();
                        self.series
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .observe(k, Instant::now(), || name.clone());
                        api.create(&PostParams::default(), &self.event(ev, regarding, name))
                            .await
                            .map(|_| ())
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    fn forget(&self, k: u64) {
        self.series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .forget(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_within_the_ttl_patch_one_series_and_expire_after_it() {
        let mut s = Series::default();
        let t0 = Instant::now();
        let mut n = 0;
        let mut name = || {
            n += 1;
            format!("e{n}")
        };
        assert_eq!(
            s.observe(1, t0, &mut name),
            Send::Create { name: "e1".into() }
        );
        assert_eq!(
            s.observe(1, t0 + Duration::from_secs(60), &mut name),
            Send::Patch {
                name: "e1".into(),
                count: 2
            }
        );
        // Another series is its own Event.
        assert_eq!(
            s.observe(2, t0 + Duration::from_secs(61), &mut name),
            Send::Create { name: "e2".into() }
        );
        // The TTL counts from the last occurrence.
        assert_eq!(
            s.observe(
                1,
                t0 + Duration::from_secs(60) + SERIES_TTL - Duration::from_secs(1),
                &mut name
            ),
            Send::Patch {
                name: "e1".into(),
                count: 3
            }
        );
        let later = t0 + Duration::from_secs(60) + 2 * SERIES_TTL;
        assert_eq!(
            s.observe(1, later, &mut name),
            Send::Create { name: "e3".into() }
        );
        // The sweep dropped series 2 (expired), kept the new one.
        assert_eq!(s.len(), 1);
        s.forget(1);
        assert!(s.is_empty());
    }

    #[test]
    fn the_sweep_bounds_the_cache_without_scanning_on_every_publish() {
        let mut s = Series::default();
        let t0 = Instant::now();
        for k in 0..10_000u64 {
            s.observe(k, t0, || format!("e{k}"));
        }
        assert_eq!(s.len(), 10_000);
        // Within SWEEP_EVERY nothing is scanned (the old series are still there, although expired).
        let expired = t0 + SERIES_TTL + Duration::from_secs(1);
        s.last_sweep = Some(expired);
        s.observe(10_001, expired, || "x".into());
        assert_eq!(s.len(), 10_001);
        // The next sweep drops every expired series.
        s.observe(10_002, expired + SWEEP_EVERY, || "y".into());
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn the_key_is_kubes_fields() {
        let reporter = Reporter {
            controller: "c".into(),
            instance: Some("i".into()),
        };
        let ev = |reason: &str, note: &str| Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(note.into()),
            action: "A".into(),
            secondary: None,
        };
        let obj = |uid: &str| ObjectReference {
            api_version: Some("ai.flexinfer/v1alpha1".into()),
            kind: Some("ModelCache".into()),
            namespace: Some("ns".into()),
            name: Some("mc".into()),
            uid: Some(uid.into()),
            resource_version: Some("1".into()),
            ..Default::default()
        };
        let base = key(&reporter, &ev("R", "one"), &obj("u1"));
        // The note and the resourceVersion do not start a new series (as in kube's recorder).
        let mut same_obj = obj("u1");
        same_obj.resource_version = Some("2".into());
        assert_eq!(base, key(&reporter, &ev("R", "two"), &same_obj));
        assert_ne!(base, key(&reporter, &ev("S", "one"), &obj("u1")));
        assert_ne!(base, key(&reporter, &ev("R", "one"), &obj("u2")));
    }
}
