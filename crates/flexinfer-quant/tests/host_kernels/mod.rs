//! The host build of `kernels/gptq.cu` (`kernels/host_harness.c`, compiled once per test binary with the
//! system C compiler), shared by tests/kernels.rs and tests/gpu_session.rs.
#![allow(dead_code)]

use libloading::{Library, Symbol};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub const KERNELS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");

/// Compiles the C file `src` into a shared library under the test target directory (once per process) with
/// the flags of the harness: no FP contraction, every warning an error.
pub fn build_shared(src: &Path, stem: &str) -> PathBuf {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gptq-kernels-host");
    std::fs::create_dir_all(&out).unwrap();
    let so = out.join(format!("lib{stem}_{}.so", std::process::id()));
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
        .arg(src)
        .arg("-lm")
        .status()
        .unwrap_or_else(|e| {
            panic!("running the C compiler {cc:?} (scripts/install-deps.sh installs gcc): {e}")
        });
    assert!(
        status.success(),
        "compiling {} failed: {status}",
        src.display()
    );
    so
}

/// The harness library.
pub fn host() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let so = build_shared(&Path::new(KERNELS).join("host_harness.c"), "gptq_host");
        // SAFETY: the library was just built from this crate's harness; loading runs no initialisers of note.
        unsafe { Library::new(&so) }.unwrap()
    })
}

/// A harness function; the caller declares its C signature `T`.
pub fn sym<T>(name: &[u8]) -> Symbol<'static, T> {
    // SAFETY: each caller declares the C signature of the harness function it names.
    unsafe { host().get(name) }.unwrap()
}

/// `gptq_host_launch(name, nargs, gx, gy, gz, bx, by, bz, params)`: a kernel by entry name, its arguments
/// as the driver APIs' `kernelParams` (one pointer per 8-byte argument slot); 0, or −2 for an unknown name
/// or argument count.
pub type LaunchFn = unsafe extern "C" fn(
    *const std::ffi::c_char,
    std::ffi::c_int,
    std::ffi::c_int,
    std::ffi::c_int,
    std::ffi::c_int,
    std::ffi::c_int,
    std::ffi::c_int,
    std::ffi::c_int,
    *mut *mut std::ffi::c_void,
) -> std::ffi::c_int;

/// Launches `kernel` on the host as the session launches it on a card: the arguments in 8-byte slots, the
/// grid and block of `launch`. Returns the harness's status.
///
/// # Safety
/// Every pointer argument must hold what the kernel touches for this launch shape.
pub unsafe fn launch(
    launch: flexinfer_quant::device::kernel::Launch,
    args: &[flexinfer_quant::device::kernel::Arg],
) -> std::ffi::c_int {
    let (grid, block) = (launch.grid, launch.block);
    let mut slots = flexinfer_quant::device::kernel::Arg::slots(args);
    let mut params: Vec<*mut std::ffi::c_void> = slots
        .iter_mut()
        .map(|s| s.as_mut_ptr() as *mut std::ffi::c_void)
        .collect();
    let name = std::ffi::CString::new(launch.kernel.entry()).unwrap();
    let f: Symbol<LaunchFn> = sym(b"gptq_host_launch\0");
    let g = |v: u32| v as std::ffi::c_int;
    f(
        name.as_ptr(),
        args.len() as std::ffi::c_int,
        g(grid[0]),
        g(grid[1]),
        g(grid[2]),
        g(block[0]),
        g(block[1]),
        g(block[2]),
        params.as_mut_ptr(),
    )
}
