//! The in-block sweep of the GPTQ solver: rows are independent inside a block, so the block is swept
//! tile by tile (`TILE` rows whose block columns stay in the L1 cache), each tile by one `pulp`
//! kernel compiled per instruction set.

use crate::numerics::quantizer::{dequantize, quantize_code, GroupParams};
use faer::{Mat, MatMut};

/// Rows per tile of the in-block sweep: a tile's block columns (`TILE × 128` weights plus as many deltas) stay
/// in the L1 cache while the block's columns are swept.
pub(super) const TILE: usize = 64;

/// One tile column of the sweep's scratch, cache-line aligned so vector loads and stores never split a line.
#[derive(Clone, Copy)]
#[repr(align(64))]
pub(super) struct TileCol(pub(super) [f32; TILE]);

/// The CPU backend's in-block sweep on explicit inputs, tile by tile as [`gptq_quantize_in`] runs it: the
/// reference of the device sweep kernel's parity test (`kernels/gptq.cu`, `tests/kernels.rs`). `w` holds the
/// block's `count` columns as the block starts, `w0` the same columns before the sweep; `coef` is the
/// block's row-major coefficients, `rdiag2` its `R_ii²`, `col_param[i]` the index into `params` of column
/// `i`'s group parameters. Returns the codes (`codes[i * rows + r]`), the deltas `W₀ − Q` and the block's
/// loss contribution.
#[doc(hidden)]
pub fn sweep_block_cpu(
    w: &Mat<f32>,
    w0: &Mat<f32>,
    coef: &[f32],
    rdiag2: &[f32],
    params: &[GroupParams],
    col_param: &[Option<usize>],
    maxq: f32,
) -> (Vec<u8>, Mat<f32>, f64) {
    let (rows, count) = (w.nrows(), w.ncols());
    let blk = Block {
        count,
        params,
        col_param,
        coef,
        rdiag2,
        maxq,
    };
    let mut w = w.clone();
    let mut delta = Mat::<f32>::zeros(rows, count);
    let mut codes = vec![0u8; rows * count];
    let mut loss = 0.0f64;
    let mut scratch = vec![TileCol([0f32; TILE]); count];
    let mut r0 = 0;
    while r0 < rows {
        let len = TILE.min(rows - r0);
        let w0s: Vec<&[f32]> = (0..count)
            .map(|i| &w0.col_as_slice(i)[r0..r0 + len])
            .collect();
        let (c, l) = blk.sweep_tile(
            w.as_mut().subrows_mut(r0, len),
            delta.as_mut().subrows_mut(r0, len),
            &w0s,
            r0,
            &mut scratch,
        );
        for i in 0..count {
            codes[i * rows + r0..i * rows + r0 + len].copy_from_slice(&c[i * len..(i + 1) * len]);
        }
        loss += l;
        r0 += len;
    }
    (codes, delta, loss)
}

/// What every row tile of one block shares.
pub(super) struct Block<'a> {
    pub(super) count: usize,
    pub(super) params: &'a [GroupParams],
    pub(super) col_param: &'a [Option<usize>],
    pub(super) coef: &'a [f32],
    pub(super) rdiag2: &'a [f32],
    pub(super) maxq: f32,
}

impl Block<'_> {
    /// The in-block column loop for rows `r0 .. r0 + w.nrows()` (at most [`TILE`]): quantize each column, record
    /// `W_k − Q_k` in `delta`, and feed it to the block's later columns. Returns the codes (`[count][len]`) and
    /// the loss `Σ (w̃ − q)²·R_ii²/2`. Runs with the widest SIMD instruction set the CPU has (runtime dispatch);
    /// no fused multiply-add is formed, so every instruction set gives the same bits.
    pub(super) fn sweep_tile(
        &self,
        mut w: MatMut<'_, f32>,
        mut delta: MatMut<'_, f32>,
        w0: &[&[f32]],
        r0: usize,
        scratch: &mut [TileCol],
    ) -> (Vec<u8>, f64) {
        let (len, count) = (w.nrows(), self.count);
        let mut codes = vec![0u8; len * count];
        let mut acc = [0f32; TILE];
        pulp::Arch::new().dispatch(TileKernel {
            blk: self,
            w: w.as_mut(),
            delta: delta.as_mut(),
            w0,
            r0,
            wt: scratch,
            codes: &mut codes,
            acc: &mut acc[..len],
        });
        let loss = acc[..len].iter().map(|&v| v as f64).sum::<f64>() / 2.0;
        (codes, loss)
    }
}

/// [`Block::sweep_tile`]'s loops as a `pulp` operation: `with_simd` is compiled once per instruction set and
/// the loops below are inlined into it, so the compiler vectorizes them for that set.
struct TileKernel<'a, 'b> {
    blk: &'a Block<'a>,
    w: MatMut<'b, f32>,
    delta: MatMut<'b, f32>,
    w0: &'a [&'a [f32]],
    r0: usize,
    wt: &'a mut [TileCol],
    codes: &'a mut [u8],
    acc: &'a mut [f32],
}

impl pulp::WithSimd for TileKernel<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let TileKernel {
            blk,
            w,
            mut delta,
            w0,
            r0,
            wt,
            codes,
            acc,
        } = self;
        let (len, count) = (w.nrows(), blk.count);
        // The tile's block columns are `rows` floats apart in W: they are copied into a dense local buffer, so
        // they do not all fall into the same few cache sets, and padded to a full tile (zero weights, unit
        // scales), so every loop below has a fixed trip count and keeps a column in registers.
        for (i, TileCol(dst)) in wt.iter_mut().enumerate() {
            match w.as_ref().col(i).try_as_col_major() {
                Some(c) => dst[..len].copy_from_slice(c.as_slice()),
                None => dst[..len].fill(0.0),
            }
            dst[len..].fill(0.0);
        }
        let mut acc_t = [0f32; TILE];
        // Columns go in sub-blocks of `SB`: inside a sub-block each column's delta is fed to the sub-block's
        // later columns at once (rank-1 updates); then every later column of the block takes the sub-block's
        // deltas in one pass with its values held in registers, instead of being loaded and stored once per
        // delta. The additions happen in the same order either way, so the result is the same to the bit.
        const SB: usize = 16;
        let mut dls = [TileCol([0f32; TILE]); SB];
        let mut s0 = 0;
        while s0 < count {
            let s1 = (s0 + SB).min(count);
            for i in s0..s1 {
                let dl = &mut dls[i - s0].0;
                *dl = [0f32; TILE];
                if let Some(gp) = blk.col_param[i].map(|pi| &blk.params[pi]) {
                    let (mut sc, mut zr, mut w0t) = ([1f32; TILE], [0f32; TILE], [0f32; TILE]);
                    sc[..len].copy_from_slice(&gp.scale[r0..r0 + len]);
                    zr[..len].copy_from_slice(&gp.zero[r0..r0 + len]);
                    w0t[..len].copy_from_slice(&w0[i][..len]);
                    let rd2 = blk.rdiag2[i];
                    let x = &wt[i].0;
                    let mut qf = [0f32; TILE];
                    for r in 0..TILE {
                        let q = quantize_code(x[r], sc[r], zr[r], blk.maxq);
                        qf[r] = q;
                        let dq = dequantize(q, sc[r], zr[r]);
                        let diff = x[r] - dq;
                        acc_t[r] += diff * diff * rd2;
                        dl[r] = w0t[r] - dq;
                    }
                    for (o, q) in codes[i * len..(i + 1) * len].iter_mut().zip(qf.iter()) {
                        *o = *q as u8;
                    }
                }
                if let Some(dcol) = delta.as_mut().col_mut(i).try_as_col_major_mut() {
                    dcol.as_slice_mut().copy_from_slice(&dl[..len]);
                }
                let row = &blk.coef[i * count + i + 1..i * count + s1];
                for (TileCol(right), &c) in wt[i + 1..s1].iter_mut().zip(row) {
                    for r in 0..TILE {
                        right[r] += dl[r] * c;
                    }
                }
            }
            for (jj, TileCol(right)) in wt[s1..].iter_mut().enumerate() {
                let j = s1 + jj;
                let mut x = *right;
                for (u, TileCol(dl)) in dls[..s1 - s0].iter().enumerate() {
                    let c = blk.coef[(s0 + u) * count + j];
                    for r in 0..TILE {
                        x[r] += dl[r] * c;
                    }
                }
                *right = x;
            }
            s0 = s1;
        }
        acc.copy_from_slice(&acc_t[..len]);
    }
}
