//! `flexinfer quantize validate-artifact --layout vllm-gptq`: a native check that a GPTQ
//! checkpoint directory is what vLLM (Marlin/ExLlama) and transformers load (docs/dev/gptq.md §2),
//! that the save completed (`.save-complete` sizes and sha256) and that the quality gate passed.
//!
//! One module per check, run in this order: [`config`] (config.json, the family, quantize_config.json),
//! [`save_complete`] (the marker), [`shards`] (headers and the index), [`linear`] (each quantized
//! linear), [`quality`] (the sidecar); [`read`] reads the files within their limits.

mod config;
mod linear;
mod quality;
mod read;
mod save_complete;
mod shards;

use std::path::Path;

use serde::Serialize;

#[cfg(test)]
use read::read_header;

/// One defect (or warning): which check and the precise message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub message: String,
}

/// Result of a validation run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub path: String,
    pub layout: String,
    pub ok: bool,
    pub defects: Vec<Finding>,
    pub warnings: Vec<Finding>,
    pub shards: usize,
    pub tensors: usize,
    pub quantized_linears: usize,
}

impl Report {
    fn defect(&mut self, check: &'static str, message: impl std::fmt::Display) {
        self.defects.push(Finding {
            check,
            message: message.to_string(),
        });
    }
    fn warn(&mut self, check: &'static str, message: impl std::fmt::Display) {
        self.warnings.push(Finding {
            check,
            message: message.to_string(),
        });
    }

    /// Human output: one line per defect/warning, then a summary line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for d in &self.defects {
            s.push_str(&format!("DEFECT [{}] {}\n", d.check, d.message));
        }
        for w in &self.warnings {
            s.push_str(&format!("WARNING [{}] {}\n", w.check, w.message));
        }
        s.push_str(&format!(
            "{}: {} ({} shard(s), {} tensors, {} quantized linears, {} defect(s), {} warning(s))\n",
            if self.ok { "OK" } else { "INVALID" },
            self.path,
            self.shards,
            self.tensors,
            self.quantized_linears,
            self.defects.len(),
            self.warnings.len()
        ));
        s
    }
}

/// Options.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Expected model family (matched against config.json `model_type`), e.g. `qwen35`, `gemma4-26b-a4b`.
    pub family: Option<String>,
    /// Skip sha256 of the shards (sizes are still checked).
    pub skip_sha256: bool,
}

/// Validate `dir` with the `vllm-gptq` layout.
pub fn validate_vllm_gptq(dir: &Path, opts: &Options) -> Report {
    let mut r = Report {
        path: dir.display().to_string(),
        layout: "vllm-gptq".into(),
        ..Default::default()
    };
    let (cfg, gptq) = config::check_config(&mut r, dir, opts);
    let save_complete = save_complete::read_save_complete(&mut r, dir);
    config::check_quantize_config(&mut r, dir, cfg.as_ref(), save_complete.as_ref());
    let (shard_files, tensors) = shards::read_shards(&mut r, dir);
    shards::check_index(&mut r, dir, &tensors, &shard_files, save_complete.as_ref());
    linear::check_linears(&mut r, dir, &tensors, gptq, cfg.as_ref());
    if let Some(sc) = &save_complete {
        save_complete::check_save_complete(&mut r, dir, sc, &shard_files, opts);
    }
    quality::check_quality(&mut r, dir);
    r.ok = r.defects.is_empty();
    r
}

/// Flags the validator cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("--layout {0}: only vllm-gptq is supported")]
    Layout(String),
    #[error("--path {}: not a directory", .0.display())]
    NotADirectory(std::path::PathBuf),
}

/// Entry point used by the command: validates the layout name first.
pub fn validate(dir: &Path, layout: &str, opts: &Options) -> Result<Report, UsageError> {
    if layout != "vllm-gptq" {
        return Err(UsageError::Layout(layout.to_string()));
    }
    if !dir.is_dir() {
        return Err(UsageError::NotADirectory(dir.to_path_buf()));
    }
    Ok(validate_vllm_gptq(dir, opts))
}

#[cfg(test)]
mod tests;
