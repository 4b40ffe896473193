//! The whole-run benchmark (not a test): a generated model of a published shape, quantized by
//! the pipeline (4-bit g128, the defaults) on a device or the CPU, with the time of each phase and the peak
//! host memory. Random weights are fine for time.
//!
//! ```text
//! bench_device_run [--shape llama3-8b|small] [--layers N] [--samples 128] [--seq 2048]
//!                  [--device auto|cuda|hip|cpu] [--forward auto|off] [--model DIR] [--json FILE]
//! ```
//! `llama3-8b`: hidden 4096, MLP 14336, 32 layers, 32 query and 8 key/value heads, bf16 (a vocabulary of 32000
//! instead of 128256: the embeddings are not quantized); `small`: hidden 256, MLP 768, 2 layers (a quick
//! check here). The model is written once under `--model` (default a temporary directory) and reused when its
//! `config.json` matches. Prints one JSON object (also to `--json`): the shape, the device, `whole_run_seconds`
//! and each phase of the `quantize_phases` event, `peak_rss_mib`, and every progress event's time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // benchmark code: a panic is the report

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::device::{select_device, MemoryBudget, SystemPlatform, VendorLibs};
use flexinfer_quant::events::EventSink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::params::GateParams;
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

struct Shape {
    name: &'static str,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
}

const LLAMA3_8B: Shape = Shape {
    name: "llama3-8b",
    hidden: 4096,
    inter: 14336,
    layers: 32,
    heads: 32,
    kv_heads: 8,
    vocab: 32000,
};
const SMALL: Shape = Shape {
    name: "small",
    hidden: 256,
    inter: 768,
    layers: 2,
    heads: 8,
    kv_heads: 2,
    vocab: 32000,
};

fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// `count` bf16 values uniform in ±`bound` (a per-tensor seeded xorshift, 64 Ki values per task).
fn random_bf16(count: usize, bound: f32, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; count * 2];
    out.par_chunks_mut(1 << 17)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut s = seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for v in chunk.chunks_exact_mut(2) {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                v.copy_from_slice(&half::bf16::from_f32((2.0 * u - 1.0) * bound).to_le_bytes());
            }
        });
    out
}

fn ones_bf16(count: usize) -> Vec<u8> {
    half::bf16::from_f32(1.0).to_le_bytes().repeat(count)
}

/// Writes `tensors` (name, shape, bf16 bytes) as one safetensors file.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    let mut header = Map::new();
    let mut off = 0usize;
    for (name, shape, data) in tensors {
        header.insert(
            name.clone(),
            json!({"dtype": "BF16", "shape": shape, "data_offsets": [off, off + data.len()]}),
        );
        off += data.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    use std::io::Write;
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    for (_, _, d) in tensors {
        f.write_all(d).unwrap();
    }
    f.flush().unwrap();
}

/// The model directory for `shape` with `layers` layers: written unless a matching one is there.
fn write_model(dir: &Path, shape: &Shape, layers: usize) {
    let head_dim = shape.hidden / shape.heads;
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden, "intermediate_size": shape.inter, "num_hidden_layers": layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": shape.vocab,
        "max_position_embeddings": 8192, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    });
    let cfg_path = dir.join("config.json");
    if std::fs::read(&cfg_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        == Some(config.clone())
        && dir.join("model.safetensors.index.json").is_file()
    {
        eprintln!("bench: reusing the model in {}", dir.display());
        return;
    }
    let t = Instant::now();
    std::fs::create_dir_all(dir).unwrap();
    let mut weight_map = Map::new();
    let (h, m) = (shape.hidden, shape.inter);
    let emb = |seed| random_bf16(shape.vocab * h, 0.05, seed);
    let file = "model-embed.safetensors".to_string();
    write_safetensors(
        &dir.join(&file),
        &[
            (
                "model.embed_tokens.weight".into(),
                vec![shape.vocab, h],
                emb(1),
            ),
            ("lm_head.weight".into(), vec![shape.vocab, h], emb(2)),
            ("model.norm.weight".into(), vec![h], ones_bf16(h)),
        ],
    );
    for n in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ] {
        weight_map.insert(n.into(), json!(file));
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        let q = shape.heads * head_dim;
        let kv = shape.kv_heads * head_dim;
        let linears = [
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_proj", m, h),
            ("mlp.up_proj", m, h),
            ("mlp.down_proj", h, m),
        ];
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = linears
            .iter()
            .enumerate()
            .map(|(i, &(name, out, inp))| {
                let bound = (3.0 / inp as f32).sqrt();
                (
                    format!("{p}{name}.weight"),
                    vec![out, inp],
                    random_bf16(out * inp, bound, 1000 + (l * 16 + i) as u64),
                )
            })
            .collect();
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            tensors.push((format!("{p}{norm}.weight"), vec![h], ones_bf16(h)));
        }
        let file = format!("model-layer-{l:03}.safetensors");
        write_safetensors(&dir.join(&file), &tensors);
        for (n, _, _) in &tensors {
            weight_map.insert(n.clone(), json!(file));
        }
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&json!({"metadata": {}, "weight_map": weight_map})).unwrap(),
    )
    .unwrap();
    flexinfer_quant::testkit::write_char_tokenizer(dir).unwrap();
    std::fs::write(&cfg_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    eprintln!("bench: model written in {:.1} s", t.elapsed().as_secs_f64());
}

/// `samples` lines of letters in five-letter words: the character tokenizer gives one token per letter, so
/// each sample has more than `seq` tokens and is cut to `seq`.
fn write_dataset(path: &Path, samples: usize, seq: usize) {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let lines: Vec<String> = (0..samples)
        .map(|_| {
            let letters: String = (0..seq + seq / 4 + 8)
                .map(|i| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    if i % 6 == 5 {
                        ' '
                    } else {
                        (b'a' + (s % 26) as u8) as char
                    }
                })
                .collect();
            json!({ "text": letters }).to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

/// One event: seconds since the start, its name and fields.
type Timed = (f64, String, Map<String, Value>);

/// Prints each event's name and time since the start; keeps them.
struct Sink {
    started: Instant,
    events: Mutex<Vec<Timed>>,
}

impl EventSink for Sink {
    fn emit(&self, event: &str, fields: Map<String, Value>) {
        let t = self.started.elapsed().as_secs_f64();
        let detail = fields.get("detail").and_then(Value::as_str).unwrap_or("");
        eprintln!("[{t:8.1} s] {event} {detail}");
        if event != "progress" {
            eprintln!("           {}", Value::Object(fields.clone()));
        }
        self.events
            .lock()
            .unwrap()
            .push((t, event.to_string(), fields));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let shape = match arg("--shape").as_deref() {
        None | Some("llama3-8b") => LLAMA3_8B,
        Some("small") => SMALL,
        Some(other) => panic!("--shape {other}: expected llama3-8b or small"),
    };
    let layers = arg("--layers").map_or(shape.layers, |v| v.parse().unwrap());
    let samples: usize = arg("--samples").map_or(128, |v| v.parse().unwrap());
    let seq: usize = arg("--seq").map_or(2048, |v| v.parse().unwrap());
    let device_setting = arg("--device").unwrap_or_else(|| "auto".into());
    let forward = arg("--forward").unwrap_or_else(|| "auto".into()) != "off";
    let tmp = tempfile::tempdir().unwrap();
    let model = arg("--model").map_or_else(|| tmp.path().join("model"), PathBuf::from);
    write_model(&model, &shape, layers);
    let ds = tmp.path().join("calib.jsonl");
    write_dataset(&ds, samples, seq);

    let sink = Sink {
        started: Instant::now(),
        events: Mutex::new(Vec::new()),
    };
    let platform = SystemPlatform {
        budget: MemoryBudget::default(),
        vendor_libs: VendorLibs::Auto,
    };
    let device = select_device(Some(&device_setting), &platform, &sink)
        .unwrap()
        .device;
    let out = tmp.path().join("out");
    let job = QuantizeJob {
        gate: GateParams {
            max_rtn_fallback_percent: 100.0,
            min_modules: 1,
        },
        resume_layers: false,
        verify_save_sha256: false,
        device_forward: forward,
        ..QuantizeJob::new(
            &model,
            &out,
            &ds,
            CalibSettings {
                max_samples: samples,
                max_seq_len: seq,
            },
            "bench_device_run",
        )
    };
    let t = Instant::now();
    let outcome = run(&job, device.as_ref(), &sink);
    let whole = t.elapsed().as_secs_f64();
    let events = sink.events.lock().unwrap();
    let phases = events
        .iter()
        .rev()
        .find(|(_, n, _)| n == flexinfer_contract::events::QUANTIZE_PHASES)
        .map(|(_, _, f)| Value::Object(f.clone()));
    let forward_event = events
        .iter()
        .find(|(_, n, _)| n == flexinfer_contract::events::CALIBRATION_FORWARD)
        .map(|(_, _, f)| Value::Object(f.clone()));
    let layers_done: Vec<Value> = events
        .iter()
        .filter(|(_, _, f)| {
            f.get("detail")
                .and_then(Value::as_str)
                .is_some_and(|d| d.ends_with(" done"))
        })
        .map(|(t, _, f)| json!({"seconds": t, "detail": f.get("detail")}))
        .collect();
    let report = json!({
        "shape": {
            "name": shape.name, "hidden": shape.hidden, "intermediate": shape.inter, "layers": layers,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab, "dtype": "bf16",
        },
        "calibration": {"samples": samples, "seq_len": seq},
        "quantization": {"bits": 4, "group_size": 128},
        "device": device.describe(),
        "device_forward_requested": forward,
        "ok": outcome.is_ok(),
        "error": outcome.as_ref().err().map(|e| e.to_string()),
        "whole_run_seconds": whole,
        "phases": phases,
        "calibration_forward": forward_event,
        "peak_rss_mib": status_mib("VmHWM:"),
        "layers_done": layers_done,
    });
    let text = serde_json::to_string_pretty(&report).unwrap();
    println!("{text}");
    if let Some(p) = arg("--json") {
        std::fs::write(p, &text).unwrap();
    }
    if outcome.is_err() {
        std::process::exit(1);
    }
}
