//! The GPU check of `scripts/gpu-check.sh` (not a test; needs a card). On the first usable device (HIP, then
//! CUDA; `--device` picks one):
//! 1. the kernel checks of `flexinfer_quant::device::check` (Hessian, factorisation; stated bounds there);
//! 2. whole input-group solves against the CPU session (`check::cases`, `check::compare`);
//! 3. a full GPTQ of a generated Llama-shaped model on the device and on the CPU, the two artifacts compared
//!    code by code and scale by scale (the same bounds as 2);
//! 4. timings: one factorisation at n = 4096, 11008 and 21504 on the device, on the CPU and with the
//!    vendor's solver (cuSOLVER `potrf`, loaded at run time from `FLEXINFER_CUSOLVER` or `libcusolver.so.*`,
//!    when there is one), and the whole solve of a 4096 × 11008 module (2048 tokens, g128) against the CPU.
//!
//! Usage: `gpu_check [--device auto|cuda|hip] [--quick] [--sizes 4096,11008,21504] [--json FILE]`. `--quick`
//! uses small sizes (a smoke run). Exit status: 0 all checks passed, 1 a check failed, 3 no usable GPU.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a tool: a panic is the failure report

use faer::Mat;
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::device::check::{self, Check};
use flexinfer_quant::device::driver::DriverVendor;
use flexinfer_quant::device::kernel::{KernelDevice, Vendor};
use flexinfer_quant::device::{Device, DeviceKind, Platform, SystemPlatform};
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::{GateParams, GptqParams};
use flexinfer_quant::pipeline::{run, QuantizeJob};
use flexinfer_quant::testkit::{self, ModelSize};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

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

struct Report {
    checks: Vec<Check>,
    records: Vec<Value>,
}

impl Report {
    fn check(&mut self, c: Check, seconds: f64) {
        println!("{c} [{seconds:.1}s]");
        self.records.push(json!({"check": c.name, "passed": c.passed, "worst": c.worst, "detail": c.detail, "seconds": seconds}));
        self.checks.push(c);
    }
    fn timing(&mut self, v: Value) {
        println!("time {v}");
        self.records.push(v);
    }
}

fn main() {
    let o = opts();
    let t0 = Instant::now();
    let dev = open(&o.device);
    println!(
        "device: {} (budget {:?} MiB)",
        dev.describe(),
        dev.budget().map(|b| b >> 20)
    );
    let mut report = Report {
        checks: Vec::new(),
        records: Vec::new(),
    };
    let (n, tokens, rows) = if o.quick {
        (96, 200, 24)
    } else {
        (1024, 2048, 512)
    };

    let t = Instant::now();
    let [h, f] =
        check::hessian_and_factor(&dev, n, tokens, 1).expect("device error in the kernel checks");
    let s = t.elapsed().as_secs_f64();
    report.check(h, s);
    report.check(f, s);

    for (i, case) in check::cases(n, rows).iter().enumerate() {
        let solved = check::solve_case(&dev, case, 10 + i as u64).expect("device error in a solve");
        let c = check::compare(&case.name, &solved.device, &solved.cpu);
        report.check(c, solved.device_seconds + solved.cpu_seconds);
    }

    let t = Instant::now();
    let c = whole_model(&dev, o.quick);
    report.check(c, t.elapsed().as_secs_f64());

    let sizes = if o.quick {
        vec![128, 200]
    } else {
        o.sizes.clone()
    };
    let cusolver = cusolver::Solver::load();
    if let Err(e) = &cusolver {
        println!("vendor solver: none ({e})");
    }
    for &n in &sizes {
        let ft = check::time_factor(&dev, n, n.min(2048), 7, n <= 4096)
            .expect("device error in a timing");
        let vendor = match (&cusolver, dev.kind()) {
            (Ok(s), DeviceKind::Cuda) => Some(
                dev.with_vendor(|v| s.potrf_seconds(v, &ft.hessian, &ft.diag))
                    .expect("device lock"),
            ),
            _ => None,
        };
        let flops = (n as f64).powi(3) / 3.0;
        let rate = |s: f64| flops / s / 1e9;
        if let Some(b) = ft.backward_error.filter(|b| *b > 1.0) {
            report.check(
                Check {
                    name: format!("factor n={n}"),
                    passed: false,
                    worst: b,
                    detail: format!("backward error {b:.3} over its bound"),
                },
                ft.device_seconds,
            );
        }
        let vendor_json = match &vendor {
            Some(Ok(s)) => json!({"seconds": s, "gflops": rate(*s)}),
            Some(Err(e)) => json!({"error": e}),
            None => Value::Null,
        };
        report.timing(json!({
            "timing": "factor", "n": n,
            "device_seconds": ft.device_seconds, "device_gflops": rate(ft.device_seconds),
            "cpu_seconds": ft.cpu_seconds, "cpu_gflops": rate(ft.cpu_seconds),
            "vendor_potrf": vendor_json, "backward_error": ft.backward_error,
        }));
    }

    let module = if o.quick {
        (48, 160, 256)
    } else {
        (4096, 11008, 2048)
    };
    let case = check::Case {
        name: format!("module {} x {}", module.0, module.1),
        rows: vec![module.0],
        n: module.1,
        tokens: module.2,
        params: GptqParams::default(),
        recovery: Default::default(),
    };
    let solved = check::solve_case(&dev, &case, 99).expect("device error in the module solve");
    report.check(
        check::compare(&case.name, &solved.device, &solved.cpu),
        solved.device_seconds + solved.cpu_seconds,
    );
    report.timing(json!({
        "timing": "module solve", "rows": module.0, "n": module.1, "tokens": module.2,
        "device_seconds": solved.device_seconds, "cpu_seconds": solved.cpu_seconds,
        "speedup": solved.cpu_seconds / solved.device_seconds,
    }));

    let failed = report.checks.iter().filter(|c| !c.passed).count();
    println!(
        "{} checks, {failed} failed, {:.0}s",
        report.checks.len(),
        t0.elapsed().as_secs_f64()
    );
    if let Some(path) = &o.json {
        let doc = json!({"device": dev.describe(), "records": report.records});
        std::fs::write(path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    }
    std::process::exit(i32::from(failed > 0));
}

/// Quantizes a generated model on `dev` and on the CPU and compares the artifacts (module docs, 3).
fn whole_model(dev: &dyn Device, quick: bool) -> Check {
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
    testkit::write_model_sized(&model, "llama", 5, &size).unwrap();
    let ds = tmp.path().join("calib.jsonl");
    testkit::write_dataset(&ds, 64).unwrap();
    let quantize = |d: &dyn Device, out: &Path| {
        let job = QuantizeJob {
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
                    max_samples: 64,
                    max_seq_len: 64,
                },
                "gpu_check",
            )
        };
        run(&job, d, &MemorySink::default())
            .unwrap_or_else(|e| panic!("quantize on {}: {e}", d.describe()))
    };
    let (a, b) = (tmp.path().join("device"), tmp.path().join("cpu"));
    quantize(dev, &a);
    quantize(&CpuBackend::default(), &b);
    let (da, db) = (artifact::modules(&a), artifact::modules(&b));
    check::compare(
        &format!("whole model hidden={} layers={}", size.hidden, size.layers),
        &da,
        &db,
    )
}

/// The quantized modules of an artifact, read back as `QuantizedLinear`s (codes and scales) for
/// [`check::compare`].
mod artifact {
    use flexinfer_quant::gptq::{Method, QuantizedLinear};
    use flexinfer_quant::pack::unpack_qweight;
    use safetensors::SafeTensors;
    use std::collections::BTreeMap;
    use std::path::Path;

    pub fn modules(dir: &Path) -> Vec<QuantizedLinear> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        let bytes: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
        let mut tensors = BTreeMap::new();
        for b in &bytes {
            let st = SafeTensors::deserialize(b).unwrap();
            for (name, view) in st.tensors() {
                tensors.insert(name, (view.shape().to_vec(), view.data().to_vec()));
            }
        }
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let bits = config["quantization_config"]["bits"].as_u64().unwrap_or(4) as u32;
        let mut out = Vec::new();
        for (name, (shape, data)) in &tensors {
            let Some(prefix) = name.strip_suffix(".qweight") else {
                continue;
            };
            let rows = shape[1];
            let cols = shape[0] * 32 / bits as usize;
            let words: Vec<i32> = bytemuck_i32(data);
            let (sshape, sdata) = &tensors[&format!("{prefix}.scales")];
            let scales: Vec<f32> = sdata
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            assert_eq!(sshape[1], rows, "{prefix}.scales");
            out.push(QuantizedLinear {
                rows,
                cols,
                bits,
                sym: true,
                codes: unpack_qweight(&words, rows, cols, bits),
                scales,
                zeros: Vec::new(),
                g_idx: Vec::new(),
                method: Method::Gptq,
                loss: 0.0,
                damp: 0.0,
            });
        }
        out
    }

    fn bytemuck_i32(data: &[u8]) -> Vec<i32> {
        data.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// cuSOLVER's `potrf`, loaded at run time, on the device's own context and buffers.
mod cusolver {
    use super::{DriverVendor, Mat, Vendor};
    use libloading::Library;
    use std::ffi::{c_int, c_void};
    use std::time::Instant;

    type Handle = *mut c_void;
    type CreateFn = unsafe extern "C" fn(*mut Handle) -> c_int;
    type BufferSizeFn =
        unsafe extern "C" fn(Handle, c_int, c_int, *mut f32, c_int, *mut c_int) -> c_int;
    type PotrfFn = unsafe extern "C" fn(
        Handle,
        c_int,
        c_int,
        *mut f32,
        c_int,
        *mut f32,
        c_int,
        *mut c_int,
    ) -> c_int;
    type DestroyFn = unsafe extern "C" fn(Handle) -> c_int;
    /// `CUBLAS_FILL_MODE_LOWER`.
    const LOWER: c_int = 0;

    pub struct Solver {
        lib: Library,
    }

    impl Solver {
        pub fn load() -> Result<Solver, String> {
            let mut names: Vec<String> = std::env::var("FLEXINFER_CUSOLVER").into_iter().collect();
            names.extend(
                ["libcusolver.so.12", "libcusolver.so.11", "libcusolver.so"].map(String::from),
            );
            let mut errors = Vec::new();
            for n in &names {
                // SAFETY: loading the vendor's solver library runs its initialisers, as any application does.
                match unsafe { Library::new(n) } {
                    Ok(lib) => return Ok(Solver { lib }),
                    Err(e) => errors.push(e.to_string()),
                }
            }
            Err(errors.join("; "))
        }

        /// Seconds of one `cusolverDnSpotrf` (lower) of the attempt's matrix `A` (the reversed `h` with the
        /// diagonal `diag`, as the engine factors it), after one warm-up on a copy.
        pub fn potrf_seconds(
            &self,
            v: &mut DriverVendor,
            h: &Mat<f32>,
            diag: &[f32],
        ) -> Result<f64, String> {
            let n = h.nrows();
            let a: Vec<f32> = (0..n * n)
                .map(|k| {
                    let (i, j) = (k % n, k / n);
                    if i == j {
                        diag[n - 1 - j]
                    } else {
                        h[(n - 1 - i, n - 1 - j)]
                    }
                })
                .collect();
            let bytes: &[u8] = bytemuck::cast_slice(&a);
            let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
            let da = v.alloc(bytes.len()).map_err(e)?;
            let info = v.alloc(4).map_err(e)?;
            let result = self.run(v, da, info, bytes, n);
            v.free(da);
            v.free(info);
            result
        }

        fn run(
            &self,
            v: &mut DriverVendor,
            da: u64,
            info: u64,
            a: &[u8],
            n: usize,
        ) -> Result<f64, String> {
            let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
            // SAFETY: cuSOLVER's C API with its documented signatures; the buffers are device allocations of
            // the context that the vendor's last call made current on this thread.
            unsafe {
                let create = *self
                    .lib
                    .get::<CreateFn>(b"cusolverDnCreate\0")
                    .map_err(|e| e.to_string())?;
                let size = *self
                    .lib
                    .get::<BufferSizeFn>(b"cusolverDnSpotrf_bufferSize\0")
                    .map_err(|e| e.to_string())?;
                let potrf = *self
                    .lib
                    .get::<PotrfFn>(b"cusolverDnSpotrf\0")
                    .map_err(|e| e.to_string())?;
                let destroy = *self
                    .lib
                    .get::<DestroyFn>(b"cusolverDnDestroy\0")
                    .map_err(|e| e.to_string())?;
                v.upload(da, a).map_err(e)?;
                let mut h: Handle = std::ptr::null_mut();
                let rc = create(&mut h);
                if rc != 0 {
                    return Err(format!("cusolverDnCreate: status {rc}"));
                }
                let (ni, pa) = (n as c_int, da as usize as *mut f32);
                let mut lwork: c_int = 0;
                let rc = size(h, LOWER, ni, pa, ni, &mut lwork);
                if rc != 0 {
                    destroy(h);
                    return Err(format!("cusolverDnSpotrf_bufferSize: status {rc}"));
                }
                let work = v.alloc(lwork.max(1) as usize * 4).map_err(e)?;
                let mut times = Vec::new();
                let mut status = 0;
                for _ in 0..2 {
                    v.upload(da, a).map_err(e)?;
                    let t = Instant::now();
                    status = potrf(
                        h,
                        LOWER,
                        ni,
                        pa,
                        ni,
                        work as usize as *mut f32,
                        lwork,
                        info as usize as *mut c_int,
                    );
                    let mut dev_info = [0i32];
                    v.download(info, bytemuck::cast_slice_mut(&mut dev_info))
                        .map_err(e)?;
                    times.push(t.elapsed().as_secs_f64());
                    if status == 0 && dev_info[0] != 0 {
                        status = -dev_info[0];
                    }
                }
                v.free(work);
                destroy(h);
                if status != 0 {
                    return Err(format!("cusolverDnSpotrf: status {status}"));
                }
                Ok(times[1])
            }
        }
    }
}
