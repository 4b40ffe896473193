//! NVRTC, loaded at run time: the CUDA kernels are compiled from `kernels/gptq.cu` to a CUBIN for the
//! device's architecture or to PTX for its compute capability.

use super::api::sym;
use super::NVRTC_LIBRARIES;
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::{Path, PathBuf};

type NvrtcProgram = *mut c_void;

/// Why NVRTC could not be loaded or could not compile.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// No candidate library loaded (each candidate's error).
    #[error("NVRTC not found: {}", .0.iter().map(|e| flexinfer_contract::error::chain(e)).collect::<Vec<_>>().join("; "))]
    NotFound(Vec<NvrtcError>),
    #[error("{}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: libloading::Error,
    },
    /// An entry point is missing from the library.
    #[error("{0}")]
    Symbol(String),
    /// An NVRTC call other than the compile failed (`nvrtcResult` code).
    #[error("{call} returned {code}")]
    Call { call: String, code: c_int },
    /// The compiler refused the source; `log` is its message.
    #[error("nvrtcCompileProgram returned {code}:\n{log}")]
    Compile { code: c_int, log: String },
    /// The compile succeeded but produced no output of the kind asked for.
    #[error("{0}: no output (a CUBIN needs a real architecture, sm_XY)")]
    NoOutput(String),
    /// A source, name or option with a NUL byte.
    #[error("{what}")]
    Nul {
        what: String,
        #[source]
        source: std::ffi::NulError,
    },
}

/// NVRTC, loaded at run time: compiles `kernels/gptq.cu` to PTX.
pub struct Nvrtc {
    lib: Library,
    pub path: PathBuf,
    /// NVRTC opens `libnvrtc-builtins.so.<ver>` by name at compile time; a copy beside libnvrtc that is not
    /// on the library path is loaded first (the dynamic loader then finds it by its soname).
    _builtins: Option<Library>,
}

impl Nvrtc {
    /// `$FLEXINFER_NVRTC`, else [`NVRTC_LIBRARIES`] on the library path.
    pub fn load() -> Result<Nvrtc, NvrtcError> {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(p) = std::env::var_os("FLEXINFER_NVRTC") {
            candidates.push(PathBuf::from(p));
        }
        candidates.extend(NVRTC_LIBRARIES.iter().map(PathBuf::from));
        let mut errors = Vec::new();
        for p in candidates {
            match Nvrtc::load_from(&p) {
                Ok(n) => return Ok(n),
                Err(e) => errors.push(e),
            }
        }
        Err(NvrtcError::NotFound(errors))
    }

    /// libnvrtc at `path` (a file, or a name the dynamic loader resolves).
    pub fn load_from(path: &Path) -> Result<Nvrtc, NvrtcError> {
        let builtins = path.parent().and_then(|dir| {
            let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
                .ok()?
                .flatten()
                .map(|e| e.path())
                .filter(|f| {
                    let n = f
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .to_string();
                    n.starts_with("libnvrtc-builtins.so") && !n.contains("alt")
                })
                .collect();
            names.sort();
            // SAFETY: NVRTC's own companion library, loaded as NVRTC itself would load it.
            names
                .into_iter()
                .find_map(|f| unsafe { Library::new(&f) }.ok())
        });
        // SAFETY: loading NVRTC runs its initialisers, which are made for run-time loading.
        let lib = unsafe { Library::new(path) }.map_err(|source| NvrtcError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Nvrtc {
            lib,
            path: path.to_path_buf(),
            _builtins: builtins,
        })
    }

    fn f<T: Copy>(&self, name: &str) -> Result<T, NvrtcError> {
        sym::<T>(&self.lib, &self.path.display().to_string(), name)
            .map_err(|e| NvrtcError::Symbol(e.message))
    }

    /// NVRTC's version `(major, minor)`.
    pub fn version(&self) -> Result<(i32, i32), NvrtcError> {
        let v: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int = self.f("nvrtcVersion")?;
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers.
        match unsafe { v(&mut a, &mut b) } {
            0 => Ok((a, b)),
            code => Err(NvrtcError::Call {
                call: "nvrtcVersion".into(),
                code,
            }),
        }
    }

    /// Compiles `src` with `opts` (`--gpu-architecture=compute_XY`): the PTX text, or the compiler's log.
    pub fn compile(&self, src: &str, name: &str, opts: &[&str]) -> Result<String, NvrtcError> {
        let ptx = self.compile_image(src, name, opts, Output::Ptx)?;
        Ok(String::from_utf8_lossy(&ptx)
            .trim_end_matches('\0')
            .to_string())
    }

    /// Compiles `src` with `opts` to `output`: the image as NVRTC returns it (PTX NUL-terminated, ready for
    /// the driver's module load), or the compiler's log. A CUBIN needs `--gpu-architecture=sm_XY`; it loads
    /// on a driver older than this NVRTC within its major version, where PTX of a newer ISA does not
    /// (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`); NVRTC before 11.1 has no CUBIN output (an error here).
    pub fn compile_image(
        &self,
        src: &str,
        name: &str,
        opts: &[&str],
        output: Output,
    ) -> Result<Vec<u8>, NvrtcError> {
        let e = self.entries(output)?;
        let (src_c, name_c, opts_c) = c_strings(src, name, opts)?;
        let opt_ptrs: Vec<*const c_char> = opts_c.iter().map(|o| o.as_ptr()).collect();
        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: NVRTC's C API with valid NUL-terminated strings and out-pointers; the program is destroyed
        // before returning.
        unsafe {
            let rc = (e.create)(
                &mut prog,
                src_c.as_ptr(),
                name_c.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if rc != 0 {
                return Err(NvrtcError::Call {
                    call: "nvrtcCreateProgram".into(),
                    code: rc,
                });
            }
            let rc = (e.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let log = program_log(prog, &e);
            let out = if rc == 0 {
                program_output(prog, &e)
            } else {
                Err(NvrtcError::Compile { code: rc, log })
            };
            (e.destroy)(&mut prog);
            out
        }
    }

    /// The NVRTC entry points one compile to `output` calls, looked up in the order of their use (the
    /// first missing one is the error).
    fn entries(&self, output: Output) -> Result<Entries, NvrtcError> {
        let (size_name, get_name) = match output {
            Output::Ptx => ("nvrtcGetPTXSize", "nvrtcGetPTX"),
            Output::Cubin => ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
        };
        Ok(Entries {
            create: self.f("nvrtcCreateProgram")?,
            compile: self.f("nvrtcCompileProgram")?,
            log_size: self.f("nvrtcGetProgramLogSize")?,
            get_log: self.f("nvrtcGetProgramLog")?,
            out_size: self.f(size_name)?,
            get_out: self.f(get_name)?,
            destroy: self.f("nvrtcDestroyProgram")?,
            size_name,
            get_name,
        })
    }
}

type CreateFn = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut NvrtcProgram) -> c_int;

/// NVRTC's entry points for one compile, with the names of the output's `size` / `get` pair (PTX or
/// CUBIN) for its errors.
struct Entries {
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    get_log: GetFn,
    out_size: SizeFn,
    get_out: GetFn,
    destroy: DestroyFn,
    size_name: &'static str,
    get_name: &'static str,
}

/// `src`, `name` and each of `opts` as C strings; one with a NUL byte is an error naming the program
/// (`name`).
fn c_strings(
    src: &str,
    name: &str,
    opts: &[&str],
) -> Result<(CString, CString, Vec<CString>), NvrtcError> {
    let cstr = |s: &str| {
        CString::new(s).map_err(|source| NvrtcError::Nul {
            what: name.to_string(),
            source,
        })
    };
    let src_c = cstr(src)?;
    let name_c = cstr(name)?;
    let opts_c = opts
        .iter()
        .map(|o| cstr(o))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((src_c, name_c, opts_c))
}

/// The compiler's log of `prog`, without its trailing NULs; empty when NVRTC cannot give it.
///
/// # Safety
/// `prog` is an NVRTC program made by `e.create`; `e` holds the named NVRTC entry points.
unsafe fn program_log(prog: NvrtcProgram, e: &Entries) -> String {
    let mut n = 0usize;
    if (e.log_size)(prog, &mut n) != 0 {
        return String::new();
    }
    let mut buf = vec![0u8; n.max(1)];
    if (e.get_log)(prog, buf.as_mut_ptr() as *mut c_char) != 0 {
        return String::new();
    }
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string()
}

/// The compiled program's output through NVRTC's `size` / `get` pair (PTX or CUBIN).
///
/// # Safety
/// `prog` is a compiled NVRTC program; `e` holds the named NVRTC entry points.
unsafe fn program_output(prog: NvrtcProgram, e: &Entries) -> Result<Vec<u8>, NvrtcError> {
    let mut n = 0usize;
    match (e.out_size)(prog, &mut n) {
        0 if n == 0 => Err(NvrtcError::NoOutput(e.get_name.to_string())),
        0 => {
            let mut bytes = vec![0u8; n];
            match (e.get_out)(prog, bytes.as_mut_ptr() as *mut c_char) {
                0 => Ok(bytes),
                code => Err(NvrtcError::Call {
                    call: e.get_name.to_string(),
                    code,
                }),
            }
        }
        code => Err(NvrtcError::Call {
            call: e.size_name.to_string(),
            code,
        }),
    }
}

/// What [`Nvrtc::compile_image`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// PTX for `compute_XY`, compiled by the driver when it loads it.
    Ptx,
    /// Machine code for `sm_XY`.
    Cubin,
}

impl Output {
    /// `--gpu-architecture=` for compute capability `major.minor`.
    pub fn arch(self, major: i32, minor: i32) -> String {
        match self {
            Output::Ptx => format!("--gpu-architecture=compute_{major}{minor}"),
            Output::Cubin => format!("--gpu-architecture=sm_{major}{minor}"),
        }
    }
}
