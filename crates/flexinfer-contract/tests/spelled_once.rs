//! Every string constant of the controller/worker contract is spelled once in production code: in this
//! crate. Anywhere else it must be used by name (`make check` runs this with the other tests).
//!
//! Production code = `crates/*/src/**/*.rs` outside this crate, without test files (`tests.rs`,
//! `*_tests.rs`, `tests/`, `testkit`) and without what follows the first line that starts with
//! `#[cfg(test)]` (the test module at the end of a file). Tests may spell contract strings: they pin the
//! wire format from the outside. A line may opt out with a `// not-contract: <why>` comment (e.g. a
//! binary name that happens to equal the field manager). Values too generic to be told apart from
//! unrelated code ("true", "http", …) are in [`GENERIC`] and skipped (GGUF, GPTQ, FP8,
//! COMPRESSED_TENSORS and AWQ, the FORMAT values, are also the API's format names and a file magic).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::path::{Path, PathBuf};

const GENERIC: &[&str] = &[
    "true",
    "false",
    "passed",
    "failed",
    "http",
    "server",
    "gpu",
    "start",
    "progress",
    "complete",
    "error",
    "warning",
    "download",
    "source",
    "abliterate",
    "quantize",
    "publish",
    "abliteration",
    "quantization",
    "dedicated",
    "NoSchedule",
    "flexinfer",
    "overwrite",
    "timestamp",
    "layers",
    "/cache",
    "/models",
    "abliterated",
    ".partial",
    "FORMAT",
    "GGUF",
    "GPTQ",
    "FP8",
    "COMPRESSED_TENSORS",
    "AWQ",
];

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The lines of `text` before the first line that starts with `#[cfg(test)]`.
fn production_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .take_while(|(_, l)| !l.starts_with("#[cfg(test)]"))
        .map(|(i, l)| (i + 1, l))
}

/// `pub const NAME: &str = "value";` of the contract crate's modules, tests excluded.
fn contract_values(src: &Path) -> Vec<String> {
    let mut values = Vec::new();
    for file in rs_files(src) {
        let text = std::fs::read_to_string(&file).unwrap();
        for (_, line) in production_lines(&text) {
            let Some(rest) = line.trim_start().strip_prefix("pub const ") else {
                continue;
            };
            let Some((name, rest)) = rest.split_once(": &str = \"") else {
                continue;
            };
            if !name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                continue;
            }
            if let Some((value, _)) = rest.split_once("\";") {
                values.push(value.to_string());
            }
        }
    }
    values.sort();
    values.dedup();
    values
}

fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Production source files of every crate but the contract crate.
fn production_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(crates_dir()).unwrap() {
        let krate = entry.unwrap().path();
        if krate.file_name().is_some_and(|n| n == "flexinfer-contract")
            || !krate.join("src").is_dir()
        {
            continue;
        }
        for f in rs_files(&krate.join("src")) {
            let s = f.to_string_lossy().replace('\\', "/");
            let name = f.file_name().unwrap().to_string_lossy();
            if name == "tests.rs"
                || name.ends_with("_tests.rs")
                || s.contains("/tests/")
                || s.contains("/testkit")
            {
                continue;
            }
            out.push(f);
        }
    }
    out.sort();
    out
}

/// Where a checked value is spelled in production code: `file:line: text`.
fn retyped(values: &[String], files: &[(PathBuf, String)]) -> Vec<String> {
    let mut hits = Vec::new();
    for v in values.iter().filter(|v| !GENERIC.contains(&v.as_str())) {
        let needle = format!("\"{v}\"");
        for (path, text) in files {
            for (n, line) in production_lines(text) {
                if line.contains("not-contract:") || !line.contains(&needle) {
                    continue;
                }
                hits.push(format!(
                    "contract string {needle} retyped at {}:{n}: {}",
                    path.display(),
                    line.trim()
                ));
            }
        }
    }
    hits
}

#[test]
fn contract_strings_are_spelled_only_in_the_contract_crate() {
    let values = contract_values(&crates_dir().join("flexinfer-contract/src"));
    assert!(
        values.len() > 50,
        "too few contract strings found ({}): is the parser broken?",
        values.len()
    );
    let files: Vec<(PathBuf, String)> = production_files()
        .into_iter()
        .map(|p| {
            let t = std::fs::read_to_string(&p).unwrap();
            (p, t)
        })
        .collect();
    assert!(
        files.len() > 100,
        "too few production files found ({})",
        files.len()
    );
    let hits = retyped(&values, &files);
    assert!(
        hits.is_empty(),
        "use the constants of crates/flexinfer-contract:\n{}",
        hits.join("\n")
    );
}

#[test]
fn the_check_finds_a_retyped_string_and_honours_the_rules() {
    let values = vec!["flexinfer.ai/requantize".to_string(), "true".to_string()];
    let file = |t: &str| vec![(PathBuf::from("x.rs"), t.to_string())];
    assert_eq!(
        retyped(&values, &file("let a = \"flexinfer.ai/requantize\";")).len(),
        1
    );
    // generic values, opted-out lines and the test module at the end are not production spellings
    assert!(retyped(&values, &file("let a = \"true\";")).is_empty());
    assert!(retyped(
        &values,
        &file("let a = \"flexinfer.ai/requantize\"; // not-contract: why")
    )
    .is_empty());
    assert!(retyped(
        &values,
        &file(
            "fn f() {}\n#[cfg(test)]\nmod tests { const A: &str = \"flexinfer.ai/requantize\"; }"
        )
    )
    .is_empty());
    // a longer string that contains the value is not the value
    assert!(retyped(&values, &file("let a = \"flexinfer.ai/requantize-all\";")).is_empty());
}
