//! Quantization settings: the GPTQ format knobs and the Hessian-recovery tunables (docs/dev/gptq.md, "The algorithm").
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use crate::error::{QuantError, Result, SpecError};
use serde::{Deserialize, Serialize};

/// How the diagonal floor of the recovery loop is scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FloorMode {
    /// `mean(diag) × GPTQ_HESSIAN_DIAG_FLOOR_SCALE` (default).
    Mean,
    /// `max|diag| × 1e-6` (the pre-MR !156 behaviour).
    AbsMax,
}

impl std::str::FromStr for FloorMode {
    type Err = QuantError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "mean" => Ok(FloorMode::Mean),
            "abs_max" | "absmax" => Ok(FloorMode::AbsMax),
            other => Err(SpecError::FloorMode {
                got: other.to_string(),
            }
            .into()),
        }
    }
}

/// The GPTQ algorithm and format settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptqParams {
    pub bits: u32,
    /// -1 = one group per row.
    pub group_size: i32,
    pub sym: bool,
    pub desc_act: bool,
    pub static_groups: bool,
    pub block_size: usize,
    /// Group-aware reordering (GPTQModel's `act_group_aware`): inside each group the columns are swept by
    /// descending Hessian diagonal, and the groups by descending group maximum of it, while every column keeps
    /// its own group (monotonic `g_idx`, plain checkpoint layout). Ignored with `desc_act`, which reorders
    /// across groups. Left out of the serialised form when off, so digests of runs without it do not change.
    #[serde(default, skip_serializing_if = "is_false")]
    pub act_group_aware: bool,
    /// Clipping search for the group parameters: each row's range is shrunk by the factor of
    /// [`clip_factors`] whose quantization has the least GPTQ-weighted squared error over the group
    /// (see `quantizer::find_params_clipped`). Left out of the serialised form when off.
    #[serde(default, skip_serializing_if = "is_false")]
    pub clip_search: bool,
    /// Scale refinement (`numerics::gptq::refine`): rounds of "refit every row's group scales by least squares
    /// to the output error `(w − q)·H·(w − q)ᵀ` with the codes fixed", each after a sweep that quantizes with the
    /// previous round's scales (the first sweep finds them from min/max as usual). 0 = off; `n` rounds cost
    /// `n` sweeps. Left out of the serialised form when 0, so digests of runs without it do not change.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refine_rounds: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Shrink factors the clipping search tries: 1, 0.975, …, 0.5 (21 values; the full range first, so a tie
/// keeps it).
pub const CLIP_GRID_STEPS: usize = 20;
/// The smallest shrink factor of the clipping search.
pub const CLIP_MIN_FACTOR: f32 = 0.5;

/// The shrink factors of the clipping search, largest first.
pub fn clip_factors() -> impl Iterator<Item = f32> {
    (0..=CLIP_GRID_STEPS).map(|k| 1.0 - (1.0 - CLIP_MIN_FACTOR) * k as f32 / CLIP_GRID_STEPS as f32)
}

/// The order in which the sweep visits the input columns (decided from the prepared Hessian diagonal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnOrder {
    /// Input order.
    Plain,
    /// Act-order: all columns by descending diagonal (`desc_act`; non-monotonic `g_idx`).
    Desc,
    /// Group-aware: groups of `group` consecutive columns stay together; see [`GptqParams::act_group_aware`].
    GroupAware { group: usize },
}

impl From<bool> for ColumnOrder {
    /// `desc_act` alone: act-order or input order.
    fn from(desc_act: bool) -> Self {
        if desc_act {
            ColumnOrder::Desc
        } else {
            ColumnOrder::Plain
        }
    }
}

/// The `clipSearch` setting: `auto` is the engine's measured default ([`ClipSearch::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipSearch {
    Auto,
    On,
    Off,
}

impl ClipSearch {
    /// Whether the search runs at `bits` bits. `auto` is off at every width: on the trained model of
    /// docs/benchmarks.md the search raised the KL divergence to the unquantized model at 2 and 3 bits and
    /// was mixed at 4 (the sweep's error feedback moves a group's later columns past a shrunk range).
    pub fn resolve(self, _bits: u32) -> bool {
        match self {
            ClipSearch::On => true,
            ClipSearch::Off | ClipSearch::Auto => false,
        }
    }
}

impl std::str::FromStr for ClipSearch {
    type Err = QuantError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(ClipSearch::Auto),
            "on" | "true" | "1" => Ok(ClipSearch::On),
            "off" | "false" | "0" => Ok(ClipSearch::Off),
            other => Err(SpecError::ClipSearch {
                got: other.to_string(),
            }
            .into()),
        }
    }
}

/// Refinement rounds of `refineScales: auto` at 2 and 3 bits (and of `on`): seven sweeps, each followed by a
/// refit. On the trained model of docs/benchmarks.md the KL divergence to the unquantized model fell with
/// the rounds up to about this many (2 bits: 5.38 after one round, 4.86 after four, 4.75 after seven, 4.76
/// after twelve, ×10⁻³).
pub const DEFAULT_REFINE_ROUNDS: u32 = 7;

/// The `refineScales` setting: `auto` is the engine's measured default ([`RefineScales::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefineScales {
    Auto,
    Off,
    /// This many rounds (`on` = [`DEFAULT_REFINE_ROUNDS`]).
    Rounds(u32),
}

impl RefineScales {
    /// The rounds at `bits` bits. `auto` refines at 2 and 3 bits, where it lowered the KL divergence to the
    /// unquantized model by 16 % and 8 % on the trained model of docs/benchmarks.md, and not at 4 and 8 bits,
    /// where the gain (−2.5 % at 4 bits) is below the spread between neighbouring settings and the extra
    /// sweeps (and, on a GPU, the CPU fallback of the group) are not worth it.
    pub fn resolve(self, bits: u32) -> u32 {
        match self {
            RefineScales::Auto if bits <= 3 => DEFAULT_REFINE_ROUNDS,
            RefineScales::Auto | RefineScales::Off => 0,
            RefineScales::Rounds(n) => n,
        }
    }
}

impl std::str::FromStr for RefineScales {
    type Err = QuantError;
    fn from_str(s: &str) -> Result<Self> {
        let v = s.trim().to_ascii_lowercase();
        match v.as_str() {
            "auto" | "" => Ok(RefineScales::Auto),
            "on" | "true" => Ok(RefineScales::Rounds(DEFAULT_REFINE_ROUNDS)),
            "off" | "false" | "0" => Ok(RefineScales::Off),
            _ => match v.parse::<u32>() {
                Ok(n) if n <= 64 => Ok(RefineScales::Rounds(n)),
                _ => Err(SpecError::RefineScales { got: s.to_string() }.into()),
            },
        }
    }
}

impl Default for GptqParams {
    fn default() -> Self {
        GptqParams {
            bits: 4,
            group_size: 128,
            sym: true,
            desc_act: false,
            static_groups: false,
            block_size: 128,
            act_group_aware: false,
            clip_search: false,
            refine_rounds: 0,
        }
    }
}

impl GptqParams {
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.bits, 2 | 3 | 4 | 8) {
            return Err(SpecError::Bits { bits: self.bits }.into());
        }
        if !(self.group_size == -1 || self.group_size > 0) {
            return Err(SpecError::GroupSize {
                group_size: self.group_size,
            }
            .into());
        }
        if self.block_size == 0 {
            return Err(SpecError::BlockSize.into());
        }
        Ok(())
    }

    /// Why a device sweep cannot run these settings (the group is solved on the CPU instead), if it cannot:
    /// the clipping search and the scale refinement exist in the CPU sweep only.
    pub fn cpu_only(&self) -> Option<&'static str> {
        if self.clip_search {
            Some("the clipping search (clipSearch) runs on the CPU only")
        } else if self.refine_rounds > 0 {
            Some("the scale refinement (refineScales) runs on the CPU only")
        } else {
            None
        }
    }

    /// The sweep's column order: act-order wins over group-aware reordering.
    pub fn column_order(&self, cols: usize) -> ColumnOrder {
        if self.desc_act {
            ColumnOrder::Desc
        } else if self.act_group_aware {
            ColumnOrder::GroupAware {
                group: self.effective_group(cols).max(1),
            }
        } else {
            ColumnOrder::Plain
        }
    }

    /// Columns per group for a layer with `cols` inputs.
    pub fn effective_group(&self, cols: usize) -> usize {
        if self.group_size <= 0 {
            cols
        } else {
            self.group_size as usize
        }
    }

    /// Checks that a linear with `cols` inputs and `rows` outputs can be stored in the gptq format.
    pub fn check_shape(&self, name: &str, rows: usize, cols: usize) -> Result<()> {
        if self.group_size > 0 && !cols.is_multiple_of(self.group_size as usize) {
            return Err(SpecError::GroupDivides {
                module: name.to_string(),
                group_size: self.group_size,
                cols,
            }
            .into());
        }
        let pack = if self.bits == 3 {
            32
        } else {
            32u32.checked_div(self.bits).unwrap_or(32) as usize
        };
        if !cols.is_multiple_of(pack) || !rows.is_multiple_of(pack) {
            return Err(SpecError::Packing {
                module: name.to_string(),
                rows,
                cols,
                bits: self.bits,
                pack,
            }
            .into());
        }
        Ok(())
    }
}

/// Hessian-recovery tunables (`GPTQ_*` env).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecoveryParams {
    pub damp_percent: f32,
    pub damp_auto_increment: f32,
    pub floor_mode: FloorMode,
    pub floor_scale: f32,
    pub floor_multiplier: f32,
    pub max_floor_attempts: u32,
}

impl Default for RecoveryParams {
    fn default() -> Self {
        RecoveryParams {
            damp_percent: 0.05,
            damp_auto_increment: 0.1,
            floor_mode: FloorMode::Mean,
            floor_scale: 0.01,
            floor_multiplier: 10.0,
            max_floor_attempts: 6,
        }
    }
}

impl RecoveryParams {
    pub fn validate(&self) -> Result<()> {
        let finite = [
            self.damp_percent,
            self.damp_auto_increment,
            self.floor_scale,
            self.floor_multiplier,
        ];
        if finite.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(SpecError::Recovery.into());
        }
        Ok(())
    }
}

/// RTN fallback gate (`GPTQ_MAX_RTN_FALLBACK_PERCENT`, `GPTQ_MIN_MODULES_FOR_FALLBACK_GATE`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateParams {
    pub max_rtn_fallback_percent: f64,
    pub min_modules: u64,
}

impl Default for GateParams {
    fn default() -> Self {
        GateParams {
            max_rtn_fallback_percent: 10.0,
            min_modules: 100,
        }
    }
}
