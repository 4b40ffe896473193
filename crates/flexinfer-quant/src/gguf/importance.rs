//! The importance matrix of a GGUF run from our own calibration pass: for every linear layer the GGUF
//! file quantizes, the mean of each input column's squared activation over the calibration tokens
//! (`llama-imatrix`'s quantity, the diagonal of the GPTQ Hessian up to its factor 2), collected from the
//! **unquantized** model's forward. Keyed by GGUF tensor name (`blk.0.attn_q.weight`) for
//! [`super::GgufJob::importance`].
//!
//! The forward is the GPTQ calibration's, layer by layer over every sample ([`calibrate::embed_samples`],
//! [`layer_forward_visit`]); only the diagonal is kept, so the work per stage is one pass over its
//! activations (no `cols²` products) and the memory is the samples' hidden states plus one layer's weights.

use crate::error::{DatasetError, Result, SpecError};
use crate::events::{fields, EventSink};
use crate::gguf::blocks::feedback::quantize_tensor_feedback;
use crate::gguf::blocks::kquants::is_kquant;
use crate::gguf::error::GgufError;
use crate::gguf::export::{tensor_types, tensor_values};
use crate::gguf::llama::{layer_tensor_name, GgufArch, MappedTensor};
use crate::gguf::types::{FileType, GgmlType};
use crate::job::calibrate::embed_samples;
use crate::memory::release_free_memory;
use crate::model::calib::{load_samples_counted, CalibSettings};
use crate::model::llama::{layer_forward_visit, Rope, Stage, STAGES};
use crate::model::tensors::TensorStore;
use crate::model::{input_groups, layer_modules, load_layer, ModelConfig};
use crate::numerics::hessian::{prepare_factor, FactorOutcome};
use crate::numerics::linalg::{CpuBackend, LinalgBackend};
use crate::params::{ColumnOrder, RecoveryParams};
use faer::{Mat, MatRef};
use flexinfer_contract::events as names;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// What the pass reads.
pub struct ImportanceJob<'a> {
    pub model_dir: &'a Path,
    /// The calibration set (the GPTQ pipeline's formats).
    pub dataset: &'a Path,
    pub calib: CalibSettings,
    /// GPTQ error feedback on the K-quant grids ([`quantize_tensor_feedback`]): with `Some(file_type)`,
    /// the pass also accumulates each stage's full Hessian `XᵀX` (one layer at a time) and quantizes
    /// every layer linear that `file_type`'s mix stores as a K-quant type into
    /// [`Importance::feedback`].
    pub feedback: Option<FileType>,
}

/// The collected importance and what it was collected from.
#[derive(Clone, Debug)]
pub struct Importance {
    /// GGUF tensor name → one weight per input column (mean of x² over the calibration tokens).
    pub weights: HashMap<String, Vec<f32>>,
    /// GGUF tensor name → the tensor's bytes, quantized with GPTQ error feedback to the type the
    /// run's mix gives it (empty without [`ImportanceJob::feedback`]).
    pub feedback: HashMap<String, Vec<u8>>,
    pub samples: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// Per-column sums of squares of one stage's inputs over every token, in f64.
#[derive(Clone, Debug)]
struct ColumnSquares {
    sums: Vec<f64>,
}

impl ColumnSquares {
    fn new(cols: usize) -> Self {
        ColumnSquares {
            sums: vec![0.0; cols],
        }
    }

    /// Adds `Σ_rows a[r, c]²` to column c (`a`: `[tokens, cols]`, one column at a time).
    fn add(&mut self, a: MatRef<'_, f32>) {
        for (c, s) in self.sums.iter_mut().enumerate().take(a.ncols()) {
            let col = a.col(c);
            *s += col
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>();
        }
    }
}

fn progress(events: &dyn EventSink, percent: f64, detail: String) {
    events.emit(
        names::PROGRESS,
        fields([
            ("phase", json!("imatrix")),
            ("percent", json!((percent * 10.0).round() / 10.0)),
            ("detail", json!(detail)),
        ]),
    );
}

/// Runs the calibration forward of the unquantized model and returns each quantizable linear's
/// per-column mean squared input. The model must be one the GGUF writer maps (checked first).
pub fn collect_importance(job: &ImportanceJob<'_>, events: &dyn EventSink) -> Result<Importance> {
    let started = Instant::now();
    if job.calib.max_samples == 0 || job.calib.max_seq_len < 2 {
        return Err(SpecError::Samples {
            max_samples: job.calib.max_samples,
            max_seq_len: job.calib.max_seq_len,
        }
        .into());
    }
    if !job.dataset.is_file() {
        return Err(DatasetError::NotAFile {
            what: crate::model::dataset::CALIBRATION.what,
            path: job.dataset.to_path_buf(),
        }
        .into());
    }
    let cfg = ModelConfig::load(job.model_dir)?;
    let arch = GgufArch::of(&cfg)?;
    let store = TensorStore::open_dir(job.model_dir)?;
    // The linears to quantize with feedback: the importance-using mix's K-quant layer tensors.
    let targets: HashMap<String, (MappedTensor, GgmlType)> = match job.feedback {
        Some(ft) => tensor_types(&cfg, &store, arch, ft, true)?
            .into_iter()
            .filter(|(t, ty)| t.layer.is_some() && t.dims.len() == 2 && is_kquant(*ty))
            .map(|(t, ty)| (t.gguf.clone(), (t, ty)))
            .collect(),
        None => HashMap::new(),
    };
    let loaded = load_samples_counted(job.model_dir, job.dataset, &job.calib)?;
    let samples = loaded.ids;
    let tokens: usize = samples.iter().map(Vec::len).sum();
    let n_samples = samples.len();
    progress(
        events,
        0.0,
        format!(
            "{} samples, {tokens} tokens{}",
            samples.len(),
            if loaded.skipped_unencodable > 0 {
                format!(
                    ", {} samples skipped (bytes the tokenizer vocabulary lacks)",
                    loaded.skipped_unencodable
                )
            } else {
                String::new()
            }
        ),
    );
    let max_len = samples.iter().map(Vec::len).max().unwrap_or(0);
    let rope = Rope::new(&cfg, max_len);
    let mut hidden = embed_samples(&store, &cfg, &samples)?;
    drop(samples);
    let (weights, feedback) =
        collect_layers(&cfg, &store, &rope, &mut hidden, tokens, &targets, events)?;
    drop(hidden);
    release_free_memory();
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        tensors = weights.len(),
        feedback = feedback.len(),
        tokens,
        seconds,
        "importance matrix collected"
    );
    Ok(Importance {
        weights,
        feedback,
        samples: n_samples,
        tokens,
        seconds,
    })
}

/// Every layer in order: its stages' column sums over every sample (and, for a stage with a
/// feedback target, its full Hessian), then `hidden` is the layer output. Returns the importance
/// vectors and the feedback-quantized tensors.
#[allow(clippy::type_complexity)]
fn collect_layers(
    cfg: &ModelConfig,
    store: &TensorStore,
    rope: &Rope,
    hidden: &mut [faer::Mat<f32>],
    tokens: usize,
    targets: &HashMap<String, (MappedTensor, GgmlType)>,
    events: &dyn EventSink,
) -> Result<(HashMap<String, Vec<f32>>, HashMap<String, Vec<u8>>)> {
    let mut out = HashMap::new();
    let mut quantized = HashMap::new();
    let backend = CpuBackend::default();
    let layers = cfg.num_layers;
    for layer in 0..layers {
        let lw = load_layer(store, cfg, layer, None)?;
        store.release_pages();
        let groups = input_groups(cfg, layer);
        let specs = layer_modules(cfg, layer);
        let gguf_name = |i: usize| layer_tensor_name(layer, &format!("{}.weight", specs[i].name));
        let mut sums: Vec<ColumnSquares> = groups
            .iter()
            .map(|g| ColumnSquares::new(g.first().map_or(0, |&i| lw.linears[i].w.ncols())))
            .collect();
        // One full Hessian per stage that has a feedback target (lower triangle while accumulating).
        let mut hessians: Vec<Option<Mat<f32>>> = groups
            .iter()
            .map(|g| {
                let wanted = g
                    .iter()
                    .any(|&i| gguf_name(i).is_some_and(|n| targets.contains_key(&n)));
                let cols = g.first().map_or(0, |&i| lw.linears[i].w.ncols());
                wanted.then(|| Mat::<f32>::zeros(cols, cols))
            })
            .collect();
        for x in hidden.iter_mut() {
            layer_forward_visit(cfg, &lw, x, rope, &mut |stage, a| {
                sums[stage as usize].add(a);
                if let Some(h) = hessians[stage as usize].as_mut() {
                    backend.accumulate_hessian(h.as_mut(), a, 1.0);
                }
            });
        }
        drop(lw);
        release_free_memory();
        for (stage, ((group, s), h)) in STAGES
            .iter()
            .zip(groups.iter().zip(&sums).zip(hessians.iter_mut()))
        {
            let mean = column_means(s, tokens, cfg, layer, *stage)?;
            if let Some(mut h) = h.take() {
                backend.finish_hessian(h.as_mut());
                let module = format!("{}{stage:?}", cfg.layer_prefix(layer));
                match prepare_factor(
                    &backend,
                    h,
                    ColumnOrder::Plain,
                    &RecoveryParams::default(),
                    &module,
                    events,
                ) {
                    FactorOutcome::Factor(pf) => {
                        for &i in group {
                            let Some((t, ty)) = gguf_name(i).and_then(|n| targets.get(&n)) else {
                                continue;
                            };
                            let (values, cols) = tensor_values(t, store)?;
                            let bytes = quantize_tensor_feedback(
                                *ty,
                                &values,
                                cols,
                                Some(&mean),
                                &pf.f,
                                &pf.dead,
                            )
                            .map_err(|e| GgufError::Unsupported {
                                key: t.gguf.clone(),
                                reason: e.to_string(),
                            })?;
                            store.release_pages();
                            quantized.insert(t.gguf.clone(), bytes);
                        }
                    }
                    FactorOutcome::Exhausted => tracing::warn!(
                        module,
                        "the Hessian could not be factored; these linears are quantized without feedback"
                    ),
                }
            }
            for &i in group {
                let Some(name) = gguf_name(i) else {
                    continue;
                };
                out.insert(name, mean.clone());
            }
        }
        progress(
            events,
            100.0 * (layer + 1) as f64 / layers.max(1) as f64,
            format!("layer {}/{layers}", layer + 1),
        );
    }
    Ok((out, quantized))
}

/// `sums / tokens` as f32; a non-finite sum (a forward that overflowed) names the layer and stage.
fn column_means(
    s: &ColumnSquares,
    tokens: usize,
    cfg: &ModelConfig,
    layer: usize,
    stage: Stage,
) -> Result<Vec<f32>> {
    let n = tokens.max(1) as f64;
    if let Some(c) = s.sums.iter().position(|v| !v.is_finite()) {
        return Err(GgufError::Unsupported {
            key: format!("{}{stage:?} input", cfg.layer_prefix(layer)),
            reason: format!(
                "the calibration activations of column {c} are not finite; no importance can be computed"
            ),
        }
        .into());
    }
    Ok(s.sums.iter().map(|v| (v / n) as f32).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::events::NullSink;
    use crate::gguf::blocks::dequantize_tensor;
    use crate::gguf::llama::{map_tensors, permute_heads, Source};
    use crate::gguf::reader::read_header;
    use crate::gguf::{write_gguf, FileType, GgufJob};
    use crate::model::calib::load_samples;
    use crate::model::llama::{embed, layer_forward};
    use crate::testkit::{self, ModelSize};

    const CALIB: CalibSettings = CalibSettings {
        max_samples: 6,
        max_seq_len: 48,
    };

    fn tiny(dir: &Path) -> std::path::PathBuf {
        testkit::write_model_sized(dir, "LlamaForCausalLM", 3, &ModelSize::GGUF_WIDE).unwrap();
        testkit::write_byte_level_tokenizer(dir).unwrap();
        let data = dir.join("calib.jsonl");
        testkit::write_dataset(&data, 8).unwrap();
        data
    }

    fn collect(dir: &Path, data: &Path) -> Importance {
        collect_importance(
            &ImportanceJob {
                model_dir: dir,
                dataset: data,
                calib: CALIB,
                feedback: None,
            },
            &NullSink,
        )
        .unwrap()
    }

    /// The reference: each stage's input from [`layer_forward`] stopped there, sample by sample, and
    /// the mean of its squares over every token, element by element.
    #[test]
    fn the_diagonal_is_the_mean_square_of_each_layer_input() {
        let d = tempfile::tempdir().unwrap();
        let data = tiny(d.path());
        let imp = collect(d.path(), &data);

        let cfg = ModelConfig::load(d.path()).unwrap();
        let store = TensorStore::open_dir(d.path()).unwrap();
        let samples = load_samples(d.path(), &data, &CALIB).unwrap();
        let tokens: usize = samples.iter().map(Vec::len).sum();
        assert_eq!((imp.samples, imp.tokens), (samples.len(), tokens));
        assert!(samples.len() > 1 && tokens > samples.len());
        let rope = Rope::new(&cfg, samples.iter().map(Vec::len).max().unwrap());
        let mut xs: Vec<_> = samples
            .iter()
            .map(|s| embed(&store, &cfg, None, s).unwrap())
            .collect();
        let suffixes = [
            (Stage::Qkv, vec!["attn_q", "attn_k", "attn_v"]),
            (Stage::O, vec!["attn_output"]),
            (Stage::GateUp, vec!["ffn_gate", "ffn_up"]),
            (Stage::Down, vec!["ffn_down"]),
        ];
        let mut checked = 0;
        for layer in 0..cfg.num_layers {
            let lw = load_layer(&store, &cfg, layer, None).unwrap();
            for (stage, names) in &suffixes {
                let inputs: Vec<_> = xs
                    .iter()
                    .map(|x| layer_forward(&cfg, &lw, x.as_ref(), &rope, Some(*stage)))
                    .collect();
                let cols = inputs[0].ncols();
                let mut want = vec![0.0f64; cols];
                for a in &inputs {
                    for r in 0..a.nrows() {
                        for (c, w) in want.iter_mut().enumerate() {
                            *w += f64::from(a[(r, c)]).powi(2);
                        }
                    }
                }
                want.iter_mut().for_each(|w| *w /= tokens as f64);
                for n in names {
                    let key = format!("blk.{layer}.{n}.weight");
                    let got = imp.weights.get(&key).unwrap_or_else(|| panic!("{key}"));
                    assert_eq!(got.len(), cols, "{key}");
                    for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(*g) - w).abs() <= 1e-5 * w.abs().max(1e-6),
                            "{key} column {c}: {g} vs {w}"
                        );
                    }
                    checked += 1;
                }
            }
            for x in xs.iter_mut() {
                *x = layer_forward(&cfg, &lw, x.as_ref(), &rope, None);
            }
        }
        // Every blk.* linear and nothing else (llama-imatrix's default: no token_embd, no output).
        assert_eq!(checked, 7 * cfg.num_layers);
        assert_eq!(imp.weights.len(), checked);
        // Not flat: the weights vary across columns (else importance could not change a block).
        let q = &imp.weights["blk.0.ffn_down.weight"];
        let (lo, hi) = q
            .iter()
            .fold((f32::MAX, 0.0f32), |(l, h), &v| (l.min(v), h.max(v)));
        assert!(hi > 2.0 * lo && lo > 0.0, "{lo} {hi}");
    }

    /// With feedback on, the pass quantizes exactly the planned K-quant layer tensors, each to its
    /// planned size; the bytes differ from independent rounding and dequantize with our reader; a
    /// prequantized tensor of the wrong size is refused before the file is created.
    #[test]
    fn feedback_quantizes_the_planned_k_quant_layer_tensors() {
        let d = tempfile::tempdir().unwrap();
        let data = tiny(d.path());
        let ft = FileType::from_name("Q3_K_M").unwrap();
        let imp = collect_importance(
            &ImportanceJob {
                model_dir: d.path(),
                dataset: &data,
                calib: CALIB,
                feedback: Some(ft),
            },
            &NullSink,
        )
        .unwrap();
        let cfg = ModelConfig::load(d.path()).unwrap();
        let store = TensorStore::open_dir(d.path()).unwrap();
        let arch = GgufArch::of(&cfg).unwrap();
        let planned = tensor_types(&cfg, &store, arch, ft, true).unwrap();
        let mut want: Vec<&str> = planned
            .iter()
            .filter(|(t, ty)| t.layer.is_some() && t.dims.len() == 2 && is_kquant(*ty))
            .map(|(t, _)| t.gguf.as_str())
            .collect();
        let mut got: Vec<&str> = imp.feedback.keys().map(String::as_str).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want);
        assert_eq!(want.len(), 7 * cfg.num_layers);
        for (t, ty) in &planned {
            let Some(b) = imp.feedback.get(&t.gguf) else {
                continue;
            };
            let (values, cols) = tensor_values(t, &store).unwrap();
            assert_eq!(
                b.len(),
                ty.row_bytes(cols).unwrap() * values.len() / cols,
                "{}",
                t.gguf
            );
            let plain = crate::gguf::blocks::quantize_tensor(
                *ty,
                &values,
                cols,
                Some(&imp.weights[&t.gguf]),
            )
            .unwrap();
            assert_ne!(&plain, b, "{}", t.gguf);
            let q = dequantize_tensor(*ty, b, cols).unwrap();
            assert!(q.iter().all(|v| v.is_finite()), "{}", t.gguf);
        }
        // The writer refuses prequantized bytes of the wrong size, naming the tensor.
        let plan = crate::gguf::export::plan_gguf(
            &GgufJob {
                model_dir: d.path(),
                out_path: d.path(),
                file_type: ft,
                importance: Some(&imp.weights),
                name: "tiny",
            },
            &cfg,
            &store,
        )
        .unwrap();
        let mut bad = imp.feedback.clone();
        bad.get_mut("blk.0.attn_q.weight").unwrap().pop();
        let out = d.path().join("bad.gguf");
        let e = crate::gguf::export::write_planned(
            &plan,
            &store,
            &out,
            Some(&imp.weights),
            Some(&bad),
            &mut |_, _| {},
        )
        .unwrap_err();
        assert!(
            flexinfer_contract::error::chain(&e).contains("blk.0.attn_q.weight"),
            "{e}"
        );
        assert!(!out.exists());
    }

    /// The pass's importance goes into the block search: the written blocks change, and the
    /// importance-weighted reconstruction error over the weighted tensors goes down.
    #[test]
    fn the_pass_importance_changes_the_chosen_blocks_and_lowers_the_weighted_error() {
        let d = tempfile::tempdir().unwrap();
        let data = tiny(d.path());
        let imp = collect(d.path(), &data);
        let out = tempfile::tempdir().unwrap();
        let write = |name: &str, w: Option<&HashMap<String, Vec<f32>>>| {
            let p = out.path().join(name);
            write_gguf(&GgufJob {
                model_dir: d.path(),
                out_path: &p,
                file_type: FileType::from_name("Q4_K_M").unwrap(),
                importance: w,
                name: "tiny",
            })
            .unwrap();
            std::fs::read(p).unwrap()
        };
        let plain = write("plain.gguf", None);
        let weighted = write("weighted.gguf", Some(&imp.weights));
        let (hp, hw) = (
            read_header(&plain).unwrap(),
            read_header(&weighted).unwrap(),
        );

        let cfg = ModelConfig::load(d.path()).unwrap();
        let store = TensorStore::open_dir(d.path()).unwrap();
        let arch = GgufArch::of(&cfg).unwrap();
        let (mut err_plain, mut err_weighted, mut differing) = (0.0f64, 0.0f64, 0);
        for t in map_tensors(&cfg, &store, arch).unwrap() {
            let Some(w) = imp.weights.get(&t.gguf) else {
                continue;
            };
            let Source::Checkpoint(src) = &t.source else {
                panic!("{}", t.gguf)
            };
            let cols = t.dims[0] as usize;
            let mut x = store.f32(src).unwrap();
            if let Some(h) = t.permute_heads {
                x = permute_heads(&x, x.len() / cols, cols, h);
            }
            let deq = |file: &[u8], h: &crate::gguf::reader::GgufHeader| {
                let (spec, off) = h.tensors.iter().find(|(s, _)| s.name == t.gguf).unwrap();
                let start = (h.data_start + off) as usize;
                let len = spec.byte_size().unwrap() as usize;
                (
                    spec.ty,
                    dequantize_tensor(spec.ty, &file[start..start + len], cols).unwrap(),
                )
            };
            let ((tp, qp), (tw, qw)) = (deq(&plain, &hp), deq(&weighted, &hw));
            assert_eq!(
                tp, tw,
                "{}: the Q4_K_M mix does not depend on importance",
                t.gguf
            );
            if qp != qw {
                differing += 1;
            }
            let werr = |q: &[f32]| -> f64 {
                x.iter()
                    .zip(q)
                    .enumerate()
                    .map(|(i, (a, b))| f64::from(w[i % cols]) * f64::from(a - b).powi(2))
                    .sum()
            };
            err_plain += werr(&qp);
            err_weighted += werr(&qw);
        }
        assert_eq!(
            differing,
            imp.weights.len(),
            "every weighted tensor changed"
        );
        assert!(
            err_weighted < 0.97 * err_plain,
            "weighted error {err_weighted} vs plain {err_plain}"
        );
    }
}
