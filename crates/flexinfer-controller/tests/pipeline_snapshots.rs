//! Snapshot tests of the generated pipeline Jobs (gfx1100, gfx906, NVIDIA, CPU-only).
//! Regenerate with `UPDATE_SNAPSHOTS=1 cargo test -p flexinfer-controller --test pipeline_snapshots`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::collections::BTreeMap;
use std::path::PathBuf;

use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::ModelCache;
use flexinfer_controller::modelcache::{jobs, Config};

fn config() -> Config {
    let env: BTreeMap<&str, &str> = BTreeMap::from([
        (
            "FLEXINFER_WORKER_IMAGE",
            "registry.example.com/flexinfer/worker:cpu",
        ),
        (
            "FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX906_IMAGE",
            "registry.example.com/flexinfer/worker:rocm-gfx906",
        ),
        (
            "FLEXINFER_QUANTIZER_GPTQ_IMAGE",
            "registry.example.com/flexinfer/worker:cuda",
        ),
        ("FLEXINFER_GPTQ_MAX_RTN_FALLBACK_PERCENT", "5"),
    ]);
    Config::from_lookup(|k| env.get(k).map(|s| s.to_string())).unwrap_or_else(|e| panic!("{e}"))
}

fn profiles() -> Vec<GPUProfile> {
    let y = r#"
- apiVersion: ai.flexinfer/v1alpha2
  kind: GPUProfile
  metadata: {name: gfx1100, namespace: flexinfer-system}
  spec:
    architecture: gfx1100
    vendor: amd
    vramMB: 24576
    resourceName: amd.com/gpu
    gpuDriverMemoryMB: 12288
    env: [{name: HSA_OVERRIDE_GFX_VERSION, value: "11.0.0"}]
    quantization: {images: {GPTQ: registry.example.com/flexinfer/worker:rocm-gfx1100}, imagePullPolicy: IfNotPresent}
- apiVersion: ai.flexinfer/v1alpha2
  kind: GPUProfile
  metadata: {name: gfx906, namespace: flexinfer-system}
  spec: {architecture: gfx906, vendor: amd, vramMB: 16384, gpuDriverMemoryMB: 8192, supplementalGroups: [44, 110]}
- apiVersion: ai.flexinfer/v1alpha2
  kind: GPUProfile
  metadata: {name: sm89, namespace: flexinfer-system}
  spec: {architecture: sm_89, vendor: nvidia, vramMB: 24576, nodeSelector: {flexinfer.ai/gpu.arch: sm_89},
         runtimeClassName: nvidia}
"#;
    serde_norway::from_str(y).expect("profiles")
}

fn cache(name: &str, selector: Option<&str>, gpu: bool) -> ModelCache {
    let sel = selector
        .map(|a| format!("  nodeSelector: {{flexinfer.ai/gpu.arch: {a}}}\n"))
        .unwrap_or_default();
    let y = format!(
        r#"apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {{name: {name}, namespace: flexinfer-system, uid: 00000000-0000-0000-0000-000000000001}}
spec:
  source: HF://org/model
  secretRef: hf-token
{sel}  tolerations: [{{key: workload, operator: Equal, value: batch, effect: NoSchedule}}]
  abliteration: {{useGPU: {gpu}, weightMatrices: [o_proj]}}
  quantization:
    format: GPTQ
    useGPU: {gpu}
    maxMemoryGB: 40
    timeoutSeconds: 43200
    calibration: {{maxSeqLen: 2048, maxSamples: 128, nParallelCalibSamples: 16}}
  publish: {{ociRef: registry.example.com/models/{name}, additionalTags: [stable]}}
"#
    );
    serde_norway::from_str(&y).expect("cache")
}

fn render(mc: &ModelCache) -> String {
    let c = config();
    let profiles = profiles();
    let mut out = String::new();
    for phase in jobs::enabled_phases(mc) {
        let t = jobs::resolve_target(mc, phase, &profiles, &c);
        let image = t.image.clone().expect("image resolves");
        let hash = jobs::spec_hash(mc, phase, &image);
        let job = jobs::build_job(mc, &Default::default(), &[], &t, &image, &hash, &c);
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(&job).expect("yaml"));
    }
    out
}

fn check(name: &str, mc: &ModelCache) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.yaml"));
    let got = render(mc);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &got).expect("write snapshot");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with UPDATE_SNAPSHOTS=1 to create it)",
            path.display()
        )
    });
    if got != want {
        let diff: Vec<String> = got
            .lines()
            .zip(want.lines())
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .take(10)
            .map(|(i, (a, b))| format!("line {}: got {a:?}, want {b:?}", i + 1))
            .collect();
        panic!(
            "{name}: generated Jobs differ from {} ({} vs {} lines):\n{}\n(run with UPDATE_SNAPSHOTS=1 if the change is intended)",
            path.display(),
            got.lines().count(),
            want.lines().count(),
            diff.join("\n")
        );
    }
}

#[test]
fn jobs_gfx1100() {
    check(
        "jobs-gfx1100",
        &cache("llama-gfx1100", Some("gfx1100"), true),
    );
}

#[test]
fn jobs_gfx906() {
    check("jobs-gfx906", &cache("llama-gfx906", Some("gfx906"), true));
}

#[test]
fn jobs_nvidia() {
    check("jobs-nvidia", &cache("llama-nvidia", Some("sm_89"), true));
}

/// GGUF on a gfx906 node pool (the format llama.cpp serves on Vega20): abliteration on the GPU, the GGUF
/// quantization in the worker image with no GPU request (its engine has no GPU path); the spec sets
/// `calibration`, so the download fetches the set and the quantize Job gets it for the importance pass.
#[test]
fn jobs_gguf_gfx906() {
    let y = serde_norway::to_string(&cache("llama-gguf", Some("gfx906"), true)).expect("yaml");
    let mc: ModelCache =
        serde_norway::from_str(&y.replace("format: GPTQ", "format: GGUF\n    ggufType: Q5_K_M"))
            .expect("cache");
    check("jobs-gguf-gfx906", &mc);
}

#[test]
fn jobs_cpu_only() {
    check("jobs-cpu", &cache("llama-cpu", None, false));
}

/// Properties the snapshots must keep (so a careless UPDATE_SNAPSHOTS cannot drop them).
#[test]
fn snapshot_invariants() {
    let amd = render(&cache("a", Some("gfx1100"), true));
    let old_amd = render(&cache("b", Some("gfx906"), true));
    let nv = render(&cache("c", Some("sm_89"), true));
    let cpu = render(&cache("d", None, false));
    for (name, y) in [
        ("gfx1100", &amd),
        ("gfx906", &old_amd),
        ("nvidia", &nv),
        ("cpu", &cpu),
    ] {
        for must in [
            "backoffLimit: 2",
            "restartPolicy: Never",
            "automountServiceAccountToken: false",
            "serviceAccountName: flexinfer-worker",
            "allowPrivilegeEscalation: false",
            "terminationMessagePolicy: FallbackToLogsOnError",
            "mountPath: /cache",
            "secretKeyRef",
            "value: v15",
            "name: GPTQ_MAX_RTN_FALLBACK_PERCENT\n          value: '5'",
        ] {
            assert!(y.contains(must), "{name}: missing {must:?}");
        }
        assert!(!y.contains("privileged: true"), "{name}");
    }
    assert!(amd.contains("amd.com/gpu") && amd.contains("53248Mi"));
    // The worker runs no PyTorch: none of its allocator settings is injected, on any vendor.
    for (name, y) in [("gfx1100", &amd), ("gfx906", &old_amd), ("nvidia", &nv)] {
        assert!(
            !y.contains("PYTORCH_"),
            "{name}: a PyTorch setting is injected"
        );
    }
    assert!(amd.contains("image: registry.example.com/flexinfer/worker:rocm-gfx1100"));
    assert!(old_amd.contains("image: registry.example.com/flexinfer/worker:rocm-gfx906"));
    assert!(
        nv.contains("nvidia.com/gpu")
            && nv.contains("image: registry.example.com/flexinfer/worker:cuda")
    );
    assert!(
        !cpu.contains("amd.com/gpu")
            && !cpu.contains("nvidia.com/gpu")
            && !cpu.contains("key: dedicated")
    );
    assert!(amd.contains("key: dedicated"));
}

/// Each phase gets only the secrets it uses: the hub token goes to the download alone (the only
/// phase that talks to the hub); registry credentials go to the publish and to the download of an
/// `oci://` source.
#[test]
fn secrets_go_only_to_the_phases_that_use_them() {
    use k8s_openapi::api::batch::v1::Job;
    let secret_envs = |job: &Job| -> Vec<String> {
        let spec = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        spec.containers[0]
            .env
            .iter()
            .flatten()
            .filter(|e| {
                e.value_from
                    .as_ref()
                    .is_some_and(|v| v.secret_key_ref.is_some())
            })
            .map(|e| e.name.clone())
            .collect()
    };
    let jobs_of = |mc: &ModelCache| -> Vec<(String, Vec<String>)> {
        let c = config();
        let profiles = profiles();
        jobs::enabled_phases(mc)
            .into_iter()
            .map(|phase| {
                let t = jobs::resolve_target(mc, phase, &profiles, &c);
                let image = t.image.clone().expect("image resolves");
                let hash = jobs::spec_hash(mc, phase, &image);
                let job = jobs::build_job(mc, &Default::default(), &[], &t, &image, &hash, &c);
                (phase.as_str().to_string(), secret_envs(&job))
            })
            .collect()
    };
    for (phase, envs) in jobs_of(&cache("s", None, false)) {
        let want: &[&str] = match phase.as_str() {
            "download" => &["HF_TOKEN"],
            "publish" => &["OCI_USERNAME", "OCI_PASSWORD"],
            _ => &[],
        };
        assert_eq!(envs, want, "{phase}");
    }
    let mut oci = cache("o", None, false);
    oci.spec.source = "oci://registry.example.com/models/base:v1".into();
    let download = jobs_of(&oci)
        .into_iter()
        .find(|(p, _)| p == "download")
        .unwrap();
    assert_eq!(download.1, ["HF_TOKEN", "OCI_USERNAME", "OCI_PASSWORD"]);
}
