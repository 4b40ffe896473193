//! The GPTQ column sweep (lazy batch updates) and the RTN fallback (docs/dev/gptq.md, "The sweep" to "RTN fallback and its gate").

use crate::numerics::hessian::PreparedFactor;
use crate::numerics::linalg::LinalgBackend;
use crate::numerics::linalg::{col, par_columns};
use crate::numerics::quantizer::{find_params, maxq, quantize_code, GroupParams};
use crate::params::GptqParams;
use faer::{Mat, MatMut, MatRef};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use tile::{Block, TileCol, TILE};

mod groups;
mod refine;
mod tile;
pub(crate) use groups::{DeadFixed, GroupLayout, Groups};
pub use refine::RefineStats;
pub use tile::sweep_block_cpu;

/// Columns per outer block of the two-level sweep (rounded up to a multiple of the block and group size).
pub const OUTER_BLOCK: usize = 512;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// How a module was quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Gptq,
    Rtn,
}

/// One quantized linear layer: integer codes plus per-group parameters, everything in original column order.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedLinear {
    /// Output features (rows of W).
    pub rows: usize,
    /// Input features (columns of W).
    pub cols: usize,
    pub bits: u32,
    pub sym: bool,
    /// Integer codes, input-major: `codes[c * rows + r]`.
    pub codes: Vec<u8>,
    /// `scales[g * rows + r]` in group-index order.
    pub scales: Vec<f32>,
    /// Integer zero-points, same layout as `scales`.
    pub zeros: Vec<u8>,
    /// Group of each input column.
    pub g_idx: Vec<i32>,
    pub method: Method,
    /// `Σ (w−q)²/d²/2` (0 for RTN).
    pub loss: f64,
    pub damp: f32,
}

impl QuantizedLinear {
    /// Codes and group parameters made with `p`'s bit width and symmetry, labelled RTN (no loss, no
    /// damp); the GPTQ sweeps (CPU and device) set their own method, loss and damp on top.
    pub(crate) fn rtn(
        p: &GptqParams,
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
        zeros: Vec<u8>,
        g_idx: Vec<i32>,
    ) -> Self {
        QuantizedLinear {
            rows,
            cols,
            bits: p.bits,
            sym: p.sym,
            codes,
            scales,
            zeros,
            g_idx,
            method: Method::Rtn,
            loss: 0.0,
            damp: 0.0,
        }
    }

    pub fn groups(&self) -> usize {
        self.scales.len() / self.rows.max(1)
    }
}

fn col_slices(w: &Mat<f32>, start: usize, end: usize) -> impl Iterator<Item = &[f32]> {
    (start..end).map(move |c| w.col_as_slice(c))
}

fn push_group(scales: &mut [f32], zeros: &mut [u8], g: usize, rows: usize, p: &GroupParams) {
    scales[g * rows..(g + 1) * rows].copy_from_slice(&p.scale);
    for r in 0..rows {
        zeros[g * rows + r] = p.zero[r] as u8;
    }
}

/// GPTQ on `w` (`[rows=out, cols=in]`) with a prepared sweep factor (see [`crate::numerics::linalg`]).
pub fn gptq_quantize(
    backend: &dyn LinalgBackend,
    w_in: &Mat<f32>,
    factor: &PreparedFactor,
    p: &GptqParams,
) -> QuantizedLinear {
    gptq_quantize_in(&mut Workspace::default(), backend, w_in, factor, p)
}

/// Working buffers of the solver, kept from one module to the next: a model's modules repeat a few shapes, so
/// after the first module of each shape no large buffer is allocated (and page-faulted) again.
#[derive(Default)]
pub struct Workspace {
    w: Vec<f32>,
    delta: Vec<f32>,
    snap: Option<(Mat<f32>, Mat<f32>)>,
}

/// A buffer of exactly `len` floats from `buf` (reused when it is large enough), every column of `rows`
/// written by `fill`.
fn reuse_columns(
    buf: &mut Vec<f32>,
    rows: usize,
    cols: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) -> &mut [f32] {
    let len = rows * cols;
    if buf.len() >= len && rows > 0 {
        buf[..len]
            .par_chunks_mut(rows)
            .enumerate()
            .for_each(|(j, c)| fill(j, c));
    } else {
        *buf = par_columns(rows, cols, fill);
    }
    &mut buf[..len]
}

/// [`gptq_quantize`] with the working buffers of `ws`.
pub fn gptq_quantize_in(
    ws: &mut Workspace,
    backend: &dyn LinalgBackend,
    w_in: &Mat<f32>,
    factor: &PreparedFactor,
    p: &GptqParams,
) -> QuantizedLinear {
    let (rows, cols) = (w_in.nrows(), w_in.ncols());
    let mut pass = sweep_pass(ws, backend, w_in, factor, p, None);
    if p.refine_rounds > 0 {
        let fixed = DeadFixed::new(w_in, &factor.dead);
        let perm: Vec<usize> = factor.perm.clone().unwrap_or_else(|| (0..cols).collect());
        let w0_col = |k: usize| fixed.col(perm[k]);
        let col_group: Vec<usize> = perm.iter().map(|&o| pass.g_idx[o] as usize).collect();
        let mut h = refine::hessian_from_factor(&factor.f);
        remove_damping(&mut h, factor.damp);
        let n_groups = pass.scales.len() / rows.max(1);
        let setup = refine::RefineSetup::new(rows, &w0_col, &col_group, n_groups, h);
        // The best round of each row so far (rows are independent in the sweep and in the refit): a sweep
        // with refitted scales can land above the previous round's error, so a row keeps its best round.
        let mut best: Option<(SweepPass, Vec<f64>)> = None;
        for round in 0..p.refine_rounds {
            if round > 0 {
                // Sweep again with the refitted scales in force: the codes are chosen anew (with the error
                // feedback) for the scales they will be stored with.
                let preset: Vec<GroupParams> = (0..n_groups)
                    .map(|g| GroupParams {
                        scale: pass.scales[g * rows..(g + 1) * rows].to_vec(),
                        zero: pass.zeros[g * rows..(g + 1) * rows]
                            .iter()
                            .map(|&z| f32::from(z))
                            .collect(),
                    })
                    .collect();
                pass = sweep_pass(ws, backend, w_in, factor, p, Some(preset));
            }
            let stats = setup.refine(&pass.codes_sweep, &mut pass.scales, &pass.zeros);
            tracing::debug!(
                round,
                rows_refined = stats.rows_refined,
                error_before = stats.error_before,
                error_after = stats.error_after,
                "gptq scale refinement"
            );
            match best.as_mut() {
                None => best = Some((pass.clone(), stats.row_error)),
                Some((b, err)) => {
                    for (r, (e_best, &e)) in err.iter_mut().zip(&stats.row_error).enumerate() {
                        if e < *e_best {
                            *e_best = e;
                            b.take_row(&pass, r, rows, n_groups);
                        }
                    }
                }
            }
        }
        if let Some((b, _)) = best {
            // (Its loss is the first sweep's: the GPTQ loss as the reference tools report it.)
            pass = b;
        }
    }
    let SweepPass {
        codes_sweep,
        scales,
        zeros,
        g_idx,
        loss,
    } = pass;
    let codes = codes_in_original_order(codes_sweep, factor.perm.as_deref(), rows, cols);
    QuantizedLinear {
        method: Method::Gptq,
        loss,
        damp: factor.damp,
        ..QuantizedLinear::rtn(p, rows, cols, codes, scales, zeros, g_idx)
    }
}

/// One sweep's result: codes in sweep order and the group parameters by group index.
#[derive(Clone)]
struct SweepPass {
    codes_sweep: Vec<u8>,
    scales: Vec<f32>,
    zeros: Vec<u8>,
    g_idx: Vec<i32>,
    loss: f64,
}

impl SweepPass {
    /// Row `r`'s codes and scales from `other` (same module; the zeros and `g_idx` are the same in every round).
    fn take_row(&mut self, other: &SweepPass, r: usize, rows: usize, groups: usize) {
        for k in 0..self.codes_sweep.len() / rows.max(1) {
            self.codes_sweep[k * rows + r] = other.codes_sweep[k * rows + r];
        }
        for g in 0..groups {
            self.scales[g * rows + r] = other.scales[g * rows + r];
        }
    }
}

/// One GPTQ sweep of `w_in`; with `preset`, every group's parameters are those given (by group index)
/// instead of being found as the sweep reaches the group.
fn sweep_pass(
    ws: &mut Workspace,
    backend: &dyn LinalgBackend,
    w_in: &Mat<f32>,
    factor: &PreparedFactor,
    p: &GptqParams,
    preset: Option<Vec<GroupParams>>,
) -> SweepPass {
    let rows = w_in.nrows();
    let cols = w_in.ncols();
    let gs = p.effective_group(cols);
    // Column `c` (original order) after the dead-column fix: the sweep's `W_c` (module docs of `linalg`).
    let fixed = DeadFixed::new(w_in, &factor.dead);
    let orig_col = |c: usize| fixed.col(c);
    let perm: Vec<usize> = factor.perm.clone().unwrap_or_else(|| (0..cols).collect());
    let groups =
        Groups::new(p, w_in, &orig_col, clip_weights(p, factor, &perm)).with_preset(preset);
    let snapshot_width = groups.layout.max_snapshot_width(p.block_size);
    // The working copy, in sweep order, written by all threads.
    let Workspace {
        w: w_buf,
        delta: delta_buf,
        snap: snap_bufs,
    } = ws;
    let w_store = reuse_columns(w_buf, rows, cols, |k, dst| {
        dst.copy_from_slice(orig_col(perm[k]))
    });
    let mut w = MatMut::from_column_major_slice_mut(w_store, rows, cols);
    let mut codes_sweep = vec![0u8; rows * cols];

    let bs = p.block_size;
    // Two-level lazy batching: inner blocks of `bs` columns (the reference's semantics, including where group
    // parameters are read), and the update of the columns beyond an outer block deferred to one wide GEMM.
    let outer = outer_width(p, gs);
    // `W_k − Q_k` of the current outer block's columns.
    // Every column of a block is written by the sweep before the block's deltas are read.
    let delta_store = reuse_columns(delta_buf, rows, outer.min(cols), |_, c| c.fill(0.0));
    let mut delta = MatMut::from_column_major_slice_mut(delta_store, rows, outer.min(cols));
    let tiles = rows.div_ceil(TILE);
    let mut sweep = Sweep {
        backend,
        fixed: &fixed,
        perm: &perm,
        factor,
        groups,
        maxq: maxq(p.bits),
        snapshot_width,
        min_tiles_per_task: (tiles / (4 * rayon::current_num_threads().max(1))).max(1),
    };
    let f = factor.f.coef();
    let mut loss = 0.0f64;
    let mut o1 = 0;
    while o1 < cols {
        let o2 = (o1 + outer).min(cols);
        let mut i1 = o1;
        while i1 < o2 {
            let i2 = (i1 + bs).min(o2);
            let (w, d, c) = (&mut w, &mut delta, &mut codes_sweep);
            loss += sweep.inner_block(w, d, c, snap_bufs, o1, (i1, i2), o2);
            i1 = i2;
        }
        if o2 < cols {
            backend.block_update(
                w.as_mut().subcols_mut(o2, cols - o2),
                delta.as_ref().subcols(0, o2 - o1),
                f.submatrix(o1, o2, o2 - o1, cols - o2),
            );
        }
        o1 = o2;
    }
    let (scales, zeros, g_idx) = sweep.groups.finish();
    SweepPass {
        codes_sweep,
        scales,
        zeros,
        g_idx,
        loss,
    }
}

/// Removes the damping the factor's Hessian `h` carries on its diagonal (`damp·mean(diag)` of the undamped
/// one, so `damp/(1 + damp)·mean(diag)` of `h`): the refinement fits the calibration's own output error. (Fitted
/// to the damped Hessian, one round raised the KL divergence at 2 bits on the trained model, 5.66 → 5.71
/// ×10⁻³, where the undamped one lowered it to 5.38.) A diagonal floor (damp 0) stays.
fn remove_damping(h: &mut Mat<f32>, damp: f32) {
    if damp <= 0.0 {
        return;
    }
    let n = h.nrows();
    let mean = (0..n).map(|i| f64::from(h[(i, i)])).sum::<f64>() / n.max(1) as f64;
    let shift = (mean * f64::from(damp) / (1.0 + f64::from(damp))) as f32;
    for i in 0..n {
        h[(i, i)] -= shift;
    }
}

/// With the clipping search, the error weight of each original column: `R_kk²` of its sweep position `k`, the
/// weight of its squared error in the GPTQ loss (`(w − q)²/U_kk²`, `U_kk = 1/R_kk`).
fn clip_weights(p: &GptqParams, factor: &PreparedFactor, perm: &[usize]) -> Option<Vec<f32>> {
    if !p.clip_search {
        return None;
    }
    let r = factor.f.r_diag();
    let mut w = vec![0f32; perm.len()];
    for (k, &orig) in perm.iter().enumerate() {
        w[orig] = r.get(k).map_or(1.0, |v| v * v);
    }
    Some(w)
}

/// What the inner blocks of one module's sweep read, and the group bookkeeping they advance.
struct Sweep<'s, 'p> {
    backend: &'s dyn LinalgBackend,
    fixed: &'s DeadFixed<'s>,
    /// `perm[k]`: the original column of sweep position `k`.
    perm: &'s [usize],
    factor: &'s PreparedFactor,
    groups: Groups<'p>,
    maxq: f32,
    /// Columns the snapshot buffers must hold ([`GroupLayout::max_snapshot_width`]).
    snapshot_width: usize,
    min_tiles_per_task: usize,
}

impl Sweep<'_, '_> {
    /// The inner block `[i1, i2)` of the outer block `[o1, o2)`: its group parameters (from the block's
    /// snapshot of `w` when a group starts in it), the sweep of its rows (codes into `codes`, sweep order), and,
    /// while the outer block goes on, the update of the outer block's later columns. Returns the block's loss.
    #[allow(clippy::too_many_arguments)] // the sweep's buffers and the block's place in it
    fn inner_block(
        &mut self,
        w: &mut MatMut<'_, f32>,
        delta: &mut MatMut<'_, f32>,
        codes: &mut [u8],
        snap_bufs: &mut Option<(Mat<f32>, Mat<f32>)>,
        o1: usize,
        (i1, i2): (usize, usize),
        o2: usize,
    ) -> f64 {
        let (rows, count) = (w.nrows(), i2 - i1);
        let (fixed, perm) = (self.fixed, self.perm);
        let w0_col = move |k: usize| fixed.col(perm[k]);
        let f = self.factor.f.coef();
        // The block's snapshot of W, when a group starts in it (see `Groups`).
        let snapshot: Option<MatRef<'_, f32>> =
            self.groups.layout.snapshot_width(i1, i2).map(|m| {
                block_snapshot(
                    self.backend,
                    w.as_ref().subcols(i1, m),
                    &|j| w0_col(i1 + j),
                    f.submatrix(i1, i1, m, m),
                    snapshot_buffers(snap_bufs, rows, self.snapshot_width),
                )
            });
        let (block_params, col_param) = self.groups.block(i1, i2, perm, snapshot);
        let (coef, rdiag2) = block_coefficients(f, self.factor.f.r_diag(), i1, count);
        let blk = Block {
            count,
            params: &block_params,
            col_param: &col_param,
            coef: &coef,
            rdiag2: &rdiag2,
            maxq: self.maxq,
        };
        let loss = sweep_rows(
            &blk,
            w.as_mut().subcols_mut(i1, count),
            delta.as_mut().subcols_mut(i1 - o1, count),
            |i| w0_col(i1 + i),
            &mut codes[i1 * rows..i2 * rows],
            self.min_tiles_per_task,
        );
        if i2 < o2 {
            self.backend.block_update(
                w.as_mut().subcols_mut(i2, o2 - i2),
                delta.as_ref().subcols(i1 - o1, count),
                f.submatrix(i1, i2, count, o2 - i2),
            );
        }
        loss
    }
}

/// Columns per outer block of the two-level sweep: [`OUTER_BLOCK`] rounded up to a multiple of the inner block
/// and, with dynamic groups, of the group size. Columns inside an outer block get every inner update before their
/// block starts, and a group never straddles two outer blocks, so each group sees W exactly as the single-level
/// sweep would.
fn outer_width(p: &GptqParams, gs: usize) -> usize {
    let bs = p.block_size;
    let lcm = |a: usize, b: usize| a / gcd(a, b) * b;
    let unit = if p.group_size > 0 && !p.static_groups {
        lcm(bs, gs)
    } else {
        bs
    };
    unit * OUTER_BLOCK.div_ceil(unit).max(1)
}

/// The snapshot's buffers (`(P − W₀, snapshot)`, `rows × width`), allocated on first use and when a module of
/// another shape needs more.
fn snapshot_buffers(
    bufs: &mut Option<(Mat<f32>, Mat<f32>)>,
    rows: usize,
    width: usize,
) -> &mut (Mat<f32>, Mat<f32>) {
    if bufs
        .as_ref()
        .is_none_or(|(a, _)| a.nrows() != rows || a.ncols() < width)
    {
        *bufs = None;
    }
    bufs.get_or_insert_with(|| (Mat::zeros(rows, width), Mat::zeros(rows, width)))
}

/// The block's coefficients at `(i1, i1)`, dense row-major (`coef[i * count + j]`, zero on and below the
/// diagonal), and the squared diagonal `R_ii²` that turns a column's squared error into its loss.
fn block_coefficients(
    f: MatRef<'_, f32>,
    r_diag: &[f32],
    i1: usize,
    count: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut coef = vec![0f32; count * count];
    let mut rdiag2 = vec![0f32; count];
    for j in 0..count {
        for i in 0..j {
            coef[i * count + j] = f[(i1 + i, i1 + j)];
        }
        rdiag2[j] = r_diag[i1 + j] * r_diag[i1 + j];
    }
    (coef, rdiag2)
}

/// One inner block's sweep over row tiles in parallel (rows are independent inside a block): `w` and `delta` are
/// the block's columns, `w0(i)` the block's column `i` of W₀, and `codes` receives the block's codes (its columns
/// contiguous, in sweep order). Returns the block's loss.
fn sweep_rows<'a>(
    blk: &Block<'_>,
    mut wr: MatMut<'_, f32>,
    mut dr: MatMut<'_, f32>,
    w0: impl Fn(usize) -> &'a [f32],
    codes: &mut [u8],
    min_tiles_per_task: usize,
) -> f64 {
    let (rows, count) = (wr.nrows(), blk.count);
    let mut parts = Vec::with_capacity(rows.div_ceil(TILE));
    let mut r0 = 0;
    while r0 < rows {
        let len = TILE.min(rows - r0);
        let (wa, wb) = wr.split_at_row_mut(len);
        let (da, db) = dr.split_at_row_mut(len);
        let w0: Vec<&[f32]> = (0..count).map(|i| &w0(i)[r0..r0 + len]).collect();
        parts.push((r0, wa, da, w0));
        wr = wb;
        dr = db;
        r0 += len;
    }
    let swept: Vec<(usize, Vec<u8>, f64)> = parts
        .into_par_iter()
        .with_min_len(min_tiles_per_task)
        .map_init(
            || vec![TileCol([0f32; TILE]); count],
            |scratch, (r0, wp, dp, w0)| {
                let (c, l) = blk.sweep_tile(wp, dp, &w0, r0, scratch);
                (r0, c, l)
            },
        )
        .collect();
    // A block's columns are contiguous in `codes`, so they are filled in parallel.
    codes
        .par_chunks_mut(rows.max(1))
        .enumerate()
        .for_each(|(i, dst)| {
            for (r0, local, _) in &swept {
                let len = local.len() / count.max(1);
                dst[*r0..r0 + len].copy_from_slice(&local[i * len..(i + 1) * len]);
            }
        });
    swept.iter().map(|(_, _, l)| l).sum::<f64>()
}

/// Codes in sweep order (`codes[k * rows + r]` for the k-th swept column) put into original column order:
/// column `perm[k]` gets the k-th. Without act-order the two orders are the same. Both sweeps (CPU and device)
/// end with this.
pub(crate) fn codes_in_original_order(
    codes_sweep: Vec<u8>,
    perm: Option<&[usize]>,
    rows: usize,
    cols: usize,
) -> Vec<u8> {
    let Some(perm) = perm else {
        return codes_sweep;
    };
    let mut inv = vec![0usize; cols];
    for (k, &orig) in perm.iter().enumerate() {
        inv[orig] = k;
    }
    let mut codes = vec![0u8; rows * cols];
    codes
        .par_chunks_mut(rows.max(1))
        .zip(inv.par_iter())
        .for_each(|(dst, &k)| dst.copy_from_slice(&codes_sweep[k * rows..(k + 1) * rows]));
    codes
}

/// W as the reference sees it at the start of the block `[i1, …)`, for its first `m` columns.
///
/// The reference has applied `−Σ_{i<i1} e_i·U_ij` to every later column; our W holds
/// `P_j = W_j + Σ_{k<i1} δ_k·F_kj`. Splitting `R` at `i1` gives `U₁₂ = −R₁₁⁻¹·R₁₂·R₂₂⁻¹`, so the reference's
/// value is `W + δ₁·R₁₂·R₂₂⁻¹` where ours is `W + δ₁·R₁₂·D₂₂⁻¹`. On the first `m` columns of the trailing part
/// only the leading `m × m` block of `R₂₂` matters, hence `snapshot = W₀ + (P − W₀)·F̂⁻¹` with `F̂` the unit
/// upper-triangular block of `F` (`F̂ = R·D⁻¹`). For `m = 1` the two agree, as they must.
///
/// `p`: the block's `m` columns of P; `w0_col(j)`: column `i1 + j` of W₀; `f`: the `m × m` block of F at
/// `(i1, i1)` (only its strict upper triangle is read). The GPU session calls this with P and the F block
/// downloaded from the device.
pub(crate) fn block_snapshot<'a, 'b>(
    backend: &dyn LinalgBackend,
    p: MatRef<'_, f32>,
    w0_col: &(dyn Fn(usize) -> &'a [f32] + Sync),
    f: MatRef<'_, f32>,
    bufs: &'b mut (Mat<f32>, Mat<f32>),
) -> MatRef<'b, f32> {
    let m = f.nrows();
    let fhat = Mat::<f32>::from_fn(m, m, |a, b| match a.cmp(&b) {
        std::cmp::Ordering::Less => f[(a, b)],
        std::cmp::Ordering::Equal => 1.0,
        std::cmp::Ordering::Greater => 0.0,
    });
    let mut t = Mat::<f32>::zeros(m, m);
    faer::linalg::triangular_inverse::invert_upper_triangular(
        t.as_mut(),
        fhat.as_ref(),
        faer::Par::Seq,
    );
    // snapshot = P + (P − W₀)·(F̂⁻¹ − I): F̂⁻¹ is unit upper triangular, so only its strict part multiplies.
    let (c, snap) = (&mut bufs.0, &mut bufs.1);
    c.as_mut()
        .subcols_mut(0, m)
        .par_col_iter_mut()
        .zip(snap.as_mut().subcols_mut(0, m).par_col_iter_mut())
        .enumerate()
        .for_each(|(j, (cc, sc))| {
            let (pc, w0) = (col(p, j), w0_col(j));
            if let (Some(cc), Some(sc)) = (cc.try_as_col_major_mut(), sc.try_as_col_major_mut()) {
                for ((cv, sv), (&pv, &wv)) in cc
                    .as_slice_mut()
                    .iter_mut()
                    .zip(sc.as_slice_mut())
                    .zip(pc.iter().zip(w0))
                {
                    *cv = pv - wv;
                    *sv = pv;
                }
            }
        });
    backend.block_update_strict_upper(
        snap.as_mut().subcols_mut(0, m),
        c.as_ref().subcols(0, m),
        t.as_ref(),
    );
    snap.as_ref().subcols(0, m)
}

/// [`block_snapshot`] on explicit inputs with the CPU backend: the reference of the device snapshot kernel's
/// test (`kernels/gptq.cu`, `tests/kernels.rs`). `p`: the block's columns of the working W; `w0`: the same
/// columns of W₀; `f`: the `m × m` block of F (strict upper triangle read).
#[doc(hidden)]
pub fn block_snapshot_cpu(p: &Mat<f32>, w0: &Mat<f32>, f: MatRef<'_, f32>) -> Mat<f32> {
    let (rows, m) = (p.nrows(), f.nrows());
    let mut bufs = (Mat::zeros(rows, m), Mat::zeros(rows, m));
    block_snapshot(
        &crate::numerics::linalg::CpuBackend::default(),
        p.as_ref(),
        &|j| w0.col_as_slice(j),
        f,
        &mut bufs,
    )
    .to_owned()
}

/// Round-to-nearest per group, no Hessian (the fallback when recovery is exhausted).
pub fn rtn_quantize(w: &Mat<f32>, p: &GptqParams) -> QuantizedLinear {
    let rows = w.nrows();
    let cols = w.ncols();
    let gs = p.effective_group(cols);
    let n_groups = cols.div_ceil(gs);
    let maxq = maxq(p.bits);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; n_groups * rows];
    let mut zeros = vec![0u8; n_groups * rows];
    let mut g_idx = vec![0i32; cols];
    for g in 0..n_groups {
        let (start, end) = (g * gs, ((g + 1) * gs).min(cols));
        let gp = find_params(rows, col_slices(w, start, end), p.bits, p.sym);
        push_group(&mut scales, &mut zeros, g, rows, &gp);
        for c in start..end {
            g_idx[c] = g as i32;
            let col = w.col_as_slice(c);
            for r in 0..rows {
                codes[c * rows + r] = quantize_code(col[r], gp.scale[r], gp.zero[r], maxq) as u8;
            }
        }
    }
    QuantizedLinear::rtn(p, rows, cols, codes, scales, zeros, g_idx)
}

/// The weight the consumer reconstructs: `scale_f16 · (code − zero)` with the group from `g_idx`.
pub fn dequantize_weight(q: &QuantizedLinear) -> Mat<f32> {
    let rows = q.rows;
    Mat::from_fn(rows, q.cols, |r, c| {
        let g = q.g_idx[c] as usize;
        let s = half::f16::from_f32(q.scales[g * rows + r]).to_f32();
        s * (q.codes[c * rows + r] as f32 - q.zeros[g * rows + r] as f32)
    })
}
