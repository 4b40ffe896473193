//! GGUF block quantizer benchmark (not a test). For each ggml type: the median time to quantize a
//! 4096×4096 Gaussian f32 matrix (64 MiB) on the rayon pool, as MB/s of f32 input, with and without an
//! importance vector, beside this machine's memcpy rate on the same buffer (the physical limit of a
//! pass over the input). `bench_gguf model [FTYPE]` then writes a generated ~110M-parameter Llama
//! model as GGUF (default Q4_K_M) and reports the wall time and file size; with `OUT_DIR` the file is
//! kept there as `model-FTYPE.gguf` (scripts/bench/gguf/vs-llama-quantize.sh feeds it to llama.cpp).
//! Usage: `cargo run --release -p flexinfer-quant --example bench_gguf [-- runs | model FTYPE [OUT_DIR]]`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code: a panic is the failure report

use flexinfer_quant::gguf::blocks::quantize_tensor;
use flexinfer_quant::gguf::{write_gguf, FileType, GgmlType, GgufJob};
use flexinfer_quant::testkit::{self, ModelSize};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("model") {
        let ft = FileType::from_name(args.get(1).map(String::as_str).unwrap_or("Q4_K_M")).unwrap();
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("model");
        testkit::write_model_sized(&src, "LlamaForCausalLM", 1, &ModelSize::SMALL_100M).unwrap();
        testkit::write_byte_level_tokenizer(&src).unwrap();
        let out = match args.get(2) {
            Some(dir) => std::path::Path::new(dir).join(format!("model-{}.gguf", ft.name())),
            None => d.path().join("model.gguf"),
        };
        let t = Instant::now();
        let s = write_gguf(&GgufJob {
            model_dir: &src,
            out_path: &out,
            file_type: ft,
            importance: None,
            name: "bench",
        })
        .unwrap();
        let secs = t.elapsed().as_secs_f64();
        println!(
            "model {} params, {}: {:.2} s, {:.1} MiB file ({} threads)",
            ModelSize::SMALL_100M.parameters(),
            ft.name(),
            secs,
            s.bytes as f64 / (1 << 20) as f64,
            rayon::current_num_threads()
        );
        return;
    }
    let runs: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(3);
    let (rows, cols) = (4096usize, 4096usize);
    let mut rng = StdRng::seed_from_u64(1);
    let x: Vec<f32> = (0..rows * cols).map(|_| testkit::gauss(&mut rng)).collect();
    let w: Vec<f32> = (0..cols)
        .map(|_| (testkit::gauss(&mut rng)).exp())
        .collect();
    let mb = (x.len() * 4) as f64 / 1e6;
    let mut copy = vec![0.0f32; x.len()];
    let memcpy = median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                copy.copy_from_slice(&x);
                std::hint::black_box(&copy);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    println!(
        "{} threads; memcpy of the {mb:.0} MB input: {:.0} MB/s",
        rayon::current_num_threads(),
        mb / memcpy
    );
    println!("type    MB/s(no imatrix)  MB/s(imatrix)  ratio to memcpy");
    for ty in GgmlType::ALL {
        let time = |imp: Option<&[f32]>| {
            median(
                (0..runs)
                    .map(|_| {
                        let t = Instant::now();
                        std::hint::black_box(quantize_tensor(ty, &x, cols, imp).unwrap());
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        };
        let plain = time(None);
        let weighted = time(Some(&w));
        println!(
            "{:<6} {:>12.0} {:>15.0} {:>14.3}",
            ty.name(),
            mb / plain,
            mb / weighted,
            memcpy / plain
        );
    }
}
