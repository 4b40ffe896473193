//! `--run-generation`: a short greedy generation with the llama.cpp found on PATH
//! (`llama-completion`, else `llama-cli`), its text and decode speed; when neither is on PATH the
//! check is skipped and says so.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

/// The tools tried, in order: `llama-completion` is llama.cpp's non-interactive generator;
/// `llama-cli` is the older name of the same program.
pub(crate) const TOOLS: &[&str] = &["llama-completion", "llama-cli"];
pub(crate) const PROMPT: &str = "The capital of France is";
const TOKENS: u32 = 16;
const TIME_LIMIT: Duration = Duration::from_secs(300);
/// The most of the tool's stdout/stderr kept.
const OUTPUT_LIMIT: u64 = 1 << 20;

/// What the generation did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Generation {
    /// The llama.cpp binary run, when one was found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// Why it did not run (nothing on PATH).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    pub prompt: String,
    /// The generated text (stdout).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Decode speed from llama.cpp's timings (`eval time ... tokens per second`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

fn on_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// llama.cpp's `eval time = ... ( ... ms per token, X tokens per second)`, not the prompt's.
pub(crate) fn tokens_per_second(log: &str) -> Option<f64> {
    log.lines()
        .filter(|l| l.contains("eval time") && !l.contains("prompt eval time"))
        .find_map(|l| {
            let before = l.split("tokens per second").next()?;
            before
                .rsplit(|c: char| c == ',' || c.is_whitespace())
                .find(|s| !s.is_empty())?
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
        })
}

fn read_limited(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(r) = r {
            let mut r = r.take(OUTPUT_LIMIT);
            let _ = r.read_to_end(&mut buf);
            // drain the rest so the child never blocks on a full pipe
            let _ = std::io::copy(&mut r.into_inner(), &mut std::io::sink());
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Runs the generation on `file`; the message is a defect (llama.cpp found but failed on the file).
pub(crate) fn run_generation(file: &Path) -> (Generation, Option<String>) {
    let mut g = Generation {
        prompt: PROMPT.into(),
        ..Default::default()
    };
    let Some((tool, bin)) = TOOLS.iter().find_map(|t| on_path(t).map(|p| (*t, p))) else {
        g.skipped = Some(format!(
            "no llama.cpp on PATH ({}): generation not run",
            TOOLS.join(", ")
        ));
        return (g, None);
    };
    g.tool = Some(tool.to_string());
    let n = TOKENS.to_string();
    let started = Instant::now();
    let child = Command::new(&bin)
        .arg("-m")
        .arg(file)
        .args(["-p", PROMPT, "-n", &n, "--temp", "0", "--seed", "0"])
        .args(["-no-cnv", "--no-display-prompt", "--no-warmup", "-c", "256"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return (g, Some(format!("cannot run {}: {e}", bin.display()))),
    };
    let out = read_limited(child.stdout.take());
    let err = read_limited(child.stderr.take());
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if started.elapsed() > TIME_LIMIT => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!(
                    "{tool} ran past {}s and was stopped",
                    TIME_LIMIT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(format!("{tool}: {e}")),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let status = match status {
        Ok(s) => s,
        Err(e) => return (g, Some(e)),
    };
    g.exit_code = status.code();
    g.tokens_per_second = tokens_per_second(&stderr).or_else(|| tokens_per_second(&stdout));
    g.output = Some(stdout.trim().to_string());
    if !status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return (
            g,
            Some(format!(
                "{tool} failed on {} ({status}): {}",
                file.display(),
                tail.join(" | ")
            )),
        );
    }
    (g, None)
}
