//! Unit tests of the stand-in (`lib.rs`).

use super::*;

fn args(s: &str) -> Result<Args, String> {
    // The messages, for the assertions below.
    parse_args(s.split_whitespace().map(String::from)).map_err(|e| chain(&e))
}

#[test]
fn parses_the_vllm_command_line_the_model_controller_renders() {
    let a = args(
        "-m vllm.entrypoints.openai.api_server --model /models/model --served-model-name demo \
         --host 0.0.0.0 --port 8000 --max-model-len 4096 --quantization gptq --enforce-eager",
    )
    .expect("parse");
    assert_eq!(a.model, PathBuf::from("/models/model"));
    assert_eq!(a.served_model_name.as_deref(), Some("demo"));
    assert_eq!(a.port, 8000);
    assert_eq!(
        a.ignored,
        vec![
            "-m vllm.entrypoints.openai.api_server",
            "--max-model-len 4096",
            "--quantization gptq",
            "--enforce-eager"
        ]
    );
    assert_eq!(args("--model=/m --port=9").expect("inline").port, 9);
    assert_eq!(a.token_delay, std::time::Duration::ZERO);
    assert_eq!(
        args("--model /m --token-delay-ms 25")
            .expect("delay")
            .token_delay,
        std::time::Duration::from_millis(25)
    );
    assert!(args("--model /m --token-delay-ms 1e9")
        .unwrap_err()
        .contains("--token-delay-ms"));
    assert!(args("--port 8000").unwrap_err().contains("--model"));
    assert!(args("--model /m --port x").unwrap_err().contains("--port"));
    assert!(args("--model").unwrap_err().contains("needs a value"));
}

#[test]
fn loads_a_quantized_artifact_and_decodes_greedily() {
    use flexinfer_quant::calib::CalibSettings;
    use flexinfer_quant::job::{run, QuantizeJob};
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    flexinfer_quant::testkit::write_model(&model, "LlamaForCausalLM", 3).expect("model");
    let ds = tmp.path().join("calib.jsonl");
    flexinfer_quant::testkit::write_dataset(&ds, 8).expect("dataset");
    let out = tmp.path().join("gptq-w4-g128");
    let job = QuantizeJob::new(
        &model,
        &out,
        &ds,
        CalibSettings {
            max_samples: 8,
            max_seq_len: 32,
        },
        "test",
    );
    run(
        &job,
        &flexinfer_quant::linalg::CpuBackend::default(),
        &flexinfer_quant::events::NullSink,
    )
    .expect("quantize");
    let e = Engine::load(&out).expect("load");
    assert_eq!(e.info["quantization"]["bits"], 4);
    assert!(e.info["verifiedShards"].as_u64().is_some_and(|n| n > 0));
    let mut pieces = Vec::new();
    let g = e
        .generate("the cat", 4, |p| {
            pieces.push(p.to_string());
            true
        })
        .expect("generate");
    assert_eq!(g.completion_tokens, 4);
    assert_eq!(pieces.concat(), g.text);
    // Deterministic: the same prompt decodes to the same text.
    assert_eq!(
        e.generate("the cat", 4, |_| true).expect("again").text,
        g.text
    );
    // A consumer that stops after the first piece stops the generation there.
    let one = e.generate("the cat", 4, |_| false).expect("stopped");
    assert_eq!(one.completion_tokens, 1);
    assert_eq!(one.text, pieces[0]);
    // A damaged shard is refused at load, naming the record.
    let shard = std::fs::read_dir(&out)
        .expect("ls")
        .flatten()
        .map(|d| d.path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a shard");
    let mut b = std::fs::read(&shard).expect("read");
    let n = b.len() - 1;
    b[n] ^= 0xff;
    std::fs::write(&shard, b).expect("write");
    let msg = chain(&Engine::load(&out).err().expect("refused"));
    assert!(msg.contains(".save-complete"), "{msg}");
}
