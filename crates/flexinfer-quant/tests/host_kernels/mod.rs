//! The host build of `kernels/gptq.cu` (`kernels/host_harness.c`, compiled once per test binary with the
//! system C compiler), shared by tests/kernels.rs and tests/gpu_session.rs.
#![allow(dead_code)]

use libloading::{Library, Symbol};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub const KERNELS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");

/// The harness library.
pub fn host() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gptq-kernels-host");
        std::fs::create_dir_all(&out).unwrap();
        let so = out.join(format!("libgptq_host_{}.so", std::process::id()));
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
        let status = std::process::Command::new(&cc)
            .args([
                "-std=c11",
                "-O2",
                "-ffp-contract=off",
                "-fPIC",
                "-shared",
                "-pthread",
                "-Wall",
                "-Werror",
                "-o",
            ])
            .arg(&so)
            .arg(Path::new(KERNELS).join("host_harness.c"))
            .arg("-lm")
            .status()
            .unwrap_or_else(|e| {
                panic!("running the C compiler {cc:?} (scripts/install-deps.sh installs gcc): {e}")
            });
        assert!(
            status.success(),
            "compiling kernels/host_harness.c failed: {status}"
        );
        // SAFETY: the library was just built from this crate's harness; loading runs no initialisers of note.
        unsafe { Library::new(&so) }.unwrap()
    })
}

/// A harness function; the caller declares its C signature `T`.
pub fn sym<T>(name: &[u8]) -> Symbol<'static, T> {
    // SAFETY: each caller declares the C signature of the harness function it names.
    unsafe { host().get(name) }.unwrap()
}
