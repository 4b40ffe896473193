//! The device-resident solve interface (`flexinfer_quant::device`): the session path gives the old
//! per-operation path's bytes; device failures drive reset/retry and the CPU fallback with events; a whole
//! quantize run through a device; `GPTQ_DEVICE` selection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use faer::Mat;
use flexinfer_quant::device::fake::{FakeDevice, Faults};
use flexinfer_quant::device::{
    select_device, solve_with_fallback, Device, DeviceKind, GpuInfo, Platform, ProbeError,
    SolveSpec, SystemPlatform, MAX_DEVICE_RESETS,
};
use flexinfer_quant::events::{EventSink, MemorySink};
use flexinfer_quant::gptq::{gptq_quantize_in, rtn_quantize, QuantizedLinear, Workspace};
use flexinfer_quant::hessian::{prepare_factor, FactorOutcome};
use flexinfer_quant::linalg::{CpuBackend, LinalgBackend};
use flexinfer_quant::params::{GptqParams, RecoveryParams};
use flexinfer_quant::QuantError;

mod support;
use support::{batches, random};

struct Case {
    rows: usize,
    cols: usize,
    tokens: usize,
    params: GptqParams,
    recovery: RecoveryParams,
}

fn cases() -> Vec<Case> {
    let p = |bits, group_size, sym, desc_act, static_groups| GptqParams {
        bits,
        group_size,
        sym,
        desc_act,
        static_groups,
        block_size: 128,
        ..GptqParams::default()
    };
    let rp = RecoveryParams::default();
    vec![
        Case {
            rows: 40,
            cols: 96,
            tokens: 300,
            params: p(4, 32, false, false, false),
            recovery: rp.clone(),
        },
        Case {
            rows: 33,
            cols: 130,
            tokens: 200,
            params: p(4, -1, true, true, false),
            recovery: rp.clone(),
        },
        Case {
            rows: 70,
            cols: 256,
            tokens: 400,
            params: p(3, 128, false, true, true),
            recovery: rp.clone(),
        },
        Case {
            rows: 17,
            cols: 600,
            tokens: 700,
            params: p(8, 64, true, true, false),
            recovery: rp.clone(),
        },
        // Fewer tokens than features and no damp: the first attempts fail, the floor recovers.
        Case {
            rows: 24,
            cols: 160,
            tokens: 40,
            params: p(4, 32, false, false, false),
            recovery: RecoveryParams {
                damp_percent: 0.0,
                damp_auto_increment: 0.0,
                ..rp.clone()
            },
        },
        // Nothing can succeed: RTN for every module.
        Case {
            rows: 24,
            cols: 64,
            tokens: 10,
            params: p(4, 32, false, false, false),
            recovery: RecoveryParams {
                damp_percent: 0.0,
                damp_auto_increment: 0.0,
                max_floor_attempts: 0,
                ..rp
            },
        },
    ]
}

/// The per-operation path the pipeline used before the device interface.
fn old_path(c: &Case, xs: &[Mat<f32>], ws: &[Mat<f32>], sink: &MemorySink) -> Vec<QuantizedLinear> {
    let b = CpuBackend::default();
    let mut h = Mat::<f32>::zeros(c.cols, c.cols);
    for x in xs {
        b.accumulate_hessian(h.as_mut(), x.as_ref(), 2.0 / c.tokens as f32);
    }
    b.finish_hessian(h.as_mut());
    let outcome = prepare_factor(&b, h, c.params.desc_act, &c.recovery, "m", sink);
    let mut workspace = Workspace::default();
    ws.iter()
        .map(|w| match &outcome {
            FactorOutcome::Factor(f) => gptq_quantize_in(&mut workspace, &b, w, f, &c.params),
            FactorOutcome::Exhausted => rtn_quantize(w, &c.params),
        })
        .collect()
}

fn session_path(
    dev: &dyn Device,
    c: &Case,
    xs: &[Mat<f32>],
    ws: &[Mat<f32>],
    sink: &MemorySink,
) -> Result<Vec<QuantizedLinear>, QuantError> {
    let mut s = dev.open(c.cols)?;
    for x in xs {
        s.accumulate(x.as_ref(), 2.0 / c.tokens as f32)?;
    }
    let refs: Vec<&Mat<f32>> = ws.iter().collect();
    let spec = SolveSpec {
        params: &c.params,
        recovery: &c.recovery,
        module: "m",
        events: sink,
    };
    solve_with_fallback(&dev.describe(), s.as_mut(), &refs, &spec)
}

fn assert_same_bytes(a: &[QuantizedLinear], b: &[QuantizedLinear], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: module count");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.method, y.method, "{what}: module {k} method");
        assert_eq!(x.codes, y.codes, "{what}: module {k} codes");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&x.scales),
            bits(&y.scales),
            "{what}: module {k} scales"
        );
        assert_eq!(x.zeros, y.zeros, "{what}: module {k} zeros");
        assert_eq!(x.g_idx, y.g_idx, "{what}: module {k} g_idx");
        assert_eq!(
            x.loss.to_bits(),
            y.loss.to_bits(),
            "{what}: module {k} loss"
        );
        assert_eq!(
            x.damp.to_bits(),
            y.damp.to_bits(),
            "{what}: module {k} damp"
        );
    }
}

/// Events without the device-only ones, for comparing a device run's recovery events with the CPU's.
fn recovery_events(sink: &MemorySink) -> Vec<serde_json::Map<String, serde_json::Value>> {
    sink.named(flexinfer_contract::events::HESSIAN_RECOVERY)
}

fn weights(c: &Case, seed: u64) -> Vec<Mat<f32>> {
    (0..3)
        .map(|k| random(c.rows + k, c.cols, seed + k as u64) * faer::Scale(0.05))
        .collect()
}

#[test]
fn cpu_session_and_fake_device_give_the_old_paths_bytes() {
    let mut methods = Vec::new();
    for (i, c) in cases().iter().enumerate() {
        let xs = batches(c.tokens, c.cols, 10 + i as u64);
        let ws = weights(c, 100 + 10 * i as u64);
        let old_sink = MemorySink::default();
        let old = old_path(c, &xs, &ws, &old_sink);
        methods.push(old[0].method);

        let cpu_sink = MemorySink::default();
        let cpu =
            session_path(&CpuBackend::default(), c, &xs, &ws, &cpu_sink).expect("cpu session");
        assert_same_bytes(&old, &cpu, &format!("case {i} cpu session"));
        assert_eq!(
            recovery_events(&old_sink),
            recovery_events(&cpu_sink),
            "case {i} events"
        );

        let fake = FakeDevice::new(Faults::default());
        let fake_sink = MemorySink::default();
        let on_fake = session_path(&fake, c, &xs, &ws, &fake_sink).expect("fake session");
        assert_same_bytes(&old, &on_fake, &format!("case {i} fake device"));
        assert_eq!(
            recovery_events(&old_sink),
            recovery_events(&fake_sink),
            "case {i} fake events"
        );
        assert!(fake_sink
            .named(flexinfer_contract::events::GPTQ_DEVICE_ERROR)
            .is_empty());
    }
    // The cases cover GPTQ after recovery and the exhausted (RTN) outcome.
    use flexinfer_quant::gptq::Method;
    assert!(
        methods.contains(&Method::Gptq) && methods.contains(&Method::Rtn),
        "{methods:?}"
    );
    let floor_case = &cases()[4];
    let sink = MemorySink::default();
    old_path(
        floor_case,
        &batches(floor_case.tokens, floor_case.cols, 14),
        &weights(floor_case, 140),
        &sink,
    );
    let ev = recovery_events(&sink);
    assert!(
        ev.iter().any(|e| e["result"] == "failed"),
        "floor case must fail first: {ev:?}"
    );
    assert!(ev.iter().any(|e| e["result"] == "recovered"), "{ev:?}");
}

fn run_fake(
    faults: Faults,
) -> (
    FakeDevice,
    MemorySink,
    Result<Vec<QuantizedLinear>, QuantError>,
    Vec<QuantizedLinear>,
) {
    let c = &cases()[0];
    let xs = batches(c.tokens, c.cols, 10);
    let ws = weights(c, 100);
    let old = old_path(c, &xs, &ws, &MemorySink::default());
    let fake = FakeDevice::new(faults);
    let sink = MemorySink::default();
    let r = session_path(&fake, c, &xs, &ws, &sink);
    (fake, sink, r, old)
}

#[test]
fn a_failed_factorisation_call_resets_the_device_and_retries() {
    let (fake, sink, r, old) = run_fake(Faults {
        factor: vec![1],
        ..Default::default()
    });
    assert_same_bytes(&old, &r.expect("solve"), "after one reset");
    let errs = sink.named(flexinfer_contract::events::GPTQ_DEVICE_ERROR);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0]["op"], "factor");
    assert_eq!(errs[0]["reset"], 1);
    assert!(errs[0]["error"]
        .as_str()
        .unwrap()
        .contains("injected failure of call 1"));
    assert!(sink
        .named(flexinfer_contract::events::GPTQ_DEVICE_FALLBACK)
        .is_empty());
    let log = fake.log();
    let i = log
        .iter()
        .position(|s| s == "factor-error")
        .expect("factor-error");
    assert_eq!(
        &log[i + 1..i + 4],
        ["reset", "restore", "factor"],
        "{log:?}"
    );
}

#[test]
fn a_poisoned_context_fails_every_call_until_the_reset() {
    // Call 2 (the first sweep's factor is call 1) fails; the reset clears the poison and the factor is redone
    // with the diagonal that succeeded before it.
    let (fake, sink, r, old) = run_fake(Faults {
        sweep: vec![2],
        ..Default::default()
    });
    assert_same_bytes(&old, &r.expect("solve"), "after a sweep reset");
    let errs = sink.named(flexinfer_contract::events::GPTQ_DEVICE_ERROR);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0]["op"], "sweep");
    let log = fake.log();
    let i = log
        .iter()
        .position(|s| s == "sweep-error")
        .expect("sweep-error");
    assert_eq!(
        &log[i + 1..i + 5],
        ["reset", "restore", "factor", "sweep"],
        "{log:?}"
    );
}

#[test]
fn repeated_device_failures_fall_back_to_the_cpu_with_an_event() {
    let fails: Vec<usize> = (1..=MAX_DEVICE_RESETS + 1).collect();
    let (fake, sink, r, old) = run_fake(Faults {
        factor: fails,
        ..Default::default()
    });
    assert_same_bytes(&old, &r.expect("solve via fallback"), "CPU fallback");
    let errs = sink.named(flexinfer_contract::events::GPTQ_DEVICE_ERROR);
    assert_eq!(errs.len(), MAX_DEVICE_RESETS + 1, "{errs:?}");
    assert!(
        errs.last().unwrap()["reset"].is_null(),
        "the last error gives up: {errs:?}"
    );
    let fb = sink.named(flexinfer_contract::events::GPTQ_DEVICE_FALLBACK);
    assert_eq!(fb.len(), 1, "{fb:?}");
    assert_eq!(fb[0]["to"], "cpu");
    assert_eq!(fb[0]["device"], "fake");
    assert!(
        fb[0]["error"].as_str().unwrap().contains("factor failed"),
        "{fb:?}"
    );
    assert_eq!(
        fake.log().iter().filter(|s| *s == "reset").count(),
        MAX_DEVICE_RESETS
    );
}

#[test]
fn a_failing_reset_falls_back_and_an_accumulation_failure_is_an_error() {
    let (_, sink, r, old) = run_fake(Faults {
        sweep: vec![1],
        reset: true,
        ..Default::default()
    });
    assert_same_bytes(&old, &r.expect("fallback"), "fallback after a failed reset");
    assert_eq!(
        sink.named(flexinfer_contract::events::GPTQ_DEVICE_FALLBACK)
            .len(),
        1
    );

    let (_, _, r, _) = run_fake(Faults {
        accumulate: vec![2],
        ..Default::default()
    });
    match r {
        Err(e @ (QuantError::Device(_) | QuantError::DeviceLost { .. })) => {
            assert!(
                flexinfer_contract::error::chain(&e).contains("accumulate failed"),
                "{e}"
            )
        }
        other => panic!("expected a device error, got {other:?}"),
    }
}

#[test]
fn a_quantize_run_on_a_device_writes_the_cpu_runs_artifact() {
    use flexinfer_quant::calib::CalibSettings;
    use flexinfer_quant::job::{run, QuantizeJob};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    flexinfer_quant::testkit::write_model(&model, "LlamaForCausalLM", 7).unwrap();
    let ds = tmp.path().join("calib.jsonl");
    flexinfer_quant::testkit::write_dataset(&ds, 12).unwrap();
    let job = |out: &str| QuantizeJob {
        params: GptqParams {
            bits: 4,
            group_size: 32,
            desc_act: true,
            ..Default::default()
        },
        ..QuantizeJob::new(
            &model,
            &tmp.path().join(out).join("gptq-w4-g32"),
            &ds,
            CalibSettings {
                max_samples: 8,
                max_seq_len: 32,
            },
            "test",
        )
    };
    let cpu = run(&job("cpu"), &CpuBackend::default(), &MemorySink::default()).expect("cpu run");
    // The first group's device fails three times in a row (its solve falls back to the CPU); after that every
    // fifth factorisation call fails (a reset and a retry).
    let factor: Vec<usize> = (1..=3).chain((4..400).filter(|k| k % 5 == 0)).collect();
    let fake = FakeDevice::new(Faults {
        factor,
        ..Default::default()
    });
    let sink = MemorySink::default();
    let dev = run(&job("dev"), &fake, &sink).expect("device run");
    assert!(
        sink.named(flexinfer_contract::events::GPTQ_DEVICE_ERROR)
            .len()
            >= 4
    );
    assert_eq!(
        sink.named(flexinfer_contract::events::GPTQ_DEVICE_FALLBACK)
            .len(),
        1
    );
    let files = |dir: &std::path::Path| {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        v.sort();
        v
    };
    let (a, b) = (files(&cpu.output_dir), files(&dev.output_dir));
    assert!(!a.is_empty());
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!(
            std::fs::read(x).unwrap() == std::fs::read(y).unwrap(),
            "{} differs",
            x.display()
        );
    }

    let broken = FakeDevice::new(Faults {
        accumulate: vec![1],
        ..Default::default()
    });
    match run(&job("broken"), &broken, &MemorySink::default()) {
        Err(e @ (QuantError::Device(_) | QuantError::DeviceLost { .. })) => {
            assert!(
                flexinfer_contract::error::chain(&e).contains("accumulate"),
                "{e}"
            )
        }
        other => panic!(
            "expected a device error, got {:?}",
            other.map(|o| o.output_dir)
        ),
    }
}

/// A platform whose runtimes answer as told: usable, or no device in the named library.
struct FakePlatform {
    hip: Result<(), &'static str>,
    cuda: Result<(), &'static str>,
    /// Whether `open` gives a device for a usable runtime.
    can_open: bool,
}

impl Platform for FakePlatform {
    fn probe(&self, kind: DeviceKind) -> Result<GpuInfo, ProbeError> {
        let r = match kind {
            DeviceKind::Hip => self.hip,
            DeviceKind::Cuda => self.cuda,
            DeviceKind::Cpu => panic!("the CPU is never probed"),
        };
        let vendor = kind.as_str();
        r.map_err(|library| ProbeError::NoDevice {
            library: library.into(),
            vendor,
        })?;
        Ok(GpuInfo {
            kind,
            library: format!("lib{}", kind.as_str()),
            devices: 1,
            name: "card".into(),
        })
    }
    fn open(&self, info: &GpuInfo) -> Result<Box<dyn Device>, ProbeError> {
        if self.can_open {
            Ok(Box::new(FakeDevice::new(Faults::default())))
        } else {
            Err(ProbeError::Session(
                flexinfer_quant::device::DeviceError::new(
                    info.kind.as_str(),
                    "load",
                    "no code object loads on this device",
                ),
            ))
        }
    }
}

fn selected(sink: &MemorySink) -> serde_json::Map<String, serde_json::Value> {
    let ev = sink.named(flexinfer_contract::events::GPTQ_DEVICE_SELECTED);
    assert_eq!(ev.len(), 1, "{ev:?}");
    ev[0].clone()
}

#[test]
fn gptq_device_selection() {
    let none = || FakePlatform {
        hip: Err("libamdhip64.so"),
        cuda: Err("libcuda.so.1"),
        can_open: true,
    };
    // auto, nothing usable: the CPU, every reason in the event.
    let sink = MemorySink::default();
    let s = select_device(None, &none(), &sink).unwrap();
    assert_eq!(s.device.kind(), DeviceKind::Cpu);
    let ev = selected(&sink);
    assert_eq!(ev["device"], "cpu-faer");
    assert_eq!(ev["requested"], "auto");
    let reason = ev["reason"].as_str().unwrap();
    assert!(
        reason.contains("libamdhip64.so: no hip device")
            && reason.contains("libcuda.so.1: no cuda device"),
        "{reason}"
    );
    assert_eq!(ev["probes"].as_array().unwrap().len(), 2);

    // auto prefers HIP, then CUDA.
    let both = FakePlatform {
        hip: Ok(()),
        cuda: Ok(()),
        can_open: true,
    };
    let sink = MemorySink::default();
    let s = select_device(Some("auto"), &both, &sink).unwrap();
    assert_eq!(s.device.describe(), "fake");
    assert_eq!(selected(&sink)["reason"], "auto: hip usable");
    assert_eq!(
        selected(&sink)["probes"].as_array().unwrap().len(),
        1,
        "CUDA is not probed once HIP is usable"
    );
    let cuda_only = FakePlatform {
        hip: Err("libamdhip64.so"),
        cuda: Ok(()),
        can_open: true,
    };
    let sink = MemorySink::default();
    select_device(Some("AUTO"), &cuda_only, &sink).unwrap();
    let r = selected(&sink)["reason"].as_str().unwrap().to_string();
    assert!(
        r.starts_with("auto: cuda usable") && r.contains("hip: libamdhip64.so: no hip device"),
        "{r}"
    );

    // A runtime that answers but that this build cannot use: auto says so and takes the CPU.
    let no_session = FakePlatform {
        hip: Err("x"),
        cuda: Ok(()),
        can_open: false,
    };
    let sink = MemorySink::default();
    let s = select_device(Some("auto"), &no_session, &sink).unwrap();
    assert_eq!(s.device.kind(), DeviceKind::Cpu);
    assert!(
        s.reason.contains(
            "card (1 device(s), libcuda) is usable, but not opened: opening the solve session failed: cuda: load failed: no code object loads on this device"
        ),
        "{}",
        s.reason
    );

    // Explicit GPUs without a usable device: an error naming the setting and the reason (bad input: exit 2).
    for (setting, needle) in [
        ("hip", "libamdhip64.so: no hip device"),
        ("cuda", "libcuda.so.1: no cuda device"),
    ] {
        let e = select_device(Some(setting), &none(), &MemorySink::default())
            .err()
            .expect("error");
        assert!(e.is_bad_input(), "{e}");
        let m = flexinfer_contract::error::chain(&e);
        assert!(
            m.contains(&format!("GPTQ_DEVICE={setting}")) && m.contains(needle),
            "{m}"
        );
    }
    assert!(select_device(Some("cuda"), &no_session, &MemorySink::default()).is_err());
    assert_eq!(
        select_device(Some("cuda"), &both, &MemorySink::default())
            .unwrap()
            .device
            .describe(),
        "fake"
    );
    // cpu: nothing probed (FakePlatform panics on a CPU probe, and a GPU probe would be recorded).
    let sink = MemorySink::default();
    let s = select_device(Some(" cpu "), &none(), &sink).unwrap();
    assert_eq!(s.device.kind(), DeviceKind::Cpu);
    assert!(selected(&sink)["probes"].as_array().unwrap().is_empty());
    // Anything else is bad input.
    let e = select_device(Some("gpu"), &none(), &MemorySink::default())
        .err()
        .expect("error");
    assert!(
        e.is_bad_input()
            && flexinfer_contract::error::chain(&e).contains("expected auto, cpu, hip or cuda"),
        "{e}"
    );
}

#[test]
fn the_system_platform_loads_runtimes_at_run_time() {
    // On a machine without a GPU runtime (CI) auto takes the CPU and names what it looked for; on one with a
    // runtime, this build still has no GPU session, so auto says that instead. Either way: the CPU.
    let sink = MemorySink::default();
    let s = select_device(Some("auto"), &SystemPlatform::default(), &sink).unwrap();
    assert_eq!(s.device.kind(), DeviceKind::Cpu);
    let reason = selected(&sink)["reason"].as_str().unwrap().to_string();
    println!("GPTQ_DEVICE=auto on this machine: {reason}");
    assert!(
        reason.contains("hip:") && reason.contains("cuda:"),
        "{reason}"
    );
    assert!(
        reason.contains("libamdhip64") || reason.contains("hipInit") || reason.contains("HIP"),
        "{reason}"
    );
    for setting in ["hip", "cuda"] {
        let e = select_device(
            Some(setting),
            &SystemPlatform::default(),
            &MemorySink::default(),
        )
        .err()
        .expect("no GPU session");
        assert!(matches!(e, QuantError::DeviceUnavailable { .. }), "{e}");
    }
    let _: &dyn EventSink = &sink;
}

/// The vendor math libraries are found at run time like the runtimes: each library that does not load is
/// named with every file tried, one whose entry points are missing is named with the missing symbol, and
/// rocSOLVER is not used without rocBLAS (it runs on a rocBLAS handle). The overrides (`FLEXINFER_CUBLAS`
/// & co.) are passed to the loader, not set in the environment.
#[test]
fn vendor_math_libraries_load_at_run_time_and_name_what_is_missing() {
    use flexinfer_quant::device::driver::{
        math_libraries, MathLibraries, CUBLAS_LIBRARIES, CUSOLVER_LIBRARIES, ROCBLAS_LIBRARIES,
    };
    use flexinfer_quant::device::kernel::MathLibs;
    let (cuda, why) = math_libraries(DeviceKind::Cuda);
    println!("CUDA math libraries here: {cuda:?} {why:?}");
    let text = why.join("; ");
    if !cuda.blas {
        for name in CUBLAS_LIBRARIES {
            assert!(text.contains(name), "{text}");
        }
    }
    if !cuda.solver {
        for name in CUSOLVER_LIBRARIES {
            assert!(text.contains(name), "{text}");
        }
    }
    let (hip, why) = math_libraries(DeviceKind::Hip);
    let text = why.join("; ");
    if !hip.blas {
        for name in ROCBLAS_LIBRARIES {
            assert!(text.contains(name), "{text}");
        }
        assert!(
            !hip.solver && text.contains("rocSOLVER needs rocBLAS"),
            "{text}"
        );
    }
    // A library that loads but is not the vendor's: its first missing entry point is named.
    let libm = "libm.so.6";
    let overrides = |var: &str| {
        ["FLEXINFER_CUBLAS", "FLEXINFER_ROCBLAS"]
            .contains(&var)
            .then(|| libm.to_string())
    };
    let loaded = |kind| {
        let m = MathLibraries::load_from(kind, &overrides);
        (m.libs(), m.missing.clone())
    };
    let (cuda, why) = loaded(DeviceKind::Cuda);
    let (hip, hwhy) = loaded(DeviceKind::Hip);
    assert!(!cuda.blas, "{why:?}");
    assert!(
        why.iter()
            .any(|w| w.contains("libm.so.6: cublasCreate_v2") && w.starts_with("BLAS:")),
        "{why:?}"
    );
    assert_eq!(hip, MathLibs::default(), "{hwhy:?}");
    assert!(
        hwhy.iter()
            .any(|w| w.contains("libm.so.6: rocblas_create_handle")),
        "{hwhy:?}"
    );
}

/// The card check's whole-solve comparison (`device::check::compare_in_order`): a row may diverge after a
/// one-step tie (its later codes and scales then differ freely); a first difference of two steps, a scale
/// off in a row whose codes agree, a loss off by more than 1 % or more than 1 % of the codes moved fail.
#[test]
fn the_card_comparison_allows_a_rows_divergence_after_a_one_step_tie_and_nothing_else() {
    use flexinfer_quant::device::check::compare_in_order;
    // 4 rows × 64 columns, 4-bit, groups of 32 (2 groups): codes[c * rows + r], scales[g * rows + r].
    let base = card_module(4, 64, 32);
    let with = |f: &dyn Fn(&mut QuantizedLinear)| {
        let mut q = base.clone();
        f(&mut q);
        vec![q]
    };
    let cpu = vec![base.clone()];
    // (name, the device's result, the sweep order, passes)
    type Row = (&'static str, Vec<QuantizedLinear>, Option<Vec<usize>>, bool);
    let table: Vec<Row> = vec![
        ("identical", cpu.clone(), None, true),
        (
            // Row 1: column 2 one step off, then column 5 three steps off, and its second group's scale.
            "a row diverges after a one-step tie",
            with(&|q| {
                q.codes[2 * 4 + 1] += 1;
                q.codes[5 * 4 + 1] += 3;
                q.scales[4 + 1] *= 1.5;
            }),
            None,
            true,
        ),
        (
            "a first difference of two steps",
            with(&|q| q.codes[2 * 4 + 1] += 2),
            None,
            false,
        ),
        (
            // In sweep order 63, 62, …, 0 column 5 comes before column 2: its 3-step move is the first.
            "the first difference in sweep order is the later column",
            with(&|q| {
                q.codes[2 * 4 + 1] += 1;
                q.codes[5 * 4 + 1] += 3;
            }),
            Some((0..64).rev().collect()),
            false,
        ),
        (
            "a scale off in a row whose codes agree",
            with(&|q| q.scales[4 + 2] *= 1.01),
            None,
            false,
        ),
        ("a loss 2 % off", with(&|q| q.loss *= 1.02), None, false),
    ];
    for (name, dev, order, pass) in table {
        let c = compare_in_order(name, &dev, &cpu, order.as_deref());
        assert_eq!(c.passed, pass, "{name}: {c}");
    }
    // Over 1 % of the codes moved (one step each, each the first of its row): 4 of 400.
    let big = card_module(40, 10, 10);
    let mut moved = big.clone();
    for r in 0..5 {
        moved.codes[r] += 1;
    }
    let c = compare_in_order("5 of 400 moved", &[moved], std::slice::from_ref(&big), None);
    assert!(!c.passed, "{c}");
    let mut moved = big.clone();
    moved.codes[0] += 1;
    moved.codes[1] += 1;
    moved.codes[2] += 1;
    moved.codes[3] += 1;
    assert!(compare_in_order("4 of 400", &[moved], &[big], None).passed);
}

/// A 4-bit GPTQ module of `rows` × `cols` with groups of `group` columns: every code 5, every scale 0.01,
/// loss 1.
fn card_module(rows: usize, cols: usize, group: usize) -> QuantizedLinear {
    let groups = cols.div_ceil(group);
    QuantizedLinear {
        rows,
        cols,
        bits: 4,
        sym: true,
        codes: vec![5; rows * cols],
        scales: vec![0.01; groups * rows],
        zeros: vec![8; groups * rows],
        g_idx: (0..cols).map(|c| (c / group) as i32).collect(),
        method: flexinfer_quant::gptq::Method::Gptq,
        loss: 1.0,
        damp: 0.01,
    }
}

/// The event names the setting in its canonical spelling (the worker reports the same in its termination
/// message): an empty setting is `auto`, `ROCm` is `hip`.
#[test]
fn gptq_device_selected_names_the_setting_canonically() {
    let platform = FakePlatform {
        hip: Err("libamdhip64.so"),
        cuda: Err("libcuda.so.1"),
        can_open: true,
    };
    for (setting, want) in [("", "auto"), (" CPU ", "cpu"), ("auto", "auto")] {
        let sink = MemorySink::default();
        select_device(Some(setting), &platform, &sink).unwrap();
        assert_eq!(selected(&sink)["requested"], want, "{setting:?}");
    }
    let sink = MemorySink::default();
    assert!(select_device(Some("ROCm"), &platform, &sink).is_err());
    assert_eq!(
        "ROCm"
            .parse::<flexinfer_quant::device::DeviceChoice>()
            .map(|c| c.as_str())
            .ok(),
        Some("hip")
    );
}
