//! Decoder layers for the direction search and the perplexity gate: the quantization engine's forward
//! (`flexinfer_quant::llama` / `flexinfer_quant::moe`: Llama-family attention, dense SwiGLU or sparse-MoE MLPs
//! of Qwen2-MoE / Qwen3-MoE / Mixtral), so abliteration and calibration run one implementation.

use std::path::Path;

use faer::{Mat, MatRef};
use flexinfer_quant::llama::{layer_forward, Rope};
use flexinfer_quant::model::{load_layer, GptqReadConfig, LayerWeights, Linear, ModelConfig};
use flexinfer_quant::tensors::TensorStore;

use super::edit::Layout;
use super::quant_err;
use crate::common::WorkerError;

/// The model as the forward sees it.
#[derive(Debug, Clone)]
pub struct Arch {
    pub cfg: ModelConfig,
}

const SUPPORTED: &str = "Llama, Mistral, Qwen2/2.5/3 dense, Qwen2-MoE, Qwen3-MoE, Mixtral";

impl Arch {
    /// Loads `config.json`; anything but a full-precision supported architecture is refused.
    pub fn load(model_dir: &Path, layout: &Layout) -> Result<Self, WorkerError> {
        let raw = super::output::read_config(model_dir)?;
        let cfg = ModelConfig::from_json(raw).map_err(|e| {
            WorkerError::BadInput(format!(
                "estimating the refusal direction needs the engine's Llama-family forward ({SUPPORTED}): {e}"
            ))
        })?;
        if cfg.gemma.is_some() {
            // The engine runs Gemma's forward (2, 3 and 4), but the edit does not carry over: Gemma normalises the
            // attention and MLP outputs (`post_attention_layernorm`, `post_feedforward_layernorm`, per-channel
            // `1 + w`, Gemma 4: `w`; Gemma 4 MoE normalises the dense MLP and the experts separately, then their
            // sum) before the residual, so projecting the direction out of o_proj / down_proj does not project
            // it out of what reaches the residual stream.
            return Err(WorkerError::BadInput(format!(
                "{}: abliteration does not support Gemma yet (its post-attention / post-feedforward norms \
                 rescale the edited outputs per channel, so the projection would not remove the direction)",
                cfg.architecture
            )));
        }
        if GptqReadConfig::from_config(&cfg).is_some() {
            return Err(WorkerError::BadInput(
                "the source is a quantized (gptq) checkpoint; abliterate the full-precision model"
                    .into(),
            ));
        }
        if cfg.hidden_size != layout.hidden {
            return Err(WorkerError::BadInput(format!(
                "config.json hidden_size {} differs from the text model's {}",
                cfg.hidden_size, layout.hidden
            )));
        }
        Ok(Arch { cfg })
    }
}

/// One decoder layer's weights in f32.
pub struct LayerModel {
    pub lw: LayerWeights,
}

impl LayerModel {
    pub fn load(store: &TensorStore, arch: &Arch, layer: usize) -> Result<Self, WorkerError> {
        Ok(LayerModel {
            lw: load_layer(store, &arch.cfg, layer, None).map_err(quant_err)?,
        })
    }

    pub fn forward(&self, arch: &Arch, x: MatRef<'_, f32>, rope: &Rope) -> Mat<f32> {
        layer_forward(&arch.cfg, &self.lw, x, rope, None)
    }

    /// The in-memory linear a layer-relative tensor name (`self_attn.o_proj.weight`, …) belongs
    /// to, and whether the name is its bias.
    pub fn linear_mut(&mut self, rest: &str) -> Option<(&mut Linear, bool)> {
        let (module, bias) = match rest.strip_suffix(".bias") {
            Some(m) => (m, true),
            None => (rest.strip_suffix(".weight")?, false),
        };
        let l = match module {
            "self_attn.o_proj" => &mut self.lw.linears[3],
            "mlp.down_proj" if self.lw.moe.is_none() => &mut self.lw.linears[6],
            "mlp.shared_expert.down_proj" => &mut self.lw.moe.as_mut()?.shared.as_mut()?.down,
            _ => return None,
        };
        Some((l, bias))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 2/3/4 (the engine's oracle fixtures: Gemma 4 dense, MoE and the multimodal wrapper) are refused with
    /// a bad-input error naming Gemma, before anything is loaded or written.
    #[test]
    fn gemma_models_are_refused_as_bad_input() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle");
        for fam in [
            "gemma2",
            "gemma3_text",
            "gemma4_text",
            "gemma4_moe",
            "gemma4_mm",
        ] {
            let dir = root.join(fam);
            let store = TensorStore::open_dir(&dir).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let raw =
                super::super::output::read_config(&dir).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let layout = Layout::from_model(&store, &raw).unwrap_or_else(|e| panic!("{fam}: {e}"));
            match Arch::load(&dir, &layout) {
                Err(WorkerError::BadInput(m)) => {
                    assert!(m.contains("does not support Gemma"), "{fam}: {m}")
                }
                Err(e) => panic!("{fam}: {e}"),
                Ok(_) => panic!("{fam}: accepted"),
            }
        }
    }
}
