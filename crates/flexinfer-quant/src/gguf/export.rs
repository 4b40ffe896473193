//! A source model directory → one `.gguf` file: map ([`super::llama`]), choose each tensor's type
//! ([`super::preset`]), check everything, then write tensor by tensor ([`super::writer`]).
//!
//! Every check that can fail on the input (architecture, tokenizer, tensor names and shapes, row
//! lengths against the chosen types, importance vectors) runs before the output file is created, so
//! bad input leaves nothing behind; an I/O failure midway leaves only the temporary, which is
//! removed.

use super::blocks::quantize_tensor;
use super::error::GgufError;
use super::llama::{map_tensors, model_metadata, permute_heads, GgufArch, MappedTensor, Source};
use super::preset::{tensor_type, MixModel};
use super::tokenizer::tokenizer_metadata;
use super::types::{FileType, GgmlType};
use super::writer::{plan, GgufWriter, MetaValue, TensorSpec};
use crate::error::{QuantError, Result};
use crate::model::config::ModelConfig;
use crate::model::tensors::TensorStore;
use std::collections::HashMap;
use std::path::Path;

/// What to write.
pub struct GgufJob<'a> {
    pub model_dir: &'a Path,
    /// The `.gguf` file to create (replaced atomically if it exists).
    pub out_path: &'a Path,
    pub file_type: FileType,
    /// Per GGUF tensor name (`blk.0.attn_q.weight`), one importance weight per input column: the
    /// calibration's Hessian diagonal, or a `llama-imatrix` entry.
    pub importance: Option<&'a HashMap<String, Vec<f32>>>,
    /// `general.name`.
    pub name: &'a str,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct GgufSummary {
    pub bytes: u64,
    pub arch: GgufArch,
    /// Each tensor's GGUF name and type, in file order.
    pub tensors: Vec<(String, GgmlType)>,
}

/// Everything decided before writing: the metadata, the tensor list with types.
pub struct GgufPlan {
    pub arch: GgufArch,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<(MappedTensor, GgmlType)>,
}

fn is_70b(cfg: &ModelConfig, arch: GgufArch) -> bool {
    cfg.num_layers == 80 && (arch == GgufArch::Qwen2 || cfg.num_heads != cfg.num_kv_heads)
}

/// Reads and checks the model and decides every tensor's type; writes nothing.
pub fn plan_gguf(job: &GgufJob<'_>, cfg: &ModelConfig, store: &TensorStore) -> Result<GgufPlan> {
    let arch = GgufArch::of(cfg)?;
    let mut metadata = model_metadata(cfg, arch, job.file_type, job.name)?;
    metadata.extend(tokenizer_metadata(job.model_dir, cfg.vocab_size, &cfg.raw)?);
    let typed = tensor_types(cfg, store, arch, job.file_type, job.importance.is_some())?;
    let mut tensors = Vec::with_capacity(typed.len());
    for (t, ty) in typed {
        let cols = t.dims.first().copied().unwrap_or(0);
        if let Some(w) = job.importance.and_then(|m| m.get(&t.gguf)) {
            if ty.is_quantized() && w.len() as u64 != cols {
                return Err(GgufError::Importance {
                    tensor: t.gguf.clone(),
                    len: w.len(),
                    cols: usize::try_from(cols).unwrap_or(usize::MAX),
                }
                .into());
            }
        }
        tensors.push((t, ty));
    }
    let specs = specs_of(&tensors);
    plan(&metadata, &specs)?;
    Ok(GgufPlan {
        arch,
        metadata,
        tensors,
    })
}

/// Every tensor of the file and the type `file_type`'s mix gives it (`has_importance`: whether an
/// importance matrix is used, which changes llama.cpp's mix for some types).
pub fn tensor_types(
    cfg: &ModelConfig,
    store: &TensorStore,
    arch: GgufArch,
    file_type: FileType,
    has_importance: bool,
) -> Result<Vec<(MappedTensor, GgmlType)>> {
    let mapped = map_tensors(cfg, store, arch)?;
    let mix = MixModel {
        layers: cfg.num_layers,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        has_output: mapped.iter().any(|t| t.gguf == "output.weight"),
        is_70b: is_70b(cfg, arch),
        has_importance,
    };
    mapped
        .into_iter()
        .map(|t| {
            let cols = t.dims.first().copied().unwrap_or(0);
            let ty = tensor_type(file_type, &t.gguf, t.dims.len(), cols, t.layer, &mix)?;
            Ok((t, ty))
        })
        .collect()
}

/// A mapped tensor's f32 values in GGUF row order (attention heads permuted where llama.cpp needs
/// it), and its row length.
pub fn tensor_values(t: &MappedTensor, store: &TensorStore) -> Result<(Vec<f32>, usize)> {
    let values = match &t.source {
        Source::Computed(v) => v.clone(),
        Source::Checkpoint(name) => store.f32(name)?,
    };
    let cols = usize::try_from(t.dims.first().copied().unwrap_or(1)).unwrap_or(1);
    let values = match t.permute_heads {
        Some(heads) => permute_heads(&values, values.len() / cols, cols, heads),
        None => values,
    };
    Ok((values, cols))
}

fn specs_of(tensors: &[(MappedTensor, GgmlType)]) -> Vec<TensorSpec> {
    tensors
        .iter()
        .map(|(t, ty)| TensorSpec {
            name: t.gguf.clone(),
            dims: t.dims.clone(),
            ty: *ty,
        })
        .collect()
}

/// Writes the GGUF of `job.model_dir` to `job.out_path`.
pub fn write_gguf(job: &GgufJob<'_>) -> Result<GgufSummary> {
    let cfg = ModelConfig::load(job.model_dir)?;
    let store = TensorStore::open_dir(job.model_dir)?;
    let plan = plan_gguf(job, &cfg, &store)?;
    write_planned(
        &plan,
        &store,
        job.out_path,
        job.importance,
        None,
        &mut |_, _| {},
    )
}

/// Writes a planned GGUF to `out_path`; `on_tensor(done, total)` after each tensor. A tensor named in
/// `prequantized` is written with those bytes (quantized earlier, e.g. with GPTQ feedback by the
/// calibration pass) instead of being quantized here; their length must be the planned size.
pub fn write_planned(
    plan: &GgufPlan,
    store: &TensorStore,
    out_path: &Path,
    importance: Option<&HashMap<String, Vec<f32>>>,
    prequantized: Option<&HashMap<String, Vec<u8>>>,
    on_tensor: &mut dyn FnMut(usize, usize),
) -> Result<GgufSummary> {
    let specs = specs_of(&plan.tensors);
    if let Some(pre) = prequantized {
        for s in &specs {
            if let Some(b) = pre.get(&s.name) {
                if b.len() as u64 != s.byte_size()? {
                    return Err(GgufError::Unsupported {
                        key: s.name.clone(),
                        reason: format!(
                            "{} prequantized bytes for a {} tensor of {:?}",
                            b.len(),
                            s.ty.name(),
                            s.dims
                        ),
                    }
                    .into());
                }
            }
        }
    }
    let mut w = GgufWriter::create(out_path, &plan.metadata, specs)?;
    let total = plan.tensors.len();
    for (i, (t, ty)) in plan.tensors.iter().enumerate() {
        if let Some(bytes) = prequantized.and_then(|m| m.get(&t.gguf)) {
            w.write_tensor(&t.gguf, bytes)?;
            tracing::debug!(tensor = %t.gguf, ty = ty.name(), bytes = bytes.len(), "gguf tensor written (prequantized)");
            on_tensor(i.saturating_add(1), total);
            continue;
        }
        let (values, cols) = tensor_values(t, store)?;
        let importance = importance
            .and_then(|m| m.get(&t.gguf))
            .map(Vec::as_slice)
            .filter(|_| ty.is_quantized());
        let bytes = quantize_tensor(*ty, &values, cols, importance).map_err(|e| {
            QuantError::from(GgufError::Unsupported {
                key: t.gguf.clone(),
                reason: e.to_string(),
            })
        })?;
        drop(values);
        w.write_tensor(&t.gguf, &bytes)?;
        store.release_pages();
        tracing::debug!(tensor = %t.gguf, ty = ty.name(), bytes = bytes.len(), "gguf tensor written");
        on_tensor(i.saturating_add(1), total);
    }
    let bytes = w.finish()?;
    tracing::info!(path = %out_path.display(), bytes, "gguf written");
    Ok(GgufSummary {
        bytes,
        arch: plan.arch,
        tensors: plan
            .tensors
            .iter()
            .map(|(t, ty)| (t.gguf.clone(), *ty))
            .collect(),
    })
}
