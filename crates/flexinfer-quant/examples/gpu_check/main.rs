//! The GPU check of `scripts/gpu-check.sh` (not a test; needs a card). On the first usable device (HIP, then
//! CUDA; `--device` picks one):
//! 1. the kernel checks of `flexinfer_quant::device::check` (Hessian, factorisation; stated bounds there);
//! 2. whole input-group solves against the CPU session (`check::cases`, `check::compare`);
//! 3. a full GPTQ of a generated Llama-shaped model on the device and on the CPU: layer 0's q/k/v (the same
//!    inputs on both sides) with the bounds of 2, every module's relative weight error within
//!    max(1 %, 4/√(2N)) of the CPU artifact's (`whole::compare_artifacts`);
//! 4. timings: the engine's host ↔ device copies of 512 MiB (into written and into new memory); the
//!    Hessian accumulation at each size (2048 tokens); one factorisation at n = 4096, 11008
//!    and 21504 on the device and on the CPU; the block update at a module's first block; the whole solve
//!    of a 4096 × 11008 module (2048 tokens, g128) against the CPU, and its steps on the device.
//!
//! Where the vendor's BLAS or solver library loads (cuBLAS / cuSOLVER, rocBLAS / rocSOLVER: what a Job with
//! `GPTQ_VENDOR_LIBS=auto` uses), sections 1, 2 and 4 run twice, first with the libraries (names ending in
//! `[vendor libs]`) and then with the engine's own kernels only (`[own kernels]`, `GPTQ_VENDOR_LIBS=off`),
//! so one run checks both paths and times them side by side; the whole model runs with the libraries.
//!
//! Usage: `gpu_check [--device auto|cuda|hip|cpu] [--quick] [--sizes 4096,11008,21504] [--json FILE]`.
//! `--quick` uses small sizes (a smoke run); `--device cpu` runs only the whole-model comparison with the CPU
//! on both sides (a check of the check that needs no card). Each section runs even when one before it
//! stopped on a device error or a panic (recorded as an error); `--json` is rewritten after every record, so
//! a run stopped by its timeout keeps what it measured. Exit status: 0 all checks passed, 1 a check failed or a section stopped on an
//! error, 3 no usable GPU.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a tool: a panic is the failure report

mod artifact;
mod report;
mod timing;
mod whole;

use flexinfer_quant::device::check::{self, Check};
use flexinfer_quant::device::driver::DriverVendor;
use flexinfer_quant::device::kernel::{KernelDevice, MathLibs};
use flexinfer_quant::device::{Device, DeviceKind, Platform, SystemPlatform};
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::GptqParams;
use report::Report;
use serde_json::{json, Value};
use std::time::Instant;
use timing::{module_steps, time_block_update, time_hessian, time_transfers};
use whole::whole_model;

struct Opts {
    device: String,
    quick: bool,
    sizes: Vec<usize>,
    json: Option<String>,
}

fn opts() -> Opts {
    let mut o = Opts {
        device: "auto".into(),
        quick: false,
        sizes: vec![4096, 11008, 21504],
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => o.device = args.next().expect("--device VALUE"),
            "--quick" => o.quick = true,
            "--sizes" => {
                o.sizes = args
                    .next()
                    .expect("--sizes N,N,…")
                    .split(',')
                    .map(|s| s.trim().parse().expect("--sizes: numbers"))
                    .collect()
            }
            "--json" => o.json = Some(args.next().expect("--json FILE")),
            other => {
                eprintln!("gpu_check: unknown argument {other:?}");
                std::process::exit(2);
            }
        }
    }
    o
}

/// The device `--device` names, or exit 3 with the probes' reasons.
fn open(setting: &str) -> KernelDevice<DriverVendor> {
    let kinds: &[DeviceKind] = match setting {
        "auto" => &[DeviceKind::Hip, DeviceKind::Cuda],
        "hip" => &[DeviceKind::Hip],
        "cuda" => &[DeviceKind::Cuda],
        other => {
            eprintln!("gpu_check: --device {other:?}: expected auto, cuda or hip");
            std::process::exit(2);
        }
    };
    let platform = SystemPlatform::default();
    let mut reasons = Vec::new();
    for &kind in kinds {
        match platform
            .probe(kind)
            .and_then(|info| platform.kernel_device(&info))
        {
            Ok(dev) => return dev,
            Err(e) => reasons.push(format!("{}: {e}", kind.as_str())),
        }
    }
    println!("no usable GPU: {}", reasons.join("; "));
    std::process::exit(3);
}

fn main() {
    let o = opts();
    let t0 = Instant::now();
    if o.device == "cpu" {
        // The check of the check, without a card: the whole-model comparison of two CPU runs must pass.
        let c = whole_model(&CpuBackend::default(), o.quick, true);
        println!("{c}");
        std::process::exit(i32::from(!c.passed));
    }
    let dev = open(&o.device);
    println!(
        "device: {} (budget {:?} MiB)",
        dev.describe(),
        dev.budget().map(|b| b >> 20)
    );
    for why in dev
        .with_vendor(|v| v.math_missing().to_vec())
        .unwrap_or_default()
    {
        println!("vendor library not used: {why}");
    }
    let mut report = Report {
        checks: Vec::new(),
        records: Vec::new(),
        errors: 0,
        device: dev.describe(),
        json: o.json.clone(),
    };
    let libs = dev.math().unwrap_or_default();
    let own = (" [own kernels]", MathLibs::default());
    let configs = if libs == MathLibs::default() {
        vec![("", libs)]
    } else {
        vec![(" [vendor libs]", libs), own]
    };
    for (i, &(label, math)) in configs.iter().enumerate() {
        dev.use_math(math).expect("the device lock");
        let run = Run {
            label,
            whole: i == 0,
        };
        checks(&mut report, &dev, &o, &run);
        timings(&mut report, &dev, &o, &run);
    }

    let failed = report.checks.iter().filter(|c| !c.passed).count();
    println!(
        "{} checks, {failed} failed, {} sections stopped by an error, {:.0}s",
        report.checks.len(),
        report.errors,
        t0.elapsed().as_secs_f64()
    );
    report.save();
    std::process::exit(i32::from(failed > 0 || report.errors > 0));
}

/// One pass over the sections: the suffix of its section and check names (which libraries), and whether
/// it runs the whole-model comparison.
struct Run {
    label: &'static str,
    whole: bool,
}

impl Run {
    fn name(&self, s: &str) -> String {
        format!("{s}{}", self.label)
    }
    /// A timing record with the pass's libraries in `"libs"`.
    fn tag(&self, mut v: Value) -> Value {
        let libs = self.label.trim().trim_matches(|c| c == '[' || c == ']');
        if let Some(m) = v.as_object_mut() {
            m.insert("libs".into(), json!(libs));
        }
        v
    }
}

/// Sections 1–3 (module docs): the device's choice, the kernel checks, the group solves, the whole model.
fn checks(report: &mut Report, dev: &KernelDevice<DriverVendor>, o: &Opts, run: &Run) {
    let (n, tokens, rows) = if o.quick {
        (96, 200, 24)
    } else {
        (1024, 2048, 512)
    };
    let de = |e: flexinfer_quant::device::DeviceError| e.to_string();

    // The worker's own choice (`GPTQ_DEVICE=auto`, what a quantize Job does): it must take this card and
    // say why in its event.
    report.section(&run.name("auto selection"), |r| {
        let events = MemorySink::default();
        let sel = flexinfer_quant::device::select_device(
            Some("auto"),
            &SystemPlatform::default(),
            &events,
        )
        .map_err(|e| e.to_string())?;
        let kind = sel.device.kind();
        let recorded = events.named(flexinfer_contract::events::GPTQ_DEVICE_SELECTED);
        let c = Check {
            name: run.name("auto selection"),
            passed: kind == dev.kind(),
            worst: 0.0,
            detail: format!(
                "GPTQ_DEVICE=auto chose {} ({}): {}",
                kind.as_str(),
                sel.device.describe(),
                sel.reason
            ),
        };
        println!(
            "selection events: {}",
            serde_json::to_string(&recorded).unwrap_or_default()
        );
        r.check(c, 0.0);
        Ok(())
    });

    report.section(&run.name("kernel checks"), |r| {
        let t = Instant::now();
        let [mut h, mut f] = check::hessian_and_factor(dev, n, tokens, 1).map_err(de)?;
        let s = t.elapsed().as_secs_f64();
        h.name = run.name(&h.name);
        f.name = run.name(&f.name);
        r.check(h, s);
        r.check(f, s);
        Ok(())
    });

    for (i, case) in check::cases(n, rows).iter().enumerate() {
        let name = run.name(&case.name);
        report.section(&name.clone(), |r| {
            let solved = check::solve_case(dev, case, 10 + i as u64).map_err(|e| e.to_string())?;
            let c = solved.compare(&name);
            r.check(c, solved.device_seconds + solved.cpu_seconds);
            Ok(())
        });
    }

    if !run.whole {
        return;
    }
    // With the forward on the device (as a Job runs it), then with only the Hessians and solves there.
    report.section(&run.name("whole model"), |r| {
        let t = Instant::now();
        let c = whole_model(dev, o.quick, true);
        r.check(c, t.elapsed().as_secs_f64());
        Ok(())
    });
    report.section(&run.name("whole model, forward on the CPU"), |r| {
        let t = Instant::now();
        let c = whole_model(dev, o.quick, false);
        r.check(c, t.elapsed().as_secs_f64());
        Ok(())
    });
}

/// Section 4 (module docs): the timings.
fn timings(report: &mut Report, dev: &KernelDevice<DriverVendor>, o: &Opts, run: &Run) {
    let sizes = if o.quick {
        vec![128, 200]
    } else {
        o.sizes.clone()
    };
    report.section(&run.name("transfer timing"), |r| {
        r.timing(run.tag(time_transfers(dev, if o.quick { 64 } else { 512 })?));
        Ok(())
    });
    for &n in &sizes {
        report.section(&run.name(&format!("hessian timing n={n}")), |r| {
            r.timing(run.tag(time_hessian(dev, n, if o.quick { 256 } else { 2048 })?));
            Ok(())
        });
    }
    for &n in &sizes {
        report.section(&run.name(&format!("factor timing n={n}")), |r| {
            factor_timing(r, dev, run, n)
        });
    }

    let module = if o.quick {
        (48, 160, 256)
    } else {
        (4096, 11008, 2048)
    };
    report.section(&run.name("block update timing"), |r| {
        // The first block of the module below: 128 deltas into the module's other columns.
        r.timing(run.tag(time_block_update(dev, module.0, 128, module.1 - 128)?));
        Ok(())
    });
    report.section(&run.name("module solve"), |r| {
        let case = check::Case {
            name: run.name(&format!("module {} x {}", module.0, module.1)),
            rows: vec![module.0],
            n: module.1,
            tokens: module.2,
            params: GptqParams::default(),
            recovery: Default::default(),
        };
        let solved = check::solve_case(dev, &case, 99).map_err(|e| e.to_string())?;
        r.check(
            solved.compare(&case.name),
            solved.device_seconds + solved.cpu_seconds,
        );
        for desc_act in [false, true] {
            r.timing(run.tag(module_steps(dev, module.0, module.1, module.2, desc_act)?));
        }
        r.timing(run.tag(json!({
            "timing": "module solve", "rows": module.0, "n": module.1, "tokens": module.2,
            "device_seconds": solved.device_seconds, "cpu_seconds": solved.cpu_seconds,
            "speedup": solved.cpu_seconds / solved.device_seconds,
        })));
        Ok(())
    });
}

/// One factorisation at `n` on the device (with the pass's libraries: the vendor's `potrf` between the
/// engine's fill and scale kernels, or the engine's own panels) and on the CPU (section 4).
fn factor_timing(
    r: &mut Report,
    dev: &KernelDevice<DriverVendor>,
    run: &Run,
    n: usize,
) -> Result<(), String> {
    let de = |e: flexinfer_quant::device::DeviceError| e.to_string();
    let ft = check::time_factor(dev, n, n.min(2048), 7, n <= 4096).map_err(de)?;
    let flops = (n as f64).powi(3) / 3.0;
    let rate = |s: f64| flops / s / 1e9;
    if let Some(b) = ft.backward_error.filter(|b| *b > 1.0) {
        r.check(
            Check {
                name: run.name(&format!("factor n={n}")),
                passed: false,
                worst: b,
                detail: format!("backward error {b:.3} over its bound"),
            },
            ft.device_seconds,
        );
    }
    r.timing(run.tag(json!({
        "timing": "factor", "n": n,
        "device_seconds": ft.device_seconds, "device_gflops": rate(ft.device_seconds),
        "cpu_seconds": ft.cpu_seconds, "cpu_gflops": rate(ft.cpu_seconds),
        "backward_error": ft.backward_error,
    })));
    Ok(())
}
