//! Table tests of the image table, the vendor recognition and the resolution (`images.rs`), and of
//! the shipped GPUProfiles against the table.

use flexinfer_api::gpuprofile::GpuVendor;
use flexinfer_api::model::Backend;
use k8s_openapi::api::core::v1::EnvVar;

use super::images::*;
use super::render::ALL_BACKENDS;

const OURS: &str = "registry.lan:5000/flexinfer/llamacpp:7";
const AMD: Option<GpuVendor> = Some(GpuVendor::Amd);
const NVIDIA: Option<GpuVendor> = Some(GpuVendor::Nvidia);

/// Architectures the properties below range over: every target either list names, AMD targets
/// neither covers, NVIDIA targets, and none.
fn archs() -> Vec<Option<&'static str>> {
    let mut a: Vec<Option<&str>> = vec![None];
    a.extend(LLAMACPP_HIP_TARGETS.iter().map(|t| Some(*t)));
    a.extend(VLLM_ROCM_TARGETS.iter().map(|t| Some(*t)));
    a.extend([
        Some("gfx1031"),
        Some("gfx1103"),
        Some("sm_89"),
        Some("sm_120"),
    ]);
    a
}

/// (vendor, architecture, backend, the default or why there is none).
type Case = (
    Option<GpuVendor>,
    Option<&'static str>,
    Backend,
    Result<String, NoDefault>,
);

#[test]
fn the_table() {
    use NoDefault::*;
    let ok = |s: &str| Ok(s.to_string());
    let cases: [Case; 22] = [
        (AMD, Some("gfx1100"), Backend::Vllm, ok(VLLM_ROCM)),
        (AMD, Some("gfx942"), Backend::Vllm, ok(VLLM_ROCM)),
        (AMD, None, Backend::Vllm, ok(VLLM_ROCM)),
        (AMD, Some("gfx906"), Backend::Vllm, Err(VllmArch)),
        (AMD, Some("gfx1030"), Backend::Vllm, Err(VllmArch)),
        (
            AMD,
            Some("gfx906"),
            Backend::Llamacpp,
            ok(&format!("{OURS}-rocm")),
        ),
        (
            AMD,
            Some("gfx1100"),
            Backend::Llamacpp,
            ok(&format!("{OURS}-rocm")),
        ),
        (
            AMD,
            Some("gfx1102"),
            Backend::Llamacpp,
            ok(&format!("{OURS}-rocm")),
        ),
        (
            AMD,
            Some("gfx942"),
            Backend::Llamacpp,
            ok(&format!("{OURS}-vulkan")),
        ),
        (
            AMD,
            Some("gfx1201"),
            Backend::Llamacpp,
            ok(&format!("{OURS}-vulkan")),
        ),
        (AMD, None, Backend::Llamacpp, ok(&format!("{OURS}-vulkan"))),
        (AMD, Some("gfx906"), Backend::Ollama, ok(OLLAMA_ROCM)),
        (AMD, Some("gfx1100"), Backend::Exllamav2, Err(NoRocmBuild)),
        (NVIDIA, Some("sm_89"), Backend::Vllm, ok(VLLM_CUDA)),
        (NVIDIA, None, Backend::Llamacpp, ok(LLAMACPP_CUDA)),
        (NVIDIA, Some("sm_89"), Backend::Ollama, ok(OLLAMA)),
        (NVIDIA, Some("sm_89"), Backend::Exllamav2, ok(TABBYAPI_CUDA)),
        (None, None, Backend::Llamacpp, ok(OURS)),
        (None, None, Backend::Ollama, ok(OLLAMA)),
        (None, None, Backend::Vllm, Err(NoCpuBuild)),
        (None, None, Backend::Exllamav2, Err(NoCpuBuild)),
        (AMD, Some("gfx1151"), Backend::Vllm, ok(VLLM_ROCM)),
    ];
    for (vendor, arch, backend, want) in cases {
        assert_eq!(
            default_image(backend, vendor, arch, OURS),
            want,
            "{vendor:?} {arch:?} {backend:?}"
        );
    }
}

/// Every (vendor, backend) pair has a row for every architecture, known or not.
#[test]
fn the_table_covers_every_vendor_backend_and_architecture() {
    for vendor in [AMD, NVIDIA, None] {
        for backend in ALL_BACKENDS {
            let rows: Vec<_> = TABLE
                .iter()
                .filter(|r| r.vendor == vendor && r.backend == backend)
                .collect();
            let has = |a: Archs| rows.iter().any(|r| r.archs == a);
            assert!(
                has(Archs::Any) || (has(Archs::Unknown) && has(Archs::Others)),
                "{vendor:?} {backend:?}: {rows:?}"
            );
        }
    }
}

/// An AMD Model never gets a CUDA image, an NVIDIA Model never a ROCm one (its GPU backends get
/// CUDA builds), and every upstream default is pinned.
#[test]
fn defaults_are_vendor_right_and_pinned() {
    for backend in ALL_BACKENDS {
        for arch in archs() {
            if let Ok(img) = default_image(backend, AMD, arch, OURS) {
                let b = built_for(&img, OURS);
                assert!(
                    matches!(b, BuiltFor::Rocm | BuiltFor::Vulkan),
                    "AMD {arch:?} {backend:?}: {img} is {b:?}"
                );
            }
            if let Ok(img) = default_image(backend, NVIDIA, arch, OURS) {
                assert_eq!(
                    built_for(&img, OURS),
                    BuiltFor::Cuda,
                    "NVIDIA {arch:?} {backend:?}: {img}"
                );
            }
            if let Ok(img) = default_image(backend, None, arch, OURS) {
                assert_ne!(built_for(&img, OURS), BuiltFor::Rocm, "no GPU: {img}");
            }
        }
    }
    for row in TABLE {
        if let DefaultImage::Upstream(img) = row.image {
            let last = img.split('@').next().unwrap_or_default();
            let tag = last
                .rsplit('/')
                .next()
                .and_then(|n| n.split_once(':'))
                .map(|(_, t)| t);
            let pinned = img.contains("@sha256:")
                || tag.is_some_and(|t| t != "latest" && t.chars().any(|c| c.is_ascii_digit()));
            assert!(pinned, "{img} is not pinned");
        }
    }
}

#[test]
fn what_an_image_is_built_for() {
    use BuiltFor::*;
    let cases = [
        ("vllm/vllm-openai:v0.11.0", Cuda),
        ("docker.io/vllm/vllm-openai:v0.18.0-cu130", Cuda),
        ("vllm/vllm-openai@sha256:fc12", Cuda),
        ("harbor.lan/dockerhub/vllm/vllm-openai:v0.18.0", Cuda),
        ("registry.example.com/vllm/vllm-openai:v0.9.2", Cuda),
        ("docker.io/vllm/vllm-openai-rocm:v0.18.0", Rocm),
        ("rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210", Rocm),
        ("docker.io/rocm/vllm-dev:nightly", Rocm),
        ("rocm/pytorch:latest", Rocm),
        ("nvcr.io/nvidia/tritonserver:25.01-py3", Cuda),
        ("ollama/ollama:0.12.6", Cuda),
        ("ollama/ollama:0.12.6-rocm", Rocm),
        ("ollama/ollama:rocm", Rocm),
        ("ollama/ollama@sha256:abcd", Unknown),
        ("ghcr.io/ggml-org/llama.cpp:server-cuda-b11206", Cuda),
        ("ghcr.io/ggml-org/llama.cpp:server-cuda13-b11206", Cuda),
        ("ghcr.io/ggml-org/llama.cpp:server-rocm", Rocm),
        ("ghcr.io/ggml-org/llama.cpp:server-vulkan", Vulkan),
        ("ghcr.io/ggml-org/llama.cpp:server", Cpu),
        ("ghcr.io/ggerganov/llama.cpp:server-b4600", Cpu),
        ("ghcr.io/ggml-org/llama.cpp:server-intel", Unknown),
        ("ghcr.io/theroyallab/tabbyapi:cu13", Cuda),
        ("ghcr.io/theroyallab/tabbyapi@sha256:cbce", Cuda),
        ("registry.lan:5000/flexinfer/llamacpp:7", Cpu),
        ("registry.lan:5000/flexinfer/llamacpp:7-rocm", Rocm),
        ("registry.lan:5000/flexinfer/llamacpp:7-vulkan", Vulkan),
        (
            "registry.example.com/flexinfer/runtime:vllm-rocm-gfx1100",
            Rocm,
        ),
        ("registry/vllm-rocm:1", Rocm),
        ("my.registry/team/vllm:0.9-cuda12.4", Cuda),
        ("my.registry/team/vllm:cuda-and-rocm", Unknown),
        // Unknown images are never refused: a fork for gfx906, a private build.
        ("nalanzeyu/vllm-gfx906:v0.10.2", Unknown),
        ("registry.lan/serving/vllm:2025-11", Unknown),
        ("spec/image:1", Unknown),
        ("", Unknown),
    ];
    for (image, want) in cases {
        assert_eq!(built_for(image, OURS), want, "{image}");
    }
    assert!(BuiltFor::Cuda.wrong_for(GpuVendor::Amd));
    assert!(BuiltFor::Rocm.wrong_for(GpuVendor::Nvidia));
    for ok in [BuiltFor::Vulkan, BuiltFor::Cpu, BuiltFor::Unknown] {
        assert!(!ok.wrong_for(GpuVendor::Amd) && !ok.wrong_for(GpuVendor::Nvidia));
    }
}

#[test]
fn hsa_override_sets_the_rocm_target() {
    let env = |v: &str| {
        vec![EnvVar {
            name: "HSA_OVERRIDE_GFX_VERSION".into(),
            value: Some(v.into()),
            value_from: None,
        }]
    };
    assert_eq!(rocm_target("gfx1100", &[]), "gfx1100");
    assert_eq!(rocm_target("gfx1102", &env("11.0.0")), "gfx1100");
    assert_eq!(rocm_target("gfx1031", &env("10.3.0")), "gfx1030");
    assert_eq!(rocm_target("gfx90c", &env("9.0.10")), "gfx90a");
    assert_eq!(rocm_target("gfx906", &env("9.0.6")), "gfx906");
    for bad in ["", "11", "11.0", "11.0.0.0", "x.0.0", "11.16.0", "0.0.0"] {
        assert_eq!(rocm_target("gfx1102", &env(bad)), "gfx1102", "{bad:?}");
    }
}

#[test]
fn the_quantization_argument() {
    let q = |a: &[&str]| quantization_arg(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    assert_eq!(q(&[]), None);
    assert_eq!(q(&["--enforce-eager"]), None);
    assert_eq!(
        q(&["--quantization", "GPTQ_Marlin"]).as_deref(),
        Some("gptq_marlin")
    );
    assert_eq!(
        q(&["--quantization=awq_marlin"]).as_deref(),
        Some("awq_marlin")
    );
    assert_eq!(q(&["-q", "gptq"]).as_deref(), Some("gptq"));
    assert_eq!(q(&["-q=marlin"]).as_deref(), Some("marlin"));
    assert_eq!(q(&["--quantization"]), None);
    assert_eq!(
        q(&["-q", "gptq", "--quantization", "fp8"]).as_deref(),
        Some("fp8")
    );
}

fn gpu(vendor: Option<GpuVendor>, arch: Option<&str>, profile: Option<&str>) -> GpuTarget {
    GpuTarget {
        vendor,
        arch: arch.map(str::to_string),
        profile: profile.map(str::to_string),
    }
}

fn named<'a>(m: Option<&'a str>, p: Option<&'a str>, c: Option<&'a str>) -> Named<'a> {
    Named {
        model: m,
        profile: p,
        controller: c,
    }
}

#[test]
fn resolution_order_and_empty_values() {
    let g = gpu(AMD, Some("gfx1100"), Some("gfx1100"));
    let r = |n: Named| resolve(Backend::Vllm, &g, n, OURS, &[]).unwrap_or_else(|e| panic!("{e}"));
    let (m, p, c) = ("spec/image:1", "registry/vllm-rocm:1", "env/vllm:2");
    assert_eq!(r(named(Some(m), Some(p), Some(c))).source, Source::Model);
    assert_eq!(r(named(Some(m), Some(p), Some(c))).image, m);
    assert_eq!(
        r(named(Some(" "), Some(p), Some(c))).source,
        Source::Profile
    );
    assert_eq!(r(named(None, Some(""), Some(c))).source, Source::Controller);
    let d = r(named(None, None, Some("")));
    assert_eq!((d.image.as_str(), d.source), (VLLM_ROCM, Source::Default));
}

/// A vendor-wrong image from any source is refused; the message names where it came from and
/// the fix (with the default to use where there is one).
#[test]
fn another_vendors_image_is_refused_naming_field_and_fix() {
    let amd = gpu(AMD, Some("gfx1100"), Some("gfx1100"));
    let nv = gpu(NVIDIA, Some("sm_89"), Some("sm89"));
    let cuda = "docker.io/vllm/vllm-openai:v0.18.0";
    let cases: [(&GpuTarget, Backend, Named, &[&str]); 6] = [
        (
            &amd,
            Backend::Vllm,
            named(Some(cuda), None, None),
            &[
                "spec.image docker.io/vllm/vllm-openai:v0.18.0 is a CUDA build",
                "AMD GPUs (GPUProfile gfx1100)",
                VLLM_ROCM,
            ],
        ),
        (
            &amd,
            Backend::Vllm,
            named(None, Some(cuda), None),
            &[
                "GPUProfile gfx1100 spec.runtime.images.vllm",
                VLLM_ROCM,
                "remove it",
            ],
        ),
        (
            &amd,
            Backend::Vllm,
            named(None, None, Some(cuda)),
            &[
                "FLEXINFER_RUNTIME_IMAGE_VLLM",
                "runtime.images.vllm",
                "GPUProfile gfx1100 spec.runtime.images.vllm",
                VLLM_ROCM,
            ],
        ),
        (
            &amd,
            Backend::Ollama,
            named(Some("ollama/ollama:0.12.6"), None, None),
            &["spec.image", OLLAMA_ROCM],
        ),
        (
            &amd,
            Backend::Exllamav2,
            named(Some("ghcr.io/theroyallab/tabbyapi:cu13"), None, None),
            &["spec.image", "a ROCm build of exllamav2"],
        ),
        (
            &nv,
            Backend::Llamacpp,
            named(
                None,
                Some("registry.lan:5000/flexinfer/llamacpp:7-rocm"),
                None,
            ),
            &[
                "is a ROCm build",
                "NVIDIA GPUs (GPUProfile sm89)",
                LLAMACPP_CUDA,
            ],
        ),
    ];
    for (g, backend, n, parts) in cases {
        let e = resolve(backend, g, n, OURS, &[])
            .err()
            .unwrap_or_else(|| panic!("{n:?} should be refused"));
        assert_eq!(e.reason(), "ImageVendorMismatch", "{e}");
        assert_eq!(e.condition_type(), "ConfigValid");
        for p in parts {
            assert!(e.to_string().contains(p), "{e} lacks {p:?}");
        }
    }
    // Not recognised, vendor-neutral or right: the named image wins.
    for (g, image) in [
        (&amd, "nalanzeyu/vllm-gfx906:v0.10.2"),
        (&amd, "registry.lan:5000/flexinfer/llamacpp:7-vulkan"),
        (&amd, "ghcr.io/ggml-org/llama.cpp:server"),
        (&nv, "ghcr.io/ggml-org/llama.cpp:server-vulkan"),
        (&nv, cuda),
    ] {
        let r = resolve(
            Backend::Llamacpp,
            g,
            named(Some(image), None, None),
            OURS,
            &[],
        );
        assert_eq!(r.map(|r| r.image).as_deref(), Ok(image));
    }
}

#[test]
fn combinations_known_not_to_work() {
    let gfx906 = gpu(AMD, Some("gfx906"), Some("gfx906"));
    // vLLM on gfx906: no default, and vLLM's own ROCm images are refused; a build made for gfx906
    // (not recognised) is served.
    let e = resolve(Backend::Vllm, &gfx906, named(None, None, None), OURS, &[])
        .err()
        .unwrap_or_else(|| panic!("vLLM on gfx906"));
    assert_eq!(e.reason(), "UnsupportedCombination");
    for p in [
        "vLLM does not support gfx906",
        "backend llamacpp",
        "-rocm",
        "gfx1100",
    ] {
        assert!(e.to_string().contains(p), "{e} lacks {p:?}");
    }
    for upstream in [VLLM_ROCM, "rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210"] {
        let e = resolve(
            Backend::Vllm,
            &gfx906,
            named(Some(upstream), None, None),
            OURS,
            &[],
        )
        .err()
        .unwrap_or_else(|| panic!("{upstream} on gfx906"));
        assert_eq!(e.reason(), "UnsupportedCombination", "{e}");
        assert!(e.to_string().starts_with("spec.image"), "{e}");
    }
    let fork = "nalanzeyu/vllm-gfx906:v0.10.2";
    let r = resolve(
        Backend::Vllm,
        &gfx906,
        named(Some(fork), None, None),
        OURS,
        &[],
    );
    assert_eq!(r.map(|r| r.image).as_deref(), Ok(fork));
    // Marlin on AMD: refused, naming the argument; on NVIDIA it is vLLM's own business.
    let marlin: Vec<String> = ["--quantization", "gptq_marlin"].map(String::from).to_vec();
    let amd = gpu(AMD, Some("gfx1100"), Some("gfx1100"));
    let e = resolve(Backend::Vllm, &amd, named(None, None, None), OURS, &marlin)
        .err()
        .unwrap_or_else(|| panic!("Marlin on AMD"));
    assert_eq!(e.reason(), "UnsupportedCombination");
    assert!(
        e.to_string()
            .contains("spec.config.extraArgs --quantization gptq_marlin"),
        "{e}"
    );
    let nv = gpu(NVIDIA, Some("sm_89"), None);
    assert!(resolve(Backend::Vllm, &nv, named(None, None, None), OURS, &marlin).is_ok());
    let gptq: Vec<String> = ["--quantization", "gptq"].map(String::from).to_vec();
    assert!(resolve(Backend::Vllm, &amd, named(None, None, None), OURS, &gptq).is_ok());
    // exllamav2 on AMD: no image unless one is named.
    let e = resolve(Backend::Exllamav2, &amd, named(None, None, None), OURS, &[])
        .err()
        .unwrap_or_else(|| panic!("exllamav2 on AMD"));
    assert_eq!(e.reason(), "ImageNotConfigured");
    assert!(
        e.to_string()
            .contains("GPUProfile gfx1100 spec.runtime.images.exllamav2"),
        "{e}"
    );
    let own = "registry.lan/tabbyapi:rocm6.4";
    let r = resolve(
        Backend::Exllamav2,
        &amd,
        named(None, Some(own), None),
        OURS,
        &[],
    );
    assert_eq!(r.map(|r| r.image).as_deref(), Ok(own));
}

/// The shipped GPUProfiles (deploy/gpuprofiles and the chart's gpuProfiles) name the table's
/// default of every backend that has one on their architecture, and nothing else.
#[test]
fn shipped_profiles_name_the_tables_images() {
    use flexinfer_api::GPUProfile;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let read =
        |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let ours = format!("{LLAMACPP_REPOSITORY}:{}", crate::VERSION);
    let check = |name: &str, spec: &flexinfer_api::gpuprofile::GPUProfileSpec, chart: bool| {
        let arch = match spec.vendor {
            GpuVendor::Amd => rocm_target(&spec.architecture, &spec.env),
            GpuVendor::Nvidia => spec.architecture.clone(),
        };
        let images = spec
            .runtime
            .as_ref()
            .map(|r| r.images.clone())
            .unwrap_or_default();
        for backend in ALL_BACKENDS {
            let want = default_image(backend, Some(spec.vendor), Some(&arch), &ours).ok();
            let got = images.get(backend.as_str()).cloned();
            // The chart's template adds FlexInfer's llama.cpp image to AMD profiles (checked by
            // scripts/chart-tests).
            if chart && spec.vendor == GpuVendor::Amd && backend == Backend::Llamacpp {
                assert_eq!(got, None, "{name}: the template sets llamacpp");
                continue;
            }
            assert_eq!(got, want, "{name} {backend:?}");
        }
    };
    let mut n = 0;
    for f in ["gfx1100", "gfx906", "nvidia-sm89"] {
        let p: GPUProfile = serde_norway::from_str(&read(&format!("deploy/gpuprofiles/{f}.yaml")))
            .unwrap_or_else(|e| panic!("{f}: {e}"));
        check(f, &p.spec, false);
        n += 1;
    }
    let values: serde_json::Value = serde_norway::from_str(&read("charts/flexinfer/values.yaml"))
        .unwrap_or_else(|e| panic!("{e}"));
    let profiles = values["gpuProfiles"]["profiles"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    for (name, p) in profiles {
        let spec: flexinfer_api::gpuprofile::GPUProfileSpec =
            serde_json::from_value(p["spec"].clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        check(&name, &spec, true);
        n += 1;
    }
    assert_eq!(n, 6, "three profiles in each place");
}

/// The table as docs/user/serving.md shows it, one line per row of [`TABLE`].
fn markdown_table() -> String {
    let mut out =
        String::from("| GPU | architecture | backend | default image |\n|---|---|---|---|\n");
    for (i, row) in TABLE.iter().enumerate() {
        let after_others = TABLE[..i]
            .iter()
            .any(|r| r.vendor == row.vendor && r.backend == row.backend);
        let gpu = match row.vendor {
            Some(GpuVendor::Amd) => "AMD",
            Some(GpuVendor::Nvidia) => "NVIDIA",
            None => "no GPU",
        };
        let archs = match row.archs {
            Archs::Any if after_others => "any other, or not known".to_string(),
            Archs::Any => "any".to_string(),
            Archs::OneOf(list) => list.join(", "),
            Archs::Unknown => "not known (`gpu.vendor` without a GPUProfile)".to_string(),
            Archs::Others => "any other".to_string(),
        };
        let image = match row.image {
            DefaultImage::Upstream(i) => format!("`{i}`"),
            DefaultImage::Ours("") => "`<llama.cpp image>` (CPU)".to_string(),
            DefaultImage::Ours(suffix) => format!("`<llama.cpp image>{suffix}`"),
            DefaultImage::None(NoDefault::VllmArch) => {
                "none: `UnsupportedCombination` (vLLM has no kernels for it)".to_string()
            }
            DefaultImage::None(NoDefault::NoRocmBuild) => {
                "none: `ImageNotConfigured` (TabbyAPI publishes CUDA builds only)".to_string()
            }
            DefaultImage::None(NoDefault::NoCpuBuild) => "none: `ImageNotConfigured`".to_string(),
        };
        out.push_str(&format!(
            "| {gpu} | {archs} | `{}` | {image} |\n",
            row.backend.as_str()
        ));
    }
    out
}

/// docs/user/serving.md shows the table the controller uses, row for row.
#[test]
fn the_docs_show_the_table() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/user/serving.md");
    let docs = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let table = markdown_table();
    assert!(
        docs.contains(&table),
        "docs/user/serving.md lacks the image table; it should read:\n{table}"
    );
}
