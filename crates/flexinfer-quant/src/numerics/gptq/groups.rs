//! The group bookkeeping of a module's sweep ([`Groups`]) and the dead-column view of its weights
//! ([`DeadFixed`]), shared by the CPU sweep and the GPU session.

use super::push_group;
use crate::numerics::linalg::col;
use crate::numerics::quantizer::{find_params, find_params_clipped, GroupParams};
use crate::params::{clip_factors, ColumnOrder, GptqParams};
use faer::{Mat, MatRef};

/// The group bookkeeping of one module's sweep, shared by the CPU sweep and the GPU session: the parameters
/// fixed before the sweep (one group per row from W as given; static groups from W after the dead-column fix),
/// those found from each block's snapshot as the sweep reaches a group's first column, and where every group's
/// scales, zeros and `g_idx` go in the result.
pub(crate) struct Groups<'p> {
    p: &'p GptqParams,
    rows: usize,
    /// Where the groups start and how wide their snapshots are.
    pub(crate) layout: GroupLayout,
    /// The parameters in force (one group per row, or the last group started).
    current: Option<GroupParams>,
    static_groups: Vec<GroupParams>,
    /// Group-aware reordering: a column's group is its original one (`orig / gs`), not its sweep position's.
    group_aware: bool,
    /// With the clipping search: each original column's error weight (the GPTQ loss weight `R_kk²` of its
    /// sweep position).
    clip_weight: Option<Vec<f32>>,
    /// Parameters given for every group (by group index) instead of found in the sweep (the scale
    /// refinement's second sweep).
    preset: Option<Vec<GroupParams>>,
    scales: Vec<f32>,
    zeros: Vec<u8>,
    g_idx: Vec<i32>,
}

/// Where a module's groups start and how wide the block-start snapshots that find their parameters are:
/// what follows from the parameters and the module's width alone, so the device memory budget
/// (`device::kernel::sweep_bytes`) reads the same widths the sweeps use.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupLayout {
    cols: usize,
    /// The group size in force (`cols` with one group per row).
    gs: usize,
    /// Whether the sweep finds each group's parameters as it reaches it (grouped, not static groups).
    found_in_sweep: bool,
}

impl GroupLayout {
    pub(crate) fn new(p: &GptqParams, cols: usize) -> Self {
        GroupLayout {
            cols,
            gs: p.effective_group(cols).max(1),
            found_in_sweep: p.group_size > 0 && !p.static_groups,
        }
    }

    /// The module's input features.
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// How many groups the module has (the result's scales and zeros hold `groups × rows` values).
    pub(crate) fn count(&self) -> usize {
        self.cols.div_ceil(self.gs)
    }

    /// The group whose parameters the sweep finds at sweep position `k` (from the snapshot of its block),
    /// and its columns `k..k + len`: `Some((group, len))` at the first column of each group, unless the
    /// groups are fixed before the sweep.
    pub(crate) fn starts_at(&self, k: usize) -> Option<(usize, usize)> {
        (self.found_in_sweep && k.is_multiple_of(self.gs))
            .then(|| (k / self.gs, self.gs.min(self.cols - k)))
    }

    /// How many columns from `i1` on the snapshot of the block `[i1, i2)` must cover (see
    /// [`block_snapshot`]): the block, and every group that starts in it to its end (a group wider than the
    /// block, or one that a block size it does not divide cuts); `None` when no group starts in the block, so
    /// no snapshot is needed.
    pub(crate) fn snapshot_width(&self, i1: usize, i2: usize) -> Option<usize> {
        (i1..i2)
            .filter_map(|k| self.starts_at(k).map(|(_, len)| k + len - i1))
            .max()
            .map(|w| w.max(i2 - i1))
    }

    /// The widest snapshot of a sweep in blocks of `bs` columns (0 when no group starts in the sweep).
    pub(crate) fn max_snapshot_width(&self, bs: usize) -> usize {
        let bs = bs.max(1);
        (0..self.cols)
            .step_by(bs)
            .filter_map(|i1| self.snapshot_width(i1, (i1 + bs).min(self.cols)))
            .max()
            .unwrap_or(0)
    }
}

/// A module's W with its dead columns (those the Hessian preparation zeroed) read as zero: the columns
/// the sweep starts from, on the CPU and on a device.
pub(crate) struct DeadFixed<'a> {
    w: &'a Mat<f32>,
    dead: &'a [bool],
    zero: Vec<f32>,
}

impl<'a> DeadFixed<'a> {
    pub(crate) fn new(w: &'a Mat<f32>, dead: &'a [bool]) -> Self {
        DeadFixed {
            w,
            dead,
            zero: vec![0f32; w.nrows()],
        }
    }

    /// Column `c` in the original order, zero when it is dead.
    pub(crate) fn col(&self, c: usize) -> &[f32] {
        if self.dead.get(c).copied().unwrap_or(false) {
            &self.zero
        } else {
            self.w.col_as_slice(c)
        }
    }
}

/// The parameters of one group from its columns: min/max, or the clipping search when `weight` (each
/// column's error weight) is given.
fn params_of(
    p: &GptqParams,
    rows: usize,
    columns: &[&[f32]],
    weight: Option<Vec<f32>>,
) -> GroupParams {
    match weight {
        None => find_params(rows, columns.iter().copied(), p.bits, p.sym),
        Some(w) => {
            let factors: Vec<f32> = clip_factors().collect();
            find_params_clipped(rows, columns, &w, p.bits, p.sym, &factors)
        }
    }
}

impl<'p> Groups<'p> {
    /// `w_in`: the module's W as given; `orig_col(c)`: column `c` after the dead-column fix; `clip_weight`:
    /// with the clipping search ([`GptqParams::clip_search`]), each original column's error weight (`None`
    /// without it).
    pub(crate) fn new<'a>(
        p: &'p GptqParams,
        w_in: &Mat<f32>,
        orig_col: &dyn Fn(usize) -> &'a [f32],
        clip_weight: Option<Vec<f32>>,
    ) -> Self {
        let (rows, cols) = (w_in.nrows(), w_in.ncols());
        let layout = GroupLayout::new(p, cols);
        let (gs, n_groups) = (layout.gs, layout.count());
        let clip_weight = clip_weight.filter(|w| p.clip_search && w.len() == cols);
        let weight_of =
            |orig: std::ops::Range<usize>| clip_weight.as_ref().map(|w| w[orig].to_vec());
        // With one group per row the parameters come from W before the dead-column fix (IST order).
        let current: Option<GroupParams> = if p.group_size <= 0 {
            let columns: Vec<&[f32]> = (0..cols).map(|c| w_in.col_as_slice(c)).collect();
            Some(params_of(p, rows, &columns, weight_of(0..cols)))
        } else {
            None
        };
        let static_groups: Vec<GroupParams> = if p.static_groups && p.group_size > 0 {
            (0..n_groups)
                .map(|g| {
                    let range = g * gs..((g + 1) * gs).min(cols);
                    let columns: Vec<&[f32]> = range.clone().map(orig_col).collect();
                    params_of(p, rows, &columns, weight_of(range))
                })
                .collect()
        } else {
            Vec::new()
        };
        let group_aware = matches!(p.column_order(cols), ColumnOrder::GroupAware { .. });
        let mut groups = Groups {
            p,
            rows,
            layout,
            current,
            static_groups,
            group_aware,
            clip_weight,
            preset: None,
            scales: vec![0f32; n_groups * rows],
            zeros: vec![0u8; n_groups * rows],
            g_idx: vec![0i32; cols],
        };
        if let (Some(cur), true) = (&groups.current, p.group_size <= 0) {
            push_group(&mut groups.scales, &mut groups.zeros, 0, rows, cur);
        }
        for (g, sg) in groups.static_groups.iter().enumerate() {
            push_group(&mut groups.scales, &mut groups.zeros, g, rows, sg);
        }
        groups
    }

    /// The same bookkeeping with every group's parameters given (by group index, `None`: found as usual):
    /// one group per row and static groups take them as their fixed parameters, groups found in the sweep
    /// take them where they start.
    pub(crate) fn with_preset(mut self, preset: Option<Vec<GroupParams>>) -> Self {
        let Some(preset) = preset.filter(|ps| ps.len() == self.layout.count()) else {
            return self;
        };
        if self.p.group_size <= 0 {
            self.current = preset.first().cloned();
        }
        if !self.static_groups.is_empty() {
            self.static_groups = preset.clone();
        }
        for (g, gp) in preset.iter().enumerate() {
            push_group(&mut self.scales, &mut self.zeros, g, self.rows, gp);
        }
        self.preset = Some(preset);
        self
    }

    /// The group of sweep position `k` (original column `orig`): the index of the parameters its codes use
    /// among the module's groups, which is also its `g_idx`.
    fn group_of(&self, k: usize, orig: usize) -> usize {
        match (self.p.group_size > 0, self.p.static_groups) {
            (false, _) => 0,
            (true, true) => orig / self.layout.gs,
            (true, false) if self.group_aware => orig / self.layout.gs,
            (true, false) => k / self.layout.gs,
        }
    }

    /// Where the parameters found at sweep position `k` go ([`GroupLayout::starts_at`]): `Some((group, len))`
    /// at the first column of each group found in the sweep, `group` being the index its columns use (the
    /// original group with group-aware reordering, whose groups are contiguous in the sweep).
    pub(crate) fn found_at(&self, k: usize, perm: &[usize]) -> Option<(usize, usize)> {
        let (_, len) = self.layout.starts_at(k)?;
        Some((self.group_of(k, perm[k]), len))
    }

    /// The group parameters of the block `[i1, i2)` (sweep order; `perm[k]` = original column) and, per
    /// column, the index of its parameters among them. Group parameters of every column of the block are
    /// fixed before the sweep: they are read from W as the block starts (the reference's quirk, kept for
    /// parity), i.e. from `snapshot` (the first [`GroupLayout::snapshot_width`] columns from `i1`).
    pub(crate) fn block(
        &mut self,
        i1: usize,
        i2: usize,
        perm: &[usize],
        snapshot: Option<MatRef<'_, f32>>,
    ) -> (Vec<GroupParams>, Vec<Option<usize>>) {
        let (p, rows) = (self.p, self.rows);
        let mut block_params: Vec<GroupParams> = Vec::new();
        let mut col_param: Vec<Option<usize>> = vec![None; i2 - i1];
        let mut cur_idx: Option<usize> = self.current.as_ref().map(|c| {
            block_params.push(c.clone());
            0
        });
        let mut cur_static: Option<usize> = None;
        for (i, slot) in col_param.iter_mut().enumerate() {
            let k = i1 + i;
            let orig = perm[k];
            let group_of_k = self.group_of(k, orig);
            if p.group_size > 0 && p.static_groups {
                if cur_static != Some(group_of_k) {
                    block_params.push(self.static_groups[group_of_k].clone());
                    cur_idx = Some(block_params.len() - 1);
                    cur_static = Some(group_of_k);
                }
            } else if let Some((g, len)) = self.found_at(k, perm) {
                let Some(snap) = snapshot.as_ref() else {
                    unreachable!("a group starts in this block, so the snapshot exists")
                };
                let gp = match self.preset.as_ref().and_then(|ps| ps.get(g)) {
                    Some(gp) => gp.clone(),
                    None => {
                        let columns: Vec<&[f32]> =
                            (k..k + len).map(|c| col(*snap, c - i1)).collect();
                        let weight = self
                            .clip_weight
                            .as_ref()
                            .map(|w| perm[k..k + len].iter().map(|&o| w[o]).collect());
                        params_of(p, rows, &columns, weight)
                    }
                };
                self.record(g, &gp);
                block_params.push(gp);
                cur_idx = Some(block_params.len() - 1);
            }
            self.g_idx[orig] = group_of_k as i32;
            *slot = cur_idx;
        }
        self.current = cur_idx.map(|i| block_params[i].clone());
        (block_params, col_param)
    }

    /// For a sweep that finds the group parameters on a device: the group of every sweep position (`perm[k]`
    /// = original column), with `g_idx` recorded for every column, and the parameters fixed before the sweep
    /// by group (one group per row; static groups). The groups that start in the sweep
    /// ([`GroupLayout::starts_at`]) are the device's to find and to [`Groups::record`].
    pub(crate) fn plan_all(&mut self, perm: &[usize]) -> (Vec<usize>, Vec<(usize, &GroupParams)>) {
        let of: Vec<usize> = (0..self.layout.cols)
            .map(|k| self.group_of(k, perm[k]))
            .collect();
        for (k, &g) in of.iter().enumerate() {
            self.g_idx[perm[k]] = g as i32;
        }
        let fixed = match (&self.current, self.p.group_size > 0) {
            (Some(cur), false) => vec![(0, cur)],
            _ => self.static_groups.iter().enumerate().collect(),
        };
        (of, fixed)
    }

    /// Records the parameters of group `g` (found from its snapshot) for the result.
    pub(crate) fn record(&mut self, g: usize, gp: &GroupParams) {
        push_group(&mut self.scales, &mut self.zeros, g, self.rows, gp);
    }

    /// Scales, zeros and `g_idx` of the module.
    pub(crate) fn finish(mut self) -> (Vec<f32>, Vec<u8>, Vec<i32>) {
        if self.p.static_groups && self.p.group_size > 0 {
            for (c, gi) in self.g_idx.iter_mut().enumerate() {
                *gi = (c / self.layout.gs) as i32;
            }
        }
        (self.scales, self.zeros, self.g_idx)
    }
}
