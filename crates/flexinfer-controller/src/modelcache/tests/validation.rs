//! Specs the API admits but the controller cannot run.

use super::*;

#[test]
fn unsupported_format_fails_clearly_once() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("format: GPTQ", "format: AWQ"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    assert!(created_jobs(&p).is_empty());
    let ready = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(ready.reason, "UnsupportedFormat");
    assert!(ready.message.contains("AWQ"), "{}", ready.message);
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
            Some("UnsupportedFormat"),
            "AWQ",
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
