//! The factorisation and the sweep of [`KernelOps`]: the launches of one factorisation attempt and of one
//! module's blocked sweep (the module docs of [`super`] say where each step runs).

use super::{
    bytes_of, dims, Arg, DevPtr, DevResult, Gemm, Kernel, KernelOps, Launch, Lib, Vendor,
    COLUMN_THREADS, MIN_ALLOC, PANEL_THREADS, STATUS_BYTES, SWEEP_THREADS, TILE,
};
use crate::device::SweepJob;
use crate::numerics::gptq::{
    codes_in_original_order, DeadFixed, GroupLayout, Groups, Method, QuantizedLinear,
};
use crate::numerics::quantizer::{maxq, GroupParams};
use crate::params::GptqParams;
use faer::Mat;

/// Columns per panel of the blocked factorisation: a quarter of n in multiples of the tile, between 16 and
/// 128 (`PANEL_THREADS`: the diagonal-block kernel has a thread per panel column). Wide panels make the
/// trailing update (a tiled product over the panel's columns) most of the work; small matrices still get
/// several panels, so every kernel of the factorisation runs on them too.
pub fn factor_panel(n: usize) -> usize {
    let tile = TILE as usize;
    (n / 4 / tile * tile).clamp(tile, PANEL_THREADS as usize)
}

impl<V: Vendor> KernelOps<'_, V> {
    /// The factor of the last successful [`crate::device::DeviceOps::try_factor`], downloaded: `M` (n × n,
    /// column-major; its strict lower triangle is meaningful) and the pivots `r` (`r[n-1-j]` = `L[j,j]` of
    /// the reversed Hessian's Cholesky factor `L`), as [`crate::numerics::linalg::SweepFactor`] holds them
    /// on the CPU. For checks; the sweep reads the factor on the device.
    pub fn factor_host(&mut self) -> DevResult<(Mat<f32>, Vec<f32>)> {
        let n = self.n;
        let (m, _, _) = self
            .m
            .filter(|_| self.factored)
            .ok_or_else(|| self.lost("factor"))?;
        let host = self.download_f32(m, n * n)?;
        Ok((Mat::from_fn(n, n, |i, j| host[j * n + i]), self.r.clone()))
    }

    /// One factorisation attempt (see the module docs); `Ok(false)` when the matrix is not positive
    /// definite or the factor not finite.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn factor_with(
        &mut self,
        h: DevPtr,
        m: DevPtr,
        r: DevPtr,
        status: DevPtr,
        d: DevPtr,
        n: usize,
        n32: i32,
    ) -> DevResult<bool> {
        self.launch(
            Launch::square(Kernel::FactorFill, n),
            &[
                Arg::Ptr(m),
                Arg::I32(n32),
                Arg::Ptr(h),
                Arg::I32(n32),
                Arg::Ptr(d),
                Arg::I32(n32),
            ],
        )?;
        // The factor, its pivots and the status words: what the pivot and scale kernels take.
        let factor = [
            Arg::Ptr(m),
            Arg::I32(n32),
            Arg::I32(n32),
            Arg::Ptr(r),
            Arg::Ptr(status),
        ];
        if self.math()?.solver {
            // The vendor's potrf in place of the panels; its info is the first status word, and the pivots
            // are read from the diagonal it leaves.
            self.math_call(Lib::Solver, |v| v.potrf_lower(m, n, n, status))?;
            let pivots = Launch::rows(Kernel::FactorPivots, n, COLUMN_THREADS);
            self.launch(pivots, &factor)?;
        } else {
            let panel = factor_panel(n);
            for k0 in (0..n).step_by(panel) {
                let k1 = (k0 + panel).min(n);
                self.factor_panel_at(m, r, status, n, k0, k1)?;
            }
        }
        self.launch(Launch::square(Kernel::FactorScale, n), &factor)?;
        let mut st = [0i32; STATUS_BYTES / 4];
        self.vendor()?
            .vendor
            .download(status, bytemuck::cast_slice_mut(&mut st))?;
        if st != [0, 0] {
            return Ok(false);
        }
        self.r = self.download_f32(r, n)?;
        Ok(true)
    }

    /// The panel of columns `[k0, k1)`: its diagonal block (one thread block, the pivots into `r`, a
    /// non-positive pivot recorded in `status`), its rows below that block, then its contribution to the
    /// trailing lower triangle.
    fn factor_panel_at(
        &mut self,
        m: DevPtr,
        r: DevPtr,
        status: DevPtr,
        n: usize,
        k0: usize,
        k1: usize,
    ) -> DevResult<()> {
        let n32 = n as i32;
        let panel = [
            Arg::Ptr(m),
            Arg::I32(n32),
            Arg::I32(n32),
            Arg::I32(k0 as i32),
            Arg::I32(k1 as i32),
        ];
        let with = |extra: &[Arg]| -> Vec<Arg> { panel.iter().chain(extra).copied().collect() };
        let pivots = with(&[Arg::Ptr(r), Arg::Ptr(status)]);
        let one_block = PANEL_THREADS as usize;
        self.launch(
            Launch::rows(Kernel::CholPanelDiag, one_block, PANEL_THREADS),
            &pivots,
        )?;
        if k1 < n {
            let below = Launch::rows(Kernel::CholPanelRows, n - k1, COLUMN_THREADS);
            self.launch(below, &pivots)?;
            let trailing = Launch::wide(Kernel::CholTrailing, n - k1, n - k1);
            self.launch(trailing, &with(&[Arg::Ptr(status)]))?;
        }
        Ok(())
    }

    /// The `count × count` (row-major) coefficients of the block at `i1` into `c`.
    fn gather_into(&mut self, c: DevPtr, m: DevPtr, i1: usize, count: usize) -> DevResult<()> {
        let n32 = self.n32("sweep")?;
        self.launch(
            Launch::square(Kernel::GatherCoef, count),
            &[
                Arg::Ptr(c),
                Arg::Ptr(m),
                Arg::I32(n32),
                Arg::I32(n32),
                Arg::I32(i1 as i32),
                Arg::I32(count as i32),
            ],
        )
    }

    /// The sweep of one module (module docs); every buffer it allocates is pushed to `bufs`. Between the
    /// uploads at its start and the downloads at its end nothing crosses the bus: the group parameters are
    /// found on the device, and the launches are queued without waiting for them.
    pub(super) fn sweep_with(
        &mut self,
        w_in: &Mat<f32>,
        job: &SweepJob<'_>,
        m: DevPtr,
        blas: bool,
        bufs: &mut Vec<DevPtr>,
    ) -> DevResult<QuantizedLinear> {
        let (rows, cols) = (w_in.nrows(), w_in.ncols());
        let (meta, p) = (job.meta, job.params);
        let fixed = DeadFixed::new(w_in, &meta.dead);
        let orig_col = |c: usize| fixed.col(c);
        // The clipping search is not a device kernel: `OpsSession` hands such groups to the CPU.
        let mut groups = Groups::new(p, w_in, &orig_col, None);
        let perm: Vec<usize> = meta.perm.clone().unwrap_or_else(|| (0..cols).collect());
        let bs = p.block_size.max(1);
        let s = self.sweep_buffers(w_in, &orig_col, &perm, &mut groups, p, (m, blas), bufs)?;
        let mut i1 = 0;
        while i1 < cols {
            let i2 = (i1 + bs).min(cols);
            let width = groups.layout.snapshot_width(i1, i2);
            if let Some(width) = width {
                self.find_group_params(&s, &groups, &perm, (i1, i2), width)?;
            }
            if width != Some(i2 - i1) {
                self.gather_into(s.coef, s.m, i1, i2 - i1)?;
            }
            self.sweep_block(&s, i1, i2, i1 / bs)?;
            if i2 < cols {
                self.block_update(&s, i1, i2)?;
            }
            i1 = i2;
        }
        let mut codes_sweep = vec![0u8; rows * cols];
        self.vendor()?.vendor.download(s.dcodes, &mut codes_sweep)?;
        let acc = self.download_f32(s.dacc, rows * cols.div_ceil(bs))?;
        let (scale, zero) = (
            self.download_f32(s.dscale, rows * groups.layout.count())?,
            self.download_f32(s.dzero, rows * groups.layout.count())?,
        );
        let found: Vec<usize> = (0..cols)
            .filter_map(|k| Some(groups.found_at(k, &perm)?.0))
            .collect();
        for g in found {
            let part = |v: &[f32]| v[g * rows..(g + 1) * rows].to_vec();
            let (scale, zero) = (part(&scale), part(&zero));
            groups.record(g, &GroupParams { scale, zero });
        }
        let codes = codes_in_original_order(codes_sweep, meta.perm.as_deref(), rows, cols);
        let (scales, zeros, g_idx) = groups.finish();
        Ok(QuantizedLinear {
            method: Method::Gptq,
            loss: block_losses(&acc, rows),
            damp: job.damp,
            ..QuantizedLinear::rtn(p, rows, cols, codes, scales, zeros, g_idx)
        })
    }

    /// The sweep's buffers, with what is known before it uploaded: W₀ (sweep order, dead columns zeroed) and
    /// the working W (a device copy of it), `R_kk²` and the group of every column, the group parameters
    /// fixed before the sweep (the others are found into the same arrays as the sweep reaches them).
    #[allow(clippy::too_many_arguments)] // the module, its groups and the factor
    fn sweep_buffers<'a>(
        &mut self,
        w_in: &Mat<f32>,
        orig_col: &(dyn Fn(usize) -> &'a [f32] + Sync),
        perm: &[usize],
        groups: &mut Groups<'_>,
        p: &GptqParams,
        (m, blas): (DevPtr, bool),
        bufs: &mut Vec<DevPtr>,
    ) -> DevResult<SweepBufs> {
        let (rows, cols) = (w_in.nrows(), w_in.ncols());
        // Gathered by the rayon pool: W₀ is new memory (one module's weights), and one thread writing it
        // first runs at its page-fault rate (see `packed`).
        let mut w0 = vec![0f32; rows * cols];
        if rows > 0 {
            use rayon::prelude::*;
            w0.par_chunks_mut(rows)
                .zip(perm.par_iter())
                .for_each(|(dst, &c)| dst.copy_from_slice(orig_col(c)));
        }
        let n_groups = groups.layout.count();
        let (of, fixed) = groups.plan_all(perm);
        let (mut scale, mut zero) = (vec![0f32; n_groups * rows], vec![0f32; n_groups * rows]);
        for (g, gp) in fixed {
            scale[g * rows..(g + 1) * rows].copy_from_slice(&gp.scale);
            zero[g * rows..(g + 1) * rows].copy_from_slice(&gp.zero);
        }
        let param = of
            .iter()
            .map(|&g| dims("sweep", g))
            .collect::<DevResult<Vec<i32>>>()?;
        let rdiag2: Vec<f32> = match self.r.get(..cols) {
            Some(r) => r.iter().map(|r| r * r).collect(),
            None => return Err(self.lost("sweep")),
        };
        let mut up = |ops: &mut Self, data: &[u8]| -> DevResult<DevPtr> {
            let b = ops.upload_new(data)?;
            bufs.push(b);
            Ok(b)
        };
        let dw0 = up(self, bytes_of(&w0))?;
        let (drd, dpar) = (up(self, bytes_of(&rdiag2))?, up(self, bytes_of(&param))?);
        let (dscale, dzero) = (up(self, bytes_of(&scale))?, up(self, bytes_of(&zero))?);
        let size = SweepSizes::new(rows, &groups.layout, p, blas);
        let mut alloc = |ops: &mut Self, bytes: usize| -> DevResult<DevPtr> {
            let b = ops.alloc(bytes)?;
            bufs.push(b);
            Ok(b)
        };
        let dw = alloc(self, size.w)?;
        self.vendor()?.vendor.copy(dw, dw0, size.w)?;
        let (dd, dcodes) = (alloc(self, size.deltas)?, alloc(self, size.codes)?);
        let dacc = alloc(self, size.losses)?;
        let coef = alloc(self, size.coef)?;
        let (snap, xs) = (alloc(self, size.snapshot)?, alloc(self, size.snapshot)?);
        let panel = match size.panel {
            0 => None,
            bytes => Some(alloc(self, bytes)?),
        };
        Ok(SweepBufs {
            m,
            dw,
            dw0,
            dd,
            dcodes,
            dacc,
            drd,
            dpar,
            dscale,
            dzero,
            coef,
            snap,
            xs,
            panel,
            rows,
            cols,
            maxq: maxq(p.bits),
            sym: p.sym,
        })
    }

    /// The parameters of the groups that start in the block `[i1, i2)`, from its snapshot of `width` columns
    /// (`gptq_gather_coef`, `gptq_block_snapshot`, then `gptq_group_params` per group), into the sweep's
    /// parameter arrays. The coefficient buffer then holds the block's `width × width` coefficients.
    fn find_group_params(
        &mut self,
        s: &SweepBufs,
        groups: &Groups<'_>,
        perm: &[usize],
        (i1, i2): (usize, usize),
        width: usize,
    ) -> DevResult<()> {
        let rows = s.rows;
        let (r32, w32) = (dims("sweep", rows)?, dims("sweep", width)?);
        self.gather_into(s.coef, s.m, i1, width)?;
        self.launch(
            Launch::rows(Kernel::BlockSnapshot, rows, SWEEP_THREADS),
            &[
                Arg::Ptr(s.snap),
                Arg::I32(r32),
                Arg::Ptr(s.xs),
                Arg::I32(r32),
                Arg::Ptr(s.dw + s.off(i1)),
                Arg::I32(r32),
                Arg::Ptr(s.dw0 + s.off(i1)),
                Arg::I32(r32),
                Arg::Ptr(s.coef),
                Arg::I32(w32),
                Arg::I32(r32),
            ],
        )?;
        // The snapshot covers every group that starts in the block (`GroupLayout::snapshot_width`).
        for (k, (g, len)) in (i1..i2).filter_map(|k| Some((k, groups.found_at(k, perm)?))) {
            let at = (g * rows * 4) as u64;
            self.launch(
                Launch::rows(Kernel::GroupParams, rows, SWEEP_THREADS),
                &[
                    Arg::Ptr(s.snap + s.off(k - i1)),
                    Arg::I32(r32),
                    Arg::I32(dims("sweep", len)?),
                    Arg::I32(r32),
                    Arg::F32(s.maxq),
                    Arg::I32(i32::from(s.sym)),
                    Arg::Ptr(s.dscale + at),
                    Arg::Ptr(s.dzero + at),
                ],
            )?;
        }
        Ok(())
    }

    /// The in-block sweep of columns `[i1, i2)` (block number `b`) with the coefficients in `s.coef`: one
    /// launch, its per-row losses into the block's slice of the loss buffer.
    fn sweep_block(&mut self, s: &SweepBufs, i1: usize, i2: usize, b: usize) -> DevResult<()> {
        let (rows, count) = (s.rows, i2 - i1);
        let r32 = dims("sweep", rows)?;
        self.launch(
            Launch::rows(Kernel::SweepBlock, rows, SWEEP_THREADS),
            &[
                Arg::Ptr(s.dw + s.off(i1)),
                Arg::I32(r32),
                Arg::Ptr(s.dw0 + s.off(i1)),
                Arg::I32(r32),
                Arg::Ptr(s.dd),
                Arg::I32(r32),
                Arg::Ptr(s.dcodes + (i1 * rows) as u64),
                Arg::I32(r32),
                Arg::Ptr(s.coef),
                Arg::Ptr(s.drd + (i1 * 4) as u64),
                Arg::Ptr(s.dpar + (i1 * 4) as u64),
                Arg::Ptr(s.dscale),
                Arg::Ptr(s.dzero),
                Arg::I32(r32),
                Arg::I32(count as i32),
                Arg::F32(s.maxq),
                Arg::Ptr(s.dacc + (b * rows * 4) as u64),
            ],
        )
    }

    /// The lazy-batch update of the columns after the block `[i1, i2)`: `W[:, i2..] −= Δ · F(i1.., i2..)`.
    /// With the vendor's BLAS: `gptq_gather_panel` copies F's block rows out of the reversed view into the
    /// dense panel buffer, and `sgemm` adds the product.
    fn block_update(&mut self, s: &SweepBufs, i1: usize, i2: usize) -> DevResult<()> {
        let (n, rows, cols) = (self.n, s.rows, s.cols);
        let (r32, n32) = (dims("sweep", rows)?, self.n32("sweep")?);
        if let Some(panel) = s.panel {
            let (k, ncols) = (i2 - i1, cols - i2);
            if rows == 0 {
                return Ok(());
            }
            let k32 = dims("sweep", k)?;
            self.launch(
                Launch::tiles(Kernel::GatherPanel, k, ncols),
                &[
                    Arg::Ptr(panel),
                    Arg::I32(k32),
                    Arg::Ptr(s.m),
                    Arg::I32(n32),
                    Arg::I32(n32),
                    Arg::I32(i1 as i32),
                    Arg::I32(k32),
                    Arg::I32(i2 as i32),
                    Arg::I32(dims("sweep", ncols)?),
                ],
            )?;
            let op = Gemm {
                m: rows,
                n: ncols,
                k,
                a: s.dd,
                lda: rows,
                b: panel,
                ldb: k,
                c: s.dw + s.off(i2),
                ldc: rows,
            };
            return self.math_call(Lib::Blas, |v| v.gemm_acc(&op));
        }
        // F(i1, i2) = M[n-1-i1, n-1-i2]; F's row stride is −1 and its column stride −n.
        let f = s.m + (((n - 1 - i2) * n + (n - 1 - i1)) * 4) as u64;
        self.launch(
            Launch::wide(Kernel::BlockUpdate, cols - i2, rows),
            &[
                Arg::Ptr(s.dw + s.off(i2)),
                Arg::I32(r32),
                Arg::Ptr(s.dd),
                Arg::I32(r32),
                Arg::Ptr(f),
                Arg::I64(-1),
                Arg::I64(-(n32 as i64)),
                Arg::I32(r32),
                Arg::I32((i2 - i1) as i32),
                Arg::I32((cols - i2) as i32),
            ],
        )
    }
}

/// The loss of a module from the per-row losses of its blocks (`acc`: block after block, `rows` each), summed
/// as the CPU sums them: per block, per 64-row tile, the tile's row losses in f64, halved.
fn block_losses(acc: &[f32], rows: usize) -> f64 {
    acc.chunks(rows.max(1))
        .map(|block| {
            block
                .chunks(64)
                .map(|t| t.iter().map(|&v| v as f64).sum::<f64>() / 2.0)
                .sum::<f64>()
        })
        .fold(0.0, |a, b| a + b)
}

/// The bytes of the device buffers a `rows`-row module's sweep allocates ([`SweepBufs`]), in one place
/// for the sweep and for the memory budget ([`super::sweep_bytes`]).
pub(super) struct SweepSizes {
    /// W and W₀ (f32), each.
    w: usize,
    codes: usize,
    /// One block's deltas.
    deltas: usize,
    /// Every block's row losses.
    losses: usize,
    /// `R_kk²` and the group of each column, each.
    per_column: usize,
    /// Every group's scales and zeros, each.
    group_params: usize,
    /// The coefficients of a block or of the widest snapshot.
    coef: usize,
    /// The widest snapshot and its scratch, each.
    snapshot: usize,
    /// With the vendor's BLAS: the factor panel of a block update, dense (0: not allocated).
    panel: usize,
}

impl SweepSizes {
    pub(super) fn new(rows: usize, layout: &GroupLayout, p: &GptqParams, blas: bool) -> Self {
        let (cols, bs) = (layout.cols(), p.block_size.max(1));
        let width = layout.max_snapshot_width(bs);
        SweepSizes {
            w: rows * cols * 4,
            codes: rows * cols,
            deltas: rows * bs * 4,
            losses: rows * cols.div_ceil(bs) * 4,
            per_column: cols * 4,
            group_params: rows * layout.count() * 4,
            coef: width.max(bs).pow(2) * 4,
            snapshot: rows * width * 4,
            panel: if blas && cols > bs {
                bs * (cols - bs) * 4
            } else {
                0
            },
        }
    }

    /// All of them, as [`KernelOps`] allocates them (at least [`MIN_ALLOC`] bytes each).
    pub(super) fn total(&self) -> u64 {
        let s = self;
        [
            s.w,
            s.w,
            s.codes,
            s.deltas,
            s.losses,
            s.per_column,
            s.per_column,
            s.group_params,
            s.group_params,
            s.coef,
            s.snapshot,
            s.snapshot,
        ]
        .iter()
        .map(|&b| b.max(MIN_ALLOC) as u64)
        .sum::<u64>()
            + s.panel as u64
    }
}

/// The device buffers of one module's sweep: the factor `m`, the working W `dw` and W₀ `dw0` (column-major,
/// sweep order), the block's deltas `dd`, the codes `dcodes`, the per-row losses of every block `dacc`,
/// `R_kk²` per column `drd`, the group of each column `dpar`, every group's scales and zeros (`dscale`,
/// `dzero`: `rows` values per group), the coefficients of the current block or snapshot `coef`, and the
/// snapshot `snap` with its scratch `xs`.
struct SweepBufs {
    m: DevPtr,
    dw: DevPtr,
    dw0: DevPtr,
    dd: DevPtr,
    dcodes: DevPtr,
    dacc: DevPtr,
    drd: DevPtr,
    dpar: DevPtr,
    dscale: DevPtr,
    dzero: DevPtr,
    coef: DevPtr,
    snap: DevPtr,
    xs: DevPtr,
    /// The dense factor panel of the vendor's `sgemm` (none without the vendor's BLAS).
    panel: Option<DevPtr>,
    rows: usize,
    cols: usize,
    maxq: f32,
    sym: bool,
}

impl SweepBufs {
    /// The byte offset of column `col` in W or W₀ (or of column `col` of the snapshot).
    fn off(&self, col: usize) -> u64 {
        (col * self.rows * 4) as u64
    }
}
