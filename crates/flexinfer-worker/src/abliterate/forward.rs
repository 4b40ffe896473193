//! Decoder layers for the direction search and the perplexity gate: the quantization engine's
//! Llama-family layer, plus sparse-MoE MLPs (Qwen2-MoE / Qwen3-MoE with an optional shared expert,
//! Mixtral) on top of the engine's attention.

use std::path::Path;

use faer::{Mat, MatRef};
use flexinfer_quant::llama::{layer_forward, linear, rms_norm, Rope, Stage};
use flexinfer_quant::model::{
    linear_shape, load_layer, load_linear, GptqReadConfig, LayerWeights, Linear, ModelConfig,
    LINEARS,
};
use flexinfer_quant::tensors::TensorStore;
use serde_json::Value;

use super::edit::Layout;
use super::quant_err;
use crate::common::WorkerError;

/// Router flavour of a sparse-MoE MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeStyle {
    /// `mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`, optional `mlp.shared_expert(_gate)`.
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.N.{w1,w3,w2}`.
    Mixtral,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    pub style: MoeStyle,
    pub top_k: usize,
    /// Renormalize the top-k routing weights to sum to 1.
    pub renormalize: bool,
}

/// The model as the forward sees it.
#[derive(Debug, Clone)]
pub struct Arch {
    pub cfg: ModelConfig,
    pub moe: Option<MoeSpec>,
}

const SUPPORTED: &str = "Llama, Mistral, Qwen2/2.5/3 dense, Qwen2-MoE, Qwen3-MoE, Mixtral";

impl Arch {
    /// Loads `config.json`; anything but a full-precision supported architecture is refused.
    pub fn load(model_dir: &Path, layout: &Layout) -> Result<Self, WorkerError> {
        let raw = super::output::read_config(model_dir)?;
        let arch = raw
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let top_k = raw
            .get("num_experts_per_tok")
            .and_then(Value::as_u64)
            .unwrap_or(2) as usize;
        let norm_topk = raw
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let (dense_arch, moe) = match arch.as_str() {
            "Qwen2MoeForCausalLM" => ("Qwen2ForCausalLM", Some((MoeStyle::Qwen, norm_topk))),
            "Qwen3MoeForCausalLM" => ("Qwen3ForCausalLM", Some((MoeStyle::Qwen, norm_topk))),
            "MixtralForCausalLM" => ("MistralForCausalLM", Some((MoeStyle::Mixtral, true))),
            _ => ("", None),
        };
        let mut patched = raw.clone();
        if let Some(obj) = patched.as_object_mut() {
            if moe.is_some() {
                obj.insert("architectures".into(), serde_json::json!([dense_arch]));
                if !obj.contains_key("intermediate_size") {
                    let i = obj
                        .get("moe_intermediate_size")
                        .cloned()
                        .unwrap_or(1.into());
                    obj.insert("intermediate_size".into(), i);
                }
            }
        }
        let mut cfg = ModelConfig::from_json(patched).map_err(|e| {
            WorkerError::BadInput(format!(
                "estimating the refusal direction needs the engine's Llama-family forward ({SUPPORTED}): {e}"
            ))
        })?;
        cfg.raw = raw;
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
        Ok(Arch {
            cfg,
            moe: moe.map(|(style, renormalize)| MoeSpec {
                style,
                top_k: top_k.max(1),
                renormalize,
            }),
        })
    }
}

/// A SwiGLU MLP.
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    fn forward(&self, x: MatRef<'_, f32>) -> Mat<f32> {
        let g = linear(x, &self.gate);
        let u = linear(x, &self.up);
        let act = Mat::from_fn(g.nrows(), g.ncols(), |r, c| {
            let gv = g[(r, c)];
            gv / (1.0 + (-gv).exp()) * u[(r, c)]
        });
        linear(act.as_ref(), &self.down)
    }
}

pub struct MoeWeights {
    pub router: Linear,
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    pub shared_gate: Option<Linear>,
}

impl MoeWeights {
    fn forward(&self, h: MatRef<'_, f32>, spec: &MoeSpec) -> Mat<f32> {
        let (t, d) = (h.nrows(), h.ncols());
        let logits = linear(h, &self.router);
        let e = logits.ncols();
        let k = spec.top_k.min(e);
        let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for tok in 0..t {
            let m = (0..e)
                .map(|j| logits[(tok, j)])
                .fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f32> = (0..e).map(|j| (logits[(tok, j)] - m).exp()).collect();
            let z: f32 = p.iter().sum();
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &idx[..k];
            let sum: f32 = top.iter().map(|&j| p[j] / z).sum();
            for &j in top {
                let w = p[j] / z;
                let w = if spec.renormalize && sum > 0.0 {
                    w / sum
                } else {
                    w
                };
                assigned[j].push((tok, w));
            }
        }
        let mut out = Mat::<f32>::zeros(t, d);
        for (j, toks) in assigned.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let sub = Mat::from_fn(toks.len(), d, |i, c| h[(toks[i].0, c)]);
            let y = self.experts[j].forward(sub.as_ref());
            for (i, &(tok, w)) in toks.iter().enumerate() {
                for c in 0..d {
                    out[(tok, c)] += w * y[(i, c)];
                }
            }
        }
        if let Some(shared) = &self.shared {
            let y = shared.forward(h);
            let g = self.shared_gate.as_ref().map(|g| linear(h, g));
            for tok in 0..t {
                let s = g
                    .as_ref()
                    .map_or(1.0, |g| 1.0 / (1.0 + (-g[(tok, 0)]).exp()));
                for c in 0..d {
                    out[(tok, c)] += s * y[(tok, c)];
                }
            }
        }
        out
    }
}

/// One decoder layer's weights in f32.
pub struct LayerModel {
    pub lw: LayerWeights,
    pub moe: Option<MoeWeights>,
}

fn lin(store: &TensorStore, name: &str) -> Result<Linear, WorkerError> {
    let shape = store
        .entry(&format!("{name}.weight"))
        .map_err(quant_err)?
        .shape
        .clone();
    match shape.as_slice() {
        [r, c] => load_linear(store, name, (*r, *c), None).map_err(quant_err),
        _ => Err(WorkerError::BadInput(format!(
            "{name}.weight has shape {shape:?}; expected a matrix"
        ))),
    }
}

fn mlp(store: &TensorStore, base: &str, names: [&str; 3]) -> Result<Mlp, WorkerError> {
    Ok(Mlp {
        gate: lin(store, &format!("{base}{}", names[0]))?,
        up: lin(store, &format!("{base}{}", names[1]))?,
        down: lin(store, &format!("{base}{}", names[2]))?,
    })
}

impl LayerModel {
    pub fn load(store: &TensorStore, arch: &Arch, layer: usize) -> Result<Self, WorkerError> {
        let cfg = &arch.cfg;
        let p = cfg.layer_prefix(layer);
        let spec = match arch.moe {
            Some(s) if !store.contains(&format!("{p}mlp.gate_proj.weight")) => s,
            _ => {
                return Ok(LayerModel {
                    lw: load_layer(store, cfg, layer, None).map_err(quant_err)?,
                    moe: None,
                })
            }
        };
        let mut linears = Vec::with_capacity(7);
        for (i, m) in LINEARS.iter().enumerate().take(4) {
            linears.push(
                load_linear(store, &format!("{p}{m}"), linear_shape(cfg, i), None)
                    .map_err(quant_err)?,
            );
        }
        for _ in 4..7 {
            linears.push(Linear {
                w: Mat::zeros(0, 0),
                b: None,
            });
        }
        let f = |n: &str| store.f32(&format!("{p}{n}")).map_err(quant_err);
        let opt = |n: &str| -> Result<Option<Vec<f32>>, WorkerError> {
            if store.contains(&format!("{p}{n}")) {
                f(n).map(Some)
            } else {
                Ok(None)
            }
        };
        let lw = LayerWeights {
            linears,
            input_norm: f("input_layernorm.weight")?,
            post_norm: f("post_attention_layernorm.weight")?,
            q_norm: opt("self_attn.q_norm.weight")?,
            k_norm: opt("self_attn.k_norm.weight")?,
        };
        let (base, names) = match spec.style {
            MoeStyle::Qwen => (format!("{p}mlp."), ["gate_proj", "up_proj", "down_proj"]),
            MoeStyle::Mixtral => (format!("{p}block_sparse_moe."), ["w1", "w3", "w2"]),
        };
        let router = lin(store, &format!("{base}gate"))?;
        let n_experts = router.w.nrows();
        let experts = (0..n_experts)
            .map(|e| mlp(store, &format!("{base}experts.{e}."), names))
            .collect::<Result<Vec<_>, _>>()?;
        let shared_base = format!("{base}shared_expert.");
        let shared = if store.contains(&format!("{shared_base}down_proj.weight")) {
            Some(mlp(
                store,
                &shared_base,
                ["gate_proj", "up_proj", "down_proj"],
            )?)
        } else {
            None
        };
        let shared_gate = if store.contains(&format!("{base}shared_expert_gate.weight")) {
            Some(lin(store, &format!("{base}shared_expert_gate"))?)
        } else {
            None
        };
        Ok(LayerModel {
            lw,
            moe: Some(MoeWeights {
                router,
                experts,
                shared,
                shared_gate,
            }),
        })
    }

    pub fn forward(&self, arch: &Arch, x: MatRef<'_, f32>, rope: &Rope) -> Mat<f32> {
        let cfg = &arch.cfg;
        match (&self.moe, &arch.moe) {
            (Some(m), Some(spec)) => {
                let att = layer_forward(cfg, &self.lw, x, rope, Some(Stage::O));
                let o = linear(att.as_ref(), &self.lw.linears[3]);
                let x1 = x + &o;
                let h2 = rms_norm(x1.as_ref(), &self.lw.post_norm, cfg.rms_norm_eps);
                let y = m.forward(h2.as_ref(), spec);
                &x1 + &y
            }
            _ => layer_forward(cfg, &self.lw, x, rope, None),
        }
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
            "mlp.down_proj" if self.moe.is_none() => &mut self.lw.linears[6],
            "mlp.shared_expert.down_proj" => &mut self.moe.as_mut()?.shared.as_mut()?.down,
            _ => return None,
        };
        Some((l, bias))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lin(rows: usize, cols: usize, seed: f32) -> Linear {
        Linear {
            w: Mat::from_fn(rows, cols, |r, c| {
                ((r * cols + c) as f32 * 0.37 + seed).sin() * 0.5
            }),
            b: None,
        }
    }

    fn mlp(seed: f32) -> Mlp {
        Mlp {
            gate: lin(5, 3, seed),
            up: lin(5, 3, seed + 1.0),
            down: lin(3, 5, seed + 2.0),
        }
    }

    fn dense(m: &Mlp, x: &[f32]) -> Vec<f32> {
        let xm = Mat::from_fn(1, x.len(), |_, c| x[c]);
        let y = m.forward(xm.as_ref());
        (0..y.ncols()).map(|c| y[(0, c)]).collect()
    }

    #[test]
    fn moe_matches_a_token_by_token_reference() {
        let moe = MoeWeights {
            router: lin(3, 3, 0.3),
            experts: vec![mlp(1.0), mlp(2.0), mlp(3.0)],
            shared: Some(mlp(4.0)),
            shared_gate: Some(lin(1, 3, 0.9)),
        };
        let h = Mat::from_fn(4, 3, |r, c| ((r * 3 + c) as f32 * 0.71).cos());
        for renormalize in [false, true] {
            let spec = MoeSpec {
                style: MoeStyle::Qwen,
                top_k: 2,
                renormalize,
            };
            let out = moe.forward(h.as_ref(), &spec);
            for t in 0..4 {
                let x: Vec<f32> = (0..3).map(|c| h[(t, c)]).collect();
                let logits: Vec<f32> = (0..3)
                    .map(|e| (0..3).map(|c| moe.router.w[(e, c)] * x[c]).sum())
                    .collect();
                let z: f32 = logits.iter().map(|l| l.exp()).sum();
                let p: Vec<f32> = logits.iter().map(|l| l.exp() / z).collect();
                let mut idx = [0usize, 1, 2];
                idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                let norm = if renormalize {
                    p[idx[0]] + p[idx[1]]
                } else {
                    1.0
                };
                let mut want = [0f32; 3];
                for &e in &idx[..2] {
                    let y = dense(&moe.experts[e], &x);
                    want.iter_mut()
                        .zip(&y)
                        .for_each(|(w, v)| *w += p[e] / norm * v);
                }
                let g: f32 = (0..3)
                    .map(|c| moe.shared_gate.as_ref().unwrap().w[(0, c)] * x[c])
                    .sum();
                let s = 1.0 / (1.0 + (-g).exp());
                let y = dense(moe.shared.as_ref().unwrap(), &x);
                want.iter_mut().zip(&y).for_each(|(w, v)| *w += s * v);
                for c in 0..3 {
                    assert!(
                        (out[(t, c)] - want[c]).abs() < 1e-5,
                        "token {t}: {} vs {}",
                        out[(t, c)],
                        want[c]
                    );
                }
            }
        }
    }
}
