//! The environment of a phase's worker container: what every phase gets (paths, the writer's identity from
//! the downward API, the garbage collection's keep list), each phase's settings from the spec, and the GPU
//! profile's env last (same name wins last). The names are the contract's (`flexinfer_contract::env`).

use flexinfer_api::contract::{self, env, JobPhase, SourceUri};
use flexinfer_api::modelcache::{ModelCache, ModelCacheSpec, ModelCacheStatus, QuantFormat};
use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, SecretKeySelector};

use super::reads_calibration;
use super::{cache_path, phase_dirs, phase_memory_gb, Config, PhaseTarget};

/// A plain env var.
pub(crate) fn ev(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        value_from: None,
    }
}

/// An env var from key `key` of Secret `secret` (optional: a missing key leaves it unset).
pub(crate) fn secret_ev(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_string(),
                key: key.to_string(),
                optional: Some(true),
            }),
            ..Default::default()
        }),
    }
}

/// An env var from the pod's own metadata (downward API).
fn field_ev(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(k8s_openapi::api::core::v1::ObjectFieldSelector {
                api_version: None,
                field_path: path.into(),
            }),
            ..Default::default()
        }),
    }
}

/// Directories (relative to the PVC root) a phase run's garbage collection keeps: its own output, the
/// promoted one, the `keep` newest earlier ones, and everything a Model serves from this claim.
pub fn keep_dirs(
    mc: &ModelCache,
    st: &ModelCacheStatus,
    phase: JobPhase,
    output: &str,
    served: &[String],
    keep: usize,
) -> Vec<String> {
    let mut v = vec![output.to_string()];
    let previous = super::super::target::previous_dirs(st, phase);
    // The promoted output becomes the newest previous one when this run succeeds.
    let promoted = super::super::target::promoted_output(mc, st, phase);
    let budget = if promoted.is_some() {
        keep.saturating_sub(1)
    } else {
        keep
    };
    v.extend(promoted);
    v.extend(previous.into_iter().take(budget));
    v.extend(served.iter().cloned());
    v.sort();
    v.dedup();
    v
}

pub(super) fn worker_env(
    mc: &ModelCache,
    st: &ModelCacheStatus,
    served: &[String],
    t: &PhaseTarget,
    config: &Config,
) -> Vec<EnvVar> {
    let s = &mc.spec;
    let phase = t.phase;
    let (input, output) = phase_dirs(mc, st, phase);
    let mut e = vec![
        ev(env::SCRIPT_VERSION, contract::SCRIPT_VERSION),
        ev(env::PHASE, phase.as_str()),
        ev(env::MODEL_DIR, cache_path(&input)),
        ev(env::TELEMETRY, "true"),
        ev(env::MAX_MEMORY_GB, phase_memory_gb(mc, phase).to_string()),
    ];
    if phase != JobPhase::Publish {
        e.push(ev(env::OUT_DIR, cache_path(&output)));
        let keep = keep_dirs(mc, st, phase, &output, served, config.keep_generations);
        e.push(ev(env::KEEP_DIRS, keep.join(",")));
    }
    if phase != JobPhase::Publish {
        e.push(field_ev(
            env::WRITER_ID,
            "metadata.labels['batch.kubernetes.io/controller-uid']",
        ));
        e.push(field_ev(env::WRITER_POD, "metadata.name"));
        e.push(field_ev(env::WRITER_NODE, "spec.nodeName"));
    }
    if let Some(ep) = &config.hf_endpoint {
        e.push(ev(env::HF_ENDPOINT, ep.clone()));
    }
    if let Some(vram) = t.profile.as_ref().and_then(|p| p.spec.vram_mb) {
        e.push(ev(env::GPU_VRAM_MB, vram.to_string()));
    }
    e.extend(match phase {
        JobPhase::Download => download_env(s),
        JobPhase::Abliterate => abliterate_env(s),
        JobPhase::Quantize => quantize_env(s, config),
        JobPhase::Publish => publish_env(s),
    });
    // No PyTorch runs in the worker, so no allocator settings of PyTorch's (e.g.
    // `PYTORCH_HIP_ALLOC_CONF`) are injected; the device memory budget is `GPU_VRAM_MB` and
    // `GPU_MEMORY_FRACTION` above.
    if t.gpu {
        apply_profile_env(t, &mut e);
    }
    e
}

/// The download's settings: source, revision, file patterns, the hub datasets fetched with the
/// model (calibration, abliteration prompt sets) and the credentials (the hub token; the registry
/// login for an `oci://` source).
fn download_env(s: &ModelCacheSpec) -> Vec<EnvVar> {
    let mut e = Vec::new();
    let d = s.download.clone().unwrap_or_default();
    e.push(ev(env::SOURCE, s.source.clone()));
    e.push(ev(env::REVISION, s.revision.clone()));
    e.push(ev(env::REPO_TYPE, "model"));
    e.push(ev(env::ALLOW_PATTERNS, d.allow_patterns.join(",")));
    e.push(ev(env::IGNORE_PATTERNS, d.ignore_patterns.join(",")));
    // The calibration set, for the formats whose engine reads one (GGUF's only with `calibration` set: its
    // importance matrix).
    if let Some(q) = s.quantization.as_ref().filter(|q| reads_calibration(q)) {
        e.push(ev(env::DATASET, q.effective_calibration().dataset));
    }
    // The abliteration prompt sets are hub datasets too: fetched with the model.
    if let Some(a) = &s.abliteration {
        e.push(ev(env::REFUSAL_DATASET, a.refusal_dataset.clone()));
        e.push(ev(env::HARMLESS_DATASET, a.harmless_dataset.clone()));
    }
    // Only the download talks to the hub; an `oci://` source needs the registry login.
    if let Some(sec) = &s.secret_ref {
        e.push(secret_ev(env::HF_TOKEN, sec, env::HF_TOKEN));
        if matches!(SourceUri::parse(&s.source), SourceUri::Oci(_)) {
            e.push(secret_ev(env::OCI_USERNAME, sec, env::OCI_USERNAME));
            e.push(secret_ev(env::OCI_PASSWORD, sec, env::OCI_PASSWORD));
        }
    }
    e
}

/// The abliteration's settings (none without `spec.abliteration`).
fn abliterate_env(s: &ModelCacheSpec) -> Vec<EnvVar> {
    let mut e = Vec::new();
    if let Some(a) = &s.abliteration {
        e.push(ev(env::NUM_SAMPLES, a.num_samples.to_string()));
        e.push(ev(env::TARGET_LAYERS, a.target_layers.clone()));
        let wm: Vec<&str> = a.weight_matrices.iter().map(|w| w.as_str()).collect();
        e.push(ev(env::WEIGHT_MATRICES, wm.join(",")));
        e.push(ev(env::SKIP_GDN_LAYERS, a.skip_gdn_layers.to_string()));
        e.push(ev(env::SKIP_VISION, a.skip_vision_layers.to_string()));
        e.push(ev(env::NORM_THRESHOLD, a.norm_threshold.clone()));
        e.push(ev(env::ABLITERATE_LM_HEAD, a.ablitate_lm_head.to_string()));
        e.push(ev(
            env::MAX_PERPLEXITY_INCREASE_PERCENT,
            a.max_perplexity_increase_percent.clone(),
        ));
        e.push(ev(env::REFUSAL_DATASET, a.refusal_dataset.clone()));
        e.push(ev(env::HARMLESS_DATASET, a.harmless_dataset.clone()));
    }
    e
}

/// The quantization's settings and calibration (none without `spec.quantization`), then the
/// controller's GPTQ tunables.
fn quantize_env(s: &ModelCacheSpec, config: &Config) -> Vec<EnvVar> {
    let mut e = Vec::new();
    if let Some(q) = s
        .quantization
        .as_ref()
        .filter(|q| q.format == QuantFormat::Gguf)
    {
        // One llama.cpp file: the type, and with `calibration` the importance pass's data (no GPTQ settings).
        e.push(ev(env::FORMAT, env::FORMAT_GGUF));
        e.push(ev(
            env::GGUF_TYPE,
            q.effective_gguf_type().to_ascii_uppercase(),
        ));
        if reads_calibration(q) {
            let c = q.effective_calibration();
            e.push(ev(env::DATASET, c.dataset.clone()));
            e.push(ev(env::MAX_SAMPLES, c.max_samples.to_string()));
            e.push(ev(env::MAX_SEQ_LEN, c.max_seq_len.to_string()));
        }
        return e;
    }
    if let Some(q) = s
        .quantization
        .as_ref()
        .filter(|q| q.format == QuantFormat::Fp8)
    {
        // E4M3 weights with dynamic activation scales: no calibration, no GPTQ settings; the exclusion
        // decides which decoder linears stay in full precision. Per-channel scales (the worker's default).
        e.push(ev(env::FORMAT, env::FORMAT_FP8));
        e.push(ev(env::BITS, q.effective_bits().to_string()));
        e.push(ev(env::DYNAMIC_EXCLUSION, q.dynamic_exclusion.as_str()));
        return e;
    }
    if let Some(q) = s
        .quantization
        .as_ref()
        .filter(|q| q.format == QuantFormat::Awq)
    {
        // The activation-aware scale and clipping search on the calibration set, 4-bit groups with zero
        // points: no GPTQ settings (sym, descAct, damping do not apply).
        let c = q.effective_calibration();
        e.push(ev(env::FORMAT, env::FORMAT_AWQ));
        e.push(ev(env::BITS, q.effective_bits().to_string()));
        e.push(ev(env::GROUP_SIZE, q.group_size.to_string()));
        e.push(ev(env::MAX_SEQ_LEN, c.max_seq_len.to_string()));
        e.push(ev(env::MAX_SAMPLES, c.max_samples.to_string()));
        e.push(ev(env::DATASET, c.dataset.clone()));
        return e;
    }
    if let Some(q) = &s.quantization {
        let c = q.effective_calibration();
        if q.format == QuantFormat::CompressedTensors {
            // The GPTQ solve, written in compressed-tensors' pack-quantized layout: every GPTQ setting below.
            e.push(ev(env::FORMAT, env::FORMAT_COMPRESSED_TENSORS));
        }
        e.push(ev(env::BITS, q.effective_bits().to_string()));
        e.push(ev(env::GROUP_SIZE, q.group_size.to_string()));
        e.push(ev(env::SYM, q.sym.to_string()));
        e.push(ev(env::DESC_ACT, q.desc_act.to_string()));
        e.push(ev(env::DYNAMIC_EXCLUSION, q.dynamic_exclusion.as_str()));
        e.push(ev(env::MAX_SEQ_LEN, c.max_seq_len.to_string()));
        e.push(ev(env::MAX_SAMPLES, c.max_samples.to_string()));
        e.push(ev(env::DATASET, c.dataset.clone()));
        if let Some(n) = c.n_parallel_calib_samples {
            e.push(ev(env::N_PARALLEL_CALIB_SAMPLES, n.to_string()));
        }
        e.push(ev(env::GPU_MEMORY_FRACTION, q.gpu_memory_fraction.clone()));
        // Set only when the spec sets them: the worker's defaults apply otherwise.
        if let Some(gar) = q.act_group_aware {
            e.push(ev(env::ACT_GROUP_AWARE, gar.to_string()));
        }
        if let Some(clip) = q.clip_search {
            e.push(ev(env::CLIP_SEARCH, clip.to_string()));
        }
        if let Some(refine) = q.refine_scales {
            e.push(ev(env::REFINE_SCALES, refine.to_string()));
        }
        for (k, v) in &config.gptq_tunables {
            // The cache's own damping wins over the cluster-wide default.
            match (&q.damp_percent, k.as_str()) {
                (Some(d), env::GPTQ_DAMP_PERCENT_OVERRIDE) => e.push(ev(k, d.clone())),
                _ => e.push(ev(k, v.clone())),
            }
        }
    }
    e
}

/// The publish target, tag policy and registry login (`spec.publish.secretRef`, else the cache's).
fn publish_env(s: &ModelCacheSpec) -> Vec<EnvVar> {
    let mut e = Vec::new();
    if let Some(p) = &s.publish {
        e.push(ev(env::OCI_REF, p.oci_ref.clone().unwrap_or_default()));
        let policy = serde_json::to_value(p.tag_policy)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_else(|| "overwrite".into());
        e.push(ev(env::OCI_TAG_POLICY, policy));
        e.push(ev(env::OCI_ADDITIONAL_TAGS, p.additional_tags.join(",")));
        e.push(ev(env::OCI_INSECURE, p.insecure.to_string()));
        if let Some(sec) = p.secret_ref.as_ref().or(s.secret_ref.as_ref()) {
            e.push(secret_ev(env::OCI_USERNAME, sec, env::OCI_USERNAME));
            e.push(secret_ev(env::OCI_PASSWORD, sec, env::OCI_PASSWORD));
        }
    }
    e
}

/// The GPU profile's env, which overrides any variable above of the same name (same name wins last).
fn apply_profile_env(t: &PhaseTarget, e: &mut Vec<EnvVar>) {
    if let Some(p) = &t.profile {
        for pe in &p.spec.env {
            // Profile env may override defaults above (same name wins last).
            e.retain(|x| x.name != pe.name);
            e.push(pe.clone());
        }
    }
}
