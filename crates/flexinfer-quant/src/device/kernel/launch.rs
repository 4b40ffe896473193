//! What the session hands a [`Vendor`]: device addresses, kernel arguments, the kernels of `kernels/gptq.cu`
//! and their launch shapes, and the vendor interface itself.

use super::super::DevResult;

/// A device address (an offset into the device's address space; the host vendor uses host addresses).
pub type DevPtr = u64;

/// One kernel argument, passed by value as the driver APIs' `kernelParams` expect.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(DevPtr),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// The argument's value in an 8-byte slot (native byte order, low bytes for 4-byte values).
    pub fn slot(&self) -> [u8; 8] {
        let mut s = [0u8; 8];
        match *self {
            Arg::Ptr(p) => s.copy_from_slice(&p.to_ne_bytes()),
            Arg::I64(v) => s.copy_from_slice(&v.to_ne_bytes()),
            Arg::I32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
            Arg::F32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
        }
        s
    }

    /// Each argument in its own slot, for a launch's `kernelParams` (`params[i]` points at slot `i`).
    pub fn slots(args: &[Arg]) -> Vec<[u8; 8]> {
        args.iter().map(Arg::slot).collect()
    }
}

/// The kernels of `kernels/gptq.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    HessianLower,
    MirrorLower,
    BlockUpdate,
    SweepBlock,
    FactorFill,
    CholPanelDiag,
    CholPanelRows,
    FactorScale,
    GatherCoef,
    CholTrailing,
    BlockSnapshot,
    GroupParams,
    FactorPivots,
    GatherPanel,
    PrepareRows,
    PermuteSym,
    FwdRmsNorm,
    FwdHeadNorm,
    FwdRope,
    FwdSoftmax,
    FwdActMul,
    FwdAdd,
    FwdAddBias,
    FwdAffine,
}

impl Kernel {
    /// The kernels of the solve session (accumulation, preparation, factorisation, sweep).
    pub const SOLVE: [Kernel; 16] = [
        Kernel::HessianLower,
        Kernel::MirrorLower,
        Kernel::BlockUpdate,
        Kernel::SweepBlock,
        Kernel::FactorFill,
        Kernel::CholPanelDiag,
        Kernel::CholPanelRows,
        Kernel::FactorScale,
        Kernel::GatherCoef,
        Kernel::CholTrailing,
        Kernel::BlockSnapshot,
        Kernel::GroupParams,
        Kernel::FactorPivots,
        Kernel::GatherPanel,
        Kernel::PrepareRows,
        Kernel::PermuteSym,
    ];
    /// The kernels of the calibration forward ([`super::forward`]).
    pub const FORWARD: [Kernel; 8] = [
        Kernel::FwdRmsNorm,
        Kernel::FwdHeadNorm,
        Kernel::FwdRope,
        Kernel::FwdSoftmax,
        Kernel::FwdActMul,
        Kernel::FwdAdd,
        Kernel::FwdAddBias,
        Kernel::FwdAffine,
    ];
    /// Every kernel of `kernels/gptq.cu`.
    pub const ALL: [Kernel; 24] = {
        let mut all = [Kernel::HessianLower; 24];
        let mut i = 0;
        while i < 16 {
            all[i] = Kernel::SOLVE[i];
            i += 1;
        }
        while i < 24 {
            all[i] = Kernel::FORWARD[i - 16];
            i += 1;
        }
        all
    };
    /// The `extern "C"` entry name.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::HessianLower => "gptq_hessian_lower",
            Kernel::MirrorLower => "gptq_mirror_lower",
            Kernel::BlockUpdate => "gptq_block_update",
            Kernel::SweepBlock => "gptq_sweep_block",
            Kernel::FactorFill => "gptq_factor_fill",
            Kernel::CholPanelDiag => "gptq_chol_panel_diag",
            Kernel::CholPanelRows => "gptq_chol_panel_rows",
            Kernel::FactorScale => "gptq_factor_scale",
            Kernel::GatherCoef => "gptq_gather_coef",
            Kernel::CholTrailing => "gptq_chol_trailing",
            Kernel::BlockSnapshot => "gptq_block_snapshot",
            Kernel::GroupParams => "gptq_group_params",
            Kernel::FactorPivots => "gptq_factor_pivots",
            Kernel::GatherPanel => "gptq_gather_panel",
            Kernel::PrepareRows => "gptq_prepare_rows",
            Kernel::PermuteSym => "gptq_permute_sym",
            Kernel::FwdRmsNorm => "fwd_rms_norm",
            Kernel::FwdHeadNorm => "fwd_head_norm",
            Kernel::FwdRope => "fwd_rope",
            Kernel::FwdSoftmax => "fwd_softmax",
            Kernel::FwdActMul => "fwd_act_mul",
            Kernel::FwdAdd => "fwd_add",
            Kernel::FwdAddBias => "fwd_add_bias",
            Kernel::FwdAffine => "fwd_affine",
        }
    }
}

/// The kernel source, for run-time compilation (NVRTC) and the host build in tests.
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/gptq.cu");

/// Thread-block edge of the square kernels (`GPTQ_TILE`).
pub(super) const TILE: u32 = 16;
/// Output tile edge of the product kernels (`GPTQ_WIDE_TILE`; their blocks are `TILE × TILE` threads).
pub(super) const WIDE_TILE: u32 = 64;
/// Threads per block of the sweep kernel (`GPTQ_SWEEP_THREADS`).
pub(super) const SWEEP_THREADS: u32 = 128;
/// Threads per block of the factorisation's row kernel (`GPTQ_COLUMN_THREADS`).
pub(super) const COLUMN_THREADS: u32 = 256;
/// Threads of the factorisation's diagonal-block kernel (`GPTQ_PANEL_THREADS`): the widest panel.
pub(super) const PANEL_THREADS: u32 = 128;
/// Threads per block of the forward's kernels (`GPTQ_FWD_THREADS`).
pub(super) const FWD_THREADS: u32 = 128;
/// Most column strides of the forward's elementwise kernels (their grid y; each block walks its share of the
/// columns).
pub(super) const FWD_COLUMN_BLOCKS: usize = 16;
/// Largest block of the sweep kernel (`GPTQ_MAX_BLOCK`).
pub const MAX_BLOCK: usize = 128;

/// The shape of one kernel launch: the kernel, its grid and its thread block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub kernel: Kernel,
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

impl Launch {
    /// `TILE × TILE` blocks over `cols × rows` elements (grid x over columns, y over rows).
    pub fn tiles(kernel: Kernel, cols: usize, rows: usize) -> Launch {
        Launch {
            kernel,
            grid: [blocks(cols, TILE), blocks(rows, TILE), 1],
            block: [TILE, TILE, 1],
        }
    }
    /// `TILE × TILE` blocks over an `n × n` matrix.
    pub fn square(kernel: Kernel, n: usize) -> Launch {
        Launch::tiles(kernel, n, n)
    }
    /// A product kernel (Hessian, block update, trailing update) over `cols × rows` outputs: `TILE × TILE`
    /// threads per `WIDE_TILE` square (grid x over columns, y over rows).
    pub fn wide(kernel: Kernel, cols: usize, rows: usize) -> Launch {
        Launch {
            kernel,
            grid: [blocks(cols, WIDE_TILE), blocks(rows, WIDE_TILE), 1],
            block: [TILE, TILE, 1],
        }
    }
    /// A forward kernel over `tokens` (grid x, [`FWD_THREADS`] per block) and `heads` (grid y, one block
    /// row per head, or per head of a batch).
    pub fn tokens(kernel: Kernel, tokens: usize, heads: usize) -> Launch {
        Launch {
            kernel,
            grid: [blocks(tokens, FWD_THREADS), heads.max(1) as u32, 1],
            block: [FWD_THREADS, 1, 1],
        }
    }
    /// An elementwise forward kernel over `tokens × cols`: grid x over the tokens, grid y at most
    /// [`FWD_COLUMN_BLOCKS`] (the kernel strides over the columns).
    pub fn columns(kernel: Kernel, tokens: usize, cols: usize) -> Launch {
        Launch {
            kernel,
            grid: [
                blocks(tokens, FWD_THREADS),
                cols.clamp(1, FWD_COLUMN_BLOCKS) as u32,
                1,
            ],
            block: [FWD_THREADS, 1, 1],
        }
    }
    /// One-dimensional blocks of `threads` over `n` elements.
    pub fn rows(kernel: Kernel, n: usize, threads: u32) -> Launch {
        Launch {
            kernel,
            grid: [blocks(n, threads), 1, 1],
            block: [threads, 1, 1],
        }
    }
}

/// A GPU runtime as the session needs it. Every call may fail with a [`DeviceError`]; after a failure the
/// session resets the vendor ([`Vendor::reset`]), after which no earlier allocation is valid.
pub trait Vendor {
    /// Names the device in events (`cuda:0 NVIDIA H200`, `hip:0 gfx1100`).
    fn name(&self) -> String;
    fn alloc(&mut self, bytes: usize) -> DevResult<DevPtr>;
    fn free(&mut self, ptr: DevPtr);
    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> DevResult<()>;
    /// Waits for the work queued before it (so an asynchronous kernel fault surfaces here).
    fn download(&mut self, src: DevPtr, dst: &mut [u8]) -> DevResult<()>;
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> DevResult<()>;
    /// Sets `bytes` bytes at `dst` to zero (default: uploads zeros, 32 MiB at a time; a runtime's memset
    /// does it without the bus).
    fn zero(&mut self, dst: DevPtr, bytes: usize) -> DevResult<()>
    where
        Self: Sized,
    {
        zero_by_upload(self, dst, bytes)
    }
    fn launch(&mut self, launch: Launch, args: &[Arg]) -> DevResult<()>;
    /// A fresh context (the old one may be poisoned by a kernel fault); every allocation is gone.
    fn reset(&mut self) -> DevResult<()>;
    /// Free and total device memory in bytes, when the runtime can tell.
    fn memory(&mut self) -> Option<(u64, u64)>;

    /// Which of the vendor's math libraries this vendor can call (default: none, and the session uses its
    /// own kernels for everything).
    fn math(&self) -> MathLibs {
        MathLibs::default()
    }
    /// BLAS `ssyrk`, lower, transposed: `C += alpha·AᵀA` on the lower triangle of the `n × n` C (`ldc`), A
    /// `k × n` (`lda`); column-major f32. Only called when [`MathLibs::blas`].
    fn syrk_lower(&mut self, _op: &Syrk) -> DevResult<()> {
        Err(no_library(self.name(), "BLAS"))
    }
    /// BLAS `sgemm`: `C += A·B`, A `m × k`, B `k × n`, C `m × n`, column-major f32. Only called when
    /// [`MathLibs::blas`].
    fn gemm_acc(&mut self, _op: &Gemm) -> DevResult<()> {
        Err(no_library(self.name(), "BLAS"))
    }
    /// BLAS `sgemm` (strided-batched when `op.batch` > 1): `C = A·op(B) (+ C when op.accumulate)`, the
    /// forward's products. Only called when [`MathLibs::blas`].
    fn gemm(&mut self, _op: &GemmOp) -> DevResult<()> {
        Err(no_library(self.name(), "BLAS"))
    }
    /// LAPACK `spotrf`, lower, in place: the Cholesky factor of the `n × n` matrix at `a` (`lda`, its lower
    /// triangle read and written), with LAPACK's `info` written to the `i32` at `info` on the device (0, or
    /// `j + 1` when the leading minor of order `j + 1` is not positive definite). Only called when
    /// [`MathLibs::solver`].
    fn potrf_lower(&mut self, _a: DevPtr, _lda: usize, _n: usize, _info: DevPtr) -> DevResult<()> {
        Err(no_library(self.name(), "solver"))
    }
}

/// The vendor math libraries a [`Vendor`] can call on its own context and buffers (cuBLAS / cuSOLVER,
/// rocBLAS / rocSOLVER, loaded at run time by [`super::super::driver`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MathLibs {
    /// [`Vendor::syrk_lower`] and [`Vendor::gemm_acc`]: the Hessian accumulation and the block update.
    pub blas: bool,
    /// [`Vendor::potrf_lower`]: the factorisation.
    pub solver: bool,
}

impl MathLibs {
    /// The libraries in both sets.
    pub fn and(self, other: MathLibs) -> MathLibs {
        MathLibs {
            blas: self.blas && other.blas,
            solver: self.solver && other.solver,
        }
    }
}

/// The arguments of [`Vendor::syrk_lower`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Syrk {
    pub c: DevPtr,
    pub ldc: usize,
    pub a: DevPtr,
    pub lda: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
}

/// The arguments of [`Vendor::gemm_acc`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: DevPtr,
    pub lda: usize,
    pub b: DevPtr,
    pub ldb: usize,
    pub c: DevPtr,
    pub ldc: usize,
}

/// The arguments of [`Vendor::gemm`]: for each of `batch` products, `C = A·B` (`accumulate`: `C += A·B`) with
/// A `m × k` (`lda`), B `k × n` (`ldb`; with `b_trans` stored as its transpose, `n × k`), C `m × n` (`ldc`),
/// column-major f32; product i's matrices start `i·stride_*` floats after the first's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmOp {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: DevPtr,
    pub lda: usize,
    pub b: DevPtr,
    pub ldb: usize,
    pub b_trans: bool,
    pub c: DevPtr,
    pub ldc: usize,
    pub accumulate: bool,
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

impl GemmOp {
    /// Product `i` of the batch alone.
    pub fn single(&self, i: usize) -> GemmOp {
        let at = |p: DevPtr, stride: usize| p + (i * stride * 4) as DevPtr;
        GemmOp {
            a: at(self.a, self.stride_a),
            b: at(self.b, self.stride_b),
            c: at(self.c, self.stride_c),
            batch: 1,
            ..*self
        }
    }
}

fn no_library(device: String, what: &str) -> super::super::DeviceError {
    super::super::DeviceError::new(
        device,
        "math",
        format!("no vendor {what} library is loaded"),
    )
}

/// [`Vendor::zero`] through uploads of zeros, 32 MiB at a time (for a runtime without a memset).
pub fn zero_by_upload<V: Vendor>(v: &mut V, dst: DevPtr, bytes: usize) -> DevResult<()> {
    let chunk = vec![0u8; bytes.min(32 << 20)];
    let mut done = 0;
    while done < bytes {
        let len = chunk.len().min(bytes - done);
        v.upload(dst + done as DevPtr, &chunk[..len])?;
        done += len;
    }
    Ok(())
}

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize).max(1) as u32
}
