//! Command-line definitions (clap derive) and dispatch.

use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand};
use flexinfer_api::formats::FORMATS;

pub use crate::args::{Global, QuantizeRequest, RecommendArgs};
use crate::output::{self, Format};
use crate::{artifact, bad, cluster, request, validate, CliError, EXIT_FAIL, EXIT_OK};

/// flexinfer: request, inspect, recommend and validate LLM quantization on FlexInfer ModelCaches.
#[derive(Debug, Parser)]
#[command(name = "flexinfer", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Request, inspect, recommend and validate quantization of a ModelCache
    Quantize(Box<QuantizeCmd>),
    /// Inspect ModelCaches
    Cache(CacheCmd),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    Completion {
        /// Shell to generate the script for
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// `flexinfer quantize <cache> --format F ...` or one of its subcommands.
#[derive(Debug, Args)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Examples:\n  flexinfer quantize llama3-8b                    (GGUF Q4_K_M)\n  flexinfer quantize llama3-8b --format GGUF --type Q6_K\n  flexinfer quantize llama3-8b --format GPTQ --bits 4 --group-size 128 --use-gpu\n  flexinfer quantize formats\n  flexinfer quantize status llama3-8b"
)]
pub struct QuantizeCmd {
    #[command(subcommand)]
    pub sub: Option<QuantizeSub>,
    #[command(flatten)]
    pub request: QuantizeRequest,
}

#[derive(Debug, Subcommand)]
pub enum QuantizeSub {
    /// List quantization formats, their bit widths and serving backends
    Formats,
    /// Show quantization status of a ModelCache: requested vs applied, Job, progress, sizes, quality
    Status {
        /// ModelCache name
        cache: String,
    },
    /// Recommend quantization settings from the model footprint and the target GPU
    Recommend(RecommendArgs),
    /// Quality gate: compare candidate against baseline perplexity and acceptance rate
    Validate(ValidateArgs),
    /// Check a quantized artifact: a GPTQ, AWQ, FP8 or compressed-tensors pack-quantized directory (config, tensors, shards, quality sidecar) or GGUF files (header, metadata, tensors, splits)
    ValidateArtifact(ValidateArtifactArgs),
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// Format whose policy applies: GGUF, AWQ, GPTQ, EXL2, FP8
    #[arg(long)]
    pub format: String,
    /// Perplexity of the baseline (unquantized) model
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    pub baseline_perplexity: f64,
    /// Perplexity of the quantized candidate
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    pub candidate_perplexity: f64,
    /// Acceptance rate of the baseline, as a ratio (0.94) or percent (94)
    #[arg(long, value_name = "A", allow_negative_numbers = true)]
    pub baseline_acceptance: f64,
    /// Acceptance rate of the candidate, as a ratio (0.92) or percent (92)
    #[arg(long, value_name = "A", allow_negative_numbers = true)]
    pub candidate_acceptance: f64,
}

#[derive(Debug, Args)]
pub struct ValidateArtifactArgs {
    /// Artifact directory (e.g. the mounted cache's gptq-w4-g128 or gguf-q4_k_m) or a .gguf file
    #[arg(long, value_name = "DIR")]
    pub path: PathBuf,
    /// Expected layout: vllm-gptq, gguf, fp8, pack-quantized or awq [default: gguf when the path is or holds .gguf files, fp8 / pack-quantized when config.json declares compressed-tensors float-quantized / pack-quantized, awq when it declares quant_method awq, else vllm-gptq]
    #[arg(long, value_name = "LAYOUT")]
    pub layout: Option<String>,
    /// Expected model family, matched against config.json model_type (e.g. llama, qwen35, gemma4-26b-a4b)
    #[arg(long, value_name = "F")]
    pub family: Option<String>,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
    /// Skip the sha256 of shards (sizes are still checked)
    #[arg(long)]
    pub no_sha256: bool,
    /// GGUF: run a short greedy generation with llama.cpp (llama-completion or llama-cli on PATH; skipped when neither is)
    #[arg(long)]
    pub run_generation: bool,
}

#[derive(Debug, Args)]
pub struct CacheCmd {
    #[command(subcommand)]
    pub sub: CacheSub,
}

#[derive(Debug, Subcommand)]
pub enum CacheSub {
    /// Table of ModelCaches: phase, current step, progress, format, compression ratio, source
    Status {
        /// List caches in all namespaces
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
}

/// Rows of `quantize formats`.
#[derive(Debug, serde::Serialize)]
struct FormatRow {
    format: &'static str,
    bits: Vec<i32>,
    default_bits: i32,
    backends: Vec<String>,
    status: &'static str,
    calibration: bool,
}

fn formats_cmd(out: Format) -> anyhow::Result<String> {
    let rows: Vec<FormatRow> = FORMATS
        .iter()
        .map(|f| FormatRow {
            format: f.name,
            bits: f.bits.to_vec(),
            default_bits: f.default_bits,
            backends: f
                .backends
                .iter()
                .map(|b| {
                    serde_json::to_value(b)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_else(|| format!("{b:?}").to_lowercase())
                })
                .collect(),
            status: if f.implemented {
                "implemented"
            } else {
                "planned"
            },
            calibration: f.needs_calibration,
        })
        .collect();
    if out != Format::Table {
        return output::structured(out, &rows);
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.format.to_string(),
                r.bits
                    .iter()
                    .map(|b| b.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                r.default_bits.to_string(),
                r.backends.join(","),
                if r.calibration { "yes" } else { "no" }.to_string(),
                r.status.to_string(),
            ]
        })
        .collect();
    Ok(output::table(
        &[
            "FORMAT",
            "BITS", // not-contract: a column header
            "DEFAULT",
            "BACKENDS",
            "CALIBRATION",
            "STATUS",
        ],
        &cells,
    ))
}

fn validate_cmd(a: &ValidateArgs, out: Format) -> Result<(String, i32), CliError> {
    let v = validate::evaluate(
        &a.format,
        validate::Inputs {
            baseline_perplexity: a.baseline_perplexity,
            candidate_perplexity: a.candidate_perplexity,
            baseline_acceptance: a.baseline_acceptance,
            candidate_acceptance: a.candidate_acceptance,
        },
    )
    .map_err(|e| bad(e.to_string()))?;
    let code = if v.passed { EXIT_OK } else { EXIT_FAIL };
    let text = match out {
        Format::Table => validate::render(&v),
        _ => output::structured(out, &v)?,
    };
    Ok((text, code))
}

fn validate_artifact_cmd(a: &ValidateArtifactArgs, out: Format) -> Result<(String, i32), CliError> {
    let report = artifact::validate(
        &a.path,
        a.layout.as_deref(),
        &artifact::Options {
            family: a.family.clone(),
            skip_sha256: a.no_sha256,
            run_generation: a.run_generation,
        },
    )
    .map_err(|e| bad(e.to_string()))?;
    let code = if report.ok { EXIT_OK } else { EXIT_FAIL };
    let text = if a.json || out == Format::Json {
        output::structured(Format::Json, &report)?
    } else if out == Format::Yaml {
        output::structured(Format::Yaml, &report)?
    } else {
        report.render()
    };
    Ok((text, code))
}

impl Cli {
    /// Run the command; returns what to print on stdout and the exit code.
    pub async fn run(self) -> Result<(String, i32), CliError> {
        let g = self.global;
        match self.command {
            Command::Completion { shell } => {
                let mut cmd = Cli::command();
                let mut buf = Vec::new();
                clap_complete::generate(shell, &mut cmd, "flexinfer", &mut buf);
                Ok((String::from_utf8_lossy(&buf).into_owned(), EXIT_OK))
            }
            Command::Cache(CacheCmd {
                sub: CacheSub::Status { all_namespaces },
            }) => Ok((cluster::cache_status(&g, all_namespaces).await?, EXIT_OK)),
            Command::Quantize(q) => match q.sub {
                Some(QuantizeSub::Formats) => Ok((formats_cmd(g.output)?, EXIT_OK)),
                Some(QuantizeSub::Validate(a)) => validate_cmd(&a, g.output),
                Some(QuantizeSub::ValidateArtifact(a)) => validate_artifact_cmd(&a, g.output),
                Some(QuantizeSub::Status { cache }) => {
                    Ok((cluster::quantize_status(&g, &cache).await?, EXIT_OK))
                }
                Some(QuantizeSub::Recommend(a)) => Ok((cluster::recommend(&g, &a).await?, EXIT_OK)),
                None => {
                    let info = request::check_request(&q.request)?;
                    Ok((cluster::quantize(&g, &q.request, info).await?, EXIT_OK))
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn formats_table_comes_from_the_shared_table() {
        let t = formats_cmd(Format::Table).unwrap();
        for f in FORMATS {
            assert!(t.contains(f.name), "{t}");
        }
        assert!(
            t.lines().any(|l| l.starts_with("GPTQ")
                && l.contains("2,3,4,8")
                && l.contains("vllm")
                && l.ends_with("implemented")),
            "{t}"
        );
        assert!(
            t.lines().any(|l| l.starts_with("GGUF")
                && l.contains("llamacpp,ollama")
                && l.ends_with("implemented")),
            "{t}"
        );
        assert!(
            t.lines()
                .any(|l| l.starts_with("EXL2") && l.ends_with("planned")),
            "{t}"
        );
        let j: serde_json::Value =
            serde_json::from_str(&formats_cmd(Format::Json).unwrap()).unwrap();
        assert_eq!(j.as_array().unwrap().len(), FORMATS.len());
    }

    #[test]
    fn validate_exit_codes() {
        let a = |cp: f64, ca: f64| ValidateArgs {
            format: "GGUF".into(),
            baseline_perplexity: 9.5,
            candidate_perplexity: cp,
            baseline_acceptance: 94.0,
            candidate_acceptance: ca,
        };
        let (t, c) = validate_cmd(&a(10.1, 92.0), Format::Table).unwrap();
        assert_eq!(c, 0);
        assert!(t.contains("Result: PASS"));
        let (t, c) = validate_cmd(&a(11.0, 90.0), Format::Table).unwrap();
        assert_eq!(c, 1);
        assert!(t.contains("Result: FAIL"));
        assert_eq!(t.matches("Failure: ").count(), 2);
        let e = validate_cmd(&a(11.0, 150.0), Format::Table).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let (t, c) = validate_cmd(&a(10.1, 92.0), Format::Json).unwrap();
        assert_eq!(c, 0);
        let j: serde_json::Value = serde_json::from_str(&t).unwrap();
        assert_eq!(j["passed"], true);
    }
}
