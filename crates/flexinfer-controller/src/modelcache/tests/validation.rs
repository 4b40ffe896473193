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
    let no_image = Config::default();
    let p = plan(&cache(SIMPLE), &obs(vec![]), &no_image, t(0));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    let r = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(r.reason, "ImageNotConfigured");
    assert!(r.message.contains("FLEXINFER_WORKER_IMAGE"));
    let mut mc = cache(SIMPLE);
    mc.metadata.annotations = Some(BTreeMap::from([(
        "flexinfer.ai/job-pod-labels".into(),
        "{not json".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &cfg(), t(0));
    let r = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(r.reason, "InvalidSpec");
    assert!(r.message.contains("flexinfer.ai/job-pod-labels"));
}
