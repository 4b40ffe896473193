//! Specs the API admits but the controller cannot run.

use super::*;

#[test]
fn unsupported_format_fails_clearly_once() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("format: GPTQ", "format: EXL2"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    assert!(created_jobs(&p).is_empty());
    let ready = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(ready.reason, "UnsupportedFormat");
    assert!(ready.message.contains("EXL2"), "{}", ready.message);
    assert_eq!(
        conditions::find(&p.status.conditions, "Quantized").map(|c| c.reason.as_str()),
        Some("UnsupportedFormat")
    );
    assert_eq!(events(&p), vec!["UnsupportedFormat"]);
    let mc = applied(mc, &p);
    let again = plan(&mc, &obs(vec![]), &c, t(60));
    assert!(!again.status_changed && events(&again).is_empty() && again.requeue_after.is_none());
    // Fixing the spec recovers without intervention.
    let mut fixed = mc.clone();
    if let Some(q) = fixed.spec.quantization.as_mut() {
        q.format = flexinfer_api::modelcache::QuantFormat::Gptq;
    }
    assert_eq!(
        created_jobs(&plan(&fixed, &obs(vec![]), &c, t(70))),
        vec!["mc-download"]
    );
}

#[test]
fn missing_image_and_bad_annotations_become_conditions() {
    let annotated = |k: &str, v: &str| {
        let mut mc = cache(SIMPLE);
        mc.metadata.annotations = Some(BTreeMap::from([(k.to_string(), v.to_string())]));
        mc
    };
    let mut bad_path = cache(SIMPLE);
    bad_path.spec.model_path = Some("../elsewhere".into());
    let peer_on_my_dir = Observed {
        claim_peers: vec![ClaimPeer {
            name: "first".into(),
            model_dir: "mc".into(),
            older: true,
        }],
        pvc_exists: true,
        ..Observed::default()
    };
    let younger_peer = Observed {
        claim_peers: vec![ClaimPeer {
            older: false,
            ..peer_on_my_dir.claim_peers[0].clone()
        }],
        ..peer_on_my_dir.clone()
    };
    let none = obs(vec![]);
    let cases = [
        // (cache, config, observed, Ready reason, in its message)
        (
            cache(SIMPLE),
            Config::default(),
            &none,
            Some("ImageNotConfigured"),
            "FLEXINFER_WORKER_IMAGE",
        ),
        (
            annotated("flexinfer.ai/job-pod-labels", "{not json"),
            cfg(),
            &none,
            Some("InvalidSpec"),
            "flexinfer.ai/job-pod-labels",
        ),
        (
            annotated(
                "flexinfer.ai/job-pod-annotations",
                r#"{"container.apparmor.security.beta.kubernetes.io/worker": "unconfined"}"#,
            ),
            cfg(),
            &none,
            Some("InvalidSpec"),
            "AppArmor",
        ),
        (
            bad_path,
            cfg(),
            &none,
            Some("InvalidSpec"),
            "spec.modelPath",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: AWQ")),
            cfg(),
            &none,
            None,
            "AWQ at 4 bits, groups of 128, has an engine",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: AWQ, groupSize: 256")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "spec.quantization.groupSize 256: format AWQ takes groups of 32, 64 or 128",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: AWQ, bits: 8")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "spec.quantization.bits 8: format AWQ takes 4 bits",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: AWQ, descAct: true")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "spec.quantization.descAct true: format AWQ",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: EXL2")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "EXL2",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: GGUF, ggufType: Q3_K_S")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "spec.quantization.ggufType Q3_K_S",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: GGUF, ggufType: q5_k_m")),
            cfg(),
            &none,
            None,
            "a type the engine writes, in any case",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: COMPRESSED_TENSORS, bits: 3")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "spec.quantization.bits 3: format COMPRESSED_TENSORS (pack-quantized) takes 4 or 8 bits",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: COMPRESSED_TENSORS, descAct: true")),
            cfg(),
            &none,
            Some("UnsupportedFormat"),
            "spec.quantization.descAct true",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: COMPRESSED_TENSORS, bits: 8")),
            cfg(),
            &none,
            None,
            "compressed-tensors at 8 bits has an engine",
        ),
        (
            cache(&SIMPLE.replace("format: GPTQ", "format: COMPRESSED_TENSORS")),
            cfg(),
            &none,
            None,
            "compressed-tensors at the default 4 bits has an engine",
        ),
        (
            cache(SIMPLE),
            cfg(),
            &peer_on_my_dir,
            Some("ClaimConflict"),
            "ModelCache first already uses claim",
        ),
        (
            cache(SIMPLE),
            cfg(),
            &younger_peer,
            None,
            "the younger cache yields: no problem here",
        ),
    ];
    for (mc, config, observed, reason, needle) in cases {
        let p = plan(&mc, observed, &config, t(0));
        let ready = conditions::find(&p.status.conditions, "Ready");
        match reason {
            Some(reason) => {
                let r = ready.expect("Ready condition");
                assert_eq!(p.status.phase, Some(CachePhase::Failed), "{reason}");
                assert_eq!(r.reason, reason);
                assert!(r.message.contains(needle), "{reason}: {}", r.message);
                assert!(created_jobs(&p).is_empty(), "{reason}");
            }
            None => {
                assert_ne!(p.status.phase, Some(CachePhase::Failed), "{needle}");
                assert_eq!(created_jobs(&p), vec!["mc-download"], "{needle}");
            }
        }
    }
}

/// A GPUProfile (made before its CRD refused it) that sets a variable FlexInfer sets itself: the GPU
/// phase's Job is not created and the cache says which variables to remove; the vendor's own variables
/// (the fixture's HSA_OVERRIDE_GFX_VERSION) are fine; the download (no GPU) ran regardless.
#[test]
fn a_profile_env_that_sets_flexinfer_variables_is_refused_naming_them() {
    let c = cfg();
    let mc = cache(FULL);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    assert_eq!(created_jobs(&p), vec!["mc-download"]);
    let dl = job_from(&p, JobPhase::Download, t(1), JobState::Succeeded);
    let mc = applied(mc, &p);
    let with_env = |names: &[&str]| {
        let mut o = obs(vec![dl.clone()]);
        for n in names {
            o.profiles[0]
                .spec
                .env
                .push(k8s_openapi::api::core::v1::EnvVar {
                    name: (*n).into(),
                    value: Some("/elsewhere".into()),
                    value_from: None,
                });
        }
        plan(&mc, &o, &c, t(10))
    };
    let fine = with_env(&[]);
    assert_eq!(created_jobs(&fine), vec!["mc-abliterate"]);
    for (names, needle) in [
        (vec!["OUT_DIR"], "sets OUT_DIR in spec.env"),
        (
            vec!["FLEXINFER_WRITER_NODE", "LD_PRELOAD"],
            "sets FLEXINFER_WRITER_NODE, LD_PRELOAD in spec.env",
        ),
    ] {
        let p = with_env(&names);
        assert!(created_jobs(&p).is_empty(), "{names:?}");
        assert_eq!(p.status.phase, Some(CachePhase::Failed), "{names:?}");
        let ready = conditions::find(&p.status.conditions, "Ready").expect("Ready");
        assert_eq!(ready.reason, "ProfileEnvProtected");
        assert!(
            ready.message.contains(needle) && ready.message.contains("GPUProfile gfx1100"),
            "{}",
            ready.message
        );
    }
    // GPU tuning stays the profile's to set.
    let tuned = with_env(&["GPU_MEMORY_FRACTION", "GPTQ_DEVICE"]);
    assert_eq!(created_jobs(&tuned), vec!["mc-abliterate"]);
}

/// Registry credentials of a Secret go only to the registries the controller is configured with:
/// a cache whose publish target (or `oci://` source) is another registry fails before any Job,
/// with a condition naming the field and the registry.
#[test]
fn credentials_go_only_to_allowed_registries() {
    let with = |extra: &str| cache(&format!("{SIMPLE}{extra}"));
    // No registry configured: a Secret's credentials go nowhere.
    let evil = with("  secretRef: regcred\n  publish: {ociRef: \"evil.example:5000/x/y:v1\"}\n");
    let p = plan(&evil, &obs(vec![]), &cfg(), t(0));
    assert!(created_jobs(&p).is_empty(), "{:?}", created_jobs(&p));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    let ready = conditions::find(&p.status.conditions, "Ready").expect("Ready");
    assert_eq!(ready.reason, "CredentialRegistryNotAllowed");
    for want in [
        "spec.publish.ociRef",
        "evil.example:5000",
        "regcred",
        "spec.secretRef",
    ] {
        assert!(ready.message.contains(want), "{want}: {}", ready.message);
    }
    // Without a Secret nothing is sent: the cache runs as before.
    let public = with("  publish: {ociRef: \"evil.example:5000/x/y:v1\"}\n");
    assert_eq!(
        created_jobs(&plan(&public, &obs(vec![]), &cfg(), t(0))),
        vec!["mc-download"]
    );
}

#[test]
fn credential_registries_table() {
    use super::super::credentials::CredentialRegistries;
    let allow = |list: &str| Config {
        credential_registries: CredentialRegistries::parse(list).unwrap_or_else(|e| panic!("{e}")),
        ..cfg()
    };
    let with = |extra: &str| cache(&format!("{SIMPLE}{extra}"));
    let publish = |secret: &str, reference: &str| {
        with(&format!(
            "  secretRef: cache-secret\n  publish: {{ociRef: \"{reference}\"{secret}}}\n"
        ))
    };
    let oci_source = |reference: &str| {
        let mut mc = with("  secretRef: cache-secret\n");
        mc.spec.source = reference.to_string();
        mc
    };
    // (case, cache, config, Ok(first Job) or Err(words of the Ready message))
    type Case<'a> = (&'a str, ModelCache, Config, Result<&'a str, Vec<&'a str>>);
    let cases: Vec<Case> = vec![
        (
            "listed publish registry",
            publish("", "registry.local:5000/m/q:v1"),
            allow("ghcr.io,registry.local:5000"),
            Ok("mc-download"),
        ),
        (
            "any registry",
            publish("", "evil.example/m/q"),
            allow("*"),
            Ok("mc-download"),
        ),
        (
            "case and scheme do not matter",
            publish("", "oci://Registry.Local:5000/m/q"),
            allow("registry.local:5000"),
            Ok("mc-download"),
        ),
        (
            "publish.secretRef to an unlisted registry",
            publish(", secretRef: push-secret", "evil.example/m/q"),
            allow("ghcr.io"),
            Err(vec![
                "spec.publish.ociRef",
                "registry evil.example",
                "push-secret",
                "spec.publish.secretRef",
                "ghcr.io",
            ]),
        ),
        (
            "another port is another registry",
            publish("", "ghcr.io:8443/m/q"),
            allow("ghcr.io"),
            Err(vec!["registry ghcr.io:8443", "spec.secretRef"]),
        ),
        (
            "userinfo-looking reference",
            publish("", "ghcr.io@evil.example/m/q"),
            allow("ghcr.io"),
            Err(vec!["spec.publish.ociRef", "no registry host"]),
        ),
        (
            "oci:// source with spec.secretRef",
            oci_source("oci://evil.example/m/q:v1"),
            allow("ghcr.io"),
            Err(vec!["spec.source", "registry evil.example", "cache-secret"]),
        ),
        (
            "oci:// source to a listed registry",
            oci_source("OCI://ghcr.io/m/q:v1"),
            allow("ghcr.io"),
            Ok("mc-download"),
        ),
        (
            "hub source: the Secret goes to the hub only",
            with("  secretRef: cache-secret\n"),
            cfg(),
            Ok("mc-download"),
        ),
    ];
    for (case, mc, config, want) in cases {
        let p = plan(&mc, &obs(vec![]), &config, t(0));
        match want {
            Ok(job) => assert_eq!(created_jobs(&p), vec![job], "{case}"),
            Err(words) => {
                assert!(
                    created_jobs(&p).is_empty(),
                    "{case}: {:?}",
                    created_jobs(&p)
                );
                let ready = conditions::find(&p.status.conditions, "Ready").expect("Ready");
                assert_eq!(ready.reason, "CredentialRegistryNotAllowed", "{case}");
                for w in words {
                    assert!(
                        ready.message.contains(w),
                        "{case}: {w} not in {}",
                        ready.message
                    );
                }
                assert_eq!(events(&p), vec!["CredentialRegistryNotAllowed"], "{case}");
            }
        }
    }
}

/// A cache that already published at its current spec stays Ready when the list changes; a
/// re-run of the publish is refused before its Job.
#[test]
fn a_done_publish_is_kept_and_a_new_one_is_checked() {
    use super::super::credentials::CredentialRegistries;
    let allowed = Config {
        credential_registries: CredentialRegistries::Any,
        ..cfg()
    };
    let mut mc = cache(&format!(
        "{SIMPLE}  secretRef: cache-secret\n  publish: {{ociRef: \"evil.example/m/q\"}}\n"
    ));
    let mut done = Vec::new();
    let mut p = plan(&mc, &obs(vec![]), &allowed, t(0));
    for (i, phase) in [JobPhase::Download, JobPhase::Quantize, JobPhase::Publish]
        .into_iter()
        .enumerate()
    {
        let at = i64::try_from(i).unwrap_or_default() * 10;
        done.push(job_from(&p, phase, t(at + 1), JobState::Succeeded));
        mc = applied(mc, &p);
        p = plan(&mc, &obs(done.clone()), &allowed, t(at + 10));
    }
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    mc = applied(mc, &p);
    let strict = cfg();
    let again = plan(&mc, &obs(done.clone()), &strict, t(100));
    assert_eq!(again.status.phase, Some(CachePhase::Ready));
    assert!(again.actions.is_empty(), "{:?}", again.actions);
    // A new ociRef means a new publish: refused before its Job, naming the new registry.
    if let Some(p) = mc.spec.publish.as_mut() {
        p.oci_ref = Some("other.example/m/q".into());
    }
    mc.metadata.generation = Some(2);
    let changed = plan(&mc, &obs(done), &strict, t(110));
    assert!(
        created_jobs(&changed).is_empty(),
        "{:?}",
        created_jobs(&changed)
    );
    let ready = conditions::find(&changed.status.conditions, "Ready").expect("Ready");
    assert_eq!(ready.reason, "CredentialRegistryNotAllowed");
    assert!(ready.message.contains("other.example"), "{}", ready.message);
}

#[test]
fn node_local_without_what_it_needs_is_refused_naming_the_field() {
    let c = cfg();
    let with = |extra: &str| cache(&format!("{FULL}  storageStrategy: NodeLocal\n{extra}"));
    let mut no_publish = with("");
    no_publish.spec.publish = None;
    let mut no_selector = with("");
    no_selector.spec.node_selector = None;
    let cases = [
        (no_publish, "spec.publish.ociRef is required"),
        (no_selector, "spec.nodeLocal.nodeSelector is required"),
    ];
    for (mc, text) in cases {
        let p = plan(&mc, &obs(vec![]), &c, t(0));
        assert_eq!(p.status.phase, Some(CachePhase::Failed), "{text}");
        assert!(created_jobs(&p).is_empty(), "{text}: no Job");
        let ready = conditions::find(&p.status.conditions, "Ready").expect("cond");
        assert_eq!(ready.reason, "InvalidSpec", "{text}");
        assert!(ready.message.contains(text), "{}", ready.message);
    }
    // With its publish target and a node selector (its own or the cache's), the pipeline runs as any
    // other cache's does; the copies come after it.
    for mc in [
        with(""),
        with("  nodeLocal: {nodeSelector: {gpu: \"yes\"}}\n"),
    ] {
        assert_eq!(
            created_jobs(&plan(&mc, &obs(vec![]), &c, t(0))),
            vec!["mc-download"]
        );
    }
}
