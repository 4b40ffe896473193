//! Where the engine reports what it does. The worker turns these into JSON lines on stdout (docs/dev/architecture.md, "The controller–worker contract").

use serde_json::{Map, Value};
use std::sync::Mutex;

/// Receives engine events: a name from the worker contract and its fields.
pub trait EventSink: Send + Sync {
    fn emit(&self, event: &str, fields: Map<String, Value>);
}

/// Drops every event.
pub struct NullSink;

impl EventSink for NullSink {
    fn emit(&self, _event: &str, _fields: Map<String, Value>) {}
}

/// Keeps every event in memory (tests, and callers that post-process).
#[derive(Default)]
pub struct MemorySink {
    pub events: Mutex<Vec<(String, Map<String, Value>)>>,
}

impl MemorySink {
    pub fn named(&self, name: &str) -> Vec<Map<String, Value>> {
        match self.events.lock() {
            Ok(ev) => ev
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, f)| f.clone())
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

impl EventSink for MemorySink {
    fn emit(&self, event: &str, fields: Map<String, Value>) {
        if let Ok(mut ev) = self.events.lock() {
            ev.push((event.to_string(), fields));
        }
    }
}

/// Builds a field map from `(key, value)` pairs.
pub fn fields<const N: usize>(pairs: [(&str, Value); N]) -> Map<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}
