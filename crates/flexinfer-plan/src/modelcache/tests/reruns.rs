//! What re-runs a phase: spec changes, trigger annotations, image drift, phases added or removed, legacy hashes.

use super::*;

#[test]
fn image_drift_inside_and_outside_grace_window() {
    let c = cfg();
    let mc = cache(FULL);
    // Abliteration etc. done: get to a running quantize Job with image q:a.
    let mut mcx = mc.clone();
    let mut done = vec![];
    let mut p = plan(&mcx, &obs(vec![]), &c, t(0));
    for ph in [JobPhase::Download, JobPhase::Abliterate] {
        done.push(job_from(&p, ph, t(0), JobState::Succeeded));
        mcx = applied(mcx, &p);
        p = plan(&mcx, &obs(done.clone()), &c, t(1));
    }
    let q = job_from(&p, JobPhase::Quantize, t(10), JobState::Active);
    assert_eq!(q.image, "q:a");
    mcx = applied(mcx, &p);
    let with_profile = |img: &str, jobs: Vec<ObservedJob>| {
        let mut o = obs(jobs);
        o.profiles = vec![profile("gfx1100", img)];
        o
    };
    let mut all = done.clone();
    all.push(q.clone());
    // Same image: nothing.
    let same = plan(&mcx, &with_profile("q:a", all.clone()), &c, t(20));
    assert!(deleted_jobs(&same).is_empty());
    // Young Job, new image: replaced with a warning.
    let young = plan(&mcx, &with_profile("q:b", all.clone()), &c, t(10 + 599));
    assert_eq!(deleted_jobs(&young), vec!["mc-quantize"]);
    assert!(events(&young).contains(&"QuantizerImageDrift".to_string()));
    // Old Job: left to finish.
    let old = plan(&mcx, &with_profile("q:b", all.clone()), &c, t(10 + 601));
    assert!(deleted_jobs(&old).is_empty());
    assert!(!events(&old).contains(&"QuantizerImageDrift".to_string()));
    // Old Job with force-image-update: replaced.
    let mut forced = mcx.clone();
    forced.metadata.annotations = Some(BTreeMap::from([(
        annotations::FORCE_IMAGE_UPDATE.into(),
        "true".into(),
    )]));
    let f = plan(&forced, &with_profile("q:b", all.clone()), &c, t(10 + 5000));
    assert_eq!(deleted_jobs(&f), vec!["mc-quantize"]);
    // Configurable grace window.
    let short = Config {
        drift_grace: Duration::from_secs(5),
        ..cfg()
    };
    let s = plan(&mcx, &with_profile("q:b", all.clone()), &short, t(10 + 6));
    assert!(deleted_jobs(&s).is_empty());
    // After deletion the Job is recreated with the new image.
    let recreated = plan(&mcx, &with_profile("q:b", done.clone()), &c, t(700));
    let j = job_from(&recreated, JobPhase::Quantize, t(700), JobState::Active);
    assert_eq!(j.image, "q:b");
    // A Ready cache is not rebuilt because the image changed.
    let mut all_done = done.clone();
    let qs = job_from(&recreated, JobPhase::Quantize, t(700), JobState::Succeeded);
    all_done.push(qs);
    let m2 = applied(mcx.clone(), &recreated);
    let p = plan(&m2, &with_profile("q:b", all_done.clone()), &c, t(710));
    all_done.push(job_from(&p, JobPhase::Publish, t(710), JobState::Succeeded));
    let m3 = applied(m2, &p);
    let p = plan(&m3, &with_profile("q:b", all_done.clone()), &c, t(720));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    let m4 = applied(m3, &p);
    let p = plan(&m4, &with_profile("q:c", all_done), &c, t(730));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    assert!(created_jobs(&p).is_empty() && deleted_jobs(&p).is_empty());
}

#[test]
fn requantize_reruns_only_quantize_and_keeps_path_until_success() {
    let c = cfg();
    let ready = ready_simple();
    let old_path = ready.status.as_ref().and_then(|s| s.path.clone());
    assert!(
        old_path
            .as_deref()
            .is_some_and(|p| p.starts_with("mc-cache:mc/gptq-w4-g128.")),
        "{old_path:?}"
    );
    // Change the spec (bits 4 -> 8): quantization re-runs, download does not.
    let mut mc = ready.clone();
    if let Some(q) = mc.spec.quantization.as_mut() {
        q.bits = Some(8);
    }
    mc.metadata.generation = Some(2);
    let old_q = ObservedJob {
        phase: JobPhase::Quantize,
        name: "mc-quantize".into(),
        image: "worker:1".into(),
        spec_hash: ready
            .status
            .as_ref()
            .and_then(|s| s.quantization.as_ref())
            .and_then(|q| q.spec_hash.clone()),
        created: t(11),
        started: t(11),
        terminating: false,
        state: JobState::Succeeded,
        pod: None,
        deadline_seconds: None,
        out_dir: None,
    };
    let p = plan(&mc, &obs(vec![old_q]), &c, t(100));
    assert_eq!(deleted_jobs(&p), vec!["mc-quantize"]);
    assert!(created_jobs(&p).is_empty(), "waits for the old Job to go");
    assert_eq!(p.status.phase, Some(CachePhase::Quantizing));
    assert_eq!(
        p.status.path, old_path,
        "path moved before the new run succeeded"
    );
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![]), &c, t(110));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    assert_eq!(p.status.path, old_path);
    let q = job_from(&p, JobPhase::Quantize, t(111), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![q]), &c, t(120));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    let new_path = p.status.path.clone().unwrap_or_default();
    assert!(
        new_path.starts_with("mc-cache:mc/gptq-w8-g128."),
        "{new_path}"
    );
    // The replaced generation is kept (the default keeps one) and named in status.
    assert_eq!(
        p.status
            .quantization
            .as_ref()
            .and_then(|q| q.generations.previous_output_dirs.clone()),
        old_path
            .as_deref()
            .and_then(|p| p.split_once(':'))
            .map(|(_, d)| vec![d.to_string()])
    );

    // The annotation: re-runs quantization with the same spec, and is removed.
    let mut mc = ready.clone();
    mc.metadata.annotations = Some(BTreeMap::from([(
        annotations::REQUANTIZE.into(),
        "true".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &c, t(200));
    assert!(p.actions.contains(&Action::RemoveAnnotations(vec![
        annotations::REQUANTIZE.into()
    ])));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    assert_eq!(p.status.path, old_path);
    // A new generation: the re-run writes beside the served artifact instead of reusing it.
    let out_dir = |p: &Plan| -> String {
        p.actions
            .iter()
            .find_map(|a| match a {
                Action::CreateJob(j) => j
                    .spec
                    .clone()
                    .and_then(|s| s.template.spec)
                    .and_then(|s| s.containers[0].env.clone())
                    .and_then(|e| e.into_iter().find(|e| e.name == "OUT_DIR"))
                    .and_then(|e| e.value),
                _ => None,
            })
            .unwrap_or_default()
    };
    let old_dir = old_path
        .as_deref()
        .and_then(|p| p.split_once(':'))
        .map(|(_, d)| d);
    assert_ne!(Some(out_dir(&p).trim_start_matches("/cache/")), old_dir);
    assert!(
        out_dir(&p).starts_with("/cache/mc/gptq-w4-g128."),
        "{}",
        out_dir(&p)
    );
    assert!(
        p.status
            .download
            .as_ref()
            .and_then(|d| d.completed_at.clone())
            .is_some(),
        "download must stay done"
    );
}

#[test]
fn redownload_reruns_everything() {
    let c = cfg();
    let mut mc = ready_simple();
    mc.metadata.annotations = Some(BTreeMap::from([(
        annotations::REDOWNLOAD.into(),
        "true".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &c, t(300));
    assert_eq!(created_jobs(&p), vec!["mc-download"]);
    assert!(p
        .status
        .quantization
        .as_ref()
        .and_then(|q| q.completed_at.clone())
        .is_none());
}

#[test]
fn running_job_from_an_older_spec_is_replaced() {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let j = job_from(&p, JobPhase::Download, t(1), JobState::Active);
    let mut mc = applied(mc, &p);
    mc.spec.revision = "v2".into();
    let p = plan(&mc, &obs(vec![j]), &c, t(30));
    assert_eq!(deleted_jobs(&p), vec!["mc-download"]);
}

#[test]
fn adding_or_removing_abliteration_reruns_quantize() {
    let c = cfg();
    let ready = ready_simple();
    // Add abliteration: abliterate runs, then quantize again (it now reads abliterated/).
    let mut mc = ready.clone();
    mc.spec.abliteration = cache(FULL).spec.abliteration;
    if let Some(a) = mc.spec.abliteration.as_mut() {
        a.use_gpu = false;
    }
    let p = plan(&mc, &obs(vec![]), &c, t(100));
    assert_eq!(created_jobs(&p), vec!["mc-abliterate"]);
    assert!(p
        .status
        .quantization
        .as_ref()
        .and_then(|q| q.completed_at.clone())
        .is_none());
    assert_eq!(
        p.status.path,
        ready.status.as_ref().and_then(|s| s.path.clone())
    );
    let ab = job_from(&p, JobPhase::Abliterate, t(101), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![ab]), &c, t(110));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    let q = job_from(&p, JobPhase::Quantize, t(111), JobState::Succeeded);
    let env = match p.actions.iter().find(|a| matches!(a, Action::CreateJob(_))) {
        Some(Action::CreateJob(j)) => j
            .spec
            .clone()
            .and_then(|s| s.template.spec)
            .map(|s| s.containers[0].env.clone().unwrap_or_default())
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let ablit = mc_ablit_dir(&p);
    assert!(env
        .iter()
        .any(|e| e.name == "MODEL_DIR" && e.value.as_deref() == Some(ablit.as_str())));
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![q]), &c, t(120));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    // Remove it again: quantize re-runs on the downloaded model.
    let mut mc = applied(mc, &p);
    mc.spec.abliteration = None;
    let p = plan(&mc, &obs(vec![]), &c, t(200));
    assert!(p.status.abliteration.is_none());
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
}

/// A phase completed under the hash an older controller wrote (which also covered run-only settings) is
/// current: no re-run after an upgrade, and status is migrated to the new hash.
#[test]
fn status_written_under_the_legacy_hash_is_current_and_migrated() {
    let c = cfg();
    let mut ready = ready_simple();
    let spec = ready.clone();
    let q = ready
        .status
        .as_mut()
        .and_then(|s| s.quantization.as_mut())
        .expect("quantization status");
    let image = q.image.clone().expect("image");
    let current = jobs::spec_hash(&spec, JobPhase::Quantize, &image);
    let legacy = jobs::legacy_spec_hash(&spec, JobPhase::Quantize, &image);
    assert_ne!(legacy, current, "the fixture must have run-only settings");
    q.spec_hash = Some(legacy);
    let p = plan(&ready, &obs(vec![]), &c, t(500));
    assert!(created_jobs(&p).is_empty() && deleted_jobs(&p).is_empty());
    assert_eq!(
        p.status
            .quantization
            .as_ref()
            .and_then(|q| q.spec_hash.clone()),
        Some(current)
    );
    assert_eq!(
        p.status.path,
        ready.status.as_ref().and_then(|s| s.path.clone())
    );
    // An unrelated hash is a spec change: the phase re-runs.
    if let Some(q) = ready.status.as_mut().and_then(|s| s.quantization.as_mut()) {
        q.spec_hash = Some("0000000000000000".into());
    }
    assert!(
        !deleted_jobs(&plan(&ready, &obs(vec![]), &c, t(501))).is_empty()
            || !created_jobs(&plan(&ready, &obs(vec![]), &c, t(501))).is_empty()
    );
}

#[test]
fn trigger_annotations_are_read_against_the_enabled_phases() {
    use crate::modelcache::triggers::{read_triggers, Triggers};
    let with = |y: &str, pairs: &[(&str, &str)]| {
        let mut mc = cache(y);
        mc.metadata.annotations = Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        mc
    };
    let (rd, rq, ra, rr) = (
        annotations::REDOWNLOAD,
        annotations::REQUANTIZE,
        annotations::REABLITERATE,
        annotations::RESET_RETRIES,
    );
    let cases = [
        // (cache, annotations, re-runs, earliest index, reset retries, removed, why)
        (SIMPLE, vec![], vec![], None, false, vec![], "none"),
        (
            SIMPLE,
            vec![(rq, "true")],
            vec![(rq, JobPhase::Quantize)],
            Some(1),
            false,
            vec![rq],
            "requantize",
        ),
        (
            SIMPLE,
            vec![(rq, "false")],
            vec![],
            None,
            false,
            vec![rq],
            "a false trigger is removed only",
        ),
        (
            SIMPLE,
            vec![(ra, "true")],
            vec![],
            None,
            false,
            vec![ra],
            "a trigger of a disabled phase is removed only",
        ),
        (
            FULL,
            vec![(rq, "true"), (rd, "true")],
            vec![(rd, JobPhase::Download), (rq, JobPhase::Quantize)],
            Some(0),
            false,
            vec![rd, rq],
            "the earliest phase wins; trigger order",
        ),
        (
            FULL,
            vec![(ra, "true")],
            vec![(ra, JobPhase::Abliterate)],
            Some(1),
            false,
            vec![ra],
            "reabliterate",
        ),
        (
            SIMPLE,
            vec![(rr, "true")],
            vec![],
            None,
            true,
            vec![rr],
            "reset-retries",
        ),
        (
            SIMPLE,
            vec![(rr, "no")],
            vec![],
            None,
            false,
            vec![rr],
            "reset-retries not true",
        ),
    ];
    for (y, pairs, reruns, rerun_from, reset_retries, remove, why) in cases {
        let mc = with(y, &pairs);
        let phases = jobs::enabled_phases(&mc);
        let want = Triggers {
            remove: remove.into_iter().map(String::from).collect(),
            reruns,
            rerun_from,
            reset_retries,
        };
        assert_eq!(read_triggers(&mc, &phases), want, "{why}");
    }
}

/// A cache downloaded before downloads had generations (files in `<modelPath>`, no
/// `download.outputDir`): a new revision downloads into a generation while `<modelPath>` is kept (it is
/// the promoted download), and once it succeeds `<modelPath>` is named as the replaced download. A
/// first download names no previous one.
#[test]
fn a_pre_generation_download_is_kept_then_becomes_the_previous_one() {
    let c = cfg();
    let first = ready_simple();
    let d1 = first
        .status
        .as_ref()
        .and_then(|s| s.download.clone())
        .expect("download");
    assert!(
        d1.output_dir
            .as_deref()
            .is_some_and(|o| o.starts_with("mc/source.")),
        "{d1:?}"
    );
    assert_eq!(
        d1.previous_output_dirs, None,
        "a first download replaces nothing"
    );

    let mut mc = first;
    if let Some(d) = mc.status.as_mut().and_then(|s| s.download.as_mut()) {
        d.output_dir = None;
        d.generation = None;
        d.previous_output_dirs = None;
        d.revision = Some("main".into());
    }
    mc.spec.revision = "v2".into();
    let p = plan(&mc, &obs(vec![]), &c, t(100));
    assert_eq!(created_jobs(&p), vec!["mc-download"]);
    let job = p
        .actions
        .iter()
        .find_map(|a| match a {
            Action::CreateJob(j) => Some(j.clone()),
            _ => None,
        })
        .expect("download Job");
    let env = job
        .spec
        .and_then(|s| s.template.spec)
        .expect("pod")
        .containers[0]
        .env
        .clone()
        .unwrap_or_default();
    let get = |k: &str| {
        env.iter()
            .find(|e| e.name == k)
            .and_then(|e| e.value.clone())
    };
    let out = get("OUT_DIR").expect("OUT_DIR");
    assert!(out.starts_with("/cache/mc/source."), "{out}");
    let keep = get("FLEXINFER_KEEP_DIRS").expect("keep list");
    let keep: Vec<&str> = keep.split(',').collect();
    assert!(
        keep.contains(&"mc"),
        "the pre-generation download is not kept: {keep:?}"
    );
    let dl = job_from(&p, JobPhase::Download, t(101), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl]), &c, t(110));
    let d = p.status.download.expect("download");
    assert_eq!(d.output_dir.as_deref(), out.strip_prefix("/cache/"));
    assert_eq!(d.previous_output_dirs, Some(vec!["mc".to_string()]));
}
