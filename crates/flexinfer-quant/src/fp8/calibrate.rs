//! Static activation scales (`FP8_ACTIVATIONS=static`): one per-tensor `input_scale` per quantized
//! linear, `max|x| / 448` over every calibration token of the linear's input — what llm-compressor's
//! min-max observer gives a static `tensor` activation scheme, and what vLLM's W8A8 FP8 kernels divide the
//! activations by (taking the max over modules it fuses, q/k/v and gate/up, each of which we record).
//!
//! The calibration forward is the GPTQ/AWQ one, layer by layer over every sample (so the memory is the
//! samples' hidden states plus one layer's weights). Each layer runs with its quantized linears'
//! weights **FP8-dequantized** (the values the consumer multiplies with), so every later layer's inputs
//! carry the earlier layers' weight rounding, as llm-compressor's observers see the model during its
//! calibration. The activations propagate unquantized: their scales are what this pass measures.

use super::e4m3;
use super::quantize::{dequantize, quantize_weight, ScaleStrategy};
use crate::error::{Result, SpecError, TensorError};
use crate::events::EventSink;
use crate::job::calibrate::embed_samples;
use crate::job::rewrite::progress;
use crate::model::calib::{load_samples_counted, CalibSettings};
use crate::model::config::ModelConfig;
use crate::model::llama::{layer_forward_visit, Rope};
use crate::model::tensors::TensorStore;
use crate::model::{input_groups, layer_modules, load_layer};
use faer::{Mat, MatRef};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The share of a static run's progress the calibration forward reports (the weights take the rest up to 90).
pub const CALIBRATION_PERCENT: f64 = 45.0;

/// The activation scales an FP8 artifact declares (`FP8_ACTIVATIONS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationScheme {
    /// Per-token scales the serving engine computes at run time; no calibration (the default).
    Dynamic,
    /// One calibrated per-tensor `input_scale` per quantized linear.
    Static,
}

impl ActivationScheme {
    pub const ALL: [ActivationScheme; 2] = [ActivationScheme::Dynamic, ActivationScheme::Static];

    pub fn as_str(self) -> &'static str {
        match self {
            ActivationScheme::Dynamic => "dynamic",
            ActivationScheme::Static => "static",
        }
    }

    /// `dynamic` or `static` (case-insensitive); `field` names the setting in the error.
    pub fn parse(field: &str, value: &str) -> std::result::Result<Self, SpecError> {
        super::quantize::parse_named(field, value, &Self::ALL, Self::as_str)
    }
}

/// What an FP8 run does about its activation scales.
#[derive(Clone, Debug)]
pub enum Fp8Activations<'a> {
    /// [`ActivationScheme::Dynamic`]: nothing to calibrate.
    Dynamic,
    /// [`ActivationScheme::Static`]: the calibration set (the GPTQ pipeline's `DATASET` formats) and how
    /// much of it to use (`MAX_SAMPLES`, `MAX_SEQ_LEN`).
    Static {
        dataset: &'a Path,
        calib: CalibSettings,
    },
}

impl Fp8Activations<'_> {
    pub fn scheme(&self) -> ActivationScheme {
        match self {
            Fp8Activations::Dynamic => ActivationScheme::Dynamic,
            Fp8Activations::Static { .. } => ActivationScheme::Static,
        }
    }
}

/// The largest magnitude in `a`; NaN when `a` holds a NaN (`f32::max` would skip it).
pub fn absmax(a: MatRef<'_, f32>) -> f32 {
    let mut m = 0f32;
    for c in 0..a.ncols() {
        for &v in a.col(c).iter() {
            if v.is_nan() {
                return f32::NAN;
            }
            m = m.max(v.abs());
        }
    }
    m
}

/// The static input scale of `module` whose calibration inputs reach `absmax`: `absmax / 448`. A zero,
/// NaN or infinite `absmax` has no usable scale: an error naming the module.
pub fn input_scale(module: &str, absmax: f32) -> std::result::Result<f32, TensorError> {
    let scale = absmax / e4m3::MAX;
    if absmax.is_finite() && absmax > 0.0 && scale.is_normal() {
        Ok(scale)
    } else {
        Err(TensorError::ActivationScale {
            module: module.to_string(),
            absmax,
        })
    }
}

/// The calibrated input scales: module name → `input_scale`, and the calibration tokens they came from.
#[derive(Clone, Debug, Default)]
pub struct InputScales {
    pub scales: HashMap<String, f32>,
    pub tokens: u64,
}

/// `w` (a `[rows, cols]` weight of module `name`) replaced by its FP8 dequantization under `strategy`.
fn fake_quantize(name: &str, w: &mut Mat<f32>, strategy: ScaleStrategy) -> Result<()> {
    let (rows, cols) = (w.nrows(), w.ncols());
    let values: Vec<f32> = (0..rows)
        .flat_map(|r| (0..cols).map(move |c| (r, c)))
        .map(|(r, c)| w[(r, c)])
        .collect();
    let q = quantize_weight(name, &values, rows, cols, strategy)?;
    for r in 0..rows {
        let s = q.scales[if q.scales.len() == 1 { 0 } else { r }];
        for c in 0..cols {
            w[(r, c)] = dequantize(q.codes[r * cols + c], s);
        }
    }
    Ok(())
}

/// Runs the calibration forward and returns the input scale of every module of `quantized` (full names).
/// Mixture-of-experts layers are refused before anything is read (each expert sees its own tokens; this
/// pass records shared-input groups only).
#[allow(clippy::too_many_arguments)]
pub fn calibrate_input_scales(
    cfg: &ModelConfig,
    store: &TensorStore,
    model_dir: &Path,
    dataset: &Path,
    calib: &CalibSettings,
    quantized: &[String],
    strategy: ScaleStrategy,
    events: &dyn EventSink,
) -> Result<InputScales> {
    check_static(cfg)?;
    if calib.max_samples == 0 || calib.max_seq_len < 2 {
        return Err(SpecError::Samples {
            max_samples: calib.max_samples,
            max_seq_len: calib.max_seq_len,
        }
        .into());
    }
    let wanted: HashSet<&str> = quantized.iter().map(String::as_str).collect();
    let samples = load_samples_counted(model_dir, dataset, calib)?.ids;
    let tokens: u64 = samples.iter().map(|s| s.len() as u64).sum();
    let rope = Rope::new(cfg, samples.iter().map(Vec::len).max().unwrap_or(1));
    let mut hidden = embed_samples(store, cfg, &samples)?;
    drop(samples);
    let mut out = InputScales {
        scales: HashMap::with_capacity(quantized.len()),
        tokens,
    };
    let layers = cfg.num_layers;
    for layer in 0..layers {
        let prefix = cfg.layer_prefix(layer);
        let specs = layer_modules(cfg, layer);
        let mut lw = load_layer(store, cfg, layer, None)?;
        store.release_pages();
        let name = |i: usize| format!("{prefix}{}", specs[i].name);
        for i in (0..specs.len()).filter(|&i| wanted.contains(name(i).as_str())) {
            if let Some(l) = lw.module_mut(i) {
                fake_quantize(&format!("{}.weight", name(i)), &mut l.w, strategy)?;
            }
        }
        lw.sync_tied();
        let mut stage_max = [0f32; 4];
        for x in hidden.iter_mut() {
            layer_forward_visit(cfg, &lw, x, &rope, &mut |stage, a| {
                let m = &mut stage_max[stage as usize];
                let v = absmax(a);
                *m = if v.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(v)
                };
            });
        }
        drop(lw);
        for (group, &amax) in input_groups(cfg, layer).iter().zip(&stage_max) {
            for &i in group {
                let module = name(i);
                if wanted.contains(module.as_str()) {
                    out.scales
                        .insert(module.clone(), input_scale(&module, amax)?);
                }
            }
        }
        progress(
            events,
            "fp8",
            CALIBRATION_PERCENT * (layer + 1) as f64 / layers.max(1) as f64,
            format!("calibration layer {}/{layers}", layer + 1),
        );
    }
    if let Some(m) = quantized.iter().find(|m| !out.scales.contains_key(*m)) {
        // A planned linear no stage reaches: never for the families [`check_static`] lets through.
        return Err(TensorError::ActivationScale {
            module: m.clone(),
            absmax: f32::NAN,
        }
        .into());
    }
    Ok(out)
}

/// Static scales are calibrated for dense decoders (attention and linear-attention mixers, dense MLPs).
pub fn check_static(cfg: &ModelConfig) -> Result<()> {
    if cfg.moe.is_some() {
        return Err(SpecError::Value {
            field: flexinfer_contract::env::FP8_ACTIVATIONS.into(),
            value: ActivationScheme::Static.as_str().into(),
            expected: format!(
                "dynamic for {} (static input scales are calibrated for dense decoders; \
                 mixture-of-experts layers are not supported)",
                cfg.architecture
            ),
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// A small pseudo-random activation with one large outlier and negative values.
    fn activation(rows: usize, cols: usize) -> Mat<f32> {
        let mut state = 11u64;
        Mat::from_fn(rows, cols, |r, c| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = ((state >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
            if (r, c) == (3, 5) {
                -37.25
            } else {
                u * 4.0
            }
        })
    }

    #[test]
    fn input_scale_is_the_absmax_over_448_of_a_reference_loop() {
        let a = activation(17, 9);
        // Reference: every element, row-major, by hand.
        let mut reference = 0f32;
        for r in 0..a.nrows() {
            for c in 0..a.ncols() {
                let v = a[(r, c)].abs();
                if v > reference {
                    reference = v;
                }
            }
        }
        assert_eq!(reference, 37.25);
        assert_eq!(absmax(a.as_ref()), reference);
        assert_eq!(absmax(a.as_ref().submatrix(0, 0, 3, 9)), {
            let mut m = 0f32;
            for r in 0..3 {
                for c in 0..9 {
                    m = m.max(a[(r, c)].abs());
                }
            }
            m
        });
        assert_eq!(input_scale("m", reference).unwrap(), reference / 448.0);
        assert_eq!(input_scale("m", reference).unwrap(), 37.25 / 448.0);
    }

    #[test]
    fn unusable_absmax_is_an_error_naming_the_module() {
        let mut a = activation(4, 4);
        a[(2, 1)] = f32::NAN;
        assert!(absmax(a.as_ref()).is_nan());
        for bad in [0.0, f32::NAN, f32::INFINITY] {
            let e = input_scale("model.layers.1.mlp.down_proj", bad).unwrap_err();
            let text = flexinfer_contract::error::chain(&e);
            assert!(text.contains("model.layers.1.mlp.down_proj"), "{text}");
        }
    }

    #[test]
    fn the_variable_parses_and_a_bad_value_names_it() {
        assert_eq!(
            ActivationScheme::parse("FP8_ACTIVATIONS", " Static ").unwrap(),
            ActivationScheme::Static
        );
        assert_eq!(
            ActivationScheme::parse("FP8_ACTIVATIONS", "dynamic").unwrap(),
            ActivationScheme::Dynamic
        );
        let e = ActivationScheme::parse("FP8_ACTIVATIONS", "per-token").unwrap_err();
        let text = flexinfer_contract::error::chain(&e);
        assert!(
            text.contains("FP8_ACTIVATIONS") && text.contains("per-token"),
            "{text}"
        );
    }
}
