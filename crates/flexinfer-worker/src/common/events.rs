//! The JSON-line event stream on stdout (`progress` kept monotonic within the process) and the recent
//! lines kept for a failure's termination message.

use std::io::Write;
use std::sync::Mutex;

use flexinfer_contract::{self as contract, env, events, ProgressEvent, WorkerEvent};
use flexinfer_fsutil::now_rfc3339;
use serde::Serialize;

/// Writes events to stdout and keeps `progress` monotonic within the process.
pub struct Events {
    phase: String,
    enabled: bool,
    last_percent: Mutex<f64>,
    /// Recent human/log lines kept for the failure termination message.
    tail: Mutex<Vec<String>>,
}

impl Events {
    /// `phase`: the status name (`download`, `abliteration`, `quantization`, `publish`).
    pub fn new(phase: &str) -> Self {
        let enabled = std::env::var(env::TELEMETRY)
            .ok()
            .and_then(|v| contract::parse_bool(&v))
            .unwrap_or(true);
        Self {
            phase: phase.to_string(),
            enabled,
            last_percent: Mutex::new(0.0),
            tail: Mutex::new(Vec::new()),
        }
    }

    /// Emit an arbitrary event with a serializable object payload.
    pub fn emit<T: Serialize>(&self, event: &str, payload: &T) {
        let ev = WorkerEvent::new(now_rfc3339(), event, payload);
        if let Ok(line) = serde_json::to_string(&ev) {
            self.remember(&line);
            if self.enabled || event == events::ERROR || event == events::COMPLETE {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        }
    }

    /// Emit a `progress` event; a percent lower than the last one is raised to it.
    pub fn progress(&self, mut p: ProgressEvent) {
        let mut last = self.last_percent.lock().unwrap_or_else(|e| e.into_inner());
        if !p.percent.is_finite() {
            return;
        }
        p.percent = p.percent.clamp(0.0, 100.0).max(*last);
        *last = p.percent;
        drop(last);
        if p.phase.is_none() {
            p.phase = Some(self.phase.clone());
        }
        self.emit(events::PROGRESS, &p);
    }

    /// A human log line (stderr) that is also kept for the failure tail.
    pub fn log(&self, msg: &str) {
        eprintln!("{msg}");
        self.remember(msg);
    }

    fn remember(&self, line: &str) {
        let mut t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        t.push(line.to_string());
        let excess = t.len().saturating_sub(40);
        if excess > 0 {
            t.drain(..excess);
        }
    }

    pub fn tail(&self) -> String {
        self.tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    pub fn phase(&self) -> &str {
        &self.phase
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_monotonic() {
        let ev = Events::new("quantization");
        ev.progress(ProgressEvent {
            percent: 40.0,
            ..Default::default()
        });
        ev.progress(ProgressEvent {
            percent: 10.0,
            ..Default::default()
        });
        assert_eq!(*ev.last_percent.lock().unwrap(), 40.0);
        let tail = ev.tail();
        let last = tail.lines().last().unwrap();
        let parsed = WorkerEvent::parse_line(last).unwrap().progress().unwrap();
        assert_eq!(parsed.percent, 40.0);
    }
}
