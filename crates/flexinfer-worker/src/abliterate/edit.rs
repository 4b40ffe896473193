//! What gets modified (layers, matrices, the guards) and how (orthogonalization in f32,
//! written back in the source dtype).

use std::collections::{BTreeMap, BTreeSet};

use flexinfer_quant::tensors::TensorStore;
use serde_json::Value;

pub use super::dtype::{f16_to_f32, f32_to_bf16, f32_to_f16, tensor_dtype, Dtype};
use crate::common::{AbliterateError, WorkerError};

/// `targetLayers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetLayers {
    /// Full-attention layers in the middle of the stack (20 %–80 % depth).
    Auto,
    /// An explicit range or list.
    List(Vec<usize>),
}

impl TargetLayers {
    pub fn parse(s: &str) -> Result<Self, WorkerError> {
        let s = s.trim();
        let bad = || {
            WorkerError::from(AbliterateError::TargetLayers {
                value: s.to_string(),
            })
        };
        if s.eq_ignore_ascii_case("auto") || s.is_empty() {
            return Ok(TargetLayers::Auto);
        }
        if let Some((a, b)) = s.split_once('-') {
            let a: usize = a.trim().parse().map_err(|_| bad())?;
            let b: usize = b.trim().parse().map_err(|_| bad())?;
            if a > b {
                return Err(bad());
            }
            return Ok(TargetLayers::List((a..=b).collect()));
        }
        let mut v = Vec::new();
        for part in s.split(',') {
            v.push(part.trim().parse::<usize>().map_err(|_| bad())?);
        }
        v.sort_unstable();
        v.dedup();
        Ok(TargetLayers::List(v))
    }
}

/// A matrix that writes into the residual stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Matrix {
    OProj,
    DownProj,
}

impl Matrix {
    pub fn as_str(self) -> &'static str {
        match self {
            Matrix::OProj => "o_proj",
            Matrix::DownProj => "down_proj",
        }
    }

    pub fn parse_list(s: &str) -> Result<Vec<Matrix>, WorkerError> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let m = match part.to_ascii_lowercase().as_str() {
                "o_proj" => Matrix::OProj,
                "down_proj" => Matrix::DownProj,
                other => {
                    return Err(AbliterateError::UnknownMatrix {
                        name: other.to_string(),
                    }
                    .into())
                }
            };
            if !out.contains(&m) {
                out.push(m);
            }
        }
        if out.is_empty() {
            return Err(AbliterateError::NoMatrices.into());
        }
        Ok(out)
    }
}

/// Path components that mark a vision/audio tower (or its projector into the language model).
const TOWER_MARKERS: &[&str] = &[
    "vision_tower",
    "vision_model",
    "vision_encoder",
    "visual",
    "vision",
    "audio_tower",
    "audio_model",
    "audio_encoder",
    "audio",
    "multi_modal_projector",
    "mm_projector",
    "embed_vision",
    "embed_audio",
];

/// True for tensors of a vision/audio tower.
pub fn is_tower(name: &str) -> bool {
    name.split('.').any(|c| TOWER_MARKERS.contains(&c))
}

/// True for MoE expert weights (`…experts.N…`, fused `…experts.down_proj`), never for shared experts.
pub fn is_expert(name: &str) -> bool {
    name.split('.')
        .any(|c| c == "experts" || c.starts_with("experts_"))
}

/// `(layer, rest)` of a language-model decoder tensor `…layers.<i>.<rest>`.
pub fn decoder_layer(name: &str) -> Option<(usize, String)> {
    if is_tower(name) {
        return None;
    }
    let comps: Vec<&str> = name.split('.').collect();
    let k = comps.iter().position(|c| *c == "layers")?;
    let idx = comps.get(k + 1)?.parse::<usize>().ok()?;
    Some((idx, comps[k + 2..].join(".")))
}

/// Structure of the model as far as the guards need it.
#[derive(Debug, Clone)]
pub struct Layout {
    pub num_layers: usize,
    pub hidden: usize,
    /// Linear-attention (GatedDeltaNet) decoder layers.
    pub linear_attention: BTreeSet<usize>,
    /// The model has MoE experts.
    pub moe: bool,
    /// The lm_head tensor, when the model has its own (untied) one.
    pub lm_head: Option<String>,
    /// Tensor name → shape.
    pub shapes: BTreeMap<String, Vec<usize>>,
}

fn cfg_field<'a>(raw: &'a Value, key: &str) -> Option<&'a Value> {
    raw.get(key)
        .or_else(|| raw.get("text_config").and_then(|t| t.get(key)))
}

impl Layout {
    pub fn from_model(store: &TensorStore, raw: &Value) -> Result<Self, WorkerError> {
        let shapes: BTreeMap<String, Vec<usize>> = store
            .entries
            .iter()
            .map(|(n, e)| (n.clone(), e.shape.clone()))
            .collect();
        Self::from_parts(shapes, raw)
    }

    pub fn from_parts(
        shapes: BTreeMap<String, Vec<usize>>,
        raw: &Value,
    ) -> Result<Self, WorkerError> {
        let hidden = cfg_field(raw, "hidden_size")
            .and_then(Value::as_u64)
            .ok_or(AbliterateError::NoHiddenSize)? as usize;
        let mut max_layer = None;
        let mut linear_attention = BTreeSet::new();
        let mut moe = false;
        for name in shapes.keys() {
            if let Some((i, rest)) = decoder_layer(name) {
                max_layer = Some(max_layer.map_or(i, |m: usize| m.max(i)));
                if rest.split('.').any(|c| c == "linear_attn") {
                    linear_attention.insert(i);
                }
                if is_expert(&rest) {
                    moe = true;
                }
            }
        }
        let num_layers = cfg_field(raw, "num_hidden_layers")
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .or(max_layer.map(|m| m + 1))
            .ok_or(AbliterateError::NoLayers)?;
        if let Some(types) = cfg_field(raw, "layer_types").and_then(Value::as_array) {
            for (i, t) in types.iter().enumerate() {
                if t.as_str()
                    .is_some_and(|t| t.to_ascii_lowercase().contains("linear"))
                {
                    linear_attention.insert(i);
                }
            }
        }
        for key in ["num_experts", "num_local_experts", "n_routed_experts"] {
            if cfg_field(raw, key).and_then(Value::as_u64).unwrap_or(0) > 0 {
                moe = true;
            }
        }
        let lm_head = [
            "lm_head.weight",
            "language_model.lm_head.weight",
            "model.lm_head.weight",
        ]
        .into_iter()
        .find(|n| shapes.contains_key(*n))
        .map(str::to_string);
        Ok(Layout {
            num_layers,
            hidden,
            linear_attention,
            moe,
            lm_head,
            shapes,
        })
    }
}

/// The layers to modify (and among which the direction's layer is chosen).
#[derive(Debug, Clone)]
pub struct Targets {
    pub layers: Vec<usize>,
    pub warnings: Vec<String>,
}

/// `auto`: attention (non-GDN) layers at 20 %–80 % depth; a list: those layers, minus GDN layers
/// when `skipGDNLayers`.
pub fn select_target_layers(layout: &Layout, s: &super::Settings) -> Result<Targets, WorkerError> {
    let n = layout.num_layers;
    let mut warnings = Vec::new();
    let layers: Vec<usize> = match &s.target.clone() {
        TargetLayers::Auto => {
            let lo = (n as f64 * 0.2).floor() as usize;
            let hi = ((n as f64 * 0.8).ceil() as usize).clamp(lo + 1, n.max(1));
            let v: Vec<usize> = (lo..hi)
                .filter(|i| !layout.linear_attention.contains(i))
                .collect();
            if v.is_empty() {
                return Err(AbliterateError::NoAutoLayer { layers: n }.into());
            }
            v
        }
        TargetLayers::List(list) => {
            if let Some(bad) = list.iter().find(|&&i| i >= n) {
                return Err(AbliterateError::LayerOutOfRange {
                    layer: *bad,
                    layers: n,
                }
                .into());
            }
            let skipped: Vec<usize> = list
                .iter()
                .copied()
                .filter(|i| s.skip_gdn && layout.linear_attention.contains(i))
                .collect();
            if !skipped.is_empty() {
                warnings.push(format!(
                    "skipGDNLayers: linear-attention layers {skipped:?} are not modified"
                ));
            }
            let v: Vec<usize> = list
                .iter()
                .copied()
                .filter(|i| !skipped.contains(i))
                .collect();
            if v.is_empty() {
                return Err(AbliterateError::AllLayersSkipped.into());
            }
            v
        }
    };
    Ok(Targets { layers, warnings })
}

/// How a tensor is edited with the unit direction `r`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EditKind {
    /// Writes into the residual (`[hidden, in]` or a `[hidden]` bias): `W ← W − r (rᵀ W)`.
    Write,
    /// Reads from the residual (`[vocab, hidden]` lm_head): `W ← W − (W r) rᵀ`.
    Read,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Edit {
    pub tensor: String,
    pub layer: Option<usize>,
    pub kind: EditKind,
    /// What the model multiplies this writer's (RMS-normalised) output by, per channel, before the residual add;
    /// `None` when the output reaches the residual as it is (Llama family; filled by [`attach_output_norms`]).
    pub out_norm: Option<OutNorm>,
}

/// The per-channel scale between a writer and the residual stream (Gemma's post-norms).
#[derive(Debug, Clone, PartialEq)]
pub struct OutNorm {
    /// The norm tensors, innermost first (Gemma 4 MoE's dense MLP: `post_feedforward_layernorm_1`, then
    /// `post_feedforward_layernorm`, which normalises the sum of both branches).
    pub norms: Vec<String>,
    /// The product of their weights as the forward multiplies them (`1 + w` in Gemma 2/3, `w` in Gemma 4).
    pub scale: Vec<f32>,
}

/// Everything that will be modified; every other tensor is copied byte for byte.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub edits: Vec<Edit>,
    pub layers_modified: Vec<usize>,
    pub warnings: Vec<String>,
    /// Expert tensors that matched a requested matrix and were left alone.
    pub guarded_experts: usize,
}

fn module_matches(rest: &str, m: Matrix, gdn_layer: bool) -> bool {
    let module = rest
        .strip_suffix(".weight")
        .or_else(|| rest.strip_suffix(".bias"))
        .unwrap_or(rest);
    let last = module.rsplit('.').next().unwrap_or(module);
    match m {
        Matrix::OProj => {
            last == "o_proj" || (gdn_layer && module.ends_with("linear_attn.out_proj"))
        }
        Matrix::DownProj => last == "down_proj",
    }
}

fn is_param(rest: &str) -> bool {
    rest.ends_with(".weight") || rest.ends_with(".bias")
}

/// Build the edit list with the guards, from tensor names and shapes alone.
pub fn plan(layout: &Layout, s: &super::Settings, targets: &[usize]) -> Result<Plan, WorkerError> {
    let targets: BTreeSet<usize> = targets.iter().copied().collect();
    let mut p = Plan::default();
    let mut modified = BTreeSet::new();
    for &m in &s.matrices {
        plan_matrix(layout, s, &targets, m, &mut p, &mut modified)?;
    }
    if s.lm_head {
        plan_lm_head(layout, &mut p)?;
    }
    if p.edits.is_empty() {
        return Err(AbliterateError::NothingToModify.into());
    }
    p.layers_modified = modified.into_iter().collect();
    Ok(p)
}

/// What [`plan`] does with one tensor for one requested matrix kind.
enum Candidate {
    /// Not a tensor of this matrix kind.
    Other,
    /// An expert weight of this kind: never modified (counted for the MoE warning).
    Expert,
    /// A tensor of this kind that the settings or the targeted layers leave alone.
    Skipped,
    /// A tensor to modify, in this decoder layer (`None`: a vision-tower tensor).
    Edit(Option<usize>),
}

/// Classifies the tensor `name` for the matrix kind `m` (see [`Candidate`]).
fn classify(
    layout: &Layout,
    s: &super::Settings,
    targets: &BTreeSet<usize>,
    m: Matrix,
    name: &str,
    shape: &[usize],
) -> Candidate {
    let tower = is_tower(name);
    let (layer, rest) = match decoder_layer(name) {
        Some((i, rest)) => (Some(i), rest),
        None if tower => (None, name.to_string()),
        None => return Candidate::Other,
    };
    let gdn = layer.is_some_and(|i| layout.linear_attention.contains(&i));
    if !module_matches(&rest, m, gdn) {
        return Candidate::Other;
    }
    // Expert weights are never modified (also the fused `experts.down_proj` of Gemma 4 / Qwen3.5 hub
    // checkpoints, which has no `.weight` suffix).
    if is_expert(&rest) {
        return Candidate::Expert;
    }
    if !is_param(&rest) {
        return Candidate::Other;
    }
    let skipped = if tower {
        s.skip_vision || shape.first() != Some(&layout.hidden)
    } else {
        layer.is_some_and(|i| !targets.contains(&i) || (gdn && s.skip_gdn))
    };
    if skipped {
        Candidate::Skipped
    } else {
        Candidate::Edit(layer)
    }
}

/// The edits of one matrix kind, with its warnings; an error when the model has no such tensor or one of
/// them cannot write the residual stream.
fn plan_matrix(
    layout: &Layout,
    s: &super::Settings,
    targets: &BTreeSet<usize>,
    m: Matrix,
    p: &mut Plan,
    modified: &mut BTreeSet<usize>,
) -> Result<(), WorkerError> {
    let mut exists = false;
    let mut guarded = 0usize;
    let mut chosen = 0usize;
    for (name, shape) in &layout.shapes {
        let layer = match classify(layout, s, targets, m, name, shape) {
            Candidate::Other => continue,
            Candidate::Expert => {
                exists = true;
                guarded += 1;
                continue;
            }
            Candidate::Skipped => {
                exists = true;
                continue;
            }
            Candidate::Edit(layer) => layer,
        };
        exists = true;
        let ok_shape = match shape.as_slice() {
            [rows, _] | [rows] => *rows == layout.hidden,
            _ => false,
        };
        if !ok_shape {
            return Err(AbliterateError::WriterShape {
                name: name.clone(),
                shape: shape.clone(),
                hidden: layout.hidden,
            }
            .into());
        }
        if let Some(i) = layer {
            modified.insert(i);
        }
        chosen += 1;
        p.edits.push(Edit {
            tensor: name.clone(),
            layer,
            kind: EditKind::Write,
            out_norm: None,
        });
    }
    if !exists {
        return Err(AbliterateError::NoSuchMatrix { matrix: m.as_str() }.into());
    }
    if guarded > 0 {
        p.guarded_experts += guarded;
        p.warnings.push(format!(
            "MoE model: {guarded} expert {} tensors are never modified; {chosen} shared/dense {} tensors are",
            m.as_str(),
            m.as_str()
        ));
    }
    if chosen == 0 {
        p.warnings.push(format!(
            "no {} tensor in the targeted layers can be modified; only the other matrices are",
            m.as_str()
        ));
    }
    Ok(())
}

/// The read-only lm_head edit of `ablitateLmHead` (a warning when it is tied to the embeddings).
fn plan_lm_head(layout: &Layout, p: &mut Plan) -> Result<(), WorkerError> {
    match &layout.lm_head {
        Some(name) => {
            let ok = matches!(layout.shapes.get(name).map(Vec::as_slice), Some([_, h]) if *h == layout.hidden);
            if !ok {
                return Err(AbliterateError::LmHeadShape {
                    name: name.clone(),
                    hidden: layout.hidden,
                }
                .into());
            }
            p.edits.push(Edit {
                tensor: name.clone(),
                layer: None,
                kind: EditKind::Read,
                out_norm: None,
            });
        }
        None => p
            .warnings
            .push("ablitateLmHead: the lm_head is tied to embed_tokens; it is not modified".into()),
    }
    Ok(())
}

/// Gemma: the norms between each planned writer of a decoder layer and the residual, read from the source with
/// the forward's convention (`cfg.norm_weight`). Other families: nothing (their writers add to the residual
/// directly; scalars such as a shared expert's sigmoid gate, Gemma's embedding scale or Gemma 4's
/// `layer_scalar` multiply whole vectors and do not change what is orthogonal to `r`).
pub fn attach_output_norms(
    plan: &mut Plan,
    store: &TensorStore,
    cfg: &flexinfer_quant::model::ModelConfig,
) -> Result<(), WorkerError> {
    if cfg.gemma.is_none() {
        return Ok(());
    }
    for e in plan.edits.iter_mut() {
        let (EditKind::Write, Some(layer)) = (e.kind, e.layer) else {
            continue;
        };
        let prefix = cfg.layer_prefix(layer);
        let rest = e
            .tensor
            .strip_prefix(&prefix)
            .ok_or_else(|| AbliterateError::NotInLayer {
                tensor: e.tensor.clone(),
                layer,
                prefix: prefix.clone(),
            })?;
        let module = rest
            .strip_suffix(".weight")
            .or_else(|| rest.strip_suffix(".bias"))
            .unwrap_or(rest);
        let gemma4_moe = cfg
            .sparse_layer(layer)
            .is_some_and(|m| m.spec.style == flexinfer_quant::moe::MoeStyle::Gemma4);
        let norms: &[&str] = match module {
            "self_attn.o_proj" => &["post_attention_layernorm"],
            // Gemma 4 MoE: the dense MLP's output is normalised on its own, added to the experts' (normalised
            // on their own), and the sum normalised again.
            "mlp.down_proj" if gemma4_moe => {
                &["post_feedforward_layernorm_1", "post_feedforward_layernorm"]
            }
            "mlp.down_proj" => &["post_feedforward_layernorm"],
            other => {
                return Err(AbliterateError::UnknownGemmaWriter {
                    tensor: e.tensor.clone(),
                    module: other.to_string(),
                }
                .into())
            }
        };
        let mut scale = vec![1f32; cfg.hidden_size];
        let mut names = Vec::new();
        for n in norms {
            let name = format!("{prefix}{n}.weight");
            let w = cfg.norm_weight(store.f32(&name).map_err(super::quant_err)?);
            if w.len() != scale.len() || w.iter().any(|v| !v.is_finite()) {
                return Err(AbliterateError::NormWeight {
                    name,
                    expected: scale.len(),
                    found: w.len(),
                }
                .into());
            }
            scale.iter_mut().zip(&w).for_each(|(s, v)| *s *= v);
            names.push(name);
        }
        e.out_norm = Some(OutNorm {
            norms: names,
            scale,
        });
    }
    Ok(())
}

#[cfg(test)]
#[path = "edit_tests.rs"]
mod tests;
