//! The vendors' BLAS and solver libraries, loaded at run time with `dlopen` next to the runtime: cuBLAS and
//! cuSOLVER for CUDA, rocBLAS and rocSOLVER for HIP. Where they load, the session uses `ssyrk` for the
//! Hessian accumulation, `sgemm` for the sweep's block update and `spotrf` for the factorisation instead of
//! the kernels of `gptq.cu` (docs/dev/gptq-device.md, "The GPU session"); where they do not, nothing changes.
//!
//! Every call runs on the vendor's context (made current by the caller) and on the runtime's default stream,
//! the stream the kernels are launched on, so library calls and kernel launches stay in order. The handles
//! are created at the first call and destroyed before the context is reset.

use super::super::kernel::{DevPtr, Gemm, GemmOp, MathLibs, Syrk};
use super::super::DeviceKind;
use flexinfer_contract::error::chain;
use libloading::Library;
use std::ffi::{c_int, c_void};

/// cuBLAS names tried in order (after `$FLEXINFER_CUBLAS`).
pub const CUBLAS_LIBRARIES: &[&str] = &[
    "libcublas.so.13",
    "libcublas.so.12",
    "libcublas.so.11",
    "libcublas.so",
];
/// cuSOLVER names tried in order (after `$FLEXINFER_CUSOLVER`).
pub const CUSOLVER_LIBRARIES: &[&str] =
    &["libcusolver.so.12", "libcusolver.so.11", "libcusolver.so"];
/// rocBLAS names tried in order (after `$FLEXINFER_ROCBLAS`): ROCm 7 and 6 releases, Debian's.
pub const ROCBLAS_LIBRARIES: &[&str] = &[
    "librocblas.so.5",
    "librocblas.so.4",
    "librocblas.so.0",
    "librocblas.so",
];
/// rocSOLVER names tried in order (after `$FLEXINFER_ROCSOLVER`).
pub const ROCSOLVER_LIBRARIES: &[&str] = &["librocsolver.so.0", "librocsolver.so"];

type Handle = *mut c_void;
type CreateFn = unsafe extern "C" fn(*mut Handle) -> c_int;
type DestroyFn = unsafe extern "C" fn(Handle) -> c_int;
/// `sgemm(handle, transa, transb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc)` (cuBLAS and rocBLAS).
type SgemmFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    *mut f32,
    c_int,
) -> c_int;
/// `sgemmStridedBatched(handle, transa, transb, m, n, k, *alpha, A, lda, strideA, B, ldb, strideB, *beta, C,
/// ldc, strideC, batchCount)` (cuBLAS `cublasSgemmStridedBatched`, rocBLAS `rocblas_sgemm_strided_batched`).
type SgemmBatchedFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    i64,
    *const f32,
    c_int,
    i64,
    *const f32,
    *mut f32,
    c_int,
    i64,
    c_int,
) -> c_int;
/// `ssyrk(handle, uplo, trans, n, k, *alpha, A, lda, *beta, C, ldc)` (cuBLAS and rocBLAS).
type SsyrkFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    *const f32,
    *mut f32,
    c_int,
) -> c_int;
/// `cusolverDnSpotrf_bufferSize(handle, uplo, n, A, lda, *lwork)`.
type CuPotrfSizeFn =
    unsafe extern "C" fn(Handle, c_int, c_int, *mut f32, c_int, *mut c_int) -> c_int;
/// `cusolverDnSpotrf(handle, uplo, n, A, lda, work, lwork, devInfo)`.
type CuPotrfFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    *mut f32,
    c_int,
    *mut f32,
    c_int,
    *mut c_int,
) -> c_int;
/// `rocsolver_spotrf(handle, uplo, n, A, lda, info)` (`info` on the device).
type RocPotrfFn = unsafe extern "C" fn(Handle, c_int, c_int, *mut f32, c_int, *mut c_int) -> c_int;

/// The enum values of one BLAS API (cuBLAS counts from 0; rocBLAS uses the CBLAS numbers).
#[derive(Clone, Copy)]
struct Enums {
    no_trans: c_int,
    trans: c_int,
    lower: c_int,
}

const CUBLAS_ENUMS: Enums = Enums {
    no_trans: 0, // CUBLAS_OP_N
    trans: 1,    // CUBLAS_OP_T
    lower: 0,    // CUBLAS_FILL_MODE_LOWER
};
const ROCBLAS_ENUMS: Enums = Enums {
    no_trans: 111, // rocblas_operation_none
    trans: 112,    // rocblas_operation_transpose
    lower: 122,    // rocblas_fill_lower
};

struct Blas {
    _lib: Library,
    library: String,
    create: CreateFn,
    destroy: DestroyFn,
    sgemm: SgemmFn,
    ssyrk: SsyrkFn,
    /// The strided-batched sgemm, where the library has it (else a batch is a loop of `sgemm` calls).
    sgemm_batched: Option<SgemmBatchedFn>,
    names: [&'static str; 2],
    enums: Enums,
    handle: Handle,
}

enum SolverApi {
    /// cuSOLVER: its own handle and a workspace the caller provides.
    Cuda {
        create: CreateFn,
        destroy: DestroyFn,
        size: CuPotrfSizeFn,
        potrf: CuPotrfFn,
        handle: Handle,
    },
    /// rocSOLVER: runs on the rocBLAS handle and allocates its own workspace.
    Hip { potrf: RocPotrfFn },
}

struct Solver {
    _lib: Library,
    library: String,
    api: SolverApi,
}

/// The libraries of one runtime that loaded, and why the others did not. [`super::DriverVendor`] owns one
/// and calls it on its context; the calls are `unsafe` because the addresses go to the vendor's C API as
/// they are.
pub struct MathLibraries {
    blas: Option<Blas>,
    solver: Option<Solver>,
    /// Why a library is not used (not found, a missing symbol, switched off, its self-test failed).
    pub missing: Vec<String>,
    /// The libraries dropped after loading (a failed self-test), with the reason: named in the device name.
    dropped: Vec<String>,
}

// SAFETY: the library handles are only used through `&mut self`, so never by two threads at once, and the
// vendors' handles may move between threads (the session serialises its calls through a mutex and makes the
// vendor's context current on the calling thread first).
unsafe impl Send for MathLibraries {}

/// Why a vendor math library cannot be used, or why a call to it failed.
#[derive(Debug, thiserror::Error)]
pub enum MathError {
    /// The CPU has no vendor libraries.
    #[error("not a GPU")]
    NotAGpu,
    /// None of the library's names could be loaded: each name's loader error, in order.
    #[error("{}", join(.0))]
    NotLoaded(Vec<libloading::Error>),
    /// The library lacks the entry point `name`.
    #[error("{library}: {name}")]
    MissingSymbol {
        library: String,
        name: &'static str,
        #[source]
        source: libloading::Error,
    },
    #[error("no BLAS library")]
    NoBlas,
    #[error("no solver library")]
    NoSolver,
    /// A call returned a status other than success.
    #[error("{call} returned status {status}")]
    Status { call: String, status: c_int },
    #[error("dimension {0} exceeds the library's 32-bit int")]
    Dimension(usize),
    #[error("stride {0} exceeds i64")]
    Stride(usize),
}

fn join(errors: &[libloading::Error]) -> String {
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    texts.join("; ")
}

/// A library's status that is not success, naming the call.
fn status(call: &str, rc: c_int) -> Result<(), MathError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(MathError::Status {
            call: call.to_string(),
            status: rc,
        })
    }
}

/// Where a library's override comes from: the environment variable's value (`FLEXINFER_CUBLAS` & co.).
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn open(lookup: Lookup<'_>, env: &str, names: &[&str]) -> Result<(Library, String), MathError> {
    let mut tried: Vec<String> = lookup(env).into_iter().collect();
    tried.extend(names.iter().map(|s| s.to_string()));
    let mut errors = Vec::new();
    for name in &tried {
        // SAFETY: loading a vendor library runs its initialisers, as any application linking it does.
        match unsafe { Library::new(name) } {
            Ok(lib) => return Ok((lib, name.clone())),
            Err(e) => errors.push(e),
        }
    }
    Err(MathError::NotLoaded(errors))
}

/// The symbol `name` of `lib` with the C signature `T`.
fn sym<T: Copy>(lib: &Library, library: &str, name: &'static str) -> Result<T, MathError> {
    let mut z = name.as_bytes().to_vec();
    z.push(0);
    // SAFETY: the caller declares `T` as the documented C signature of `name`.
    unsafe { lib.get::<T>(&z) }
        .map(|s| *s)
        .map_err(|source| MathError::MissingSymbol {
            library: library.to_string(),
            name,
            source,
        })
}

impl MathLibraries {
    /// None loaded, with the reason.
    pub(super) fn none(reason: &str) -> MathLibraries {
        MathLibraries {
            blas: None,
            solver: None,
            missing: vec![reason.to_string()],
            dropped: Vec::new(),
        }
    }

    /// The BLAS and solver libraries of `kind`'s runtime that load and have every entry point used.
    pub fn load(kind: DeviceKind) -> MathLibraries {
        Self::load_from(kind, &|var| std::env::var(var).ok())
    }

    /// As [`MathLibraries::load`], the overrides read through `lookup` instead of the environment.
    pub fn load_from(kind: DeviceKind, lookup: Lookup<'_>) -> MathLibraries {
        let mut missing = Vec::new();
        let blas = match Self::load_blas(kind, lookup) {
            Ok(b) => Some(b),
            Err(e) => {
                missing.push(format!("BLAS: {}", chain(&e)));
                None
            }
        };
        let solver = match (kind, &blas) {
            // rocSOLVER works on a rocBLAS handle.
            (DeviceKind::Hip, None) => {
                missing.push("solver: rocSOLVER needs rocBLAS".into());
                None
            }
            _ => match Self::load_solver(kind, lookup) {
                Ok(s) => Some(s),
                Err(e) => {
                    missing.push(format!("solver: {}", chain(&e)));
                    None
                }
            },
        };
        MathLibraries {
            blas,
            solver,
            missing,
            dropped: Vec::new(),
        }
    }

    fn load_blas(kind: DeviceKind, lookup: Lookup<'_>) -> Result<Blas, MathError> {
        let (env, names, calls, enums, batched) = match kind {
            DeviceKind::Cuda => (
                "FLEXINFER_CUBLAS",
                CUBLAS_LIBRARIES,
                [
                    "cublasCreate_v2",
                    "cublasDestroy_v2",
                    "cublasSgemm_v2",
                    "cublasSsyrk_v2",
                ],
                CUBLAS_ENUMS,
                "cublasSgemmStridedBatched",
            ),
            DeviceKind::Hip => (
                "FLEXINFER_ROCBLAS",
                ROCBLAS_LIBRARIES,
                [
                    "rocblas_create_handle",
                    "rocblas_destroy_handle",
                    "rocblas_sgemm",
                    "rocblas_ssyrk",
                ],
                ROCBLAS_ENUMS,
                "rocblas_sgemm_strided_batched",
            ),
            DeviceKind::Cpu => return Err(MathError::NotAGpu),
        };
        let (lib, library) = open(lookup, env, names)?;
        Ok(Blas {
            create: sym(&lib, &library, calls[0])?,
            destroy: sym(&lib, &library, calls[1])?,
            sgemm: sym(&lib, &library, calls[2])?,
            ssyrk: sym(&lib, &library, calls[3])?,
            sgemm_batched: sym(&lib, &library, batched).ok(),
            names: [calls[2], calls[3]],
            enums,
            handle: std::ptr::null_mut(),
            _lib: lib,
            library,
        })
    }

    fn load_solver(kind: DeviceKind, lookup: Lookup<'_>) -> Result<Solver, MathError> {
        match kind {
            DeviceKind::Cuda => {
                let (lib, library) = open(lookup, "FLEXINFER_CUSOLVER", CUSOLVER_LIBRARIES)?;
                let api = SolverApi::Cuda {
                    create: sym(&lib, &library, "cusolverDnCreate")?,
                    destroy: sym(&lib, &library, "cusolverDnDestroy")?,
                    size: sym(&lib, &library, "cusolverDnSpotrf_bufferSize")?,
                    potrf: sym(&lib, &library, "cusolverDnSpotrf")?,
                    handle: std::ptr::null_mut(),
                };
                Ok(Solver {
                    _lib: lib,
                    library,
                    api,
                })
            }
            DeviceKind::Hip => {
                let (lib, library) = open(lookup, "FLEXINFER_ROCSOLVER", ROCSOLVER_LIBRARIES)?;
                let api = SolverApi::Hip {
                    potrf: sym(&lib, &library, "rocsolver_spotrf")?,
                };
                Ok(Solver {
                    _lib: lib,
                    library,
                    api,
                })
            }
            DeviceKind::Cpu => Err(MathError::NotAGpu),
        }
    }

    /// Stops using the BLAS (and rocSOLVER, which runs on its handle) for `why`.
    pub(super) fn drop_blas(&mut self, why: String) {
        self.drop_handles();
        if let Some(b) = self.blas.take() {
            self.missing.push(format!("BLAS: {why}"));
            self.dropped.push(format!("{}: {why}", b.library));
        }
        if matches!(
            self.solver,
            Some(Solver {
                api: SolverApi::Hip { .. },
                ..
            })
        ) {
            self.solver = None;
            self.missing.push("solver: rocSOLVER needs rocBLAS".into());
        }
    }

    /// Stops using the solver for `why`.
    pub(super) fn drop_solver(&mut self, why: String) {
        if let Some(s) = self.solver.take() {
            self.missing.push(format!("solver: {why}"));
            self.dropped.push(format!("{}: {why}", s.library));
        }
    }

    /// The libraries loaded (and not dropped).
    pub fn libs(&self) -> MathLibs {
        MathLibs {
            blas: self.blas.is_some(),
            solver: self.solver.is_some(),
        }
    }

    /// What the device name says: the libraries in use, or that the kernels do everything.
    pub fn describe(&self) -> String {
        let used: Vec<&str> = [
            self.blas.as_ref().map(|b| b.library.as_str()),
            self.solver.as_ref().map(|s| s.library.as_str()),
        ]
        .into_iter()
        .flatten()
        .collect();
        let used = if used.is_empty() {
            "own kernels only".into()
        } else {
            used.join(", ")
        };
        match self.dropped.is_empty() {
            true => used,
            false => format!("{used}; not used: {}", self.dropped.join("; ")),
        }
    }

    /// The BLAS handle, created at the first call (on the current context).
    fn blas(&mut self) -> Result<&Blas, MathError> {
        let b = self.blas.as_mut().ok_or(MathError::NoBlas)?;
        if b.handle.is_null() {
            let mut h: Handle = std::ptr::null_mut();
            // SAFETY: an out-pointer; the vendor's context is current.
            status(&format!("{} create", b.library), unsafe {
                (b.create)(&mut h)
            })?;
            b.handle = h;
        }
        Ok(b)
    }

    /// `C += alpha·AᵀA`, lower triangle.
    ///
    /// # Safety
    /// The vendor's context is current on this thread, and `op.a` / `op.c` are its device allocations
    /// holding `k × n` (`lda`) and `n × n` (`ldc`) floats.
    pub unsafe fn syrk(&mut self, op: &Syrk) -> Result<(), MathError> {
        let b = self.blas()?;
        let (alpha, beta) = (op.alpha, 1.0f32);
        // SAFETY: the caller's contract (the buffers, the context); alpha and beta are host scalars (the
        // default pointer mode).
        let rc = unsafe {
            (b.ssyrk)(
                b.handle,
                b.enums.lower,
                b.enums.trans,
                int(op.n)?,
                int(op.k)?,
                &alpha,
                op.a as usize as *const f32,
                int(op.lda)?,
                &beta,
                op.c as usize as *mut f32,
                int(op.ldc)?,
            )
        };
        status(b.names[1], rc)
    }

    /// `C += A·B`.
    ///
    /// # Safety
    /// As [`MathLibraries::syrk`], with A `m × k` (`lda`), B `k × n` (`ldb`), C `m × n` (`ldc`).
    pub unsafe fn gemm(&mut self, op: &Gemm) -> Result<(), MathError> {
        let single = GemmOp {
            m: op.m,
            n: op.n,
            k: op.k,
            a: op.a,
            lda: op.lda,
            b: op.b,
            ldb: op.ldb,
            b_trans: false,
            c: op.c,
            ldc: op.ldc,
            accumulate: true,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        };
        // SAFETY: the caller's contract is `gemm_op`'s for this one product (`sgemm` with β = 1).
        unsafe { self.gemm_op(&single) }
    }

    /// The forward's products: `C = A·op(B)` (or `+=`), strided-batched where the library has the call.
    ///
    /// # Safety
    /// As [`MathLibraries::syrk`], with every product's A `m × k` (`lda`), B `k × n` or `n × k` (`ldb`) and C
    /// `m × n` (`ldc`) inside allocations of the context.
    pub unsafe fn gemm_op(&mut self, op: &GemmOp) -> Result<(), MathError> {
        let b = self.blas()?;
        let (one, beta) = (1.0f32, if op.accumulate { 1.0f32 } else { 0.0 });
        let transb = if op.b_trans {
            b.enums.trans
        } else {
            b.enums.no_trans
        };
        let (m, n, k) = (int(op.m)?, int(op.n)?, int(op.k)?);
        let (lda, ldb, ldc) = (int(op.lda)?, int(op.ldb)?, int(op.ldc)?);
        if op.batch > 1 {
            if let Some(batched) = b.sgemm_batched {
                let stride = |s: usize| i64::try_from(s).map_err(|_| MathError::Stride(s));
                // SAFETY: the caller's contract for every product of the batch; scalars on the host.
                let rc = unsafe {
                    batched(
                        b.handle,
                        b.enums.no_trans,
                        transb,
                        m,
                        n,
                        k,
                        &one,
                        op.a as usize as *const f32,
                        lda,
                        stride(op.stride_a)?,
                        op.b as usize as *const f32,
                        ldb,
                        stride(op.stride_b)?,
                        &beta,
                        op.c as usize as *mut f32,
                        ldc,
                        stride(op.stride_c)?,
                        int(op.batch)?,
                    )
                };
                return status("sgemm (strided batched)", rc);
            }
        }
        for i in 0..op.batch {
            let p = op.single(i);
            // SAFETY: as above, product i alone.
            let rc = unsafe {
                (b.sgemm)(
                    b.handle,
                    b.enums.no_trans,
                    transb,
                    m,
                    n,
                    k,
                    &one,
                    p.a as usize as *const f32,
                    lda,
                    p.b as usize as *const f32,
                    ldb,
                    &beta,
                    p.c as usize as *mut f32,
                    ldc,
                )
            };
            status(b.names[0], rc)?;
        }
        Ok(())
    }

    /// The workspace floats cuSOLVER's `spotrf` needs for this matrix (0 for rocSOLVER, which allocates its
    /// own).
    ///
    /// # Safety
    /// The vendor's context is current, and `a` is its device allocation of an `n × n` (`lda`) matrix.
    pub unsafe fn potrf_workspace(
        &mut self,
        a: DevPtr,
        lda: usize,
        n: usize,
    ) -> Result<usize, MathError> {
        let s = self.solver.as_mut().ok_or(MathError::NoSolver)?;
        let SolverApi::Cuda {
            create,
            size,
            handle,
            ..
        } = &mut s.api
        else {
            return Ok(0);
        };
        if handle.is_null() {
            let mut h: Handle = std::ptr::null_mut();
            // SAFETY: an out-pointer; the vendor's context is current.
            status("cusolverDnCreate", unsafe { create(&mut h) })?;
            *handle = h;
        }
        let mut lwork: c_int = 0;
        // SAFETY: `a` is an `n × n` (lda) device matrix of the current context; an out-pointer.
        let rc = unsafe {
            size(
                *handle,
                CUBLAS_ENUMS.lower,
                int(n)?,
                a as usize as *mut f32,
                int(lda)?,
                &mut lwork,
            )
        };
        status("cusolverDnSpotrf_bufferSize", rc)?;
        Ok(lwork.max(1) as usize)
    }

    /// `spotrf`, lower, in place; `info` (an `i32` on the device) gets LAPACK's info. `work` holds the floats
    /// [`MathLibraries::potrf_workspace`] asked for.
    ///
    /// # Safety
    /// As [`MathLibraries::potrf_workspace`]; `info` is a device `i32` and `work` a device buffer of that many
    /// floats, of the same context.
    pub unsafe fn potrf(
        &mut self,
        a: DevPtr,
        lda: usize,
        n: usize,
        info: DevPtr,
        work: (DevPtr, usize),
    ) -> Result<(), MathError> {
        let rocblas = match &self.solver {
            Some(Solver {
                api: SolverApi::Hip { .. },
                ..
            }) => Some(self.blas()?.handle),
            _ => None,
        };
        let s = self.solver.as_mut().ok_or(MathError::NoSolver)?;
        let (n, lda) = (int(n)?, int(lda)?);
        let (pa, pinfo) = (a as usize as *mut f32, info as usize as *mut c_int);
        // SAFETY: `a` is an `n × n` (lda) device matrix of the current context, `info` a device i32, `work`
        // a device buffer of the floats the size query asked for; the handles belong to this context.
        let rc = unsafe {
            match &s.api {
                SolverApi::Cuda { potrf, handle, .. } => potrf(
                    *handle,
                    CUBLAS_ENUMS.lower,
                    n,
                    pa,
                    lda,
                    work.0 as usize as *mut f32,
                    int(work.1)?,
                    pinfo,
                ),
                SolverApi::Hip { potrf } => potrf(
                    rocblas.unwrap_or(std::ptr::null_mut()),
                    ROCBLAS_ENUMS.lower,
                    n,
                    pa,
                    lda,
                    pinfo,
                ),
            }
        };
        let call = match s.api {
            SolverApi::Cuda { .. } => "cusolverDnSpotrf",
            SolverApi::Hip { .. } => "rocsolver_spotrf",
        };
        status(call, rc)
    }

    /// Destroys the handles (before the context they belong to goes); the next call creates new ones.
    /// Errors are ignored: a context poisoned by a fault may refuse, and it is about to be destroyed.
    pub fn drop_handles(&mut self) {
        if let Some(s) = self.solver.as_mut() {
            if let SolverApi::Cuda {
                destroy, handle, ..
            } = &mut s.api
            {
                if !handle.is_null() {
                    // SAFETY: a handle this library created on the still current context, destroyed once.
                    unsafe { destroy(*handle) };
                    *handle = std::ptr::null_mut();
                }
            }
        }
        if let Some(b) = self.blas.as_mut() {
            if !b.handle.is_null() {
                // SAFETY: as above.
                unsafe { (b.destroy)(b.handle) };
                b.handle = std::ptr::null_mut();
            }
        }
    }
}

fn int(v: usize) -> Result<c_int, MathError> {
    c_int::try_from(v).map_err(|_| MathError::Dimension(v))
}
