//! Section 3 of the check: a whole generated model quantized on the device and on the CPU, compared.

use crate::artifact::{relative_error, Artifact};
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::device::check::{self, Check};
use flexinfer_quant::device::Device;
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::model::tensors::TensorStore;
use flexinfer_quant::params::{GateParams, GptqParams};
use flexinfer_quant::testkit::{self, ModelSize};
use std::path::Path;

/// Quantizes a generated model on `dev` and on the CPU and compares the artifacts (module docs, 3). With
/// `device_forward` the device run's calibration forward runs on the device where it has one (the
/// default of a Job), else on the CPU; the check's detail says where it ran (`forward on the device` /
/// `forward on the CPU`).
pub fn whole_model(dev: &dyn Device, quick: bool, device_forward: bool) -> Check {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let size = if quick {
        ModelSize::TINY
    } else {
        ModelSize {
            hidden: 1024,
            inter: 2816,
            layers: 2,
            heads: 8,
            kv_heads: 4,
            ..ModelSize::TINY
        }
    };
    testkit::write_model_sized(&model, "LlamaForCausalLM", 5, &size).unwrap();
    let ds = tmp.path().join("calib.jsonl");
    // `--quick`: 16 samples of 32 tokens (the host build of the kernels in the tests runs every device thread
    // on a host thread); else 64 of 64.
    let (samples, len) = if quick { (16, 32) } else { (64, 64) };
    testkit::write_dataset(&ds, samples).unwrap();
    let quantize = |d: &dyn Device, out: &Path, forward: bool, sink: &MemorySink| {
        let job = QuantizeJob {
            device_forward: forward,
            params: GptqParams::default(),
            gate: GateParams {
                max_rtn_fallback_percent: 100.0,
                min_modules: 1,
            },
            resume_layers: false,
            ..QuantizeJob::new(
                &model,
                out,
                &ds,
                CalibSettings {
                    max_samples: samples,
                    max_seq_len: len,
                },
                "gpu_check",
            )
        };
        run(&job, d, sink).unwrap_or_else(|e| panic!("quantize on {}: {e}", d.describe()))
    };
    let (a, b) = (tmp.path().join("device"), tmp.path().join("cpu"));
    let sink = MemorySink::default();
    quantize(dev, &a, device_forward, &sink);
    quantize(&CpuBackend::default(), &b, false, &MemorySink::default());
    let on_device = sink
        .named(flexinfer_contract::events::QUANTIZE_PHASES)
        .iter()
        .any(|e| e.get("forwardOn").and_then(|v| v.as_str()) == Some("device"));
    let mut c = compare_artifacts(
        &format!("whole model hidden={} layers={}", size.hidden, size.layers),
        &model,
        &Artifact::open(&a),
        &Artifact::open(&b),
    );
    c.detail = format!(
        "forward on the {}; {}",
        if on_device { "device" } else { "CPU" },
        c.detail
    );
    c
}

/// The whole-model comparison. Layer 0's first input group (q, k, v: the same calibration inputs on both
/// sides) is held to the per-group rules of [`check::compare`]. Every later module sees inputs computed
/// through the already quantized modules before it, which differ between the two runs, so its codes may
/// differ widely; it is held to the artifact's quality instead: its relative weight error
/// `‖W − Ŵ‖_F / ‖W‖_F` (W the source weights, Ŵ the dequantized checkpoint) within max(1 %, 4/√(2N)) of the
/// CPU artifact's, N the module's weights (the second term matters for the small modules of `--quick`).
fn compare_artifacts(name: &str, model: &Path, dev: &Artifact, cpu: &Artifact) -> Check {
    let fail = |detail: String| Check {
        name: name.to_string(),
        passed: false,
        worst: f64::INFINITY,
        detail,
    };
    let modules = cpu.modules();
    if dev.modules() != modules || modules.is_empty() {
        return fail(format!(
            "the artifacts quantize different modules: {} vs {}",
            dev.modules().len(),
            modules.len()
        ));
    }
    let first: Vec<&String> = modules
        .iter()
        .filter(|k| {
            ["q_proj", "k_proj", "v_proj"]
                .iter()
                .any(|m| k.ends_with(&format!("layers.0.self_attn.{m}")))
        })
        .collect();
    let strict = check::compare(
        "layer 0 q/k/v",
        &first.iter().map(|k| dev.linear(k)).collect::<Vec<_>>(),
        &first.iter().map(|k| cpu.linear(k)).collect::<Vec<_>>(),
    );
    let source = TensorStore::open_dir(model).unwrap();
    let (mut worst, mut at, mut sum_dev, mut sum_cpu) = (0f64, String::new(), 0f64, 0f64);
    for k in &modules {
        let Ok(w) = source.f32(&format!("{k}.weight")) else {
            return fail(format!("{k}: no {k}.weight in the source model"));
        };
        let (ed, ec) = (
            relative_error(&dev.weights(k), &w),
            relative_error(&cpu.weights(k), &w),
        );
        sum_dev += ed;
        sum_cpu += ec;
        // Two equally good quantizations of N weights differ in their relative error by about
        // 1/sqrt(2N) (the spread of a norm over N independent errors): 4 of those, at least 1 %.
        let tolerance = (4.0 / (2.0 * w.len().max(1) as f64).sqrt()).max(0.01);
        let r = (ed / ec - 1.0).abs() / tolerance;
        let r = if r.is_nan() { f64::INFINITY } else { r };
        if r > worst || at.is_empty() {
            (worst, at) = (r, k.clone());
        }
    }
    Check {
        name: name.to_string(),
        passed: strict.passed && worst <= 1.0,
        worst: worst.max(strict.worst),
        detail: format!(
            "{} modules; mean relative weight error device {:.5} vs CPU {:.5}, worst |ratio − 1|/tolerance {worst:.3} ({at}); {}: {}",
            modules.len(),
            sum_dev / modules.len() as f64,
            sum_cpu / modules.len() as f64,
            if strict.passed { "ok" } else { "FAIL" },
            strict.detail
        ),
    }
}
