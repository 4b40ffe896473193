//! The report of a card check: each record printed and kept, the JSON rewritten after every record.

use flexinfer_quant::device::check::Check;
use serde_json::{json, Value};
use std::time::Instant;

pub struct Report {
    pub checks: Vec<Check>,
    pub records: Vec<Value>,
    /// Sections that stopped on a device error or a panic.
    pub errors: usize,
    pub device: String,
    pub json: Option<String>,
}

impl Report {
    pub fn check(&mut self, c: Check, seconds: f64) {
        println!("{c} [{seconds:.1}s]");
        self.records.push(json!({"check": c.name, "passed": c.passed, "worst": c.worst, "detail": c.detail, "seconds": seconds}));
        self.checks.push(c);
        self.save();
    }
    pub fn timing(&mut self, v: Value) {
        println!("time {v}");
        self.records.push(v);
        self.save();
    }
    fn error(&mut self, section: &str, message: String) {
        println!("ERROR {section}: {message}");
        self.records
            .push(json!({"section": section, "error": message}));
        self.errors += 1;
        self.save();
    }
    /// Runs one section; a device error or a panic in it is recorded and the next section runs (a card run
    /// is rare: one failure must not hide what the others would show).
    pub fn section(&mut self, name: &str, f: impl FnOnce(&mut Report) -> Result<(), String>) {
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *self)));
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.error(name, e),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".to_string());
                self.error(name, format!("panicked: {msg}"));
            }
        }
        println!("-- {name}: {:.1}s", t.elapsed().as_secs_f64());
    }
    /// Writes the JSON report so far (after every record: a run stopped by its timeout keeps what it did).
    pub fn save(&self) {
        if let Some(path) = &self.json {
            let doc =
                json!({"device": self.device, "records": self.records, "errors": self.errors});
            if let Err(e) = std::fs::write(path, serde_json::to_vec_pretty(&doc).unwrap()) {
                eprintln!("gpu_check: cannot write {path}: {e}");
            }
        }
    }
}
