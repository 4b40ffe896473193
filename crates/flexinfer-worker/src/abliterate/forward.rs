//! Decoder layers for the direction search and the perplexity gate: the quantization engine's forward
//! (`flexinfer_quant::llama` / `flexinfer_quant::moe`: Llama-family attention, dense SwiGLU or sparse-MoE MLPs
//! of Qwen2-MoE / Qwen3-MoE / Mixtral, and Gemma 2 / 3 / 4 with their output norms, Gemma 4's experts beside
//! the dense MLP), so abliteration and calibration run one implementation. Gemma's post-attention /
//! post-feedforward norms are why the edit is norm-aware (`edit::attach_output_norms`). The gated delta-net
//! hybrids (Qwen3-Next, Qwen3.5) run the engine's linear-attention mixer in their linear layers; their
//! writers are `linear_attn.out_proj` there (edited only with `skipGDNLayers: false`) and `self_attn.o_proj`
//! in the full-attention layers.

use std::path::Path;

use faer::{Mat, MatRef};
use flexinfer_quant::llama::{layer_forward, Rope};
use flexinfer_quant::model::{load_layer, GptqReadConfig, LayerWeights, Linear, ModelConfig};
use flexinfer_quant::tensors::TensorStore;

use super::edit::Layout;
use super::quant_err;
use crate::common::{AbliterateError, ExitKind, WorkerError};

/// The model as the forward sees it.
#[derive(Debug, Clone)]
pub struct Arch {
    pub cfg: ModelConfig,
}

const SUPPORTED: &str = "Llama, Mistral, Qwen2/2.5/3 dense, Qwen2-MoE, Qwen3-MoE, Mixtral, \
                         Gemma 2, Gemma 3 (text), Gemma 4 (dense, MoE, multimodal), \
                         Qwen3-Next, Qwen3.5 (dense, MoE, multimodal)";

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
        if GptqReadConfig::from_config(&cfg).is_some() {
            return Err(AbliterateError::QuantizedSource.into());
        }
        if cfg.hidden_size != layout.hidden {
            return Err(AbliterateError::HiddenSize {
                config: cfg.hidden_size,
                text: layout.hidden,
            }
            .into());
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
        // The token mixer's linears come first (attention: q, k, v, o; linear attention: its input
        // projections, then out_proj), then the dense MLP's gate, up, down.
        let mixer = self.lw.mixer;
        let l = match module {
            "self_attn.o_proj" if self.lw.gdn.is_none() => {
                self.lw.linears.get_mut(mixer.checked_sub(1)?)?
            }
            "linear_attn.out_proj" if self.lw.gdn.is_some() => {
                self.lw.linears.get_mut(mixer.checked_sub(1)?)?
            }
            "mlp.down_proj" if self.lw.moe.is_none() => {
                self.lw.linears.get_mut(mixer.checked_add(2)?)?
            }
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

    /// The gated delta-net hybrids (the engine's oracle fixtures) load, and every residual writer the
    /// edit plans (full attention's o_proj, linear attention's out_proj, the dense or shared-expert
    /// down_proj) is found in the forward's layer with the tensor's shape.
    #[test]
    fn hybrid_writers_map_onto_the_forward() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle");
        for fam in ["qwen3_next", "qwen3_5", "qwen3_5_moe_mm"] {
            let dir = root.join(fam);
            let store = TensorStore::open_dir(&dir).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let raw =
                super::super::output::read_config(&dir).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let layout = Layout::from_model(&store, &raw).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let arch = Arch::load(&dir, &layout).unwrap_or_else(|e| panic!("{fam}: {e}"));
            let (mut attn, mut linear) = (0, 0);
            for layer in 0..arch.cfg.num_layers {
                let mut lm =
                    LayerModel::load(&store, &arch, layer).unwrap_or_else(|e| panic!("{e}"));
                let prefix = arch.cfg.layer_prefix(layer);
                for (name, shape) in &layout.shapes {
                    let Some(rest) = name.strip_prefix(&prefix) else {
                        continue;
                    };
                    let writer = ["self_attn.o_proj.weight", "linear_attn.out_proj.weight"]
                        .contains(&rest)
                        || rest == "mlp.down_proj.weight"
                        || rest == "mlp.shared_expert.down_proj.weight";
                    if !writer {
                        continue;
                    }
                    let (lin, bias) = lm
                        .linear_mut(rest)
                        .unwrap_or_else(|| panic!("{fam}: {name} has no linear in the forward"));
                    assert!(!bias);
                    assert_eq!(vec![lin.w.nrows(), lin.w.ncols()], *shape, "{fam}: {name}");
                    match rest {
                        "self_attn.o_proj.weight" => attn += 1,
                        "linear_attn.out_proj.weight" => linear += 1,
                        _ => {}
                    }
                }
                // A module of the other kind of mixer is not found in this layer.
                let other = if lm.lw.gdn.is_some() {
                    "self_attn.o_proj.weight"
                } else {
                    "linear_attn.out_proj.weight"
                };
                assert!(
                    lm.linear_mut(other).is_none(),
                    "{fam}: layer {layer} {other}"
                );
            }
            assert!(
                attn > 0 && linear > 0,
                "{fam}: {attn} attention, {linear} linear"
            );
        }
    }
}
