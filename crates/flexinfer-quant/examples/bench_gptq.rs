//! GPTQ solve benchmark (not a test). Measures this machine's faer GEMM and Cholesky rates, then the GPTQ
//! solve per module with 2048-token Hessians, and reports each time as a ratio to the lower bound
//! FLOPs ÷ measured rate. Usage: `bench_gptq [runs] [shapes...]` with shapes as `OUTxIN` (default: the three
//! Llama-7B shapes 4096x4096, 11008x4096, 4096x11008). `bench_gptq model [samples] [seq_len]` quantizes a
//! generated ~110M-parameter model end to end and reports wall time and peak RSS; `bench_gptq hybrid [samples]
//! [seq_len]` does the same for a generated Qwen3.5-MoE-hybrid-shaped model (8 layers, 6 linear attention and 2
//! full attention, 32 experts top 4 with a shared expert); `bench_gptq gemma4-moe [samples] [seq_len]` for a
//! generated Gemma-4-MoE-shaped model (8 layers, 32 experts top 4 beside a dense MLP). With
//! `BENCH_MEMORY_LIMIT_MIB=N` the last two quantize under an enforced memory limit (a cgroup; root).
//! `bench_gptq fp8 [runs] [samples] [seq_len]` writes the FP8 artifact (per-channel) and then the GPTQ 4-bit
//! g128 artifact of the same generated ~110M-parameter model, alternately `runs` times, each with its wall time
//! and peak RSS. `bench_gptq fp8-static [runs] [samples] [seq_len]` writes the FP8 artifact (per-channel) of the
//! same model with dynamic activation scales and then with static ones calibrated on `samples × seq_len` tokens
//! (`FP8_ACTIVATIONS=static`), alternately, each with its wall time and peak RSS.
//! `bench_gptq ct [runs] [samples] [seq_len]` does the same for the compressed-tensors
//! `pack-quantized` artifact (the GPTQ 4-bit g128 solve in compressed-tensors' container) beside the GPTQ one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat};
use flexinfer_quant::device::{DevResult, Device, DeviceKind, Session, SolveSpec};
use flexinfer_quant::events::NullSink;
use flexinfer_quant::gptq::{gptq_quantize_in, Workspace};
use flexinfer_quant::hessian::{prepare_factor, FactorOutcome};
use flexinfer_quant::linalg::{CpuBackend, LinalgBackend};
use flexinfer_quant::params::{GptqParams, RecoveryParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn random(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    Mat::from_fn(rows, cols, |_, _| rng.random_range(-1.0f32..1.0))
}

/// A `/proc/self/status` memory field (`VmHWM`, `VmRSS`) in MiB.
fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

fn rss_mib() -> f64 {
    status_mib("VmRSS:")
}

/// Whole-model run on a generated ~110M-parameter Llama-layout model.
fn bench_model(samples: usize, seq_len: usize) {
    use flexinfer_quant::testkit::{self, ModelSize};
    let size = ModelSize::SMALL_100M;
    let Ok(tmp) = tempfile::tempdir() else {
        panic!("tempdir")
    };
    let model = tmp.path().join("model");
    let t = Instant::now();
    testkit::write_model_sized(&model, "LlamaForCausalLM", 7, &size).expect("generate model");
    let ds = write_calibration(tmp.path(), samples, seq_len);
    println!(
        "generated {} parameters in {:.1} s; peak RSS so far {:.0} MiB",
        size.parameters(),
        t.elapsed().as_secs_f64(),
        peak_rss_mib()
    );
    let job = bench_job(&model, tmp.path(), &ds, samples, seq_len);
    let (o, secs, baseline) = measured_run(&job);
    let hd = size.hidden / size.heads;
    let layer_f32 = 4 * size.hidden * (hd * (2 * size.heads + 2 * size.kv_heads) + 3 * size.inter);
    let acts = 4 * samples * seq_len * size.hidden;
    let hess = 4 * (size.hidden * size.hidden * 2 + size.inter * size.inter * 2);
    let budget = 1.2 * (layer_f32 + acts + hess) as f64 / (1 << 20) as f64;
    let peak = peak_rss_mib();
    println!(
        "whole model: {samples} x {seq_len} tokens, {} layers: {secs:.1} s; artifact {} -> {} bytes; peak RSS {peak:.0} MiB, of which {baseline:.0} MiB resident before the run (binary, test data) and {:.0} MiB added by the run (issue target {budget:.0} MiB = 1.2 x (layer f32 + activations + Hessians))",
        size.layers, o.original_size_bytes, o.compressed_size_bytes, peak - baseline
    );
}

/// FP8 (per-channel) beside GPTQ 4-bit g128 on one generated ~110M-parameter model, alternated `runs` times:
/// wall time, peak RSS (the counter reset before each run) and the artifact's size.
fn bench_fp8_vs_gptq(runs: usize, samples: usize, seq_len: usize) {
    use flexinfer_quant::fp8::{write_fp8_artifact, Fp8Activations};
    use flexinfer_quant::testkit::{self, ModelSize};
    let size = ModelSize::SMALL_100M;
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    testkit::write_model_sized(&model, "LlamaForCausalLM", 7, &size).expect("generate model");
    testkit::write_byte_level_tokenizer(&model).expect("tokenizer");
    let ds = write_calibration(tmp.path(), samples, seq_len);
    println!("model: {} parameters (BF16)", size.parameters());
    for run in 1..=runs {
        let out = tmp.path().join("fp8");
        let _ = std::fs::remove_dir_all(&out);
        flexinfer_quant::memory::release_free_memory();
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let baseline = rss_mib();
        let t = Instant::now();
        let o = write_fp8_artifact(
            &fp8_job(&model, &out, Fp8Activations::Dynamic),
            &flexinfer_quant::events::NullSink,
        )
        .expect("fp8");
        let secs = t.elapsed().as_secs_f64();
        println!(
            "run {run} FP8 channel: {secs:.2} s; artifact {} -> {} bytes; peak RSS {:.0} MiB ({baseline:.0} MiB before the run)",
            o.original_size_bytes,
            o.compressed_size_bytes,
            peak_rss_mib()
        );
        let job = bench_job(&model, tmp.path(), &ds, samples, seq_len);
        let _ = std::fs::remove_dir_all(&job.out_dir);
        let (o, secs, baseline) = measured_run(&job);
        println!(
            "run {run} GPTQ w4 g128 ({samples} x {seq_len} tokens): {secs:.2} s; artifact {} -> {} bytes; peak RSS {:.0} MiB ({baseline:.0} MiB before the run)",
            o.original_size_bytes,
            o.compressed_size_bytes,
            peak_rss_mib()
        );
    }
}

/// The benchmarks' FP8 job (per-channel weight scales) of `model` into `out`.
fn fp8_job<'a>(
    model: &'a std::path::Path,
    out: &'a std::path::Path,
    activations: flexinfer_quant::fp8::Fp8Activations<'a>,
) -> flexinfer_quant::fp8::Fp8Job<'a> {
    flexinfer_quant::fp8::Fp8Job {
        model_dir: model,
        out_dir: out,
        strategy: flexinfer_quant::fp8::ScaleStrategy::Channel,
        activations,
        dynamic_exclusion: None,
        script_version: "bench",
        verify_save_sha256: true,
        max_shard_bytes: flexinfer_quant::job::DEFAULT_MAX_SHARD_BYTES,
    }
}

/// FP8 (per-channel) with dynamic activation scales beside static ones calibrated on `samples × seq_len` tokens,
/// on one generated ~110M-parameter model, alternated `runs` times: wall time and peak RSS (the counter reset
/// before each run).
fn bench_fp8_static(runs: usize, samples: usize, seq_len: usize) {
    use flexinfer_quant::calib::CalibSettings;
    use flexinfer_quant::fp8::{write_fp8_artifact, Fp8Activations};
    use flexinfer_quant::testkit::{self, ModelSize};
    let size = ModelSize::SMALL_100M;
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    testkit::write_model_sized(&model, "LlamaForCausalLM", 7, &size).expect("generate model");
    testkit::write_byte_level_tokenizer(&model).expect("tokenizer");
    let ds = write_calibration(tmp.path(), samples, seq_len);
    println!("model: {} parameters (BF16)", size.parameters());
    for run in 1..=runs {
        for label in ["dynamic", "static"] {
            let activations = if label == "static" {
                Fp8Activations::Static {
                    dataset: &ds,
                    calib: CalibSettings {
                        max_samples: samples,
                        max_seq_len: seq_len,
                    },
                }
            } else {
                Fp8Activations::Dynamic
            };
            let out = tmp.path().join("fp8");
            let _ = std::fs::remove_dir_all(&out);
            flexinfer_quant::memory::release_free_memory();
            let _ = std::fs::write("/proc/self/clear_refs", "5");
            let baseline = rss_mib();
            let t = Instant::now();
            let o = write_fp8_artifact(
                &fp8_job(&model, &out, activations),
                &flexinfer_quant::events::NullSink,
            )
            .expect("fp8");
            let secs = t.elapsed().as_secs_f64();
            let tokens = o.quality.as_ref().map_or(0, |q| q.calibration_tokens);
            println!(
                "run {run} FP8 channel, {label} activations ({tokens} calibration tokens): {secs:.2} s; artifact {} -> {} bytes; peak RSS {:.0} MiB ({baseline:.0} MiB before the run)",
                o.original_size_bytes,
                o.compressed_size_bytes,
                peak_rss_mib()
            );
        }
    }
}

fn bench_ct_vs_gptq(runs: usize, samples: usize, seq_len: usize) {
    use flexinfer_quant::job::Container;
    use flexinfer_quant::testkit::{self, ModelSize};
    let size = ModelSize::SMALL_100M;
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    testkit::write_model_sized(&model, "LlamaForCausalLM", 7, &size).expect("generate model");
    testkit::write_byte_level_tokenizer(&model).expect("tokenizer");
    let ds = write_calibration(tmp.path(), samples, seq_len);
    println!("model: {} parameters (BF16)", size.parameters());
    for run in 1..=runs {
        for (label, container) in [
            ("compressed-tensors w4 g128", Container::CompressedTensors),
            ("GPTQ w4 g128", Container::Gptq),
        ] {
            let job = flexinfer_quant::job::QuantizeJob {
                container,
                ..bench_job(&model, tmp.path(), &ds, samples, seq_len)
            };
            let _ = std::fs::remove_dir_all(&job.out_dir);
            let (o, secs, baseline) = measured_run(&job);
            println!(
                "run {run} {label} ({samples} x {seq_len} tokens): {secs:.2} s; artifact {} -> {} bytes; peak RSS {:.0} MiB ({baseline:.0} MiB before the run)",
                o.original_size_bytes,
                o.compressed_size_bytes,
                peak_rss_mib()
            );
        }
    }
}

/// One measured quantize run: returns the outcome, its wall seconds and the RSS resident before it.
/// The generator's freed memory is returned first, then the peak-RSS counter is reset so the peak
/// covers the run (Linux clear_refs, value 5); what is resident then is the baseline.
fn measured_run(
    job: &flexinfer_quant::job::QuantizeJob,
) -> (flexinfer_quant::job::Outcome, f64, f64) {
    use flexinfer_quant::job::run;
    flexinfer_quant::memory::release_free_memory();
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let baseline = rss_mib();
    let t = Instant::now();
    let sink = RssSink::start();
    let device = Timed::default();
    let o = run(job, &device, &sink).expect("quantize");
    sink.report();
    let secs = t.elapsed().as_secs_f64();
    device.report(secs);
    (o, secs, baseline)
}

/// The CPU backend with the time spent in its sessions counted: the Hessian accumulation and the solves are
/// what a GPU `Device` takes over; the rest of a run (the calibration forward through every layer, reading,
/// packing, writing) stays on the CPU whatever the device.
#[derive(Default)]
struct Timed {
    inner: CpuBackend,
    /// Nanoseconds in `open` + `accumulate`, and in `solve`.
    accumulate: AtomicU64,
    solve: AtomicU64,
}

impl Timed {
    fn add(counter: &AtomicU64, since: Instant) {
        let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(ns, Ordering::Relaxed);
    }
    fn report(&self, total: f64) {
        let s = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 / 1e9;
        let (a, v) = (s(&self.accumulate), s(&self.solve));
        let pct = |x: f64| 100.0 * x / total.max(1e-9);
        println!(
            "split of the {total:.1} s run: Hessian accumulation {a:.1} s ({:.0} %), solves {v:.1} s ({:.0} %), \
             everything else (calibration forward, reading, packing, writing) {:.1} s ({:.0} %)",
            pct(a),
            pct(v),
            total - a - v,
            pct(total - a - v)
        );
    }
}

impl Device for Timed {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn open(&self, n: usize) -> DevResult<Box<dyn Session + '_>> {
        let t = Instant::now();
        let inner = self.inner.open(n)?;
        Timed::add(&self.accumulate, t);
        Ok(Box::new(TimedSession { inner, dev: self }))
    }
}

struct TimedSession<'a> {
    inner: Box<dyn Session + 'a>,
    dev: &'a Timed,
}

impl Session for TimedSession<'_> {
    fn accumulate(&mut self, x: faer::MatRef<'_, f32>, alpha: f32) -> DevResult<()> {
        let t = Instant::now();
        let r = self.inner.accumulate(x, alpha);
        Timed::add(&self.dev.accumulate, t);
        r
    }
    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
    ) -> DevResult<Vec<flexinfer_quant::gptq::QuantizedLinear>> {
        let t = Instant::now();
        let r = self.inner.solve(weights, spec);
        Timed::add(&self.dev.solve, t);
        r
    }
    fn fallback_hessian(&mut self) -> Option<flexinfer_quant::hessian::PreparedHessian> {
        self.inner.fallback_hessian()
    }
}

/// Whole-model run on a generated Qwen3.5-MoE-shaped gated delta-net hybrid.
fn bench_hybrid(samples: usize, seq_len: usize) {
    use flexinfer_quant::testkit::{self, HybridSize};
    let size = HybridSize {
        hidden: 768,
        layers: 8,
        full_attention_interval: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        linear_k_heads: 8,
        linear_v_heads: 16,
        linear_k_dim: 64,
        linear_v_dim: 64,
        inter: 256,
        experts: 32,
        top_k: 4,
        vocab: 16384,
        multimodal: true,
    };
    // Per expert: the gate/up Hessian (hidden²) and the down Hessian (inter²), f32.
    let hessians = size.layers * size.experts * (size.hidden.pow(2) + size.inter.pow(2)) * 4;
    bench_generated(
        "hybrid",
        size.layers,
        hessians,
        |dir| testkit::write_hybrid_model(dir, &size, 7).expect("generate model"),
        samples,
        seq_len,
    );
}

/// Whole-model run on a generated Gemma-4-MoE-shaped model (8 layers, 2 of them global; a dense MLP
/// beside 32 routed experts top 4 in every layer; multimodal wrapper).
fn bench_gemma4_moe(samples: usize, seq_len: usize) {
    use flexinfer_quant::testkit::{self, Gemma4Options, Gemma4Size};
    let size = Gemma4Size {
        hidden: 768,
        inter: 1024,
        layers: 8,
        global_every: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        global_kv_heads: 1,
        global_head_dim: 256,
        experts: 32,
        moe_inter: 256,
        top_k: 4,
        vocab: 16384,
    };
    let opts = Gemma4Options {
        moe: true,
        multimodal: true,
    };
    let hessians = size.layers * size.experts * (size.hidden.pow(2) + size.moe_inter.pow(2)) * 4;
    bench_generated(
        "gemma4-moe",
        size.layers,
        hessians,
        |dir| testkit::write_gemma4_model_sized(dir, opts, &size, 7).expect("generate model"),
        samples,
        seq_len,
    );
}

/// Puts this process into a new cgroup-v1 memory group limited to `mib` (what the process allocates
/// from now on counts against it; going over it gets the process killed by the kernel's OOM killer).
/// Returns the group's directory, whose `memory.max_usage_in_bytes` is the peak under the limit.
fn enforce_memory_limit(mib: usize) -> std::path::PathBuf {
    let root = std::path::Path::new("/sys/fs/cgroup/memory");
    assert!(
        root.join("memory.limit_in_bytes").exists(),
        "BENCH_MEMORY_LIMIT_MIB needs the cgroup-v1 memory controller at {} (and root)",
        root.display()
    );
    let group = root.join(format!("flexinfer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&group).expect("create the memory cgroup");
    let bytes = (mib << 20).to_string();
    std::fs::write(group.join("memory.limit_in_bytes"), &bytes).expect("set memory.limit_in_bytes");
    // No swap on these machines; where there is, forbid it too so the limit is a real one.
    let _ = std::fs::write(group.join("memory.memsw.limit_in_bytes"), &bytes);
    let _ = std::fs::write(group.join("memory.swappiness"), "0");
    std::fs::write(group.join("cgroup.procs"), std::process::id().to_string())
        .expect("join the memory cgroup");
    group
}

/// Generates a model, then quantizes it (`dynamicExclusion: auto`) and reports wall time, modules, artifact
/// size and peak RSS. `BENCH_MEMORY_LIMIT_MIB=N` runs the quantization under an enforced memory limit of N MiB
/// (a cgroup, joined after the model is generated) and reports the group's peak.
fn bench_generated(
    name: &str,
    layers: usize,
    expert_hessian_bytes: usize,
    generate: impl FnOnce(&std::path::Path),
    samples: usize,
    seq_len: usize,
) {
    use flexinfer_quant::job::QuantizeJob;
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    let t = Instant::now();
    generate(&model);
    let params: u64 = flexinfer_quant::tensors::TensorStore::open_dir(&model)
        .expect("open")
        .entries
        .values()
        .map(|e| e.shape.iter().product::<usize>() as u64)
        .sum();
    let ds = write_calibration(tmp.path(), samples, seq_len);
    println!(
        "{name}: generated {params} parameters in {:.1} s; peak RSS so far {:.0} MiB; all expert Hessians \
         together {:.0} MiB",
        t.elapsed().as_secs_f64(),
        peak_rss_mib(),
        expert_hessian_bytes as f64 / (1 << 20) as f64
    );
    let job = QuantizeJob {
        dynamic_exclusion: Some("auto".into()),
        ..bench_job(&model, tmp.path(), &ds, samples, seq_len)
    };
    let limit: Option<usize> = std::env::var("BENCH_MEMORY_LIMIT_MIB").ok().map(|v| {
        v.parse()
            .expect("BENCH_MEMORY_LIMIT_MIB is a number of MiB")
    });
    let group = limit.map(|mib| {
        flexinfer_quant::memory::release_free_memory();
        let g = enforce_memory_limit(mib);
        println!(
            "{name}: quantizing under an enforced memory limit of {mib} MiB ({})",
            g.display()
        );
        g
    });
    let (o, secs, baseline) = measured_run(&job);
    let q = o.quality.expect("quality");
    let peak = peak_rss_mib();
    println!(
        "{name} whole model (dynamicExclusion auto): {samples} x {seq_len} tokens, {layers} layers: {secs:.1} s; \
         {} GPTQ + {} RTN modules; artifact {} -> {} bytes; peak RSS {peak:.0} MiB, of which {baseline:.0} MiB \
         resident before the run",
        q.gptq_modules,
        q.rtn_fallback_modules,
        o.original_size_bytes,
        o.compressed_size_bytes
    );
    if let (Some(mib), Some(g)) = (limit, group) {
        let read = |f: &str| {
            std::fs::read_to_string(g.join(f))
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        println!(
            "{name}: under the {mib} MiB limit: cgroup peak {:.0} MiB (anonymous memory and page cache), \
             limit reached {} times",
            read("memory.max_usage_in_bytes") as f64 / (1 << 20) as f64,
            read("memory.failcnt")
        );
        // Leave the group so it can be removed.
        let _ = std::fs::write(
            "/sys/fs/cgroup/memory/cgroup.procs",
            std::process::id().to_string(),
        );
        let _ = std::fs::remove_dir(&g);
    }
}

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    match std::env::args().nth(1).as_deref() {
        Some("fp8") => return bench_fp8_vs_gptq(arg(2, 3), arg(3, 32), arg(4, 512)),
        Some("fp8-static") => return bench_fp8_static(arg(2, 3), arg(3, 32), arg(4, 512)),
        Some("ct") => return bench_ct_vs_gptq(arg(2, 3), arg(3, 32), arg(4, 512)),
        Some("hybrid") => return bench_hybrid(arg(2, 32), arg(3, 512)),
        Some("gemma4-moe") => return bench_gemma4_moe(arg(2, 32), arg(3, 512)),
        _ => {}
    }
    if std::env::args().nth(1).as_deref() == Some("model") {
        let samples = std::env::args()
            .nth(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(32);
        let seq_len = std::env::args()
            .nth(3)
            .and_then(|s| s.parse().ok())
            .unwrap_or(512);
        bench_model(samples, seq_len);
        return;
    }
    let mut argv = std::env::args().skip(1);
    let runs: usize = argv.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let mut shapes: Vec<(usize, usize)> = argv
        .filter_map(|s| {
            let (a, b) = s.split_once('x')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    if shapes.is_empty() {
        shapes = vec![(4096, 4096), (11008, 4096), (4096, 11008)];
    }
    let par = faer::get_global_parallelism();
    println!("threads: {par:?}, runs per shape: {runs}; each run measures GEMM/Cholesky rate right before its solve");
    let tokens = 2048;
    let backend = CpuBackend::default();
    // The low-bit quality knobs, for the time each costs: BENCH_BITS, BENCH_ACT_GROUP_AWARE=1, BENCH_CLIP_SEARCH=1,
    // BENCH_REFINE_ROUNDS=N.
    let knob = |name: &str| std::env::var(name).is_ok_and(|v| v == "1" || v == "true");
    let params = GptqParams {
        bits: std::env::var("BENCH_BITS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4),
        group_size: 128,
        act_group_aware: knob("BENCH_ACT_GROUP_AWARE"),
        clip_search: knob("BENCH_CLIP_SEARCH"),
        refine_rounds: std::env::var("BENCH_REFINE_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        ..Default::default()
    };
    println!(
        "bits {}, group 128, act_group_aware {}, clip_search {}, refine_rounds {}",
        params.bits, params.act_group_aware, params.clip_search, params.refine_rounds
    );
    let recovery = RecoveryParams::default();
    let probe = rate_probe(par);
    println!("| module (out x in) | GEMM GF/s | Cholesky GF/s | Hessian 2048 tok | ratio to bound | solve (factor + sweep) | of which factor | ratio to bound |");
    println!("|---|---|---|---|---|---|---|---|");
    for (rows, cols) in shapes {
        // Correlated activations: a low-rank signal plus noise, like real hidden states.
        let latent = random(tokens, 64, 3);
        let mix = random(64, cols, 4);
        let mut x = random(tokens, cols, 5);
        matmul(
            x.as_mut(),
            Accum::Add,
            latent.as_ref(),
            mix.as_ref(),
            1.0,
            par,
        );
        let w = random(rows, cols, 6) * faer::Scale(0.02);
        let (mut gemm, mut chol, mut hess, mut hratio, mut solve, mut factor_t, mut sratio) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let (nf, rf, tf) = (cols as f64, rows as f64, tokens as f64);
        let mut ws = Workspace::default();
        for _ in 0..runs {
            let (gemm_rate, chol_rate) = probe.measure();
            let t = Instant::now();
            let mut h = Mat::<f32>::zeros(cols, cols);
            backend.accumulate_hessian(h.as_mut(), x.as_ref(), 2.0 / tokens as f32);
            backend.finish_hessian(h.as_mut());
            let ht = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let FactorOutcome::Factor(f) = prepare_factor(
                &backend,
                h,
                params.column_order(cols),
                &recovery,
                "bench",
                &NullSink,
            ) else {
                panic!("factorisation failed")
            };
            let ft = t.elapsed().as_secs_f64();
            // As in a model run, the solver's buffers are reused from the previous module of this shape
            // (the first run of each shape allocates them).
            let q = gptq_quantize_in(&mut ws, &backend, &w, &f, &params);
            let st = t.elapsed().as_secs_f64();
            assert_eq!(q.codes.len(), rows * cols);
            // Hessian: the symmetric product needs T·n² flops (SYRK). Solve: the one Cholesky n³/3 at the
            // Cholesky rate and the block updates rows·n² at the GEMM rate (the sweep factor needs no inverse).
            let hess_bound = tf * nf * nf / gemm_rate;
            let solve_bound = nf.powi(3) / 3.0 / chol_rate + rf * nf * nf / gemm_rate;
            gemm.push(gemm_rate / 1e9);
            chol.push(chol_rate / 1e9);
            hess.push(ht);
            hratio.push(ht / hess_bound);
            solve.push(st);
            factor_t.push(ft);
            sratio.push(st / solve_bound);
        }
        println!(
            "| {rows} x {cols} | {:.0} | {:.0} | {:.2} s | {:.2} | {:.2} s | {:.2} s | {:.2} |",
            median(gemm),
            median(chol),
            median(hess),
            median(hratio),
            median(solve),
            median(factor_t),
            median(sratio)
        );
    }
}

/// GEMM and Cholesky rate at n = 4096 (f32, all threads), measured on demand.
struct RateProbe {
    a: Mat<f32>,
    b: Mat<f32>,
    spd: Mat<f32>,
    par: faer::Par,
}

fn rate_probe(par: faer::Par) -> RateProbe {
    let n = 4096;
    let a = random(n, n, 1);
    let b = random(n, n, 2);
    let mut spd = Mat::<f32>::zeros(n, n);
    matmul(
        spd.as_mut(),
        Accum::Replace,
        a.as_ref(),
        a.transpose(),
        1.0 / n as f32,
        par,
    );
    for i in 0..n {
        spd[(i, i)] += 1.0;
    }
    RateProbe { a, b, spd, par }
}

impl RateProbe {
    fn measure(&self) -> (f64, f64) {
        let n = self.a.nrows() as f64;
        let mut c = Mat::<f32>::zeros(self.a.nrows(), self.a.nrows());
        let t = Instant::now();
        matmul(
            c.as_mut(),
            Accum::Replace,
            self.a.as_ref(),
            self.b.as_ref(),
            1.0,
            self.par,
        );
        let gemm = 2.0 * n.powi(3) / t.elapsed().as_secs_f64();
        // faer's in-place Cholesky (its fastest form; the copy into the work matrix is not timed).
        let mut work = self.spd.clone();
        let nn = self.spd.nrows();
        let mut mem = MemBuffer::new(cholesky_in_place_scratch::<f32>(
            nn,
            self.par,
            Default::default(),
        ));
        let t = Instant::now();
        let ok = cholesky_in_place(
            work.as_mut(),
            Default::default(),
            self.par,
            MemStack::new(&mut mem),
            Default::default(),
        )
        .is_ok();
        let chol = n.powi(3) / 3.0 / t.elapsed().as_secs_f64();
        assert!(ok);
        (gemm, chol)
    }
}

/// Samples the resident set every 10 ms and remembers the largest value seen during each progress stage, so
/// the benchmark can say where the peak is.
/// The current stage label and the largest resident set seen per label.
type StageRss = std::sync::Arc<std::sync::Mutex<(String, Vec<(String, f64)>)>>;

struct RssSink {
    stage: StageRss,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl RssSink {
    fn start() -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex};
        let stage = Arc::new(Mutex::new((
            "start".to_string(),
            Vec::<(String, f64)>::new(),
        )));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (stage.clone(), stop.clone());
        std::thread::spawn(move || {
            while !sp.load(Ordering::Relaxed) {
                let r = rss_mib();
                if let Ok(mut g) = st.lock() {
                    let name = g.0.clone();
                    match g.1.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, m)) => *m = m.max(r),
                        None => g.1.push((name, r)),
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        });
        RssSink { stage, stop }
    }
    fn report(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(g) = self.stage.lock() {
            let text: Vec<String> = g.1.iter().map(|(n, m)| format!("{n} {m:.0}")).collect();
            println!(
                "largest resident set (MiB) sampled during each stage: {}",
                text.join(", ")
            );
        }
    }
}

impl flexinfer_quant::events::EventSink for RssSink {
    fn emit(&self, event: &str, fields: serde_json::Map<String, serde_json::Value>) {
        if event != "progress" {
            return;
        }
        let stage = fields.get("phase").and_then(|v| v.as_str()).unwrap_or("?");
        let msg = fields.get("detail").and_then(|v| v.as_str()).unwrap_or("");
        // A stage is named by the progress event that opened it: "after q_proj" is the o_proj stage of a
        // layer (attention forward, o_proj Hessian and GPTQ); layer and shard numbers are folded together.
        let label = match msg.split_once(": ") {
            Some((_, modules)) if stage == "quantize" => {
                let first = modules.split(',').next().unwrap_or(modules);
                format!("after {}", first.rsplit('.').next().unwrap_or(first))
            }
            _ if msg.ends_with(" done") => "after layer".to_string(),
            _ => stage.to_string(),
        };
        if let Ok(mut g) = self.stage.lock() {
            g.0 = label;
        }
    }
}

/// The calibration text of the benchmarks: plain text, blank-line separated, each sample long enough to
/// fill `seq_len` character tokens.
fn write_calibration(dir: &std::path::Path, samples: usize, seq_len: usize) -> std::path::PathBuf {
    let ds = dir.join("calib.txt");
    let text: Vec<String> = flexinfer_quant::testkit::sentences(9, samples)
        .into_iter()
        .map(|s| s.repeat(seq_len / 40 + 1))
        .collect();
    std::fs::write(&ds, text.join("\n\n")).expect("dataset");
    ds
}

/// The benchmarks' quantize job: `model` into `<dir>/out`, calibrated on `ds`.
fn bench_job(
    model: &std::path::Path,
    dir: &std::path::Path,
    ds: &std::path::Path,
    samples: usize,
    seq_len: usize,
) -> flexinfer_quant::job::QuantizeJob {
    flexinfer_quant::job::QuantizeJob::new(
        model,
        &dir.join("out"),
        ds,
        flexinfer_quant::calib::CalibSettings {
            max_samples: samples,
            max_seq_len: seq_len,
        },
        "bench",
    )
}
