//! Integration tests of `quantize`, `quantize status`, `quantize recommend` and `cache status`
//! against the local control plane (`scripts/testenv/up.sh api` + `kubectl apply --server-side -f
//! deploy/crds/`). They run the real binary with the test's KUBECONFIG and their own namespace.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::process::Command;

use flexinfer_e2e::{client, TestNamespace};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::Client;
use serde_json::{json, Value};

#[path = "support/one_shot_http.rs"]
mod one_shot_http;
use one_shot_http::serve_json_once;

const BIN: &str = env!("CARGO_BIN_EXE_flexinfer");

fn ar(kind: &str, plural: &str, version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("ai.flexinfer", version, kind),
        plural,
    )
}

fn caches(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &ar("ModelCache", "modelcaches", "v1alpha1"),
    )
}

async fn create_cache(client: &Client, ns: &str, name: &str, spec: Value) {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": ns}, "spec": spec
    }))
    .unwrap();
    caches(client, ns)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| {
            panic!("create modelcache {name} (are the CRDs from deploy/crds applied?): {e}")
        });
}

async fn set_status(client: &Client, ns: &str, name: &str, status: Value) {
    caches(client, ns)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": status})),
        )
        .await
        .expect("patch status");
}

async fn spec_quant(client: &Client, ns: &str, name: &str) -> Value {
    let o = caches(client, ns).get(name).await.unwrap();
    o.data["spec"]["quantization"].clone()
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn flexinfer(args: &[&str]) -> Out {
    let o = Command::new(BIN)
        .args(args)
        .output()
        .expect("run flexinfer");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

#[tokio::test]
async fn quantize_validates_and_patches_the_spec() {
    let c = client().await;
    let ns = TestNamespace::new(&c, "cli-quantize")
        .await
        .expect("create namespace");
    create_cache(
        &c,
        &ns.name,
        "llama3-8b",
        json!({"source": "HF://meta-llama/Meta-Llama-3-8B"}),
    )
    .await;

    let o = flexinfer(&[
        "quantize",
        "llama3-8b",
        "-n",
        &ns.name,
        "--format",
        "GPTQ",
        "--bits",
        "4",
        "--group-size",
        "128",
        "--use-gpu",
    ]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains("quantization requested: GPTQ gptq-w4-g128"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains(&format!(
            "flexinfer quantize status llama3-8b -n {}",
            ns.name
        )),
        "{}",
        o.stdout
    );
    let q = spec_quant(&c, &ns.name, "llama3-8b").await;
    assert_eq!(q["format"], "GPTQ");
    assert_eq!(q["bits"], 4);
    assert_eq!(q["groupSize"], 128);
    assert_eq!(q["useGPU"], true);
    // CRD defaults were applied by the API server
    assert_eq!(q["sym"], true);

    // Local validation: exit 2, the flag is named, nothing is patched.
    for (args, needle) in [
        (
            vec!["--format", "GPTQ", "--bits", "5"],
            "--bits 5 is not valid for --format GPTQ",
        ),
        (
            vec!["--format", "GPTQ", "--group-size", "100"],
            "--group-size 100 must be -1 or a power of two",
        ),
        (
            vec!["--format", "AWQ", "--type", "Q4_K_M"],
            "--type Q4_K_M is only valid with --format GGUF",
        ),
        (
            vec!["--format", "FP8", "--bits", "4"],
            "--bits 4 is not valid for --format FP8",
        ),
        (vec!["--format", "MP3"], "--format MP3: unknown format"),
    ] {
        let mut full = vec!["quantize", "llama3-8b", "-n", ns.name.as_str()];
        full.extend(args.iter().copied());
        let o = flexinfer(&full);
        assert_eq!(o.code, 2, "{args:?}: {}{}", o.stdout, o.stderr);
        assert!(o.stderr.contains(needle), "{args:?}: {}", o.stderr);
    }
    assert_eq!(spec_quant(&c, &ns.name, "llama3-8b").await["bits"], 4);

    // GGUF with a type, then back to GPTQ: the leftover ggufType is removed.
    let o = flexinfer(&[
        "quantize",
        "llama3-8b",
        "-n",
        &ns.name,
        "--format",
        "GGUF",
        "--type",
        "Q4_K_M",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        !o.stdout.contains("planned") && o.stdout.contains("GGUF gguf-q4_k_m on the CPU"),
        "GGUF has an engine, on the CPU: {}",
        o.stdout
    );
    let q = spec_quant(&c, &ns.name, "llama3-8b").await;
    assert_eq!(
        (q["format"].as_str(), q["ggufType"].as_str()),
        (Some("GGUF"), Some("Q4_K_M"))
    );
    let o = flexinfer(&[
        "quantize",
        "llama3-8b",
        "-n",
        &ns.name,
        "--format",
        "gptq",
        "-o",
        "json",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let printed: Value = serde_json::from_str(&o.stdout).expect("json output");
    assert_eq!(printed["format"], "GPTQ");
    let q = spec_quant(&c, &ns.name, "llama3-8b").await;
    assert_eq!(q["format"], "GPTQ");
    assert!(q.get("ggufType").is_none(), "{q}");

    // No --format: GGUF (Q4_K_M, the type the API applies when ggufType is unset).
    let o = flexinfer(&["quantize", "llama3-8b", "-n", &ns.name]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("GGUF gguf-q4_k_m"), "{}", o.stdout);
    let q = spec_quant(&c, &ns.name, "llama3-8b").await;
    assert_eq!(q["format"], "GGUF", "{q}");

    let o = flexinfer(&["quantize", "nope", "-n", &ns.name, "--format", "GPTQ"]);
    assert_eq!(o.code, 1);
    assert!(
        o.stderr.contains(&format!(
            "modelcache nope not found in namespace {}",
            ns.name
        )),
        "{}",
        o.stderr
    );
}

#[tokio::test]
async fn quantize_status_shows_requested_applied_job_progress_and_quality() {
    let c = client().await;
    let ns = TestNamespace::new(&c, "cli-qstatus")
        .await
        .expect("create namespace");
    create_cache(
        &c,
        &ns.name,
        "qwen",
        json!({"source": "Qwen/Qwen3-14B", "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "useGPU": true}}),
    )
    .await;
    let now = jiff::Timestamp::now();
    set_status(
        &c,
        &ns.name,
        "qwen",
        json!({"phase": "Quantizing", "currentPhase": "quantization", "progress": 42,
               "quantization": {"type": "gptq-w4-g128", "specHash": "0123456789abcdef", "progress": 42,
                 "progressDetail": "layer 17/40", "progressSource": "telemetry", "lastProgressAt": now.to_string(),
                 "startedAt": now.to_string(),
                 "originalSizeBytes": 29_540_000_000i64, "compressedSizeBytes": 9_800_000_000i64, "compressionRatio": 3.01,
                 "gptqDevice": "cpu-faer", "gptqDeviceReason": "auto: no usable GPU (hip: no /dev/kfd in this container)",
                 "quality": {"gptqModules": 280, "rtnFallbackModules": 0, "rtnFallbackPercent": 0.0, "gate": "passed"}}}),
    )
    .await;
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": "qwen-quantize", "namespace": ns.name},
        "spec": {
            // Not the built-in Job controller's: under `make test` (cluster mode) it would
            // otherwise rewrite the status this test sets.
            "managedBy": "flexinfer.ai/cli-test",
            "template": {"spec": {"restartPolicy": "Never",
                "nodeSelector": {"flexinfer.ai/none": "none"},
                "containers": [{"name": "w", "image": "busybox"}]}}}
    }))
    .unwrap();
    let jobs: Api<Job> = Api::namespaced(c.clone(), &ns.name);
    jobs.create(&PostParams::default(), &job)
        .await
        .expect("create job");
    jobs.patch_status(
        "qwen-quantize",
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"active": 1, "startTime": now.to_string()}})),
    )
    .await
    .expect("job status");

    let o = flexinfer(&["quantize", "status", "qwen", "-n", &ns.name]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let line = |key: &str| {
        o.stdout
            .lines()
            .find(|l| l.starts_with(&format!("{key}:")))
            .unwrap_or_else(|| panic!("no {key} line in:\n{}", o.stdout))
            .to_string()
    };
    assert!(line("Phase").ends_with("Quantizing"));
    assert!(line("Current step").ends_with("quantization"));
    assert!(
        line("Requested").contains("GPTQ gptq-w4-g128 (bits 4, groupSize 128"),
        "{}",
        o.stdout
    );
    assert!(line("Applied").contains("gptq-w4-g128 (specHash 0123456789abcdef)"));
    assert!(line("Up to date").ends_with("yes"));
    assert!(
        line("Job").contains("qwen-quantize Running (active 1, succeeded 0, failed 0)"),
        "{}",
        o.stdout
    );
    assert!(line("Progress").contains("42% (telemetry) layer 17/40"));
    assert!(line("Last update").contains("ago"));
    assert!(line("Sizes").contains("GiB -> "));
    assert!(line("Ratio").ends_with("3.01x"));
    assert!(line("Duration").contains("(running)"));
    assert!(
        line("GPTQ device")
            .ends_with(" cpu-faer (auto: no usable GPU (hip: no /dev/kfd in this container))"),
        "{}",
        o.stdout
    );
    assert!(line("Quality gate").contains("passed (gptq modules 280, RTN fallback 0"));

    let o = flexinfer(&["quantize", "status", "qwen", "-n", &ns.name, "-o", "json"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["job"]["active"], 1);
    assert_eq!(v["appliedSpecHash"], "0123456789abcdef");
    assert_eq!(v["upToDate"], true);
    assert_eq!(v["quantization"]["progress"], 42);

    // a changed request is reported as not yet applied
    let o = flexinfer(&[
        "quantize", "qwen", "-n", &ns.name, "--format", "GPTQ", "--bits", "8",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = flexinfer(&["quantize", "status", "qwen", "-n", &ns.name, "-o", "yaml"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: Value = serde_norway::from_str(&o.stdout).unwrap();
    assert_eq!(v["requestedType"], "gptq-w8-g128");
    assert_eq!(v["upToDate"], false);

    let o = flexinfer(&["quantize", "status", "missing", "-n", &ns.name]);
    assert_eq!(o.code, 1);
}

#[tokio::test]
async fn cache_status_lists_caches() {
    let c = client().await;
    let ns = TestNamespace::new(&c, "cli-cstatus")
        .await
        .expect("create namespace");
    create_cache(
        &c,
        &ns.name,
        "a-ready",
        json!({"source": "HF://meta-llama/Meta-Llama-3-8B", "quantization": {"format": "GPTQ"}}),
    )
    .await;
    create_cache(
        &c,
        &ns.name,
        "b-down",
        json!({"source": "oci://registry.example.com/models/x:v1"}),
    )
    .await;
    set_status(
        &c,
        &ns.name,
        "a-ready",
        json!({"phase": "Ready", "currentPhase": "ready", "progress": 100,
        "quantization": {"type": "gptq-w4-g128", "compressionRatio": 3.52}}),
    )
    .await;
    set_status(
        &c,
        &ns.name,
        "b-down",
        json!({"phase": "Downloading", "currentPhase": "download",
        "download": {"progress": 37}}),
    )
    .await;

    let o = flexinfer(&["cache", "status", "-n", &ns.name]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", o.stdout);
    let cols = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    assert_eq!(
        cols(lines[0]),
        ["NAME", "PHASE", "STEP", "PROGRESS", "FORMAT", "RATIO", "SOURCE"]
    );
    assert_eq!(
        cols(lines[1]),
        [
            "a-ready",
            "Ready",
            "ready",
            "100%",
            "gptq-w4-g128",
            "3.52x",
            "HF://meta-llama/Meta-Llama-3-8B"
        ]
    );
    assert_eq!(
        cols(lines[2]),
        [
            "b-down",
            "Downloading",
            "download",
            "37%",
            "-",
            "-",
            "oci://registry.example.com/models/x:v1"
        ]
    );

    let o = flexinfer(&["cache", "status", "-A"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.starts_with("NAMESPACE"), "{}", o.stdout);
    assert!(
        o.stdout
            .lines()
            .any(|l| l.starts_with(&ns.name) && l.contains("a-ready")),
        "{}",
        o.stdout
    );

    let o = flexinfer(&["cache", "status", "-n", &ns.name, "-o", "json"]);
    let v: Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v[0]["name"], "a-ready");
    assert_eq!(v[1]["progress"], 37);

    let empty = TestNamespace::new(&c, "cli-empty")
        .await
        .expect("create namespace");
    let o = flexinfer(&["cache", "status", "-n", &empty.name]);
    assert_eq!(o.code, 0);
    assert!(o.stdout.contains("No ModelCaches found"), "{}", o.stdout);
}

#[tokio::test]
async fn recommend_uses_the_gpu_profile_and_applies() {
    let c = client().await;
    let ns = TestNamespace::new(&c, "cli-recommend")
        .await
        .expect("create namespace");
    let profiles: Api<DynamicObject> = Api::namespaced_with(
        c.clone(),
        &ns.name,
        &ar("GPUProfile", "gpuprofiles", "v1alpha2"),
    );
    let p: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
        "metadata": {"name": "gfx1100", "namespace": ns.name},
        "spec": {"architecture": "gfx1100", "vendor": "amd", "vramMB": 24576}
    }))
    .unwrap();
    profiles
        .create(&PostParams::default(), &p)
        .await
        .expect("create gpuprofile");
    create_cache(
        &c,
        &ns.name,
        "qwen14",
        json!({"source": "local://models/qwen14",
        "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx1100"}}),
    )
    .await;

    // no footprint reachable: ask for --params
    let o = flexinfer(&["quantize", "recommend", "qwen14", "-n", &ns.name]);
    assert_eq!(o.code, 2, "{}{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("pass --params"), "{}", o.stderr);

    let o = flexinfer(&[
        "quantize",
        "recommend",
        "qwen14",
        "-n",
        &ns.name,
        "--params",
        "14B",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("GPUProfile gfx1100"), "{}", o.stdout);
    assert!(o.stdout.contains("ExLlama"), "{}", o.stdout);
    assert!(o.stdout.contains("Preview only"), "{}", o.stdout);
    assert!(
        spec_quant(&c, &ns.name, "qwen14").await.is_null(),
        "preview must not patch"
    );

    let o = flexinfer(&[
        "quantize",
        "recommend",
        "qwen14",
        "-n",
        &ns.name,
        "--params",
        "14B",
        "--apply",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let q = spec_quant(&c, &ns.name, "qwen14").await;
    assert_eq!(q["format"], "GPTQ");
    assert_eq!(q["bits"], 4);
    assert_eq!(q["sym"], true);
    assert_eq!(q["descAct"], false);
    assert_eq!(q["maxMemoryGB"], 56);
    assert_eq!(q["calibration"]["nParallelCalibSamples"], 32);
    assert_eq!(q["calibration"]["maxSeqLen"], 4096);

    // --format AWQ on the same cache: the API server takes the patch (its AWQ rules included), the GPTQ
    // calibration fields it does not use are gone.
    let o = flexinfer(&[
        "quantize",
        "recommend",
        "qwen14",
        "-n",
        &ns.name,
        "--params",
        "14B",
        "--format",
        "AWQ",
        "--apply",
    ]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("ROCm int4 kernels"), "{}", o.stdout);
    let q = spec_quant(&c, &ns.name, "qwen14").await;
    assert_eq!(q["format"], "AWQ", "{q}");
    assert_eq!(q["bits"], 4, "{q}");
    assert_eq!(q["groupSize"], 128, "{q}");
    assert_eq!(q["descAct"], false, "{q}");
    assert_eq!(q["useGPU"], false, "{q}");
    assert_eq!(q["calibration"]["maxSamples"], 128, "{q}");
    assert_eq!(q["calibration"]["maxSeqLen"], 512, "{q}");
    assert!(q["calibration"]["nParallelCalibSamples"].is_null(), "{q}");
    assert!(q["ggufType"].is_null(), "{q}");
}

/// Without `--params`, the parameter count comes from the hub metadata of an HF source.
#[tokio::test]
async fn recommend_reads_hub_metadata() {
    let c = client().await;
    let ns = TestNamespace::new(&c, "cli-hub")
        .await
        .expect("create namespace");
    create_cache(
        &c,
        &ns.name,
        "qwen",
        json!({"source": "HF://Qwen/Qwen3-14B",
        "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx906"}}),
    )
    .await;
    // A profile in the test's namespace wins over any other namespace's (shared control plane).
    let profiles: Api<DynamicObject> = Api::namespaced_with(
        c.clone(),
        &ns.name,
        &ar("GPUProfile", "gpuprofiles", "v1alpha2"),
    );
    let p: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
        "metadata": {"name": "gfx906", "namespace": ns.name},
        "spec": {"architecture": "gfx906", "vendor": "amd", "vramMB": 16384}
    }))
    .unwrap();
    profiles
        .create(&PostParams::default(), &p)
        .await
        .expect("create gpuprofile");
    let (endpoint, server) = serve_json_once(
        r#"{"id":"Qwen/Qwen3-14B","safetensors":{"total":14768307200},"config":{"model_type":"qwen3"}}"#,
    );
    let o = flexinfer(&[
        "quantize",
        "recommend",
        "qwen",
        "-n",
        &ns.name,
        "--hub-endpoint",
        &endpoint,
        "--format",
        "GPTQ",
        "-o",
        "json",
    ]);
    let req = server.join().unwrap();
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(req.starts_with("GET /api/models/Qwen/Qwen3-14B "), "{req}");
    let v: Value = serde_json::from_str(&o.stdout).unwrap();
    let reasons = v["reasons"].to_string();
    assert!(
        reasons.contains("14.8B parameters (hub metadata of Qwen/Qwen3-14B"),
        "{reasons}"
    );
    // gfx906 (16 GB) moves 14B to the 27B calibration recipe
    assert!(
        reasons.contains("gfx906, 16 GB VRAM (GPUProfile gfx906)"),
        "{reasons}"
    );
    assert_eq!(v["calibration"]["maxSeqLen"], 2048);
    assert_eq!(v["maxMemoryGB"], 56);
    // Without --format, gfx906 (which vLLM does not serve) gets GGUF; --apply patches it in.
    let o = flexinfer(&[
        "quantize",
        "recommend",
        "qwen",
        "-n",
        &ns.name,
        "--params",
        "14B",
        "--apply",
        "-o",
        "json",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["format"], "GGUF", "{v}");
    assert_eq!(v["ggufType"], "Q4_K_M", "{v}");
    let caches: Api<DynamicObject> = Api::namespaced_with(
        c.clone(),
        &ns.name,
        &ar("ModelCache", "modelcaches", "v1alpha1"),
    );
    let mc = caches.get("qwen").await.expect("get cache");
    let q = &mc.data["spec"]["quantization"];
    assert_eq!(q["format"], "GGUF", "{q}");
    assert_eq!(q["ggufType"], "Q4_K_M", "{q}");
    let o = flexinfer(&[
        "quantize",
        "recommend",
        "qwen",
        "-n",
        &ns.name,
        "--params",
        "14B",
        "--format",
        "EXL2",
    ]);
    assert_eq!(o.code, 2, "{}", o.stdout);
    assert!(o.stderr.contains("--format EXL2"), "{}", o.stderr);
}
