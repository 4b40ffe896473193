//! The GPU solve session (`device::kernel::KernelOps` over a `Vendor`) without a GPU: the vendor here is the
//! host build of `kernels/gptq.cu` (`kernels/host_harness.c`), launched by entry name with the driver APIs'
//! `kernelParams` convention, so the session's buffers, argument lists, launch geometry and orchestration are
//! the ones a card gets; only the runtime underneath differs. Every device address the session passes is
//! checked against the live allocations (a reset frees them all), so a stale or out-of-range buffer is an
//! error here, not memory corruption.
//!
//! Checked: the whole input-group solve against the CPU session (bounds below), device faults (reset,
//! restore, retry; give up → CPU fallback), the memory budget (a group that does not fit runs on the CPU
//! with an event).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

#[path = "../examples/gpu_check/artifact.rs"]
#[allow(dead_code)]
mod artifact;
mod host_kernels;
#[path = "../examples/gpu_check/whole.rs"]
mod whole;

use faer::Mat;
use flexinfer_contract::error::chain;
use flexinfer_contract::events as names;
use flexinfer_quant::device::driver::{MathError, MathLibraries};
use flexinfer_quant::device::kernel::{
    Arg, DevPtr, Gemm, GemmOp, Kernel, KernelDevice, Launch, MathLibs, Syrk, Vendor,
};
use flexinfer_quant::device::{
    check, solve_with_fallback, DevResult, Device, DeviceError, DeviceKind, SolveSpec,
};
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::gptq::{Method, QuantizedLinear};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::{ColumnOrder, GptqParams, RecoveryParams};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// What the host vendor did, shared with the test.
#[derive(Default)]
struct Log {
    launches: usize,
    resets: usize,
    /// Launch numbers (1-based, over the vendor's life) that fail.
    fail_launches: Vec<usize>,
    /// Every launch from this number on fails (a card that stays broken).
    fail_from: Option<usize>,
    kernels: BTreeMap<&'static str, usize>,
    /// The kernel of every launch, in order.
    sequence: Vec<Kernel>,
    /// The device bytes the session held (as it asked for them) at each launch of a module's sweep.
    sweep_live_bytes: Vec<u64>,
    /// After every launch of this kernel, its output is corrupted (`corrupt`): a vendor whose kernel is
    /// wrong, for the checks of `device::check` to catch.
    corrupt: Option<Kernel>,
    /// The "vendor libraries" this host vendor offers (`ssyrk`, `sgemm`, `spotrf` computed here by
    /// straightforward loops), as cuBLAS/cuSOLVER or rocBLAS/rocSOLVER would on a card.
    math: MathLibs,
    /// Library calls by name.
    math_calls: BTreeMap<&'static str, usize>,
    /// The first call of this library routine fails (once), as a library returning an error status.
    fail_math_once: Option<&'static str>,
    /// `sgemm` adds 1 to its first output: a library that runs but answers wrongly.
    wrong_sgemm: bool,
    /// Allocations of a size in `(lo, hi]` bytes fail (a card out of memory for buffers of that size).
    fail_alloc_sizes: Option<(usize, usize)>,
}

/// Corrupts what `kernel` just wrote: the second entry of the Hessian or the factor (below the diagonal)
/// times 1.01, or the block's first code with its bit 2 flipped (4 steps away).
fn corrupt(kernel: Kernel, args: &[Arg]) {
    let ptr = |i: usize| match args[i] {
        Arg::Ptr(p) => p,
        _ => panic!("argument {i} of {} is not a pointer", kernel.entry()),
    };
    // SAFETY: the launch just succeeded with these buffers, each a live host allocation that holds the
    // entries touched here (the Hessian and factor are n × n with n ≥ 2; the codes block is rows × count).
    unsafe {
        match kernel {
            Kernel::HessianLower | Kernel::FactorScale => *(ptr(0) as *mut f32).add(1) *= 1.01,
            Kernel::SweepBlock => *(ptr(6) as *mut u8) ^= 4,
            other => panic!("no corruption for {}", other.entry()),
        }
    }
}

/// The host "device": allocations are host buffers (8-byte aligned); after a failed launch every call fails
/// until a reset, as a HIP context after a kernel fault; a reset frees every allocation.
struct HostVendor {
    /// Real library code for `math()` and its calls: the engine's loader and FFI calls into the C stand-ins
    /// of tests/vendor_stub/stub.c (instead of this file's loops).
    lib: Option<MathLibraries>,
    allocs: BTreeMap<u64, Vec<u64>>,
    /// The bytes asked for, per live allocation.
    asked: BTreeMap<u64, u64>,
    poisoned: bool,
    log: Arc<Mutex<Log>>,
    total: Option<u64>,
}

impl HostVendor {
    fn new(log: Arc<Mutex<Log>>) -> Self {
        HostVendor {
            lib: None,
            allocs: BTreeMap::new(),
            asked: BTreeMap::new(),
            poisoned: false,
            log,
            total: None,
        }
    }
    fn err(op: &str, msg: impl Into<String>) -> DeviceError {
        DeviceError::new("host", op, msg)
    }
    /// The allocation holding `[p, p + len)`.
    fn check(&self, op: &str, p: DevPtr, len: usize) -> DevResult<()> {
        let (base, buf) = self
            .allocs
            .range(..=p)
            .next_back()
            .ok_or_else(|| Self::err(op, format!("{p:#x} is not an allocation")))?;
        if p + len as u64 > base + (buf.len() * 8) as u64 {
            return Err(Self::err(
                op,
                format!("{p:#x}+{len} is outside its allocation"),
            ));
        }
        Ok(())
    }
    fn live(&self, op: &str) -> DevResult<()> {
        if self.poisoned {
            Err(Self::err(op, "context poisoned by an earlier fault"))
        } else {
            Ok(())
        }
    }
}

impl Vendor for HostVendor {
    fn name(&self) -> String {
        "host".into()
    }
    fn alloc(&mut self, bytes: usize) -> DevResult<DevPtr> {
        self.live("alloc")?;
        if let Some((lo, hi)) = self.log.lock().unwrap().fail_alloc_sizes {
            if bytes > lo && bytes <= hi {
                return Err(Self::err(
                    "alloc",
                    format!("out of memory for {bytes} bytes"),
                ));
            }
        }
        let buf = vec![0u64; bytes.div_ceil(8)];
        let p = buf.as_ptr() as u64;
        self.allocs.insert(p, buf);
        self.asked.insert(p, bytes as u64);
        Ok(p)
    }
    fn free(&mut self, ptr: DevPtr) {
        self.allocs.remove(&ptr);
        self.asked.remove(&ptr);
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> DevResult<()> {
        self.live("upload")?;
        self.check("upload", dst, src.len())?;
        // SAFETY: `[dst, dst + len)` lies in a live allocation (checked above).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn download(&mut self, src: DevPtr, dst: &mut [u8]) -> DevResult<()> {
        self.live("download")?;
        self.check("download", src, dst.len())?;
        // SAFETY: as in upload.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> DevResult<()> {
        self.live("copy")?;
        self.check("copy", dst, bytes)?;
        self.check("copy", src, bytes)?;
        // SAFETY: both ranges lie in live allocations; the session never copies a buffer onto itself.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn launch(&mut self, launch: Launch, args: &[Arg]) -> DevResult<()> {
        let kernel = launch.kernel;
        self.live("launch")?;
        let n = {
            let mut log = self.log.lock().unwrap();
            log.launches += 1;
            *log.kernels.entry(kernel.entry()).or_default() += 1;
            log.sequence.push(kernel);
            let sweep = [
                Kernel::BlockSnapshot,
                Kernel::GroupParams,
                Kernel::SweepBlock,
                Kernel::BlockUpdate,
                Kernel::GatherPanel,
            ];
            if sweep.contains(&kernel) {
                log.sweep_live_bytes.push(self.asked.values().sum());
            }
            let n = log.launches;
            if log.fail_launches.contains(&n) || log.fail_from.is_some_and(|f| n >= f) {
                drop(log);
                self.poisoned = true;
                return Err(Self::err(
                    "launch",
                    format!("injected fault in launch {n} ({})", kernel.entry()),
                ));
            }
            n
        };
        for a in args {
            if let Arg::Ptr(p) = a {
                self.check("launch", *p, 0)
                    .map_err(|e| Self::err("launch", format!("launch {n}: {}", e.message)))?;
            }
        }
        // SAFETY: the harness unpacks the arguments with the kernel's C signature; every pointer argument lies
        // in a live allocation (checked above) and the session sizes the buffers for the launch it makes.
        let rc = unsafe { host_kernels::launch(launch, args) };
        if rc != 0 {
            return Err(Self::err(
                "launch",
                format!("{} returned {rc}", kernel.entry()),
            ));
        }
        if self.log.lock().unwrap().corrupt == Some(kernel) {
            corrupt(kernel, args);
        }
        Ok(())
    }
    fn reset(&mut self) -> DevResult<()> {
        self.log.lock().unwrap().resets += 1;
        self.allocs.clear();
        self.asked.clear();
        self.poisoned = false;
        Ok(())
    }
    fn memory(&mut self) -> Option<(u64, u64)> {
        self.total.map(|t| (t, t))
    }
    fn math(&self) -> MathLibs {
        match &self.lib {
            Some(l) => l.libs(),
            None => self.log.lock().unwrap().math,
        }
    }
    fn syrk_lower(&mut self, op: &Syrk) -> DevResult<()> {
        self.math_call("ssyrk")?;
        let (n, k) = (op.n, op.k);
        self.check("ssyrk", op.c, (op.ldc * (n - 1) + n) * 4)?;
        self.check("ssyrk", op.a, (op.lda * (n - 1) + k) * 4)?;
        if let Some(l) = self.lib.as_mut() {
            // SAFETY: host "device" buffers checked above; the stand-in computes on them in place.
            return unsafe { l.syrk(op) }.map_err(|e| Self::err("ssyrk", chain(&e)));
        }
        let (a, c) = (op.a as *const f32, op.c as *mut f32);
        // SAFETY: both ranges were checked against live allocations just above.
        unsafe {
            for j in 0..n {
                for i in j..n {
                    let mut s = 0f32;
                    for t in 0..k {
                        s += *a.add(t + i * op.lda) * *a.add(t + j * op.lda);
                    }
                    *c.add(i + j * op.ldc) += op.alpha * s;
                }
            }
        }
        Ok(())
    }
    fn gemm_acc(&mut self, op: &Gemm) -> DevResult<()> {
        self.math_call("sgemm")?;
        self.check("sgemm", op.a, (op.lda * (op.k - 1) + op.m) * 4)?;
        self.check("sgemm", op.b, (op.ldb * (op.n - 1) + op.k) * 4)?;
        self.check("sgemm", op.c, (op.ldc * (op.n - 1) + op.m) * 4)?;
        if let Some(l) = self.lib.as_mut() {
            // SAFETY: as in syrk_lower.
            return unsafe { l.gemm(op) }.map_err(|e| Self::err("sgemm", chain(&e)));
        }
        let (a, b, c) = (op.a as *const f32, op.b as *const f32, op.c as *mut f32);
        // SAFETY: the three ranges were checked against live allocations just above.
        unsafe {
            for j in 0..op.n {
                for i in 0..op.m {
                    let mut s = 0f32;
                    for u in 0..op.k {
                        s += *a.add(i + u * op.lda) * *b.add(u + j * op.ldb);
                    }
                    *c.add(i + j * op.ldc) += s;
                }
            }
            if self.log.lock().unwrap().wrong_sgemm {
                *c += 1.0;
            }
        }
        Ok(())
    }
    fn gemm(&mut self, op: &GemmOp) -> DevResult<()> {
        self.math_call(if op.batch > 1 {
            "sgemm batched"
        } else {
            "sgemm"
        })?;
        for i in 0..op.batch {
            let p = op.single(i);
            let (brows, bcols) = if op.b_trans {
                (op.n, op.k)
            } else {
                (op.k, op.n)
            };
            if op.m == 0 || op.n == 0 {
                continue;
            }
            if op.k > 0 {
                self.check("sgemm", p.a, (p.lda * (op.k - 1) + op.m) * 4)?;
                self.check("sgemm", p.b, (p.ldb * (bcols - 1) + brows) * 4)?;
            }
            self.check("sgemm", p.c, (p.ldc * (op.n - 1) + op.m) * 4)?;
        }
        if let Some(l) = self.lib.as_mut() {
            // SAFETY: as in syrk_lower.
            return unsafe { l.gemm_op(op) }.map_err(|e| Self::err("sgemm", chain(&e)));
        }
        for i in 0..op.batch {
            let p = op.single(i);
            let (a, b, c) = (p.a as *const f32, p.b as *const f32, p.c as *mut f32);
            // SAFETY: every product's ranges were checked against live allocations above.
            unsafe {
                for j in 0..op.n {
                    for r in 0..op.m {
                        let mut s = 0f32;
                        for u in 0..op.k {
                            let bv = if op.b_trans {
                                *b.add(j + u * p.ldb)
                            } else {
                                *b.add(u + j * p.ldb)
                            };
                            s += *a.add(r + u * p.lda) * bv;
                        }
                        let out = c.add(r + j * p.ldc);
                        *out = if op.accumulate { *out + s } else { s };
                    }
                }
            }
        }
        Ok(())
    }
    fn potrf_lower(&mut self, a: DevPtr, lda: usize, n: usize, info: DevPtr) -> DevResult<()> {
        self.math_call("spotrf")?;
        self.check("spotrf", a, (lda * (n - 1) + n) * 4)?;
        self.check("spotrf", info, 4)?;
        if let Some(mut l) = self.lib.take() {
            // SAFETY: as in syrk_lower; the workspace is a live allocation of the floats asked for.
            let math = |e: MathError| Self::err("spotrf", chain(&e));
            let r = unsafe { l.potrf_workspace(a, lda, n) }
                .map_err(math)
                .and_then(|need| {
                    let w = self
                        .alloc(need * 4)
                        .map_err(|e| Self::err("spotrf", e.message))?;
                    let r = unsafe { l.potrf(a, lda, n, info, (w, need)) }.map_err(math);
                    self.free(w);
                    r
                });
            self.lib = Some(l);
            return r;
        }
        let (a, info) = (a as *mut f32, info as *mut i32);
        // SAFETY: checked above; the unblocked Cholesky of LAPACK's reference, lower, stopping at the first
        // pivot that is not positive (info = j + 1).
        unsafe {
            let at = |i: usize, j: usize| a.add(i + j * lda);
            for j in 0..n {
                let mut d = *at(j, j);
                for k in 0..j {
                    d -= *at(j, k) * *at(j, k);
                }
                if !(d > 0.0 && d.is_finite()) {
                    *at(j, j) = d;
                    *info = j as i32 + 1;
                    return Ok(());
                }
                let d = d.sqrt();
                *at(j, j) = d;
                for i in j + 1..n {
                    let mut s = *at(i, j);
                    for k in 0..j {
                        s -= *at(i, k) * *at(j, k);
                    }
                    *at(i, j) = s / d;
                }
            }
            *info = 0;
        }
        Ok(())
    }
}

impl HostVendor {
    /// A library call: counted as a launch (so injected faults reach it), and failing once where the test
    /// says so.
    fn math_call(&mut self, name: &'static str) -> DevResult<()> {
        self.live(name)?;
        let mut log = self.log.lock().unwrap();
        log.launches += 1;
        *log.math_calls.entry(name).or_default() += 1;
        let n = log.launches;
        if log.fail_math_once == Some(name) {
            log.fail_math_once = None;
            return Err(Self::err(name, format!("{name} returned status 13")));
        }
        if log.fail_launches.contains(&n) || log.fail_from.is_some_and(|f| n >= f) {
            drop(log);
            self.poisoned = true;
            return Err(Self::err(
                name,
                format!("injected fault in launch {n} ({name})"),
            ));
        }
        Ok(())
    }
}

mod support;
use support::{batches, random};

#[derive(Clone)]
struct Case {
    name: &'static str,
    rows: usize,
    cols: usize,
    tokens: usize,
    params: GptqParams,
    recovery: RecoveryParams,
}

fn cases() -> Vec<Case> {
    let p = check::params;
    let rp = RecoveryParams::default();
    vec![
        Case {
            name: "g32 asym, 3 blocks of 32",
            rows: 40,
            cols: 96,
            tokens: 300,
            params: p(4, 32, false, false, false, 32),
            recovery: rp.clone(),
        },
        Case {
            name: "per-row sym act-order, n=130 (ragged block)",
            rows: 33,
            cols: 130,
            tokens: 200,
            params: p(4, -1, true, true, false, 128),
            recovery: rp.clone(),
        },
        Case {
            name: "g64 3-bit static groups act-order, groups wider than blocks",
            rows: 20,
            cols: 128,
            tokens: 300,
            params: p(3, 64, false, true, true, 32),
            recovery: rp.clone(),
        },
        Case {
            name: "g64 over blocks of 32 (snapshot wider than the block)",
            rows: 24,
            cols: 128,
            tokens: 300,
            params: p(8, 64, true, false, false, 32),
            recovery: rp.clone(),
        },
        Case {
            // Block [32, 64) starts the group 48..96, which reaches past the block's end and past the
            // group size: its snapshot must cover columns 32..96.
            name: "g48 over blocks of 32 (a group that the block size does not divide)",
            rows: 24,
            cols: 96,
            tokens: 300,
            params: p(4, 48, false, false, false, 32),
            recovery: rp.clone(),
        },
        Case {
            name: "fewer tokens than features, no damp: the floor recovers",
            rows: 24,
            cols: 96,
            tokens: 40,
            params: p(4, 32, false, false, false, 32),
            recovery: RecoveryParams {
                damp_percent: 0.0,
                damp_auto_increment: 0.0,
                ..rp.clone()
            },
        },
        Case {
            name: "nothing succeeds: RTN",
            rows: 24,
            cols: 64,
            tokens: 10,
            params: p(4, 32, false, false, false, 128),
            recovery: RecoveryParams {
                damp_percent: 0.0,
                damp_auto_increment: 0.0,
                max_floor_attempts: 0,
                ..rp.clone()
            },
        },
        Case {
            // Group-aware order: each group's parameters are found on the device into its original slot.
            name: "g32 asym group-aware, 3 groups over blocks of 32",
            rows: 40,
            cols: 96,
            tokens: 300,
            params: GptqParams {
                act_group_aware: true,
                ..p(4, 32, false, false, false, 32)
            },
            recovery: rp.clone(),
        },
        Case {
            name: "g48 3-bit group-aware over blocks of 32",
            rows: 24,
            cols: 96,
            tokens: 300,
            params: GptqParams {
                act_group_aware: true,
                ..p(3, 48, true, false, false, 32)
            },
            recovery: rp,
        },
    ]
}

fn weights(c: &Case, seed: u64) -> Vec<Mat<f32>> {
    (0..2)
        .map(|k| random(c.rows + k, c.cols, seed + k as u64) * faer::Scale(0.05))
        .collect()
}

fn solve(
    dev: &dyn Device,
    c: &Case,
    xs: &[Mat<f32>],
    ws: &[Mat<f32>],
    sink: &MemorySink,
) -> Vec<QuantizedLinear> {
    let mut s = dev.open(c.cols).unwrap();
    for x in xs {
        s.accumulate(x.as_ref(), 2.0 / c.tokens as f32).unwrap();
    }
    let refs: Vec<&Mat<f32>> = ws.iter().collect();
    let spec = SolveSpec {
        params: &c.params,
        recovery: &c.recovery,
        module: "m",
        events: sink,
    };
    solve_with_fallback(&dev.describe(), s.as_mut(), &refs, &spec).unwrap()
}

fn host_device(log: &Arc<Mutex<Log>>, budget: Option<u64>) -> KernelDevice<HostVendor> {
    KernelDevice::new(HostVendor::new(Arc::clone(log)), DeviceKind::Cuda, budget)
}

/// The device result is the CPU's up to the summation order of the Hessian, factor and block-update GEMMs:
/// `device::check::compare` states the bounds (the same the card check applies), and the zero-points too.
fn assert_close(case: &str, dev: &[QuantizedLinear], cpu: &[QuantizedLinear]) {
    let c = check::compare(case, dev, cpu);
    assert!(c.passed, "{c}");
    for (k, (d, c)) in dev.iter().zip(cpu).enumerate() {
        let zeros_moved = d.zeros.iter().zip(&c.zeros).filter(|(a, b)| a != b).count();
        assert!(
            zeros_moved * 100 <= d.zeros.len().max(100),
            "{case}: module {k}: {zeros_moved} zeros differ"
        );
    }
}

/// The vendor libraries a host device offers in the solve comparisons: none (the kernels do everything),
/// and BLAS and solver (`ssyrk`, `spotrf` and `sgemm` replace the Hessian, factorisation and block-update
/// kernels).
const MATH: [MathLibs; 2] = [
    MathLibs {
        blas: false,
        solver: false,
    },
    MathLibs {
        blas: true,
        solver: true,
    },
];

fn host_device_with(
    log: &Arc<Mutex<Log>>,
    budget: Option<u64>,
    math: MathLibs,
) -> KernelDevice<HostVendor> {
    log.lock().unwrap().math = math;
    host_device(log, budget)
}

#[test]
fn the_kernel_session_solves_like_the_cpu_session() {
    for math in MATH {
        solves_like_the_cpu_session(math);
    }
}

fn solves_like_the_cpu_session(math: MathLibs) {
    for (i, c) in cases().iter().enumerate() {
        let xs = batches(c.tokens, c.cols, 10 + i as u64);
        let ws = weights(c, 100 + 10 * i as u64);
        let cpu_sink = MemorySink::default();
        let cpu = solve(&CpuBackend::default(), c, &xs, &ws, &cpu_sink);
        let log = Arc::new(Mutex::new(Log::default()));
        let dev = host_device_with(&log, None, math);
        let dev_sink = MemorySink::default();
        let got = solve(&dev, c, &xs, &ws, &dev_sink);
        let name = format!("{} ({math:?})", c.name);
        assert_close(&name, &got, &cpu);
        // The same recovery path, attempt by attempt.
        assert_eq!(
            dev_sink.named(names::HESSIAN_RECOVERY),
            cpu_sink.named(names::HESSIAN_RECOVERY),
            "{}: recovery events",
            c.name
        );
        assert!(dev_sink.named(names::GPTQ_DEVICE_ERROR).is_empty());
        assert!(dev_sink.named(names::GPTQ_DEVICE_FALLBACK).is_empty());
        let log = log.lock().unwrap();
        // Every kernel ran that this configuration uses, and no other: the RTN case never sweeps, the
        // snapshot kernels run only where the sweep finds group parameters (not one group per row, not
        // static groups), and the vendor's libraries replace the Hessian, panel and block-update kernels.
        let replaced_by = |k: &Kernel| match k {
            Kernel::HessianLower | Kernel::BlockUpdate => Some(math.blas),
            Kernel::GatherPanel => Some(!math.blas),
            Kernel::CholPanelDiag | Kernel::CholPanelRows | Kernel::CholTrailing => {
                Some(math.solver)
            }
            Kernel::FactorPivots => Some(!math.solver),
            _ => None,
        };
        let factor = [
            Kernel::HessianLower,
            Kernel::MirrorLower,
            Kernel::PrepareRows,
            Kernel::PermuteSym,
            Kernel::FactorFill,
            Kernel::CholPanelDiag,
            Kernel::CholPanelRows,
            Kernel::CholTrailing,
            Kernel::FactorPivots,
            Kernel::FactorScale,
        ];
        let found_in_sweep = c.params.group_size > 0 && !c.params.static_groups;
        let swept = got[0].method != Method::Rtn;
        let expected: Vec<Kernel> = if swept {
            Kernel::SOLVE
                .into_iter()
                .filter(|k| {
                    found_in_sweep || !matches!(k, Kernel::BlockSnapshot | Kernel::GroupParams)
                })
                .collect()
        } else {
            factor.to_vec()
        };
        // The permutation runs on the device only for act-order or group-aware order.
        let permuted = c.params.column_order(c.cols) != ColumnOrder::Plain;
        let expected: Vec<Kernel> = expected
            .into_iter()
            .filter(|k| permuted || *k != Kernel::PermuteSym)
            .collect();
        for k in Kernel::ALL {
            let used = expected.contains(&k) && replaced_by(&k) != Some(true);
            assert_eq!(
                log.kernels.contains_key(k.entry()),
                used,
                "{name}: {} launched: {:?}",
                k.entry(),
                log.kernels
            );
        }
        let calls = |f: &str| log.math_calls.get(f).copied().unwrap_or(0);
        assert_eq!(
            calls("ssyrk") > 0,
            math.blas,
            "{name}: {:?}",
            log.math_calls
        );
        assert_eq!(calls("spotrf") > 0, math.solver, "{name}");
        assert_eq!(calls("sgemm") > 0, math.blas && swept, "{name}");
        if !found_in_sweep {
            for k in [Kernel::BlockSnapshot, Kernel::GroupParams] {
                assert!(
                    !log.kernels.contains_key(k.entry()),
                    "{name}: {} launched without groups to find",
                    k.entry()
                );
            }
        }
        // The memory budget's estimate covers what the sweep of the widest module holds on the device.
        let widest = ws.iter().map(|w| w.nrows()).max().unwrap();
        let budget = flexinfer_quant::device::kernel::group_bytes(c.cols)
            + flexinfer_quant::device::kernel::sweep_bytes(widest, c.cols, &c.params, math.blas);
        let held = log.sweep_live_bytes.iter().copied().max().unwrap_or(0);
        assert!(
            held <= budget,
            "{name}: the sweep held {held} device bytes, the budget check counts {budget}"
        );
        println!(
            "{name}: {} launches {:?} {:?}; sweep held {held} of {budget} bytes counted",
            log.launches, log.kernels, log.math_calls
        );
    }
}

#[test]
fn a_device_fault_resets_restores_and_retries_and_a_broken_card_falls_back_to_the_cpu() {
    let c = &cases()[0];
    let xs = batches(c.tokens, c.cols, 10);
    let ws = weights(c, 100);
    // The fault-free run, and how many launches it makes.
    let log = Arc::new(Mutex::new(Log::default()));
    let clean = solve(
        &host_device(&log, None),
        c,
        &xs,
        &ws,
        &MemorySink::default(),
    );
    let (total, in_factor) = {
        let l = log.lock().unwrap();
        // The first launch (1-based) of a panel's rows below its diagonal block: inside the factorisation.
        let at = l.sequence.iter().position(|&k| k == Kernel::CholPanelRows);
        (
            l.launches,
            at.expect("the factorisation has several panels") + 1,
        )
    };
    assert!(
        total > in_factor + 10,
        "the sweep launches kernels after the factorisation"
    );

    // One fault in the factorisation and one in the second module's sweep: two resets, the same bytes.
    let log = Arc::new(Mutex::new(Log {
        fail_launches: vec![in_factor, total - 3],
        ..Default::default()
    }));
    let sink = MemorySink::default();
    let got = solve(&host_device(&log, None), c, &xs, &ws, &sink);
    assert_eq!(got, clean, "a retried solve gives the fault-free result");
    assert_eq!(log.lock().unwrap().resets, 2);
    let errs = sink.named(names::GPTQ_DEVICE_ERROR);
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert_eq!(errs[0]["op"], "factor");
    assert_eq!(errs[1]["op"], "sweep");
    assert!(errs[0]["error"]
        .as_str()
        .unwrap()
        .contains("injected fault"));
    assert!(sink.named(names::GPTQ_DEVICE_FALLBACK).is_empty());

    // A card that stays broken after the Hessian is prepared: MAX_DEVICE_RESETS resets, then the group is
    // solved on the CPU from the host checkpoint, with an event.
    // Launches 1–3 accumulate the three batches, 4 mirrors the Hessian and 5 prepares it; from 6 on (the
    // factorisation) every launch fails.
    let log = Arc::new(Mutex::new(Log {
        fail_from: Some(6),
        ..Default::default()
    }));
    let sink = MemorySink::default();
    let got = solve(&host_device(&log, None), c, &xs, &ws, &sink);
    let fb = sink.named(names::GPTQ_DEVICE_FALLBACK);
    assert_eq!(fb.len(), 1, "{fb:?}");
    assert_eq!(fb[0]["to"], "cpu");
    assert_eq!(
        log.lock().unwrap().resets,
        flexinfer_quant::device::MAX_DEVICE_RESETS
    );
    let cpu = solve(&CpuBackend::default(), c, &xs, &ws, &MemorySink::default());
    assert_close("fallback", &got, &cpu);
}

/// The preparation on the device (`gptq_prepare_rows`, `gptq_permute_sym`) against the CPU's
/// `prepare_hessian`: activations with a feature that is always zero (a dead column) and a NaN and an
/// infinity in two others (whole Hessian rows and columns of non-finite entries, replaced by 0, which makes
/// those columns dead too), with and without act-order. The same codes within the solve bounds and the same
/// recovery events (the count of replaced entries among them); and the prepared Hessian (the checkpoint)
/// itself, entry by entry, with the same dead columns and permutation.
#[test]
fn the_device_prepares_non_finite_entries_dead_columns_and_act_order_like_the_cpu() {
    // 90 inputs: faer pads the columns of a 90 × 90 matrix, so the checkpoint takes the padded download path.
    for (desc_act, cols) in [(false, 96), (true, 96), (true, 90)] {
        let c = Case {
            name: "prepare",
            rows: 24,
            cols,
            tokens: 300,
            params: GptqParams {
                bits: 4,
                group_size: 32,
                sym: false,
                desc_act,
                static_groups: false,
                block_size: 32,
                ..GptqParams::default()
            },
            recovery: RecoveryParams::default(),
        };
        let mut xs = batches(c.tokens, c.cols, 77);
        for x in xs.iter_mut() {
            for t in 0..x.nrows() {
                x[(t, 3)] = 0.0;
            }
        }
        xs[0][(5, 7)] = f32::NAN;
        xs[1][(2, 40)] = f32::INFINITY;
        let ws = weights(&c, 300);
        let cpu_sink = MemorySink::default();
        let cpu = solve(&CpuBackend::default(), &c, &xs, &ws, &cpu_sink);
        for math in MATH {
            let log = Arc::new(Mutex::new(Log::default()));
            let dev_sink = MemorySink::default();
            let got = solve(&host_device_with(&log, None, math), &c, &xs, &ws, &dev_sink);
            let name = format!("desc_act {desc_act}, n = {cols} ({math:?})");
            assert_close(&name, &got, &cpu);
            let rec = dev_sink.named(names::HESSIAN_RECOVERY);
            assert_eq!(rec, cpu_sink.named(names::HESSIAN_RECOVERY), "{name}");
            assert!(
                rec.iter().any(|e| e["sanitized"].as_u64().unwrap_or(0) > 0),
                "{name}: the non-finite entries were reported: {rec:?}"
            );
            let l = log.lock().unwrap();
            assert_eq!(
                l.kernels.get(Kernel::PrepareRows.entry()),
                Some(&1),
                "{name}"
            );
            assert_eq!(
                l.kernels.contains_key(Kernel::PermuteSym.entry()),
                desc_act,
                "{name}"
            );
        }
        // The prepared Hessian itself (the checkpoint a reset restores and the CPU fallback solves; the
        // factorisation takes its diagonal from the host, so the solves above do not see H's diagonal):
        // against the CPU's `prepare_hessian` of the CPU's Hessian, the same dead columns and permutation,
        // exactly 0 where a non-finite entry was and exactly 1 on a dead column's diagonal, the rest within
        // the accumulation's rounding.
        use flexinfer_quant::device::DeviceOps;
        use flexinfer_quant::linalg::LinalgBackend;
        let alpha = 2.0 / c.tokens as f32;
        let cpu_backend = CpuBackend::default();
        let mut h = Mat::<f32>::zeros(c.cols, c.cols);
        for x in &xs {
            cpu_backend.accumulate_hessian(h.as_mut(), x.as_ref(), alpha);
        }
        cpu_backend.finish_hessian(h.as_mut());
        let want = flexinfer_quant::hessian::prepare_hessian(
            h,
            desc_act,
            "m",
            &flexinfer_quant::events::NullSink,
        );
        let log = Arc::new(Mutex::new(Log::default()));
        let dev = host_device_with(&log, None, MATH[0]);
        let mut ops = dev.ops(c.cols).unwrap();
        for x in &xs {
            ops.accumulate(x.as_ref(), alpha).unwrap();
        }
        let meta = ops.prepare(desc_act.into()).unwrap();
        let got = ops.checkpoint().unwrap();
        assert_eq!(meta.dead, want.dead, "desc_act {desc_act}: dead columns");
        assert_eq!(meta.perm, want.perm, "desc_act {desc_act}: permutation");
        assert!(meta.sanitized > 0, "desc_act {desc_act}");
        let scale = (0..c.cols)
            .map(|i| want.h[(i, i)].abs())
            .fold(0f32, f32::max);
        let original = |i: usize| want.perm.as_ref().map_or(i, |p| p[i]);
        for j in 0..c.cols {
            for i in 0..c.cols {
                let (g, w) = (got[(i, j)], want.h[(i, j)]);
                let exact = w == 0.0 || (i == j && want.dead[original(i)]);
                assert!(
                    g.is_finite()
                        && if exact {
                            g == w
                        } else {
                            (g - w).abs() <= 1e-5 * scale
                        },
                    "desc_act {desc_act}: prepared H[{i}, {j}] device {g} vs CPU {w}"
                );
            }
        }
        let diag: Vec<f32> = (0..c.cols).map(|i| got[(i, i)]).collect();
        assert_eq!(meta.diag, diag, "desc_act {desc_act}: the diagonal");
    }
}

/// A vendor library that returns an error: a device error (reset, retry), and that library is not called
/// again; the kernels do its work, and the result is what they give.
#[test]
fn a_failing_vendor_library_is_switched_off_and_the_kernels_take_over() {
    let c = &cases()[0];
    let xs = batches(c.tokens, c.cols, 10);
    let ws = weights(c, 100);
    let run = |math: MathLibs, fail: Option<&'static str>| {
        let log = Arc::new(Mutex::new(Log {
            fail_math_once: fail,
            ..Default::default()
        }));
        let dev = host_device_with(&log, None, math);
        let sink = MemorySink::default();
        let got = solve(&dev, c, &xs, &ws, &sink);
        // A second group on the same device: it sees what the first left switched off.
        let again = solve(&dev, c, &xs, &ws, &MemorySink::default());
        let l = log.lock().unwrap();
        (got, again, sink, l.math_calls.clone(), l.resets)
    };
    let both = MATH[1];
    // The solver fails once: the factorisation is retried on the kernels, from the same Hessian (ssyrk's).
    let (got, again, sink, calls, resets) = run(both, Some("spotrf"));
    let blas_only = MathLibs {
        blas: true,
        solver: false,
    };
    let (expected, ..) = run(blas_only, None);
    assert_eq!(
        got, expected,
        "the kernels' factorisation after the solver failed"
    );
    assert_eq!(
        again, expected,
        "the next group does not call the solver either"
    );
    assert_eq!(resets, 1);
    assert_eq!(calls.get("spotrf"), Some(&1), "{calls:?}");
    let errs = sink.named(names::GPTQ_DEVICE_ERROR);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0]["op"], "factor");
    let text = errs[0]["error"].as_str().unwrap();
    assert!(
        text.contains("spotrf returned status 13")
            && text.contains("solver library is not used again"),
        "{text}"
    );
    assert!(sink.named(names::GPTQ_DEVICE_FALLBACK).is_empty());

    // The BLAS fails in the first block update: the sweep is retried with the block-update kernel, and
    // the next group accumulates its Hessian with the Hessian kernel.
    let (got, again, sink, calls, _) = run(both, Some("sgemm"));
    let cpu = solve(&CpuBackend::default(), c, &xs, &ws, &MemorySink::default());
    assert_close("after sgemm failed", &got, &cpu);
    let solver_only = MathLibs {
        blas: false,
        solver: true,
    };
    let (expected, ..) = run(solver_only, None);
    assert_eq!(again, expected, "the next group runs without the BLAS");
    assert_eq!(calls.get("sgemm"), Some(&1), "{calls:?}");
    assert_eq!(
        calls.get("ssyrk"),
        Some(&3),
        "the first group's three batches only"
    );
    let errs = sink.named(names::GPTQ_DEVICE_ERROR);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0]["op"], "sweep");
}

/// The self-test a device runs on the vendor libraries when it opens (`kernel::math_self_test`): right
/// libraries pass; one that errors or answers wrongly fails, naming the routine and what it gave.
#[test]
fn the_vendor_library_self_test_passes_right_libraries_and_catches_wrong_ones() {
    use flexinfer_quant::device::kernel::math_self_test;
    let vendor = |log: Log| {
        let log = Arc::new(Mutex::new(Log {
            math: MATH[1],
            ..log
        }));
        (HostVendor::new(Arc::clone(&log)), log)
    };
    let (mut v, log) = vendor(Log::default());
    let t = math_self_test(&mut v);
    assert!(t.blas.is_ok() && t.solver.is_ok(), "{t:?}");
    let calls = log.lock().unwrap().math_calls.clone();
    assert_eq!(
        (calls.get("ssyrk"), calls.get("sgemm"), calls.get("spotrf")),
        (Some(&1), Some(&1), Some(&2)),
        "{calls:?}"
    );
    assert!(v.allocs.is_empty(), "the test's buffers are freed");
    // Nothing to test without libraries.
    let (mut none, log) = vendor(Log::default());
    log.lock().unwrap().math = MATH[0];
    let t = math_self_test(&mut none);
    assert!(t.blas.is_ok() && t.solver.is_ok() && log.lock().unwrap().math_calls.is_empty());

    let (mut v, _) = vendor(Log {
        wrong_sgemm: true,
        ..Default::default()
    });
    let t = math_self_test(&mut v);
    let e = t
        .blas
        .as_ref()
        .map_err(|e| flexinfer_contract::error::chain(&e))
        .unwrap_err();
    assert!(e.contains("sgemm [20.0, 43.0, 22.0, 50.0]"), "{e}");
    assert!(t.solver.is_ok(), "{t:?}");
    let (mut v, _) = vendor(Log {
        fail_math_once: Some("spotrf"),
        ..Default::default()
    });
    let t = math_self_test(&mut v);
    assert!(t.blas.is_ok());
    assert!(
        t.solver
            .as_ref()
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err()
            .contains("spotrf returned status 13"),
        "{t:?}"
    );
}

/// The engine's loader and FFI calls (src/device/driver/math.rs) against C libraries with the vendors'
/// entry points and prototypes (tests/vendor_stub/stub.c, which rejects wrong enum values, handles, leading
/// dimensions and cuSOLVER workspaces with the libraries' error statuses): for each runtime's names, the
/// libraries load, pass the self-test, and carry whole-group solves that meet the bounds against the CPU.
/// The stand-in is named to the loader as the `FLEXINFER_CUBLAS` family's override would name it.
#[test]
fn the_session_drives_the_vendor_libraries_through_their_c_interfaces() {
    use flexinfer_quant::device::kernel::math_self_test;
    let so = host_kernels::build_shared(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vendor_stub/stub.c"),
        "vendor_stub",
    );
    let overrides = |var: &str| {
        var.starts_with("FLEXINFER_")
            .then(|| so.display().to_string())
    };
    // SAFETY: the stand-in library built just above; `stub_calls` is `int stub_calls(int, int)`.
    let stub = unsafe { libloading::Library::new(&so) }.unwrap();
    let stub_calls = |api: i32, call: i32| -> i32 {
        // SAFETY: as above.
        unsafe {
            let f: libloading::Symbol<unsafe extern "C" fn(i32, i32) -> i32> =
                stub.get(b"stub_calls\0").unwrap();
            f(api, call)
        }
    };
    for (api, kind) in [(0, DeviceKind::Cuda), (1, DeviceKind::Hip)] {
        let lib = MathLibraries::load_from(kind, &overrides);
        assert_eq!(lib.libs(), MATH[1], "{kind:?}: {:?}", lib.missing);
        assert!(lib.describe().contains("vendor_stub"), "{}", lib.describe());
        let log = Arc::new(Mutex::new(Log::default()));
        let mut v = HostVendor::new(Arc::clone(&log));
        v.lib = Some(lib);
        let t = math_self_test(&mut v);
        assert!(t.blas.is_ok() && t.solver.is_ok(), "{kind:?}: {t:?}");
        let dev = KernelDevice::new(v, kind, None);
        for (i, c) in cases().iter().enumerate().take(6) {
            let xs = batches(c.tokens, c.cols, 10 + i as u64);
            let ws = weights(c, 100 + 10 * i as u64);
            let cpu = solve(&CpuBackend::default(), c, &xs, &ws, &MemorySink::default());
            let sink = MemorySink::default();
            let got = solve(&dev, c, &xs, &ws, &sink);
            assert_close(&format!("{} ({kind:?} stand-ins)", c.name), &got, &cpu);
            assert!(
                sink.named(names::GPTQ_DEVICE_ERROR).is_empty(),
                "{:?}",
                sink.named(names::GPTQ_DEVICE_ERROR)
            );
        }
        let kernels = log.lock().unwrap().kernels.clone();
        for k in [
            Kernel::HessianLower,
            Kernel::CholPanelDiag,
            Kernel::BlockUpdate,
        ] {
            assert!(!kernels.contains_key(k.entry()), "{kind:?}: {kernels:?}");
        }
        // create, sgemm, ssyrk, (cuSOLVER) bufferSize, potrf: each reached the library.
        let (create, sgemm, ssyrk, size, potrf) = (
            stub_calls(api, 0),
            stub_calls(api, 2),
            stub_calls(api, 3),
            stub_calls(api, 4),
            stub_calls(api, 5),
        );
        println!(
            "{kind:?}: create {create} sgemm {sgemm} ssyrk {ssyrk} bufferSize {size} potrf {potrf}"
        );
        assert!(
            create >= 1 && sgemm > 10 && ssyrk > 10 && potrf > 6,
            "{kind:?}"
        );
        assert_eq!(size > 0, api == 0, "only cuSOLVER asks for a workspace");
        // The forward's products through the libraries' sgemm (B transposed) and strided-batched sgemm.
        let tmp = tempfile::tempdir().unwrap();
        flexinfer_quant::testkit::write_model(tmp.path(), "LlamaForCausalLM", 4).unwrap();
        let (on_device, _) = forward_against_cpu(&dev, tmp.path(), &format!("{kind:?} stand-ins"));
        assert!(on_device > 0);
        assert!(
            stub_calls(api, 6) > 0,
            "{kind:?}: the strided-batched sgemm was not called"
        );
        drop(dev);
    }
}

#[test]
fn a_group_over_the_memory_budget_runs_on_the_cpu_with_an_event() {
    let c = &cases()[1];
    let xs = batches(c.tokens, c.cols, 11);
    let ws = weights(c, 110);
    let cpu_sink = MemorySink::default();
    let cpu = solve(&CpuBackend::default(), c, &xs, &ws, &cpu_sink);
    let need = flexinfer_quant::device::kernel::group_bytes(c.cols);
    // Just under what the Hessian and the factor need.
    let log = Arc::new(Mutex::new(Log::default()));
    let dev = host_device(&log, Some(need - 1));
    let sink = MemorySink::default();
    let got = solve(&dev, c, &xs, &ws, &sink);
    assert_eq!(got, cpu, "the CPU's own result");
    assert_eq!(log.lock().unwrap().launches, 0, "nothing ran on the device");
    let fb = sink.named(names::GPTQ_DEVICE_FALLBACK);
    assert_eq!(fb.len(), 1);
    assert!(
        fb[0]["error"].as_str().unwrap().contains("over the budget"),
        "{fb:?}"
    );
    // The weights are checked too: a budget that holds the Hessian and the factor but not the sweep's
    // buffers gives device errors and the CPU fallback from the checkpoint.
    let log = Arc::new(Mutex::new(Log::default()));
    let dev = host_device(&log, Some(need + 1024));
    let sink = MemorySink::default();
    let got = solve(&dev, c, &xs, &ws, &sink);
    let fb = sink.named(names::GPTQ_DEVICE_FALLBACK);
    assert_eq!(fb.len(), 1, "{fb:?}");
    assert!(
        fb[0]["error"].as_str().unwrap().contains("module needs"),
        "{fb:?}"
    );
    assert_close("sweep over budget", &got, &cpu);
    // With room for all of it, the device solves.
    let dev = host_device(&log, Some(need * 4));
    let sink = MemorySink::default();
    solve(&dev, c, &xs, &ws, &sink);
    assert!(sink.named(names::GPTQ_DEVICE_FALLBACK).is_empty());
}

/// The card checks of `scripts/gpu-check.sh` (`device::check`) on the host build of the kernels: they pass,
/// and each fails when the kernel it covers is wrong.
#[test]
fn the_card_checks_pass_on_correct_kernels_and_fail_on_a_corrupted_one() {
    let dev_with = |corrupt: Option<Kernel>| {
        let log = Arc::new(Mutex::new(Log {
            corrupt,
            ..Default::default()
        }));
        host_device(&log, None)
    };
    let dev = dev_with(None);
    let [h, f] = check::hessian_and_factor(&dev, 48, 120, 1).unwrap();
    assert!(h.passed, "{h}");
    assert!(f.passed, "{f}");
    println!("{h}\n{f}");
    for (i, case) in check::cases(48, 16).iter().enumerate() {
        let s = check::solve_case(&dev, case, 3 + i as u64).unwrap();
        let c = s.compare(&case.name);
        assert!(c.passed, "{c}");
        println!("{c}");
    }
    let ft = check::time_factor(&dev, 40, 80, 7, true).unwrap();
    let b = ft.backward_error.unwrap();
    assert!(b <= 1.0, "the timed factor's backward error {b}");

    let [h, f] =
        check::hessian_and_factor(&dev_with(Some(Kernel::HessianLower)), 48, 120, 1).unwrap();
    assert!(!h.passed, "a corrupted Hessian kernel passed: {h}");
    assert!(h.worst > 10.0, "{h}");
    // The factor of the corrupted (still symmetric positive definite) Hessian is itself right.
    assert!(f.passed, "{f}");
    let [h, f] =
        check::hessian_and_factor(&dev_with(Some(Kernel::FactorScale)), 48, 120, 1).unwrap();
    assert!(h.passed, "{h}");
    assert!(!f.passed, "a corrupted factor passed: {f}");
    let case = &check::cases(48, 16)[0];
    let s = check::solve_case(&dev_with(Some(Kernel::SweepBlock)), case, 3).unwrap();
    let c = s.compare(&case.name);
    assert!(!c.passed, "corrupted codes passed: {c}");
}

/// The clipping search is the CPU sweep's: a kernel session hands the group to the CPU after preparing the
/// Hessian (one `gptq_device_fallback` event naming the reason) and the result is the CPU session's.
#[test]
fn the_clipping_search_goes_to_the_cpu_with_an_event() {
    let c = Case {
        params: GptqParams {
            bits: 2,
            clip_search: true,
            act_group_aware: true,
            ..cases()[0].params.clone()
        },
        ..cases()[0].clone()
    };
    let xs = batches(c.tokens, c.cols, 31);
    let ws = weights(&c, 310);
    let cpu = solve(&CpuBackend::default(), &c, &xs, &ws, &MemorySink::default());
    let log = Arc::new(Mutex::new(Log::default()));
    let dev = host_device(&log, None);
    let sink = MemorySink::default();
    let spec = SolveSpec {
        params: &c.params,
        recovery: &c.recovery,
        module: "m",
        events: &sink,
    };
    let mut s = dev.open(c.cols).unwrap();
    for x in &xs {
        s.accumulate(x.as_ref(), 2.0 / c.tokens as f32).unwrap();
    }
    let refs: Vec<&Mat<f32>> = ws.iter().collect();
    let got = solve_with_fallback("host", s.as_mut(), &refs, &spec).unwrap();
    let fb = sink.named(names::GPTQ_DEVICE_FALLBACK);
    assert_eq!(fb.len(), 1, "{fb:?}");
    let error = fb[0].get("error").and_then(|e| e.as_str()).unwrap_or("");
    assert!(error.contains("clipping search"), "{:?}", fb[0]);
    assert_close("clipping search on the CPU", &got, &cpu);
    assert!(!log
        .lock()
        .unwrap()
        .kernels
        .contains_key(Kernel::SweepBlock.entry()));
}

/// A session that keeps every batch it is handed: it takes no resident activations, so the device forward
/// downloads each batch for it, and the test sees exactly what a Hessian would be built from.
#[derive(Default)]
struct Recorder {
    batches: Vec<Mat<f32>>,
}

impl flexinfer_quant::device::Session for Recorder {
    fn accumulate(&mut self, x: faer::MatRef<'_, f32>, _alpha: f32) -> DevResult<()> {
        self.batches.push(x.to_owned());
        Ok(())
    }
    fn solve(
        &mut self,
        _weights: &[&Mat<f32>],
        _spec: &SolveSpec<'_>,
    ) -> DevResult<Vec<QuantizedLinear>> {
        Err(DeviceError::new(
            "recorder",
            "solve",
            "a recorder does not solve",
        ))
    }
    fn fallback_hessian(&mut self) -> Option<flexinfer_quant::hessian::PreparedHessian> {
        None
    }
}

/// Rows of `parts` stacked (the samples of a batch, in order).
fn stack(parts: &[Mat<f32>]) -> Mat<f32> {
    let rows: usize = parts.iter().map(Mat::nrows).sum();
    let cols = parts.first().map_or(0, Mat::ncols);
    let mut out = Mat::<f32>::zeros(rows, cols);
    let mut r0 = 0;
    for p in parts {
        out.as_mut().subrows_mut(r0, p.nrows()).copy_from(p);
        r0 += p.nrows();
    }
    out
}

/// `|device − cpu| ≤ 1e-4 · max|cpu|` entry by entry: f32 sums in another order (the GEMMs, the norms), never
/// a different formula; a wrong mask, rope, norm or layout is off by the values' own size.
fn assert_forward_close(what: &str, dev: &Mat<f32>, cpu: &Mat<f32>) {
    assert_eq!(
        (dev.nrows(), dev.ncols()),
        (cpu.nrows(), cpu.ncols()),
        "{what}: shape"
    );
    let mut scale = 0f32;
    let mut err = 0f32;
    for j in 0..cpu.ncols() {
        for i in 0..cpu.nrows() {
            scale = scale.max(cpu[(i, j)].abs());
            let d = (dev[(i, j)] - cpu[(i, j)]).abs();
            assert!(
                d.is_finite(),
                "{what}: ({i}, {j}) = {} vs {}",
                dev[(i, j)],
                cpu[(i, j)]
            );
            err = err.max(d);
        }
    }
    assert!(
        err <= 1e-4 * scale.max(1e-6),
        "{what}: max abs err {err:e} > 1e-4 × {scale}"
    );
}

/// The device forward (the host build of its kernels, with the host vendor's BLAS and with the own kernels)
/// against the CPU forward on every oracle family (tests/fixtures/oracle): three samples of different lengths in
/// two batches, attention in chunks of 4 queries, each stage's module-group input (Qkv, O, GateUp, Down) and
/// the layer output, from the same input on both sides. A layer the device forward does not run (MoE,
/// gated delta-net, gated attention) is named by `layer_unsupported` and goes through the CPU, with the
/// activations downloaded and uploaded again. Every odd layer is moved by `advance` from the layer input
/// (a cached layer's path), every even one through the stages and `advance` from the residual after attention.
/// The own kernels (no vendor BLAS: every product by `gptq_block_update`, slow on host threads) run three
/// families that between them use every forward kernel; the vendor path runs all.
#[test]
fn the_device_forward_runs_each_family_like_the_cpu_forward() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle");
    let mut fams: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(fams.len() >= 10, "{fams:?}");
    // Dense Llama and Qwen2 (attention biases) from the test kit: no oracle fixture has them.
    let tmp = tempfile::tempdir().unwrap();
    let generated: Vec<(String, std::path::PathBuf)> =
        [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]
            .iter()
            .map(|(fam, arch)| {
                let d = tmp.path().join(fam);
                flexinfer_quant::testkit::write_model(&d, arch, 3).unwrap();
                (fam.to_string(), d)
            })
            .collect();
    fams.extend(generated.iter().map(|(f, _)| f.clone()));
    fams.sort();
    let (mut on_device, mut on_cpu) = (0, 0);
    for math in MATH {
        let mut used: BTreeMap<&str, usize> = BTreeMap::new();
        let own = ["gemma2", "gemma4_text", "qwen2"];
        for fam in fams
            .iter()
            .filter(|f| math.blas || own.contains(&f.as_str()))
        {
            let dir = match generated.iter().find(|(f, _)| f == fam) {
                Some((_, d)) => d.clone(),
                None => root.join(fam),
            };
            let log = Arc::new(Mutex::new(Log::default()));
            let dev = host_device_with(&log, None, math);
            let device_layers = on_device;
            let (d, c) = forward_against_cpu(&dev, &dir, &format!("{fam} ({math:?})"));
            on_device += d;
            on_cpu += c;
            let l = log.lock().unwrap();
            used.extend(l.kernels.iter().map(|(k, v)| (*k, *v)));
            assert_eq!(
                l.math_calls.contains_key("sgemm batched"),
                math.blas && on_device > device_layers,
                "{fam}: {:?}",
                l.math_calls
            );
        }
        for k in Kernel::FORWARD {
            assert!(
                used.contains_key(k.entry()),
                "{math:?}: {} never ran: {used:?}",
                k.entry()
            );
        }
    }
    println!("device layers {on_device}, CPU layers {on_cpu}");
    assert!(
        on_device > 20 && on_cpu > 4,
        "device {on_device}, cpu {on_cpu}"
    );
}

/// A whole quantize run (the job, as a Job runs it) on the host device with the calibration forward on the
/// device: the activations stay there (every batch accumulated where it is: no session is handed a host
/// copy) and the artifact meets the card check's whole-model comparison against the CPU run.
#[test]
fn a_whole_run_with_the_device_forward_matches_the_cpu_run() {
    let log = Arc::new(Mutex::new(Log::default()));
    let dev = host_device_with(&log, None, MATH[1]);
    let c = whole::whole_model(&dev, true, true);
    assert!(c.passed, "{c}");
    assert!(c.detail.starts_with("forward on the device"), "{c}");
    let l = log.lock().unwrap();
    for k in [Kernel::FwdRmsNorm, Kernel::FwdSoftmax, Kernel::FwdActMul] {
        assert!(
            l.kernels.contains_key(k.entry()),
            "{}: {:?}",
            k.entry(),
            l.kernels
        );
    }
}

/// The device forward of `dev` against the CPU forward on the model in `dir` (see
/// `the_device_forward_runs_each_family_like_the_cpu_forward`); returns the layers run on the device and on
/// the CPU.
fn forward_against_cpu<V: Vendor + Send>(
    dev: &KernelDevice<V>,
    dir: &std::path::Path,
    what: &str,
) -> (usize, usize) {
    forward_against_cpu_spilled(dev, dir, what, false)
}

/// [`forward_against_cpu`], with the activations spilled to host memory (`spill`).
fn forward_against_cpu_spilled<V: Vendor + Send>(
    dev: &KernelDevice<V>,
    dir: &std::path::Path,
    what: &str,
    spill: bool,
) -> (usize, usize) {
    use flexinfer_quant::device::kernel::forward::{layer_unsupported, ForwardPass};
    use flexinfer_quant::llama::{embed, layer_forward, Rope, Stage};
    use flexinfer_quant::model::{load_layer, ModelConfig};
    use flexinfer_quant::tensors::TensorStore;
    let (mut on_device, mut on_cpu) = (0, 0);
    let cfg = ModelConfig::load(dir).unwrap();
    let store = TensorStore::open_dir(dir).unwrap();
    let lens = [11usize, 16, 5];
    let rope = Rope::new(&cfg, 16);
    let mut host: Vec<Mat<f32>> = lens
        .iter()
        .enumerate()
        .map(|(s, &len)| {
            let toks: Vec<u32> = (0..len)
                .map(|i| ((i * 7 + s * 13 + 3) % cfg.vocab_size.min(200)) as u32)
                .collect();
            embed(&store, &cfg, None, &toks).unwrap()
        })
        .collect();
    let mut fwd = dev
        .forward_ops(cfg.hidden_size, 27)
        .unwrap()
        .with_query_chunk(4);
    fwd.set_spill(spill);
    fwd.upload(host.clone()).unwrap();
    for layer in 0..cfg.num_layers {
        let lw = load_layer(&store, &cfg, layer, None).unwrap();
        let name = format!("{what} layer {layer}");
        let cpu_out: Vec<Mat<f32>> = host
            .iter()
            .map(|x| layer_forward(&cfg, &lw, x.as_ref(), &rope, None))
            .collect();
        if layer_unsupported(&lw).is_some() || cfg.sparse_layer(layer).is_some() {
            assert!(
                lw.moe.is_some() || lw.gdn.is_some() || lw.attn.output_gate,
                "{name}: unsupported without a reason"
            );
            on_cpu += 1;
            host = cpu_out;
            fwd.download().unwrap();
            fwd.upload(host.clone()).unwrap();
            continue;
        }
        on_device += 1;
        if layer % 2 == 0 {
            for stage in [Stage::Qkv, Stage::O, Stage::GateUp, Stage::Down] {
                let mut rec = Recorder::default();
                fwd.stage(&cfg, &lw, &rope, stage, Some(&mut rec), 1.0)
                    .unwrap_or_else(|e| panic!("{name} {stage:?}: {e}"));
                assert_eq!(rec.batches.len(), 2, "{name} {stage:?}: batches");
                let got = stack(&rec.batches);
                let want = stack(
                    &host
                        .iter()
                        .map(|x| layer_forward(&cfg, &lw, x.as_ref(), &rope, Some(stage)))
                        .collect::<Vec<_>>(),
                );
                assert_forward_close(&format!("{name} {stage:?}"), &got, &want);
            }
            fwd.advance(&cfg, &lw, &rope, true).unwrap();
        } else {
            fwd.advance(&cfg, &lw, &rope, false).unwrap();
        }
        let got = fwd.download().unwrap();
        for (s, (g, w)) in got.iter().zip(&cpu_out).enumerate() {
            assert_forward_close(&format!("{name} output, sample {s}"), g, w);
        }
        // Both sides go on from the CPU's output.
        host = cpu_out;
        fwd.upload(host.clone()).unwrap();
    }
    (on_device, on_cpu)
}

/// A batch whose buffers do not fit runs again as smaller batches of whole samples, and the activations and
/// Hessian inputs are those of the CPU all the same; a single sample that does not fit is an error.
#[test]
fn a_forward_batch_out_of_device_memory_runs_again_smaller() {
    use flexinfer_quant::device::kernel::forward::ForwardPass;
    use flexinfer_quant::llama::{embed, layer_forward, Rope, Stage};
    use flexinfer_quant::model::{load_layer, ModelConfig};
    use flexinfer_quant::tensors::TensorStore;
    let tmp = tempfile::tempdir().unwrap();
    flexinfer_quant::testkit::write_model(tmp.path(), "LlamaForCausalLM", 6).unwrap();
    let cfg = ModelConfig::load(tmp.path()).unwrap();
    let store = TensorStore::open_dir(tmp.path()).unwrap();
    let rope = Rope::new(&cfg, 16);
    let host: Vec<Mat<f32>> = [11usize, 16, 5]
        .iter()
        .map(|&len| {
            let toks: Vec<u32> = (0..len).map(|i| (i % 20) as u32).collect();
            embed(&store, &cfg, None, &toks).unwrap()
        })
        .collect();
    let lw = load_layer(&store, &cfg, 0, None).unwrap();
    // The MLP's gate and up for 27 tokens (27 × intermediate × 4 bytes) do not fit; for 16 they do.
    let mlp = |rows: usize| rows * cfg.intermediate_size * 4;
    let log = Arc::new(Mutex::new(Log::default()));
    log.lock().unwrap().fail_alloc_sizes = Some((mlp(16), mlp(27)));
    let dev = host_device_with(&log, None, MATH[1]);
    let mut fwd = dev.forward_ops(cfg.hidden_size, 27).unwrap();
    fwd.upload(host.clone()).unwrap();
    let mut rec = Recorder::default();
    fwd.stage(&cfg, &lw, &rope, Stage::Down, Some(&mut rec), 1.0)
        .unwrap();
    assert_eq!(
        rec.batches.iter().map(Mat::nrows).collect::<Vec<_>>(),
        [11, 16, 5]
    );
    // (The Down stage reads the activations as they are: here the layer input, as the residual.)
    let want: Vec<Mat<f32>> = host
        .iter()
        .map(|x| flexinfer_quant::llama::mlp_activation(&cfg, &lw, x.as_ref()))
        .collect();
    assert_forward_close("Down after the retry", &stack(&rec.batches), &stack(&want));
    assert_eq!(fwd.times().smaller_batches, 1);
    assert_eq!(fwd.times().batch_tokens, 13);
    // The smaller size stays: the whole layer moves in batches of single samples, like the CPU.
    fwd.advance(&cfg, &lw, &rope, false).unwrap();
    assert_eq!(fwd.times().smaller_batches, 1);
    let got = fwd.download().unwrap();
    for (g, x) in got.iter().zip(&host) {
        assert_forward_close(
            "layer output",
            g,
            &layer_forward(&cfg, &lw, x.as_ref(), &rope, None),
        );
    }
    // One sample alone that does not fit: the error, nothing run again.
    let log = Arc::new(Mutex::new(Log::default()));
    log.lock().unwrap().fail_alloc_sizes = Some((mlp(10), mlp(11)));
    let dev = host_device_with(&log, None, MATH[1]);
    let mut fwd = dev.forward_ops(cfg.hidden_size, 11).unwrap();
    fwd.upload(host.clone()).unwrap();
    let e = fwd
        .stage(
            &cfg,
            &lw,
            &rope,
            Stage::Down,
            Some(&mut Recorder::default()),
            1.0,
        )
        .unwrap_err();
    assert_eq!(e.op, "alloc", "{e}");
    assert_eq!(fwd.times().smaller_batches, 0);
}

/// Activations that do not fit the device stay in host memory: each batch is uploaded for its stage and the
/// stages that change them bring them back; the values are the CPU's all the same, and the device never
/// holds more than a batch of them.
#[test]
fn spilled_activations_give_the_cpu_forward_batch_by_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle");
    flexinfer_quant::testkit::write_model(tmp.path(), "Qwen2ForCausalLM", 7).unwrap();
    for (name, dir) in [
        ("qwen2", tmp.path().to_path_buf()),
        ("gemma4_text", root.join("gemma4_text")),
    ] {
        let log = Arc::new(Mutex::new(Log::default()));
        let dev = host_device_with(&log, None, MATH[1]);
        let (on_device, _) =
            forward_against_cpu_spilled(&dev, &dir, &format!("{name} spilled"), true);
        assert!(on_device > 0, "{name}");
    }
    // The device's largest allocation is a batch's, not all samples' (27 of 32 rows here): no allocation
    // of the whole 32 × hidden activations.
    let log = Arc::new(Mutex::new(Log::default()));
    let cfg = flexinfer_quant::model::ModelConfig::load(tmp.path()).unwrap();
    let whole = 32 * cfg.hidden_size * 4;
    log.lock().unwrap().fail_alloc_sizes = Some((whole - 1, whole));
    let dev = host_device_with(&log, None, MATH[1]);
    forward_against_cpu_spilled(
        &dev,
        tmp.path(),
        "qwen2 spilled, no whole-activation buffer",
        true,
    );
}
