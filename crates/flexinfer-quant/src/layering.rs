//! The crate's layering, checked on its source: lower layers never import higher ones, so no import
//! circle can form across them. `device` (where a group's solve runs) is below `job` (one quantize
//! run); `error` is below `device` (the device's error types live in [`crate::error`]); `memory`
//! imports nothing of the crate.

use std::path::{Path, PathBuf};

/// The `.rs` files under `dir` (or `dir` itself when it is a file).
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_path_buf()];
    }
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The code of `text` without line comments (doc links may name any module).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether `code` imports module `module` of this crate: `crate::module`, `flexinfer_quant::module`,
/// or `module` inside a `crate::{…}` group. With `relative`, `super::module` too (for a top-level
/// module whose own submodules have other names, `super::…::module` can only be the crate's).
fn imports(code: &str, module: &str, relative: bool) -> bool {
    let is_name_end = |rest: &str| !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_');
    let prefixes: &[&str] = if relative {
        &["crate::", "flexinfer_quant::", "super::"]
    } else {
        &["crate::", "flexinfer_quant::"]
    };
    for prefix in prefixes {
        for (i, _) in code.match_indices(prefix) {
            let rest = &code[i + prefix.len()..];
            if let Some(after) = rest.strip_prefix(module) {
                if is_name_end(after) {
                    return true;
                }
            }
            if let Some(group) = rest.strip_prefix('{') {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                if group
                    .split(',')
                    .any(|item| item.trim().split("::").next() == Some(module))
                {
                    return true;
                }
            }
        }
    }
    false
}

/// The files under `src/<lower>` that import one of `higher`, with the module they import.
fn violations(lower: &str, higher: &[&str], relative: bool) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in rust_files(&src.join(lower)) {
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let code = code(&text);
        for module in higher {
            if imports(&code, module, relative) {
                found.push(format!("{} imports crate::{module}", file.display()));
            }
        }
    }
    found
}

#[test]
fn device_does_not_import_job() {
    let found = violations("device", &["job"], true);
    assert!(
        found.is_empty(),
        "device must not depend on job: {found:#?}"
    );
}

#[test]
fn error_does_not_import_device() {
    let mut found = violations("error.rs", &["device"], false);
    found.extend(violations("error", &["device"], false));
    assert!(
        found.is_empty(),
        "error must not depend on device: {found:#?}"
    );
}

#[test]
fn memory_imports_nothing_of_the_crate() {
    let found = violations(
        "memory.rs",
        &["device", "error", "job", "model", "numerics"],
        true,
    );
    assert!(found.is_empty(), "memory must stay a leaf: {found:#?}");
}

#[test]
fn the_import_check_sees_the_forms_of_use() {
    assert!(imports(
        "use crate::job::release_free_memory;",
        "job",
        false
    ));
    assert!(imports("crate::job::release_free_memory();", "job", false));
    assert!(imports(
        "use crate::{error::QuantError, job};",
        "job",
        false
    ));
    assert!(imports("use crate::{job::Run, error};", "job", false));
    assert!(imports("flexinfer_quant::job::run(x)", "job", false));
    assert!(!imports("use crate::jobs::x;", "job", false));
    assert!(!imports("use crate::error::QuantError;", "job", false));
    assert!(!imports(&code("// see crate::job::run"), "job", false));
    assert!(imports("use super::super::job::Run;", "job", true));
    assert!(!imports("use super::job::Run;", "job", false));
}
