//! `flexinfer quantize validate-artifact`: for GGUF (`--layout gguf`, chosen when the path is or
//! holds `.gguf` files) the checks of [`gguf`]; for FP8, compressed-tensors `pack-quantized` and AWQ
//! those of [`fp8`], [`pack_quantized`] and [`awq`]; for `--layout vllm-gptq`, a native check that a GPTQ
//! checkpoint directory is what vLLM (Marlin/ExLlama) and transformers load (docs/dev/gptq.md, "The checkpoint"),
//! that the save completed (`.save-complete` sizes and sha256) and that the quality gate passed.
//!
//! One module per check, run in this order: [`config`] (config.json, the family, quantize_config.json),
//! [`save_complete`] (the marker), [`shards`] (headers and the index), [`linear`] (each quantized
//! linear), [`quality`] (the sidecar); [`read`] reads the files within their limits.

pub mod awq;
mod compressed_tensors;
mod config;
pub mod fp8;
pub mod gguf;
mod linear;
pub mod pack_quantized;
mod quality;
mod read;
mod save_complete;
mod shards;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use read::TensorInfo;

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
    /// The GGUF models (layout `gguf`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gguf: Vec<gguf::GgufModel>,
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
        for m in &self.gguf {
            s.push_str(&render_gguf(m));
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

/// Human lines for one GGUF model: what it is, its tensors by type, its metadata, the generation.
fn render_gguf(m: &gguf::GgufModel) -> String {
    let mut s = format!(
        "GGUF {}: {} {}, {} file(s), {:.1} MB, {} tensors ({})\n",
        m.file,
        m.architecture.as_deref().unwrap_or("(no architecture)"),
        m.file_type.as_deref().unwrap_or("(no file type)"),
        m.files,
        m.size_bytes as f64 / 1e6,
        m.tensors,
        m.tensors_by_type
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !m.metadata.is_empty() {
        let md: Vec<String> = m
            .metadata
            .iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(t) => format!("{k}={t}"),
                v => format!("{k}={v}"),
            })
            .collect();
        s.push_str(&format!("  metadata: {}\n", md.join(" ")));
    }
    if let Some(g) = &m.generation {
        match (&g.tool, &g.skipped) {
            (_, Some(why)) => s.push_str(&format!("  generation: skipped: {why}\n")),
            (Some(tool), None) => s.push_str(&format!(
                "  generation ({tool}, greedy): {:?} -> {:?}{}\n",
                g.prompt,
                g.output.as_deref().unwrap_or(""),
                g.tokens_per_second
                    .map(|t| format!(", {t:.1} tokens/s"))
                    .unwrap_or_default()
            )),
            (None, None) => {}
        }
    }
    s
}

/// Options.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Expected model family (matched against config.json `model_type`), e.g. `qwen35`, `gemma4-26b-a4b`.
    pub family: Option<String>,
    /// Skip sha256 of the shards (sizes are still checked).
    pub skip_sha256: bool,
    /// GGUF: run a short generation with llama.cpp when it is on PATH.
    pub run_generation: bool,
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

/// The steps the `fp8`, `pack-quantized` and `awq` layouts share, in this order: a report for `dir`
/// named `layout`, the layout's config check (`check_config`; `None` skips the tensor checks), the
/// `.save-complete` marker, the shards and the index, the layout's tensor checks (`check_tensors`, with
/// what the config check returned), the shards against `.save-complete`, and `ok` (no defect).
fn validate_layout<C>(
    dir: &Path,
    layout: &str,
    opts: &Options,
    check_config: impl FnOnce(&mut Report) -> Option<C>,
    check_tensors: impl FnOnce(&mut Report, &BTreeMap<String, TensorInfo>, &C),
) -> Report {
    let mut r = Report {
        path: dir.display().to_string(),
        layout: layout.into(),
        ..Default::default()
    };
    let config = check_config(&mut r);
    let sc = save_complete::read_save_complete(&mut r, dir);
    let (shard_files, tensors) = shards::read_shards(&mut r, dir);
    shards::check_index(&mut r, dir, &tensors, &shard_files, sc.as_ref());
    if let Some(config) = &config {
        check_tensors(&mut r, &tensors, config);
    }
    if let Some(sc) = &sc {
        save_complete::check_save_complete(&mut r, dir, sc, &shard_files, opts);
    }
    r.ok = r.defects.is_empty();
    r
}

/// Flags the validator cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("--layout {0}: only vllm-gptq, gguf, fp8, pack-quantized and awq are supported")]
    Layout(String),
    #[error("--path {}: not a directory", .0.display())]
    NotADirectory(std::path::PathBuf),
    #[error("--path {}: neither a directory nor a .gguf file", .0.display())]
    NotGguf(std::path::PathBuf),
}

/// Entry point used by the command: validates the layout name first. Without a layout, a path that
/// is or holds `.gguf` files is validated as `gguf`, a directory whose `config.json` declares
/// compressed-tensors' `float-quantized` format as `fp8`, one declaring `pack-quantized` as
/// `pack-quantized`, one declaring `quant_method: awq` as `awq`, anything else as `vllm-gptq`.
pub fn validate(path: &Path, layout: Option<&str>, opts: &Options) -> Result<Report, UsageError> {
    let layout = match layout {
        Some(l) => l,
        None if gguf::is_gguf(path) => "gguf",
        None if path.is_dir() && fp8::is_fp8(path) => "fp8",
        None if path.is_dir() && pack_quantized::is_pack_quantized(path) => "pack-quantized",
        None if path.is_dir() && awq::is_awq(path) => "awq",
        None => "vllm-gptq",
    };
    match layout {
        "vllm-gptq" => {
            if !path.is_dir() {
                return Err(UsageError::NotADirectory(path.to_path_buf()));
            }
            Ok(validate_vllm_gptq(path, opts))
        }
        "gguf" => {
            if !(path.is_dir() || path.is_file() && gguf::is_gguf(path)) {
                return Err(UsageError::NotGguf(path.to_path_buf()));
            }
            Ok(gguf::validate_gguf(path, opts))
        }
        "fp8" => {
            if !path.is_dir() {
                return Err(UsageError::NotADirectory(path.to_path_buf()));
            }
            Ok(fp8::validate_fp8(path, opts))
        }
        "pack-quantized" => {
            if !path.is_dir() {
                return Err(UsageError::NotADirectory(path.to_path_buf()));
            }
            Ok(pack_quantized::validate_pack_quantized(path, opts))
        }
        "awq" => {
            if !path.is_dir() {
                return Err(UsageError::NotADirectory(path.to_path_buf()));
            }
            Ok(awq::validate_awq(path, opts))
        }
        other => Err(UsageError::Layout(other.to_string())),
    }
}

#[cfg(test)]
mod tests;
