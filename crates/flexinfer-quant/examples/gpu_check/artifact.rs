//! A `gptq` checkpoint read back: each quantized module's packed tensors, and the source model's weights.

use flexinfer_quant::gptq::{Method, QuantizedLinear};
use flexinfer_quant::pack::{
    dequantize_packed, unpack_qweight, unpack_qzeros, PackedLinear, ZeroFormat,
};
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::Path;

pub struct Module {
    pub packed: PackedLinear,
    pub format: ZeroFormat,
}

impl Module {
    /// Codes and parameters for [`flexinfer_quant::device::check::compare`] (no loss or damp in a checkpoint: both 0).
    pub fn linear(&self) -> QuantizedLinear {
        let p = &self.packed;
        QuantizedLinear {
            rows: p.rows,
            cols: p.cols,
            bits: p.bits,
            sym: true,
            codes: unpack_qweight(&p.qweight, p.rows, p.cols, p.bits),
            scales: p.scales.iter().map(|s| s.to_f32()).collect(),
            zeros: unpack_qzeros(&p.qzeros, p.rows, p.groups, p.bits, self.format),
            g_idx: p.g_idx.clone(),
            method: Method::Gptq,
            loss: 0.0,
            damp: 0.0,
        }
    }

    /// `‖W − Ŵ‖_F / ‖W‖_F` against the source weights `w` (`[rows][cols]`).
    pub fn relative_error(&self, w: &[f32]) -> f64 {
        let q = dequantize_packed(&self.packed, self.format);
        assert_eq!(q.len(), w.len(), "weight shape");
        let (mut e, mut n) = (0f64, 0f64);
        for (a, b) in q.iter().zip(w) {
            e += ((a - b) as f64).powi(2);
            n += (*b as f64).powi(2);
        }
        (e / n.max(f64::MIN_POSITIVE)).sqrt()
    }
}

fn tensors(dir: &Path) -> BTreeMap<String, (Vec<usize>, String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let mut out = BTreeMap::new();
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            out.insert(
                name,
                (
                    view.shape().to_vec(),
                    format!("{:?}", view.dtype()),
                    view.data().to_vec(),
                ),
            );
        }
    }
    out
}

fn words(data: &[u8]) -> Vec<i32> {
    data.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The quantized modules of the checkpoint in `dir`, by name (`model.layers.0.self_attn.q_proj`).
pub fn read(dir: &Path) -> BTreeMap<String, Module> {
    let t = tensors(dir);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let q = &config["quantization_config"];
    let bits = q["bits"].as_u64().unwrap_or(4) as u32;
    let format = match q["checkpoint_format"].as_str() {
        Some("gptq_v2") => ZeroFormat::V2,
        _ => ZeroFormat::V1,
    };
    let mut out = BTreeMap::new();
    for (name, (shape, _, data)) in &t {
        let Some(prefix) = name.strip_suffix(".qweight") else {
            continue;
        };
        let (rows, cols) = (shape[1], shape[0] * 32 / bits as usize);
        let (sshape, _, sdata) = &t[&format!("{prefix}.scales")];
        let scales: Vec<half::f16> = sdata
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
            .collect();
        let g_idx = t
            .get(&format!("{prefix}.g_idx"))
            .map(|(_, _, d)| words(d))
            .unwrap_or_else(|| {
                (0..cols)
                    .map(|c| (c / (cols / sshape[0]).max(1)) as i32)
                    .collect()
            });
        let packed = PackedLinear {
            qweight: words(data),
            qzeros: words(&t[&format!("{prefix}.qzeros")].2),
            scales,
            g_idx,
            rows,
            cols,
            groups: sshape[0],
            bits,
        };
        out.insert(prefix.to_string(), Module { packed, format });
    }
    out
}

/// The source model's linear weights as f32 `[rows][cols]`, by module name (without `.weight`).
pub fn source_weights(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let mut out = BTreeMap::new();
    for (name, (shape, dtype, data)) in tensors(dir) {
        let Some(prefix) = name.strip_suffix(".weight") else {
            continue;
        };
        if shape.len() != 2 {
            continue;
        }
        let w: Vec<f32> = match dtype.as_str() {
            "BF16" => data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            "F16" => data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            "F32" => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            _ => continue,
        };
        out.insert(prefix.to_string(), w);
    }
    out
}
