//! A `gptq` checkpoint read back through the engine's own reader (`TensorStore`, `GptqReadConfig`,
//! `load_linear`): each quantized module's codes and parameters, and its dequantized weights.

use faer::Mat;
use flexinfer_quant::gptq::{Method, QuantizedLinear};
use flexinfer_quant::model::tensors::TensorStore;
use flexinfer_quant::model::{load_linear, GptqReadConfig, ModelConfig};
use flexinfer_quant::pack::{unpack_qweight, unpack_qzeros};
use std::path::Path;

/// One checkpoint directory, opened.
pub struct Artifact {
    store: TensorStore,
    gq: GptqReadConfig,
}

impl Artifact {
    pub fn open(dir: &Path) -> Artifact {
        let cfg = ModelConfig::load(dir).unwrap();
        Artifact {
            gq: GptqReadConfig::from_config(&cfg).expect("config.json has a quantization_config"),
            store: TensorStore::open_dir(dir).unwrap(),
        }
    }

    /// The quantized modules' names (`model.layers.0.self_attn.q_proj`), sorted.
    pub fn modules(&self) -> Vec<String> {
        self.store
            .entries
            .keys()
            .filter_map(|n| n.strip_suffix(".qweight").map(str::to_string))
            .collect()
    }

    /// `(rows, cols)` of module `m` (`qweight` is `[cols·bits/32, rows]`).
    fn shape(&self, m: &str) -> (usize, usize) {
        let s = &self.store.entry(&format!("{m}.qweight")).unwrap().shape;
        (s[1], s[0] * 32 / self.gq.bits as usize)
    }

    /// Codes and parameters of module `m` for [`flexinfer_quant::device::check::compare`] (no loss or damp
    /// in a checkpoint: both 0).
    pub fn linear(&self, m: &str) -> QuantizedLinear {
        let ((rows, cols), bits) = (self.shape(m), self.gq.bits);
        let scales: Vec<f32> = self
            .store
            .raw(&format!("{m}.scales"))
            .unwrap()
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let groups = scales.len() / rows.max(1);
        let qzeros = self.store.i32(&format!("{m}.qzeros")).unwrap();
        QuantizedLinear {
            rows,
            cols,
            bits,
            sym: true,
            codes: unpack_qweight(
                &self.store.i32(&format!("{m}.qweight")).unwrap(),
                rows,
                cols,
                bits,
            ),
            scales,
            zeros: unpack_qzeros(&qzeros, rows, groups, bits, self.gq.format),
            g_idx: self.store.i32(&format!("{m}.g_idx")).unwrap(),
            method: Method::Gptq,
            loss: 0.0,
            damp: 0.0,
        }
    }

    /// Module `m` dequantized (`[rows, cols]`).
    pub fn weights(&self, m: &str) -> Mat<f32> {
        load_linear(&self.store, m, self.shape(m), Some(self.gq))
            .unwrap()
            .w
    }
}

/// `‖W − Ŵ‖_F / ‖W‖_F` of the dequantized `q` against the source weights `w` (`[rows][cols]`, row-major).
pub fn relative_error(q: &Mat<f32>, w: &[f32]) -> f64 {
    let cols = q.ncols();
    assert_eq!(q.nrows() * cols, w.len(), "weight shape");
    let (mut e, mut n) = (0f64, 0f64);
    for (i, &b) in w.iter().enumerate() {
        let a = q[(i / cols, i % cols)];
        e += ((a - b) as f64).powi(2);
        n += (b as f64).powi(2);
    }
    (e / n.max(f64::MIN_POSITIVE)).sqrt()
}
