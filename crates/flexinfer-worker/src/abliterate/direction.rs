//! The refusal direction (difference of last-token residual means, per layer), the layer choice,
//! the perplexity of harmless text before and after the edit, and the projection check: how far the refusal
//! and harmless prompts' last-token residuals still separate along the direction once the edit is applied.

use std::collections::BTreeMap;

use faer::Mat;
use flexinfer_contract::{events, ProgressEvent};
use flexinfer_quant::llama::{cap_logits, embed, final_norm_weight, linear, rms_norm, Rope};
use flexinfer_quant::model::{load_linear, ModelConfig};
use flexinfer_quant::tensors::TensorStore;

use super::data::PromptSets;
use super::edit::Plan;
use super::forward::{Arch, LayerModel};
use super::ortho::edited_tensor;
use super::output::RunResult;
use super::quant_err;
use crate::common::{AbliterateError, Events, WorkerError};

/// Per-layer candidate: raw difference of means and its separation score.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub layer: usize,
    pub diff: Vec<f32>,
    pub norm: f64,
    /// `‖μ_refusal − μ_harmless‖ / mean ‖x‖` of the last-token residuals at that layer's output.
    pub score: f64,
}

/// Running sums of the last-token residuals of one layer.
struct LayerStats {
    sum_r: Vec<f64>,
    sum_h: Vec<f64>,
    norm_sum: f64,
    /// The same sums over the prompts of the projection check (the first [`CHECK_PROMPTS`] of each class).
    check_r: Vec<f64>,
    check_h: Vec<f64>,
}

/// Prompts per class whose residuals the projection check follows through the edited layers.
pub const CHECK_PROMPTS: usize = 32;

/// `⟨mean(refusal) − mean(harmless), r⟩` from per-class sums of `nr` and `nh` vectors.
fn separation(sum_r: &[f64], sum_h: &[f64], nr: usize, nh: usize, r: &[f32]) -> f64 {
    sum_r
        .iter()
        .zip(sum_h)
        .zip(r)
        .map(|((a, b), &u)| (a / nr.max(1) as f64 - b / nh.max(1) as f64) * u as f64)
        .sum()
}

/// Adds the last row of each of `hs` to `sum`.
/// The last-token residual sums of one target layer's outputs `hs` (refusal prompts first, then
/// harmless, then the perplexity texts): per class, with the sum of their norms, and over the first
/// `cr`/`ch` prompts of each class for the projection check.
fn layer_stats(
    hs: &[Mat<f32>],
    (nr, nh): (usize, usize),
    (cr, ch): (usize, usize),
    d: usize,
) -> LayerStats {
    let mut st = LayerStats {
        sum_r: vec![0.0; d],
        sum_h: vec![0.0; d],
        norm_sum: 0.0,
        check_r: vec![0.0; d],
        check_h: vec![0.0; d],
    };
    add_last_rows(&mut st.check_r, hs[..cr].iter());
    add_last_rows(&mut st.check_h, hs[nr..nr + ch].iter());
    for (i, h) in hs[..nr + nh].iter().enumerate() {
        let last = h.nrows() - 1;
        let sum = if i < nr { &mut st.sum_r } else { &mut st.sum_h };
        let mut sq = 0f64;
        for (c, s) in sum.iter_mut().enumerate() {
            let v = h[(last, c)] as f64;
            *s += v;
            sq += v * v;
        }
        st.norm_sum += sq.sqrt();
    }
    st
}

/// One candidate per target layer: the difference of the class means, its norm, and its score
/// (the norm over the mean residual norm; NaN when that is zero).
fn candidates(stats: &BTreeMap<usize, LayerStats>, nr: usize, nh: usize) -> Vec<Candidate> {
    stats
        .iter()
        .map(|(&layer, st)| {
            let diff: Vec<f32> = st
                .sum_r
                .iter()
                .zip(&st.sum_h)
                .map(|(r, h)| (r / nr as f64 - h / nh as f64) as f32)
                .collect();
            let norm = diff
                .iter()
                .map(|v| (*v as f64) * (*v as f64))
                .sum::<f64>()
                .sqrt();
            let mean_norm = st.norm_sum / (nr + nh) as f64;
            let score = if mean_norm > 0.0 {
                norm / mean_norm
            } else {
                f64::NAN
            };
            Candidate {
                layer,
                diff,
                norm,
                score,
            }
        })
        .collect()
}

/// Announces the chosen direction with every candidate's score and norm.
fn emit_direction(ev: &Events, best: &Candidate, cands: &[Candidate]) {
    ev.emit(
        events::ABLITERATION_DIRECTION,
        &serde_json::json!({
            "layer": best.layer,
            "refusalDirNorm": best.norm,
            "score": best.score,
            "scores": cands.iter().map(|c| serde_json::json!({"layer": c.layer, "score": c.score, "norm": c.norm})).collect::<Vec<_>>(),
        }),
    );
}

/// The chosen difference scaled to unit length; zeros when its norm is zero or not finite (the
/// gate rejects that result; the direction stays finite).
fn unit_direction(best: &Candidate, d: usize) -> Vec<f32> {
    if best.norm.is_finite() && best.norm > 0.0 {
        best.diff
            .iter()
            .map(|v| (*v as f64 / best.norm) as f32)
            .collect()
    } else {
        // The gate rejects this result; keep the (useless) direction finite.
        vec![0.0; d]
    }
}

fn add_last_rows<'a>(sum: &mut [f64], hs: impl Iterator<Item = &'a Mat<f32>>) {
    for h in hs {
        let last = h.nrows() - 1;
        for (c, s) in sum.iter_mut().enumerate() {
            *s += h[(last, c)] as f64;
        }
    }
}

fn progress(ev: &Events, percent: f64, detail: String, layer: usize, layers: usize) {
    ev.progress(ProgressEvent {
        percent,
        detail: Some(detail),
        layer: Some(layer as i64),
        layers: Some(layers as i64),
        unit: Some("layers".into()),
        done: Some((layer + 1) as f64),
        total: Some(layers as f64),
        ..Default::default()
    });
}

/// Applies the plan's edits of `layer` to its in-memory weights (as the written model will have them).
fn edit_layer(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    lm: &mut LayerModel,
    plan: &Plan,
    r: &[f32],
) -> Result<(), WorkerError> {
    let prefix = cfg.layer_prefix(layer);
    for e in plan.edits.iter().filter(|e| e.layer == Some(layer)) {
        let rest = e.tensor.strip_prefix(&prefix).unwrap_or(&e.tensor);
        let Some((lin, bias)) = lm.linear_mut(rest) else {
            return Err(AbliterateError::NoForwardModule {
                tensor: e.tensor.clone(),
            }
            .into());
        };
        let (_, v) = edited_tensor(store, e, r)?;
        if bias {
            lin.b = Some(v);
        } else {
            let cols = lin.w.ncols();
            for i in 0..lin.w.nrows() {
                for j in 0..cols {
                    lin.w[(i, j)] = v[i * cols + j];
                }
            }
        }
    }
    Ok(())
}

/// Mean next-token negative log-likelihood → perplexity of the sequences whose final hidden states
/// are `hs`.
fn perplexity(
    store: &TensorStore,
    cfg: &ModelConfig,
    hs: &[Mat<f32>],
    tokens: &[Vec<u32>],
    plan: &Plan,
    r: Option<&[f32]>,
) -> Result<f64, WorkerError> {
    let norm_w = final_norm_weight(store, cfg).map_err(quant_err)?;
    // The lm_head, or the embeddings when tied (under `model.language_model.` in a multimodal checkpoint).
    let embed_name = cfg.embed_name();
    let head_name = if store.contains("lm_head.weight") {
        "lm_head"
    } else {
        embed_name.strip_suffix(".weight").unwrap_or(&embed_name)
    };
    let vocab = store
        .entry(&format!("{head_name}.weight"))
        .map_err(quant_err)?
        .shape
        .first()
        .copied()
        .unwrap_or(0);
    let mut head =
        load_linear(store, head_name, (vocab, cfg.hidden_size), None).map_err(quant_err)?;
    if let Some(r) = r {
        for e in plan
            .edits
            .iter()
            .filter(|e| e.tensor == format!("{head_name}.weight"))
        {
            let (_, v) = edited_tensor(store, e, r)?;
            let cols = head.w.ncols();
            for i in 0..head.w.nrows() {
                for j in 0..cols {
                    head.w[(i, j)] = v[i * cols + j];
                }
            }
        }
    }
    let (mut nll, mut count) = (0f64, 0usize);
    for (x, toks) in hs.iter().zip(tokens) {
        let xn = rms_norm(x.as_ref(), &norm_w, cfg.rms_norm_eps);
        let mut logits = linear(xn.as_ref(), &head);
        cap_logits(cfg, &mut logits);
        for t in 0..toks.len().saturating_sub(1) {
            let target = toks[t + 1] as usize;
            if target >= logits.ncols() {
                continue;
            }
            let mut m = f64::NEG_INFINITY;
            for v in 0..logits.ncols() {
                m = m.max(logits[(t, v)] as f64);
            }
            let lse = m
                + (0..logits.ncols())
                    .map(|v| (logits[(t, v)] as f64 - m).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - logits[(t, target)] as f64;
            count += 1;
        }
    }
    if count == 0 {
        return Err(AbliterateError::ShortHarmless.into());
    }
    Ok((nll / count as f64).exp())
}

/// Chooses the target layer with the best separation score.
pub fn choose(cands: &[Candidate]) -> Option<&Candidate> {
    cands
        .iter()
        .filter(|c| c.score.is_finite())
        .max_by(|a, b| a.score.total_cmp(&b.score))
        .or(cands.first())
}

/// Runs both prompt sets and the perplexity texts through the model, picks the direction and
/// measures perplexity before and after the planned edit.
pub fn compute(
    store: &TensorStore,
    arch: &Arch,
    targets: &[usize],
    plan: &Plan,
    prompts: &PromptSets,
    ev: &Events,
) -> Result<RunResult, WorkerError> {
    let cfg = &arch.cfg;
    let (nr, nh) = (prompts.refusal.len(), prompts.harmless.len());
    let seqs: Vec<&Vec<u32>> = prompts
        .refusal
        .iter()
        .chain(&prompts.harmless)
        .chain(&prompts.ppl)
        .collect();
    let max_len = seqs.iter().map(|s| s.len()).max().unwrap_or(1).max(1);
    let run = Run {
        store,
        arch,
        plan,
        ev,
        rope: Rope::new(cfg, max_len),
        n_layers: cfg.num_layers,
        first_mod: plan
            .layers_modified
            .first()
            .copied()
            .unwrap_or(cfg.num_layers),
        nr,
        nh,
        cr: nr.min(CHECK_PROMPTS),
        ch: nh.min(CHECK_PROMPTS),
    };
    let (cr, ch, d) = (run.cr, run.ch, cfg.hidden_size);
    let pass = run.unedited(&seqs, targets)?;
    let ppl_texts = &prompts.ppl;
    let before = perplexity(store, cfg, &pass.hs[nr + nh..], ppl_texts, plan, None)?;

    let cands = candidates(&pass.stats, nr, nh);
    let best = choose(&cands)
        .ok_or(AbliterateError::NoTargetLayer)?
        .clone();
    emit_direction(ev, &best, &cands);
    let unit = unit_direction(&best, d);

    // The projection check before the edit: the separation along the direction at its layer.
    let usable = best.norm.is_finite() && best.norm > 0.0;
    let proj_before = pass
        .stats
        .get(&best.layer)
        .map(|st| separation(&st.check_r, &st.check_h, cr, ch, &unit))
        .filter(|_| usable);
    let mut proj_after = proj_before.filter(|_| best.layer < run.first_mod);

    // Perplexity after: from the saved input of the first modified layer, with the edits applied; the check's
    // prompts go through the edited layers up to the direction's layer.
    let mut after_hs = pass.saved.unwrap_or_else(|| pass.hs[nr + nh..].to_vec());
    let check_hs = pass.saved_check.filter(|_| best.layer >= run.first_mod);
    let after = if usable {
        if let Some(p) = run.edited(&mut after_hs, check_hs, best.layer, &unit)? {
            proj_after = Some(p);
        }
        perplexity(store, cfg, &after_hs, ppl_texts, plan, Some(&unit))?
    } else {
        f64::NAN
    };
    Ok(RunResult {
        layer: best.layer,
        direction: unit,
        refusal_dir_norm: best.norm,
        score: best.score,
        perplexity_before: before,
        perplexity_after: after,
        layers_modified: plan.layers_modified.clone(),
        refusal_projection_before: proj_before,
        refusal_projection_after: proj_after,
    })
}

/// One direction run: the model, the plan, and how the residual streams are laid out (`nr` refusal prompts,
/// then `nh` harmless ones, then the perplexity texts; the first `cr` / `ch` of each set are the projection
/// check's).
struct Run<'a> {
    store: &'a TensorStore,
    arch: &'a Arch,
    plan: &'a Plan,
    ev: &'a Events,
    rope: Rope,
    n_layers: usize,
    /// The first layer the plan modifies (`n_layers` when none).
    first_mod: usize,
    nr: usize,
    nh: usize,
    cr: usize,
    ch: usize,
}

/// The residual streams after the unedited model, the target layers' statistics, and the inputs of the first
/// modified layer saved for the edited pass (perplexity texts; check prompts).
struct Unedited {
    hs: Vec<Mat<f32>>,
    stats: BTreeMap<usize, LayerStats>,
    saved: Option<Vec<Mat<f32>>>,
    saved_check: Option<Vec<Mat<f32>>>,
}

impl Run<'_> {
    /// Every sequence through every layer of the unedited model.
    fn unedited(&self, seqs: &[&Vec<u32>], targets: &[usize]) -> Result<Unedited, WorkerError> {
        let (cfg, n_layers) = (&self.arch.cfg, self.n_layers);
        let (nr, nh, cr, ch) = (self.nr, self.nh, self.cr, self.ch);
        // Row by row from the mapped table (Gemma's 262k-token vocabulary would be GiBs in f32).
        let mut hs: Vec<Mat<f32>> = seqs
            .iter()
            .map(|s| embed(self.store, cfg, None, s))
            .collect::<Result<_, _>>()
            .map_err(quant_err)?;
        let check_idx: Vec<usize> = (0..cr).chain(nr..nr + ch).collect();
        let (mut saved, mut saved_check) = (None, None);
        let mut stats: BTreeMap<usize, LayerStats> = BTreeMap::new();
        for layer in 0..n_layers {
            if layer == self.first_mod {
                saved = Some(hs[nr + nh..].to_vec());
                saved_check = Some(check_idx.iter().map(|&i| hs[i].clone()).collect());
            }
            let lm = LayerModel::load(self.store, self.arch, layer)?;
            for h in hs.iter_mut() {
                *h = lm.forward(self.arch, h.as_ref(), &self.rope);
            }
            if targets.contains(&layer) {
                stats.insert(layer, layer_stats(&hs, (nr, nh), (cr, ch), cfg.hidden_size));
            }
            progress(
                self.ev,
                5.0 + 40.0 * (layer + 1) as f64 / n_layers as f64,
                format!("residual stream: layer {}/{n_layers}", layer + 1),
                layer,
                n_layers,
            );
        }
        Ok(Unedited {
            hs,
            stats,
            saved,
            saved_check,
        })
    }

    /// The perplexity texts' streams (`after_hs`, the first modified layer's inputs) through the edited layers;
    /// the check prompts' (`check_hs`) up to the direction's layer `best_layer`, where their separation along
    /// `unit` is measured. Returns that separation when it was measured.
    fn edited(
        &self,
        after_hs: &mut [Mat<f32>],
        mut check_hs: Option<Vec<Mat<f32>>>,
        best_layer: usize,
        unit: &[f32],
    ) -> Result<Option<f64>, WorkerError> {
        let (cfg, n_layers, first_mod) = (&self.arch.cfg, self.n_layers, self.first_mod);
        let (cr, ch, d) = (self.cr, self.ch, cfg.hidden_size);
        let mut proj_after = None;
        for layer in first_mod..n_layers {
            let mut lm = LayerModel::load(self.store, self.arch, layer)?;
            edit_layer(self.store, cfg, layer, &mut lm, self.plan, unit)?;
            for h in after_hs.iter_mut() {
                *h = lm.forward(self.arch, h.as_ref(), &self.rope);
            }
            if let Some(chs) = check_hs.as_mut() {
                for h in chs.iter_mut() {
                    *h = lm.forward(self.arch, h.as_ref(), &self.rope);
                }
                if layer == best_layer {
                    let (mut sr, mut sh) = (vec![0f64; d], vec![0f64; d]);
                    add_last_rows(&mut sr, chs[..cr].iter());
                    add_last_rows(&mut sh, chs[cr..].iter());
                    proj_after = Some(separation(&sr, &sh, cr, ch, unit));
                    check_hs = None;
                }
            }
            progress(
                self.ev,
                45.0 + 25.0 * (layer + 1 - first_mod) as f64 / (n_layers - first_mod).max(1) as f64,
                format!("perplexity with the edit: layer {}/{n_layers}", layer + 1),
                layer,
                n_layers,
            );
        }
        Ok(proj_after)
    }
}
