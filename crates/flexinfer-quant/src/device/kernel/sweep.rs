//! The factorisation and the sweep of [`KernelOps`]: the launches of one factorisation attempt and of one
//! module's blocked sweep (the module docs of [`super`] say where each step runs).

use super::{
    bytes_of, dims, Arg, DevPtr, DevResult, Kernel, KernelOps, Launch, Vendor, COLUMN_THREADS,
    SWEEP_THREADS, TILE,
};
use crate::device::PreparedMeta;
use crate::numerics::gptq::{
    block_snapshot, codes_in_original_order, DeadFixed, Groups, Method, QuantizedLinear,
};
use crate::numerics::linalg::CpuBackend;
use crate::numerics::quantizer::{maxq, GroupParams};
use crate::params::GptqParams;
use faer::Mat;

/// Columns per panel of the blocked factorisation: a quarter of n in multiples of the tile, between 16 and
/// 128. Wide panels make the trailing update (a tiled product over the panel's columns) most of the work;
/// small matrices still get several panels, so every kernel of the factorisation runs on them too.
pub fn factor_panel(n: usize) -> usize {
    let tile = TILE as usize;
    (n / 4 / tile * tile).clamp(tile, 128)
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
        let panel = factor_panel(n);
        for k0 in (0..n).step_by(panel) {
            let k1 = (k0 + panel).min(n);
            for j in k0..k1 {
                self.factor_column(m, r, status, n, k0, j)?;
            }
            if k1 < n {
                self.launch(
                    Launch::square(Kernel::CholTrailing, n - k1),
                    &[
                        Arg::Ptr(m),
                        Arg::I32(n32),
                        Arg::I32(n32),
                        Arg::I32(k0 as i32),
                        Arg::I32(k1 as i32),
                        Arg::Ptr(status),
                    ],
                )?;
            }
        }
        self.launch(
            Launch::square(Kernel::FactorScale, n),
            &[
                Arg::Ptr(m),
                Arg::I32(n32),
                Arg::I32(n32),
                Arg::Ptr(r),
                Arg::Ptr(status),
            ],
        )?;
        let mut st = [0i32; 2];
        self.vendor()?
            .vendor
            .download(status, bytemuck::cast_slice_mut(&mut st))?;
        if st != [0, 0] {
            return Ok(false);
        }
        self.r = self.download_f32(r, n)?;
        Ok(true)
    }

    /// Column `j` of the panel starting at `k0`: its update by the panel's earlier columns (left-looking), then
    /// its pivot (`r[j]`, the column scaled; a non-positive pivot is recorded in `status`).
    fn factor_column(
        &mut self,
        m: DevPtr,
        r: DevPtr,
        status: DevPtr,
        n: usize,
        k0: usize,
        j: usize,
    ) -> DevResult<()> {
        let (n32, j32) = (n as i32, j as i32);
        self.launch(
            Launch::rows(Kernel::CholUpdate, n - j, COLUMN_THREADS),
            &[
                Arg::Ptr(m),
                Arg::I32(n32),
                Arg::I32(n32),
                Arg::I32(k0 as i32),
                Arg::I32(j32),
                Arg::Ptr(status),
            ],
        )?;
        self.launch(
            Launch::rows(Kernel::CholPivot, n - j, COLUMN_THREADS),
            &[
                Arg::Ptr(m),
                Arg::I32(n32),
                Arg::I32(n32),
                Arg::I32(j32),
                Arg::Ptr(r),
                Arg::Ptr(status),
            ],
        )
    }

    /// The `count × count` (row-major) coefficients of the block at `i1` into a new buffer.
    pub(super) fn gather(
        &mut self,
        m: DevPtr,
        i1: usize,
        count: usize,
        bufs: &mut Vec<DevPtr>,
    ) -> DevResult<DevPtr> {
        let c = self.alloc(count * count * 4)?;
        bufs.push(c);
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
        )?;
        Ok(c)
    }

    /// The sweep of one module (module docs); every buffer it allocates is pushed to `bufs`.
    pub(super) fn sweep_with(
        &mut self,
        w_in: &Mat<f32>,
        meta: &PreparedMeta,
        damp: f32,
        p: &GptqParams,
        m: DevPtr,
        bufs: &mut Vec<DevPtr>,
    ) -> DevResult<QuantizedLinear> {
        let (rows, cols) = (w_in.nrows(), w_in.ncols());
        let fixed = DeadFixed::new(w_in, &meta.dead);
        let orig_col = |c: usize| fixed.col(c);
        let mut groups = Groups::new(p, w_in, &orig_col);
        let perm: Vec<usize> = meta.perm.clone().unwrap_or_else(|| (0..cols).collect());
        let mut w0 = Vec::with_capacity(rows * cols);
        for &c in &perm {
            w0.extend_from_slice(orig_col(c));
        }
        // W₀ and the working W, one upload.
        let dw0 = self.upload_new(bytes_of(&w0))?;
        bufs.push(dw0);
        let dw = self.alloc(rows * cols * 4)?;
        bufs.push(dw);
        self.vendor()?.vendor.copy(dw, dw0, rows * cols * 4)?;
        let bs = p.block_size.max(1);
        let mut scratch = [0; 3];
        for (b, bytes) in scratch
            .iter_mut()
            .zip([rows * bs * 4, rows * cols, rows * 4])
        {
            *b = self.alloc(bytes)?;
            bufs.push(*b);
        }
        let [dd, dcodes, dacc] = scratch;
        let s = SweepBufs {
            m,
            dw,
            dw0,
            dd,
            dcodes,
            dacc,
            rows,
            cols,
            maxq: maxq(p.bits),
        };
        let mut loss = 0.0f64;
        let mut snap_bufs = (Mat::<f32>::zeros(0, 0), Mat::<f32>::zeros(0, 0));
        let mut i1 = 0;
        while i1 < cols {
            let i2 = (i1 + bs).min(cols);
            // The block-start snapshot, from the block's columns of W and the F block.
            let snapshot = match groups.snapshot_width(i1, i2) {
                None => None,
                Some(width) => {
                    let w0_block = &w0[i1 * rows..(i1 + width) * rows];
                    Some(self.snapshot(&s, i1, width, w0_block, &mut snap_bufs, bufs)?)
                }
            };
            let (block_params, col_param) =
                groups.block(i1, i2, &perm, snapshot.as_ref().map(|s| s.as_ref()));
            loss += self.sweep_block(&s, i1, i2, &block_params, &col_param, bufs)?;
            if i2 < cols {
                self.block_update(&s, i1, i2)?;
            }
            i1 = i2;
        }
        let mut codes_sweep = vec![0u8; rows * cols];
        self.vendor()?.vendor.download(s.dcodes, &mut codes_sweep)?;
        let codes = codes_in_original_order(codes_sweep, meta.perm.as_deref(), rows, cols);
        let (scales, zeros, g_idx) = groups.finish();
        Ok(QuantizedLinear {
            method: Method::Gptq,
            loss,
            damp,
            ..QuantizedLinear::rtn(p, rows, cols, codes, scales, zeros, g_idx)
        })
    }

    /// The block-start snapshot of the `width` columns at `i1`: the block's columns of the working W and its
    /// F block downloaded, combined with W₀'s columns (`w0_block`) on the host ([`block_snapshot`]).
    fn snapshot(
        &mut self,
        s: &SweepBufs,
        i1: usize,
        width: usize,
        w0_block: &[f32],
        snap_bufs: &mut (Mat<f32>, Mat<f32>),
        bufs: &mut Vec<DevPtr>,
    ) -> DevResult<Mat<f32>> {
        let rows = s.rows;
        let pcols = self.download_f32(s.dw + s.off(i1), rows * width)?;
        let cm = self.gather(s.m, i1, width, bufs)?;
        let coef = self.download_f32(cm, width * width)?;
        let pm = Mat::from_fn(rows, width, |r, c| pcols[c * rows + r]);
        let fm = Mat::from_fn(width, width, |a, b| coef[a * width + b]);
        if snap_bufs.0.nrows() != rows || snap_bufs.0.ncols() < width {
            *snap_bufs = (Mat::zeros(rows, width), Mat::zeros(rows, width));
        }
        Ok(block_snapshot(
            &CpuBackend::default(),
            pm.as_ref(),
            &|j| &w0_block[j * rows..(j + 1) * rows],
            fm.as_ref(),
            snap_bufs,
        )
        .to_owned())
    }

    /// The in-block sweep of columns `[i1, i2)` with the block's group parameters: one launch, its
    /// per-row losses downloaded and summed as the CPU sums them. Returns the block's loss.
    fn sweep_block(
        &mut self,
        s: &SweepBufs,
        i1: usize,
        i2: usize,
        block_params: &[GroupParams],
        col_param: &[Option<usize>],
        bufs: &mut Vec<DevPtr>,
    ) -> DevResult<f64> {
        let (rows, count) = (s.rows, i2 - i1);
        let r32 = dims("sweep", rows)?;
        let coef = self.gather(s.m, i1, count, bufs)?;
        let rdiag2: Vec<f32> = (i1..i2).map(|k| self.r[k] * self.r[k]).collect();
        let param: Vec<i32> = col_param
            .iter()
            .map(|c| c.map_or(-1, |i| i as i32))
            .collect();
        let scale: Vec<f32> = block_params
            .iter()
            .flat_map(|g| g.scale.iter().copied())
            .collect();
        let zero: Vec<f32> = block_params
            .iter()
            .flat_map(|g| g.zero.iter().copied())
            .collect();
        let drd = self.upload_new(bytes_of(&rdiag2))?;
        let dpar = self.upload_new(bytes_of(&param))?;
        let dsc = self.upload_new(bytes_of(&scale))?;
        let dze = self.upload_new(bytes_of(&zero))?;
        bufs.extend([drd, dpar, dsc, dze]);
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
                Arg::Ptr(coef),
                Arg::Ptr(drd),
                Arg::Ptr(dpar),
                Arg::Ptr(dsc),
                Arg::Ptr(dze),
                Arg::I32(r32),
                Arg::I32(count as i32),
                Arg::F32(s.maxq),
                Arg::Ptr(s.dacc),
            ],
        )?;
        let acc = self.download_f32(s.dacc, rows)?;
        for b in [coef, drd, dpar, dsc, dze] {
            self.release(b);
            bufs.retain(|&x| x != b);
        }
        // As the CPU: per 64-row tile, the sum of the row losses in f64, halved.
        Ok(acc
            .chunks(64)
            .map(|t| t.iter().map(|&v| v as f64).sum::<f64>() / 2.0)
            .sum::<f64>())
    }

    /// The lazy-batch update of the columns after the block `[i1, i2)`: `W[:, i2..] −= Δ · F(i1.., i2..)`.
    fn block_update(&mut self, s: &SweepBufs, i1: usize, i2: usize) -> DevResult<()> {
        let (n, rows, cols) = (self.n, s.rows, s.cols);
        let (r32, n32) = (dims("sweep", rows)?, self.n32("sweep")?);
        // F(i1, i2) = M[n-1-i1, n-1-i2]; F's row stride is −1 and its column stride −n.
        let f = s.m + (((n - 1 - i2) * n + (n - 1 - i1)) * 4) as u64;
        self.launch(
            Launch::tiles(Kernel::BlockUpdate, cols - i2, rows),
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

/// The device buffers of one module's sweep: the factor `m`, the working W `dw` and W₀ `dw0` (column-major,
/// sweep order), the block's deltas `dd`, the codes `dcodes`, the per-row loss accumulator `dacc`.
struct SweepBufs {
    m: DevPtr,
    dw: DevPtr,
    dw0: DevPtr,
    dd: DevPtr,
    dcodes: DevPtr,
    dacc: DevPtr,
    rows: usize,
    cols: usize,
    maxq: f32,
}

impl SweepBufs {
    /// The byte offset of column `col` in W or W₀.
    fn off(&self, col: usize) -> u64 {
        (col * self.rows * 4) as u64
    }
}
