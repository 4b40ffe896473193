//! The GPU solve session: [`KernelOps`] implements [`DeviceOps`] with the kernels of `kernels/gptq.cu`,
//! launched through a [`Vendor`] (device memory, copies, launches by entry name). The CUDA and HIP runtimes
//! are vendors ([`super::driver`]); so is the host build of the same kernel source in the tests, which is
//! how this file is tested without a GPU (docs/dev/gptq-device.md).
//!
//! Where each step runs:
//! - accumulation: `gptq_hessian_lower` on the device (one upload of each batch);
//! - preparation, on the device: `gptq_mirror_lower`, `gptq_prepare_rows` (non-finite entries to 0, a zero
//!   diagonal entry to 1; each row's count and the diagonal downloaded: 2n values), and for act-order the
//!   permutation, decided on the host from that diagonal by the CPU's rule (`hessian::prepared_diagonal`), uploaded
//!   (n indices) and applied by `gptq_permute_sym` into a new buffer. The prepared Hessian is then
//!   downloaded once: the host checkpoint that [`OpsSession`] needs;
//! - each factorisation attempt: only the diagonal is uploaded; `gptq_factor_fill`, then per panel of ≤ 128
//!   columns `gptq_chol_panel_diag`, `gptq_chol_panel_rows` and `gptq_chol_trailing`, then
//!   `gptq_factor_scale`; the status words and the n pivots are downloaded;
//! - each module's sweep: W, `R²` and the group of each column uploaded once (with the group parameters
//!   fixed before the sweep: one group per row, static groups); per block of ≤ 128 columns, where groups
//!   start, `gptq_gather_coef`, `gptq_block_snapshot` and `gptq_group_params` (the block-start snapshot and
//!   each group's parameters, on the device), then `gptq_gather_coef`, `gptq_sweep_block` and
//!   `gptq_block_update` of all later columns; nothing is transferred until the codes, the group
//!   parameters and every block's row losses are downloaded at the end, so the launches are queued
//!   without waiting.
//!
//! Numerics: the sweep kernel gives the CPU's bits for the same inputs; the factorisation and the GEMMs sum
//! in another order than faer, so the result is close to the CPU's, not equal (tests/gpu_session.rs states
//! the bounds).

use super::{
    CpuSession, DevResult, Device, DeviceError, DeviceKind, DeviceOps, Handover, OpsSession,
    PreparedMeta, Resident, Session, SweepJob,
};
use crate::numerics::gptq::{GroupLayout, QuantizedLinear};
use crate::numerics::hessian::prepared_diagonal;
use crate::numerics::linalg::CpuBackend;
use crate::params::{ColumnOrder, GptqParams};
use faer::{Mat, MatRef};
use forward::{ForwardOps, ForwardPass};
use std::sync::{Mutex, MutexGuard};

pub mod forward;
mod launch;
mod math_check;
mod sweep;

pub use launch::{
    zero_by_upload, Arg, DevPtr, Gemm, GemmOp, Kernel, Launch, MathLibs, Syrk, Vendor,
    KERNEL_SOURCE, MAX_BLOCK,
};
use launch::{COLUMN_THREADS, PANEL_THREADS, SWEEP_THREADS, TILE};
pub use math_check::{math_self_test, MathSelfTest, SelfTestError};

/// The vendor shared by the sessions of one device, which context generation is current, and which of the
/// vendor's math libraries the sessions may call.
struct Shared<V> {
    vendor: V,
    generation: u64,
    /// Cleared by [`KernelDevice::use_math`], and for a library whose call failed (the kernels take over).
    allowed: MathLibs,
}

impl<V: Vendor> Shared<V> {
    fn math(&self) -> MathLibs {
        self.vendor.math().and(self.allowed)
    }
}

/// Which library a call of [`KernelOps::math_call`] uses.
#[derive(Clone, Copy, Debug)]
enum Lib {
    Blas,
    Solver,
}

/// A [`Device`] whose sessions run the kernels through the vendor `V` (one context for all sessions).
pub struct KernelDevice<V: Vendor + Send> {
    shared: Mutex<Shared<V>>,
    kind: DeviceKind,
    name: String,
    /// Device memory an input group may use, bytes (`None`: no limit known).
    budget: Option<u64>,
}

impl<V: Vendor + Send> KernelDevice<V> {
    pub fn new(vendor: V, kind: DeviceKind, budget: Option<u64>) -> Self {
        let name = vendor.name();
        KernelDevice {
            shared: Mutex::new(Shared {
                vendor,
                generation: 0,
                allowed: MathLibs {
                    blas: true,
                    solver: true,
                },
            }),
            kind,
            name,
            budget,
        }
    }
    /// The device memory budget in bytes.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }
    /// Which of the vendor's math libraries the sessions may use from now on (the vendor must have them
    /// too); the others' work goes to the kernels. For comparisons (the card check); a library whose call
    /// fails is switched off by the session itself.
    pub fn use_math(&self, allowed: MathLibs) -> DevResult<()> {
        lock(&self.shared)?.allowed = allowed;
        Ok(())
    }
    /// The math libraries the sessions use now.
    pub fn math(&self) -> DevResult<MathLibs> {
        Ok(lock(&self.shared)?.math())
    }
}

/// The smallest allocation the session asks a vendor for (an empty buffer still gets an address).
const MIN_ALLOC: usize = 4;

/// The factorisation's status words (two `i32`: a non-positive pivot, a non-finite entry).
const STATUS_BYTES: usize = 8;

/// Device bytes one input group of `n` input features needs at least: the Hessian and the factor (n² f32
/// each), the factor's pivots (n f32) and its status words; the weights of the largest module come on top
/// and are checked by the sweep.
pub fn group_bytes(n: usize) -> u64 {
    let n = n as u64;
    2 * n * n * 4 + n * 4 + STATUS_BYTES as u64
}

/// Device bytes the sweep of a `rows × cols` module with parameters `p` adds: W and W₀ (f32), the codes, the
/// block's deltas, every block's row losses, every group's scales and zeros, `R²` and the group of each
/// column, the coefficients of a block (or of a snapshot), the snapshot with its scratch, and with the
/// vendor's BLAS (`blas`) the dense factor panel its `sgemm` reads (`sweep::SweepSizes`, the sizes the
/// sweep allocates).
pub fn sweep_bytes(rows: usize, cols: usize, p: &GptqParams, blas: bool) -> u64 {
    sweep::SweepSizes::new(rows, &GroupLayout::new(p, cols), p, blas).total()
}

impl<V: Vendor + Send> Device for KernelDevice<V> {
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn kind(&self) -> DeviceKind {
        self.kind
    }
    fn open(&self, n: usize) -> DevResult<Box<dyn Session + '_>> {
        let need = group_bytes(n);
        if let Some(budget) = self.budget.filter(|&b| need > b) {
            let reason = format!(
                "the input group's Hessian and factor need {} MiB of device memory, over the budget of {} MiB (GPU_VRAM_MB × GPU_MEMORY_FRACTION)",
                need.div_ceil(1 << 20),
                budget >> 20
            );
            let device = self.name.clone();
            let handover = Some(Handover { device, reason });
            return Ok(Box::new(CpuSession::new(
                CpuBackend::default(),
                n,
                handover,
            )));
        }
        Ok(Box::new(OpsSession::new(self.ops(n)?)))
    }
    fn forward(
        &self,
        hidden_size: usize,
        batch_tokens: usize,
    ) -> Option<DevResult<Box<dyn ForwardPass + '_>>> {
        Some(
            self.forward_ops(hidden_size, batch_tokens)
                .map(|f| Box::new(f) as Box<dyn ForwardPass>),
        )
    }
    fn memory_budget(&self) -> Option<u64> {
        self.budget
    }
}

impl<V: Vendor + Send> KernelDevice<V> {
    /// The device steps of one input group of `n` features without [`OpsSession`]'s recovery rules: what
    /// [`Device::open`] wraps, and what the kernel checks ([`crate::device::check`]) drive step by step.
    pub fn ops(&self, n: usize) -> DevResult<KernelOps<'_, V>> {
        let generation = lock(&self.shared)?.generation;
        Ok(KernelOps {
            shared: &self.shared,
            generation,
            n,
            budget: self.budget,
            h: None,
            m: None,
            scratch: None,
            r: Vec::new(),
            factored: false,
            started: false,
            live: Vec::new(),
        })
    }
    /// The calibration forward on this device's context (see [`forward`]).
    pub fn forward_ops(
        &self,
        hidden_size: usize,
        batch_tokens: usize,
    ) -> DevResult<ForwardOps<'_, V>> {
        let generation = lock(&self.shared)?.generation;
        Ok(ForwardOps::new(
            &self.shared,
            generation,
            hidden_size,
            batch_tokens,
        ))
    }
    /// Runs `f` on the vendor (the device's context), e.g. to time a vendor library on the same device.
    /// Allocations made here are not tracked by any session.
    pub fn with_vendor<R>(&self, f: impl FnOnce(&mut V) -> R) -> DevResult<R> {
        Ok(f(&mut lock(&self.shared)?.vendor))
    }
}

fn lock<V>(m: &Mutex<Shared<V>>) -> DevResult<MutexGuard<'_, Shared<V>>> {
    m.lock()
        .map_err(|_| DeviceError::new("gpu", "lock", "an earlier device call panicked"))
}

/// One input group's buffers on the device (see the module docs).
pub struct KernelOps<'d, V: Vendor> {
    shared: &'d Mutex<Shared<V>>,
    /// The context generation the buffers below belong to.
    generation: u64,
    n: usize,
    budget: Option<u64>,
    /// The Hessian (n × n): accumulated, then prepared.
    h: Option<DevPtr>,
    /// The factor (n × n), the pivots (n) and the status words (2 i32).
    m: Option<(DevPtr, DevPtr, DevPtr)>,
    /// Upload buffer of the calibration batches, and its size in bytes.
    scratch: Option<(DevPtr, usize)>,
    /// The factor's `R` diagonal (host copy).
    r: Vec<f32>,
    factored: bool,
    /// Whether a batch was accumulated (a Hessian that is gone after that cannot be started again).
    started: bool,
    /// Every allocation of this session in the current generation (freed on drop).
    live: Vec<DevPtr>,
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn dims(what: &str, v: usize) -> DevResult<i32> {
    i32::try_from(v)
        .map_err(|_| DeviceError::new("gpu", what, format!("dimension {v} exceeds i32")))
}

/// An n × n zero matrix whose pages were first written by the rayon pool's threads, not one: `Mat::zeros`
/// writes them on the calling thread, and a download of the checkpoint into such a new matrix ran at the
/// rate of one thread's page faults (1.3–1.6 GB/s on the H100 machine's VM, against 6.5 GB/s into written
/// memory; the card check's `transfer timing`).
fn zeroed_mat(n: usize) -> Mat<f32> {
    use rayon::prelude::*;
    let mut m = Mat::<f32>::with_capacity(n, n);
    let stride = m.col_stride().unsigned_abs().max(n);
    let base = m.as_ptr_mut() as usize;
    (0..n).into_par_iter().for_each(|j| {
        // SAFETY: `with_capacity(n, n)` allocated n columns of at least n values each, `stride` values apart
        // (the matrix's column stride); column j's first n values are in it and written by this task alone.
        unsafe { std::ptr::write_bytes((base as *mut f32).add(j * stride), 0, n) };
    });
    // SAFETY: every value of the n × n matrix was written above.
    unsafe { m.set_dims(n, n) };
    m
}

/// The values of `m` column by column: its own memory when its columns are contiguous and adjacent, else a
/// packed copy, written by the rayon pool. faer pads a column to a multiple of 16 values, so a matrix whose
/// row count is a multiple of 16 (the usual activation batch and Hessian) is borrowed. Borrowing saves a copy
/// whose pages are new for every batch (over glibc's mmap threshold); the pool writes new pages faster than
/// one thread (see `zeroed_mat`).
fn packed(m: MatRef<'_, f32>) -> std::borrow::Cow<'_, [f32]> {
    let (rows, cols) = (m.nrows(), m.ncols());
    if rows == 0 || cols == 0 {
        return std::borrow::Cow::Borrowed(&[]);
    }
    if m.row_stride() == 1 && (cols == 1 || m.col_stride() == rows as isize) {
        // SAFETY: with unit row stride and a column stride of `rows` (or one column), the rows · cols values
        // are one contiguous run from `as_ptr`, borrowed from `m` for its lifetime.
        return std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(m.as_ptr(), rows * cols)
        });
    }
    use rayon::prelude::*;
    let mut v = vec![0f32; rows * cols];
    v.par_chunks_mut(rows).enumerate().for_each(|(j, dst)| {
        for (d, s) in dst.iter_mut().zip(m.col(j).iter()) {
            *d = *s;
        }
    });
    std::borrow::Cow::Owned(v)
}

impl<V: Vendor> KernelOps<'_, V> {
    /// The vendor, after dropping this session's buffers if another session reset the context.
    fn vendor(&mut self) -> DevResult<MutexGuard<'_, Shared<V>>> {
        let guard = lock(self.shared)?;
        if guard.generation != self.generation {
            self.generation = guard.generation;
            self.forget();
        }
        Ok(guard)
    }
    /// Drops every buffer reference (the context that held them is gone).
    fn forget(&mut self) {
        self.h = None;
        self.m = None;
        self.scratch = None;
        self.factored = false;
        self.live.clear();
    }
    fn alloc(&mut self, bytes: usize) -> DevResult<DevPtr> {
        let p = self.vendor()?.vendor.alloc(bytes.max(MIN_ALLOC))?;
        self.live.push(p);
        Ok(p)
    }
    fn release(&mut self, p: DevPtr) {
        if let Ok(mut g) = lock(self.shared) {
            if g.generation == self.generation {
                g.vendor.free(p);
            }
        }
        self.live.retain(|&q| q != p);
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> DevResult<()> {
        self.vendor()?.vendor.upload(dst, src)
    }
    /// The act-order permutation of the prepared Hessian `h` (the session's) into a new buffer, which becomes
    /// the session's Hessian; the old one is freed. The two exist together only before the factor is
    /// allocated, so the input group's memory stays within [`group_bytes`].
    fn permute(&mut self, h: DevPtr, perm: &[usize]) -> DevResult<()> {
        let n = self.n;
        let n32 = self.n32("prepare")?;
        let idx = perm
            .iter()
            .map(|&i| dims("prepare", i))
            .collect::<DevResult<Vec<i32>>>()?;
        let dperm = self.upload_new(bytes_of(&idx))?;
        let out = match self.alloc(n * n * 4) {
            Ok(p) => p,
            Err(e) => {
                self.release(dperm);
                return Err(e);
            }
        };
        let r = self.launch(
            Launch::square(Kernel::PermuteSym, n),
            &[
                Arg::Ptr(h),
                Arg::I32(n32),
                Arg::Ptr(out),
                Arg::I32(n32),
                Arg::Ptr(dperm),
                Arg::I32(n32),
            ],
        );
        self.release(dperm);
        if let Err(e) = r {
            self.release(out);
            return Err(e);
        }
        self.release(h);
        self.h = Some(out);
        Ok(())
    }
    fn upload_new(&mut self, src: &[u8]) -> DevResult<DevPtr> {
        let p = self.alloc(src.len())?;
        if let Err(e) = self.upload(p, src) {
            self.release(p);
            return Err(e);
        }
        Ok(p)
    }
    /// The `n × n` column-major matrix at `src`, downloaded straight into a `Mat`'s storage when its
    /// columns are contiguous (no second host copy of an n² buffer).
    fn download_mat(&mut self, src: DevPtr, n: usize) -> DevResult<Mat<f32>> {
        // Zeroed first (on the pool): the slice the download writes must be initialised memory.
        let mut m = zeroed_mat(n);
        if n > 0 && m.col_stride() == n as isize && m.row_stride() == 1 {
            // SAFETY: with unit row stride and a column stride of n, the n columns of n initialised f32 each
            // are one contiguous run of n·n values starting at `as_ptr_mut`, owned by `m` for this borrow.
            let all = unsafe { std::slice::from_raw_parts_mut(m.as_ptr_mut(), n * n) };
            self.vendor()?
                .vendor
                .download(src, bytemuck::cast_slice_mut(all))?;
            return Ok(m);
        }
        // Padded columns (n not a multiple of 16): download packed, then copy the columns on the pool into
        // the matrix whose pages the pool already wrote.
        let host = self.download_f32(src, n * n)?;
        {
            use rayon::prelude::*;
            m.as_mut()
                .par_col_iter_mut()
                .enumerate()
                .for_each(|(j, col)| {
                    for (d, s) in col.iter_mut().zip(&host[j * n..(j + 1) * n]) {
                        *d = *s;
                    }
                });
        }
        Ok(m)
    }
    fn download_f32(&mut self, src: DevPtr, len: usize) -> DevResult<Vec<f32>> {
        let mut v = vec![0f32; len];
        self.vendor()?
            .vendor
            .download(src, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }
    fn launch(&mut self, launch: Launch, args: &[Arg]) -> DevResult<()> {
        self.vendor()?.vendor.launch(launch, args)
    }
    /// The vendor math libraries this session may call now.
    fn math(&mut self) -> DevResult<MathLibs> {
        Ok(self.vendor()?.math())
    }
    /// A call of the vendor's library `lib`. When it fails, the library is switched off for the device (its
    /// work goes to the kernels from then on: after the session's reset, the retry runs without it) and the
    /// error says so.
    fn math_call(&mut self, lib: Lib, f: impl FnOnce(&mut V) -> DevResult<()>) -> DevResult<()> {
        let mut g = self.vendor()?;
        let r = f(&mut g.vendor);
        r.map_err(|mut e| {
            match lib {
                Lib::Blas => g.allowed.blas = false,
                Lib::Solver => g.allowed.solver = false,
            }
            e.message = format!(
                "{}; the vendor {} library is not used again in this run (the kernels of gptq.cu take over)",
                e.message,
                match lib {
                    Lib::Blas => "BLAS",
                    Lib::Solver => "solver",
                }
            );
            e
        })
    }
    fn lost(&self, op: &str) -> DeviceError {
        DeviceError::new(
            self.name(),
            op,
            "the buffer is not on the device (the context was reset)",
        )
    }
    fn n32(&self, op: &str) -> DevResult<i32> {
        dims(op, self.n)
    }

    /// The Hessian buffer, allocated and zeroed at the first batch.
    fn hessian(&mut self) -> DevResult<DevPtr> {
        match self.h {
            Some(h) => Ok(h),
            None if !self.started => {
                self.started = true;
                let n = self.n;
                let h = self.alloc(n * n * 4)?;
                self.vendor()?.vendor.zero(h, n * n * 4)?;
                self.h = Some(h);
                Ok(h)
            }
            None => Err(self.lost("accumulate")),
        }
    }

    /// `H += alpha · xᵀx` from the `tokens × n` activations at `x` (leading dimension `ldx`) on the device.
    fn accumulate_from(
        &mut self,
        h: DevPtr,
        x: DevPtr,
        ldx: usize,
        tokens: usize,
        alpha: f32,
    ) -> DevResult<()> {
        let n = self.n;
        if tokens == 0 || n == 0 {
            return Ok(());
        }
        let (t32, l32, n32) = (
            dims("accumulate", tokens)?,
            dims("accumulate", ldx)?,
            self.n32("accumulate")?,
        );
        if self.math()?.blas {
            let op = Syrk {
                c: h,
                ldc: n,
                a: x,
                lda: ldx,
                n,
                k: tokens,
                alpha,
            };
            return self.math_call(Lib::Blas, |v| v.syrk_lower(&op));
        }
        self.launch(
            Launch::wide(Kernel::HessianLower, n, n),
            &[
                Arg::Ptr(h),
                Arg::I32(n32),
                Arg::Ptr(x),
                Arg::I32(l32),
                Arg::I32(t32),
                Arg::I32(n32),
                Arg::F32(alpha),
            ],
        )
    }

    /// The factor buffers (allocated on first use).
    fn factor_buffers(&mut self) -> DevResult<(DevPtr, DevPtr, DevPtr)> {
        if let Some(m) = self.m {
            return Ok(m);
        }
        let n = self.n;
        let m = self.alloc(n * n * 4)?;
        let r = self.alloc(n * 4)?;
        let s = self.alloc(STATUS_BYTES)?;
        self.m = Some((m, r, s));
        Ok((m, r, s))
    }

    /// Whether a `rows × cols` sweep fits the budget next to the Hessian and the factor.
    fn check_fits(&self, rows: usize, cols: usize, p: &GptqParams, blas: bool) -> DevResult<()> {
        let need = group_bytes(self.n) + sweep_bytes(rows, cols, p, blas);
        match self.budget {
            Some(b) if need > b => Err(DeviceError::new(
                self.name(),
                "sweep",
                format!(
                    "a {rows} × {cols} module needs {} MiB of device memory with its Hessian, over the budget of {} MiB",
                    need.div_ceil(1 << 20),
                    b >> 20
                ),
            )),
            _ => Ok(()),
        }
    }
}

impl<V: Vendor> Drop for KernelOps<'_, V> {
    fn drop(&mut self) {
        if let Ok(mut g) = lock(self.shared) {
            if g.generation == self.generation {
                for p in self.live.drain(..) {
                    g.vendor.free(p);
                }
            }
        }
    }
}

impl<V: Vendor> DeviceOps for KernelOps<'_, V> {
    fn name(&self) -> String {
        lock(self.shared)
            .map(|g| g.vendor.name())
            .unwrap_or_else(|_| "gpu".to_string())
    }

    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()> {
        let (tokens, n) = (x.nrows(), x.ncols());
        if n != self.n {
            return Err(DeviceError::new(
                self.name(),
                "accumulate",
                format!("activations have {n} features, the session {}", self.n),
            ));
        }
        let h = self.hessian()?;
        let data = packed(x);
        let bytes = data.len() * 4;
        let buf = match self.scratch {
            Some((p, len)) if len >= bytes => p,
            old => {
                if let Some((p, _)) = old {
                    self.release(p);
                }
                let p = self.alloc(bytes)?;
                self.scratch = Some((p, bytes));
                p
            }
        };
        self.upload(buf, bytes_of(&data))?;
        self.accumulate_from(h, buf, tokens, tokens, alpha)
    }

    fn accumulate_resident(&mut self, x: &Resident, alpha: f32) -> DevResult<bool> {
        if x.context != self.shared as *const _ as usize {
            return Ok(false);
        }
        if x.cols != self.n {
            return Err(DeviceError::new(
                self.name(),
                "accumulate",
                format!(
                    "activations have {} features, the session {}",
                    x.cols, self.n
                ),
            ));
        }
        let g = self.vendor()?;
        if g.generation != x.generation {
            drop(g);
            return Err(self.lost("accumulate"));
        }
        drop(g);
        let h = self.hessian()?;
        self.accumulate_from(h, x.ptr, x.ld, x.rows, alpha)?;
        Ok(true)
    }

    fn prepare(&mut self, order: ColumnOrder) -> DevResult<PreparedMeta> {
        let n = self.n;
        let n32 = self.n32("prepare")?;
        let h = self.h.ok_or_else(|| self.lost("prepare"))?;
        if let Some((p, _)) = self.scratch.take() {
            self.release(p);
        }
        if n == 0 {
            return Ok(PreparedMeta {
                diag: Vec::new(),
                perm: (order != ColumnOrder::Plain).then(Vec::new),
                dead: Vec::new(),
                sanitized: 0,
            });
        }
        self.launch(
            Launch::square(Kernel::MirrorLower, n),
            &[Arg::Ptr(h), Arg::I32(n32), Arg::I32(n32)],
        )?;
        // Sanitise and fix the dead columns in place; only each row's count of replaced entries and the
        // diagonal (before the fix) come back: 2n values.
        let bad_buf = self.alloc(n * 4)?;
        let diag_buf = match self.alloc(n * 4) {
            Ok(p) => p,
            Err(e) => {
                self.release(bad_buf);
                return Err(e);
            }
        };
        let read = (|| -> DevResult<(Vec<i32>, Vec<f32>)> {
            self.launch(
                Launch::rows(Kernel::PrepareRows, n, COLUMN_THREADS),
                &[
                    Arg::Ptr(h),
                    Arg::I32(n32),
                    Arg::I32(n32),
                    Arg::Ptr(bad_buf),
                    Arg::Ptr(diag_buf),
                ],
            )?;
            let mut bad = vec![0i32; n];
            self.vendor()?
                .vendor
                .download(bad_buf, bytemuck::cast_slice_mut(&mut bad))?;
            Ok((bad, self.download_f32(diag_buf, n)?))
        })();
        self.release(bad_buf);
        self.release(diag_buf);
        let (bad, raw) = read?;
        let sanitized = bad.iter().map(|&c| usize::try_from(c).unwrap_or(0)).sum();
        let pd = prepared_diagonal(&raw, order);
        if let Some(p) = &pd.perm {
            self.permute(h, p)?;
        }
        Ok(PreparedMeta {
            diag: pd.diag,
            perm: pd.perm,
            dead: pd.dead,
            sanitized,
        })
    }

    fn checkpoint(&mut self) -> DevResult<Mat<f32>> {
        let n = self.n;
        let h = self.h.ok_or_else(|| self.lost("checkpoint"))?;
        self.download_mat(h, n)
    }

    fn restore(&mut self, prepared: &Mat<f32>) -> DevResult<()> {
        drop(self.vendor()?);
        let data = packed(prepared.as_ref());
        match self.h {
            Some(h) => self.upload(h, bytes_of(&data)),
            None => {
                self.h = Some(self.upload_new(bytes_of(&data))?);
                Ok(())
            }
        }
    }

    fn try_factor(&mut self, diag: &[f32]) -> DevResult<bool> {
        let n = self.n;
        let n32 = self.n32("factor")?;
        if diag.len() != n {
            return Err(DeviceError::new(
                self.name(),
                "factor",
                format!(
                    "diagonal of {} entries for an {n} × {n} Hessian",
                    diag.len()
                ),
            ));
        }
        self.factored = false;
        let h = self.h.ok_or_else(|| self.lost("factor"))?;
        let (m, r, status) = self.factor_buffers()?;
        self.upload(status, bytes_of(&[0i32, 0]))?;
        let d = self.upload_new(bytes_of(diag))?;
        let result = self.factor_with(h, m, r, status, d, n, n32);
        self.release(d);
        let ok = result?;
        self.factored = ok;
        Ok(ok)
    }

    fn has_factor(&self) -> bool {
        self.factored && self.m.is_some()
    }

    fn sweep(&mut self, w: &Mat<f32>, job: &SweepJob<'_>) -> DevResult<QuantizedLinear> {
        let (rows, cols, p) = (w.nrows(), w.ncols(), job.params);
        if cols != self.n {
            return Err(DeviceError::new(
                self.name(),
                "sweep",
                format!("a module with {cols} inputs in a session of {}", self.n),
            ));
        }
        if p.block_size > MAX_BLOCK {
            return Err(DeviceError::new(
                self.name(),
                "sweep",
                format!(
                    "block size {} is over the sweep kernel's {MAX_BLOCK}",
                    p.block_size
                ),
            ));
        }
        let blas = self.math()?.blas;
        self.check_fits(rows, cols, p, blas)?;
        let (m, _, _) = self
            .m
            .filter(|_| self.factored)
            .ok_or_else(|| self.lost("sweep"))?;
        let mut bufs = Vec::new();
        let result = self.sweep_with(w, job, m, blas, &mut bufs);
        for b in bufs {
            self.release(b);
        }
        result
    }

    fn reset(&mut self) -> DevResult<()> {
        let mut g = lock(self.shared)?;
        g.vendor.reset()?;
        g.generation += 1;
        self.generation = g.generation;
        drop(g);
        self.forget();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{packed, zeroed_mat};
    use faer::Mat;

    #[test]
    fn packed_borrows_contiguous_columns_and_packs_any_other_view() {
        // 32 rows: faer's columns are adjacent (padding to 16 values adds none); 37 rows: padded.
        let m = Mat::<f32>::from_fn(32, 5, |i, j| (i * 100 + j) as f32);
        let padded = Mat::<f32>::from_fn(37, 5, |i, j| (i * 100 + j) as f32);
        let expect = |v: faer::MatRef<'_, f32>| -> Vec<f32> {
            (0..v.ncols())
                .flat_map(|j| (0..v.nrows()).map(move |i| v[(i, j)]))
                .collect()
        };
        for (name, view, borrowed) in [
            ("32 x 5", m.as_ref(), true),
            ("one column", padded.as_ref().subcols(2, 1), true),
            ("37 x 5 (padded columns)", padded.as_ref(), false),
            (
                "rows 3..20 (strided columns)",
                m.as_ref().subrows(3, 17),
                false,
            ),
            ("transposed", m.as_ref().transpose(), false),
        ] {
            let p = packed(view);
            assert_eq!(&*p, expect(view).as_slice(), "{name}");
            assert_eq!(
                matches!(p, std::borrow::Cow::Borrowed(_)),
                borrowed,
                "{name}: borrowed"
            );
        }
        assert!(packed(m.as_ref().subcols(0, 0)).is_empty());
    }

    #[test]
    fn zeroed_mat_is_an_n_by_n_zero_matrix_of_any_size() {
        for n in [0usize, 1, 3, 17, 64, 300] {
            let m = zeroed_mat(n);
            assert_eq!((m.nrows(), m.ncols()), (n, n), "n = {n}");
            assert!(m.col_stride() >= n as isize, "n = {n}");
            for j in 0..n {
                for i in 0..n {
                    assert_eq!(m[(i, j)].to_bits(), 0, "n = {n}: ({i}, {j})");
                }
            }
        }
    }
}
