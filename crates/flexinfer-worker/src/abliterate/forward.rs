//! Decoder layers for the direction search and the perplexity gate: the quantization engine's forward
//! (`flexinfer_quant::llama` / `flexinfer_quant::moe`: Llama-family attention, dense SwiGLU or sparse-MoE MLPs
//! of Qwen2-MoE / Qwen3-MoE / Mixtral, and Gemma 2 / 3 / 4 with their output norms, Gemma 4's experts beside
//! the dense MLP), so abliteration and calibration run one implementation. Gemma's post-attention /
//! post-feedforward norms are why the edit is norm-aware (`edit::attach_output_norms`).

use std::path::Path;

use faer::{Mat, MatRef};
use flexinfer_quant::llama::{layer_forward, Rope};
use flexinfer_quant::model::{load_layer, GptqReadConfig, LayerWeights, Linear, ModelConfig};
use flexinfer_quant::tensors::TensorStore;

use super::edit::Layout;
use super::quant_err;
use crate::common::{ExitKind, WorkerError};

/// The model as the forward sees it.
#[derive(Debug, Clone)]
pub struct Arch {
    pub cfg: ModelConfig,
}

const SUPPORTED: &str = "Llama, Mistral, Qwen2/2.5/3 dense, Qwen2-MoE, Qwen3-MoE, Mixtral, \
                         Gemma 2, Gemma 3 (text), Gemma 4 (dense, MoE, multimodal)";

impl Arch {
    /// Loads `config.json`; anything but a full-precision supported architecture is refused.
    pub fn load(model_dir: &Path, layout: &Layout) -> Result<Self, WorkerError> {
        let raw = super::output::read_config(model_dir)?;
        let cfg = ModelConfig::from_json(raw).map_err(WorkerError::caused(
            ExitKind::BadInput,
            format!(
                "estimating the refusal direction needs the engine's Llama-family forward ({SUPPORTED})"
            ),
        ))?;
        if cfg.gdn.is_some() {
            // The engine runs the gated delta-net forward (calibration), but the edit's mapping of
            // writers onto the forward's modules (for the perplexity gate) is not done for the
            // linear-attention layers' `linear_attn.out_proj` nor checked against these models.
            return Err(WorkerError::BadInput(format!(
                "{}: abliteration does not support linear-attention hybrids (Qwen3-Next, Qwen3.5) yet; \
                 quantize the model without an abliteration block",
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
            // Gemma 4 MoE: the dense MLP beside the experts is the layer's always-on (shared) unit.
            "mlp.down_proj" if self.lw.moe.as_ref()?.gemma4.is_some() => {
                &mut self.lw.moe.as_mut()?.shared.as_mut()?.down
            }
            "mlp.shared_expert.down_proj" => &mut self.lw.moe.as_mut()?.shared.as_mut()?.down,
            _ => return None,
        };
        Some((l, bias))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gated delta-net hybrids (the engine's oracle fixtures) are refused with a bad-input
    /// error naming them, before anything is loaded or written.
    #[test]
    fn hybrid_models_are_refused_as_bad_input() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle");
        for fam in ["qwen3_next", "qwen3_5", "qwen3_5_moe_mm"] {
            let dir = root.join(fam);
            let store = TensorStore::open_dir(&dir).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let raw =
                super::super::output::read_config(&dir).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let layout = Layout::from_model(&store, &raw).unwrap_or_else(|e| panic!("{fam}: {e}"));
            match Arch::load(&dir, &layout) {
                Err(WorkerError::BadInput(m)) => {
                    assert!(m.contains("linear-attention hybrids"), "{fam}: {m}")
                }
                Err(e) => panic!("{fam}: {e}"),
                Ok(_) => panic!("{fam}: accepted"),
            }
        }
    }
}
