//! `--help` of every command matches docs/user/cli.md, and completions generate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::process::Command;

use clap::CommandFactory;

const BIN: &str = env!("CARGO_BIN_EXE_flexinfer");

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/user/cli.md");
    std::fs::read_to_string(path).expect("docs/user/cli.md")
}

fn normalize(s: &str) -> String {
    s.lines()
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_string()
}

/// Blocks introduced by `<!-- help: <command path> -->` followed by a ```text fence.
fn documented() -> Vec<(String, String)> {
    let d = doc();
    let mut out = Vec::new();
    let mut rest = d.as_str();
    while let Some(i) = rest.find("<!-- help:") {
        rest = &rest[i + "<!-- help:".len()..];
        let end = rest.find("-->").expect("unterminated help marker");
        let path = rest[..end].trim().to_string();
        let start = rest
            .find("```text\n")
            .expect("help marker without a ```text block")
            + "```text\n".len();
        let body_end = rest[start..].find("\n```").expect("unterminated block") + start;
        out.push((path, rest[start..body_end].to_string()));
        rest = &rest[body_end..];
    }
    out
}

/// Every command path (without `help`).
fn paths(cmd: &clap::Command, prefix: &str, out: &mut Vec<String>) {
    for sub in cmd.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        let p = if prefix.is_empty() {
            sub.get_name().to_string()
        } else {
            format!("{prefix} {}", sub.get_name())
        };
        out.push(p.clone());
        paths(sub, &p, out);
    }
}

#[test]
fn help_matches_docs() {
    let docs = documented();
    let mut all = vec![String::new()];
    paths(&flexinfer_cli::Cli::command(), "", &mut all);
    for p in &all {
        let shown = if p.is_empty() {
            "flexinfer"
        } else {
            p.as_str()
        };
        let Some((_, body)) = docs.iter().find(|(d, _)| d == shown) else {
            panic!("docs/user/cli.md has no `<!-- help: {shown} -->` block");
        };
        let mut args: Vec<&str> = p.split_whitespace().collect();
        args.push("--help");
        let o = Command::new(BIN)
            .args(&args)
            .env_remove("HF_ENDPOINT")
            .output()
            .unwrap();
        assert!(o.status.success());
        let actual = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            normalize(body),
            normalize(&actual),
            "docs/user/cli.md block for `{shown}` differs from `flexinfer {}`",
            args.join(" ")
        );
    }
    assert_eq!(
        docs.len(),
        all.len(),
        "docs document commands that do not exist"
    );
}

#[test]
fn completions_generate() {
    for (shell, needle) in [
        ("bash", "_flexinfer()"),
        ("zsh", "#compdef flexinfer"),
        ("fish", "complete -c flexinfer"),
    ] {
        let o = Command::new(BIN)
            .args(["completion", shell])
            .output()
            .unwrap();
        assert!(o.status.success(), "{shell}");
        let s = String::from_utf8_lossy(&o.stdout);
        assert!(s.contains(needle), "{shell}: {}", &s[..s.len().min(200)]);
        assert!(
            s.contains("validate-artifact"),
            "{shell} completion lacks subcommands"
        );
    }
}

#[test]
fn validate_binary_exit_codes() {
    let run = |args: &[&str]| {
        let o = Command::new(BIN)
            .args(["quantize", "validate"])
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // the guide's example
    let (code, out, _) = run(&[
        "--format",
        "GGUF",
        "--baseline-perplexity",
        "9.50",
        "--candidate-perplexity",
        "10.10",
        "--baseline-acceptance",
        "94",
        "--candidate-acceptance",
        "92",
    ]);
    assert_eq!(code, Some(0));
    assert!(out.contains("Result: PASS"), "{out}");
    let (code, out, _) = run(&[
        "--format",
        "GPTQ",
        "--baseline-perplexity",
        "9.50",
        "--candidate-perplexity",
        "10.50",
        "--baseline-acceptance",
        "0.94",
        "--candidate-acceptance",
        "0.90",
    ]);
    assert_eq!(code, Some(1));
    assert!(out.contains("Result: FAIL"), "{out}");
    assert_eq!(out.matches("\nFailure: ").count(), 2, "{out}");
    let (code, _, err) = run(&[
        "--format",
        "GPTQ",
        "--baseline-perplexity",
        "-1",
        "--candidate-perplexity",
        "10.50",
        "--baseline-acceptance",
        "94",
        "--candidate-acceptance",
        "90",
    ]);
    assert_eq!(code, Some(2), "{err}");
    let (code, _, err) = run(&["--format", "GPTQ"]);
    assert_eq!(code, Some(2), "missing flags are bad input: {err}");
}
