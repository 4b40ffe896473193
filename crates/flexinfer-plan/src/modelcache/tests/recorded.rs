//! The stores do not keep a Job whose completion the status records; the planner reads it as
//! `observe::recorded_job` describes it from the status. These tests plan every situation in which a
//! finished phase's Job matters twice — once with the Jobs as the cluster reports them, once with the
//! recorded phases' Jobs replaced by the status's description — and require the same plan.

use super::*;
use crate::modelcache::observe::{recorded_job, records};

/// SIMPLE or FULL driven to Ready; returns the Ready object and every Job as the cluster has it.
fn ready_with_jobs(y: &str) -> (ModelCache, Vec<ObservedJob>) {
    let c = cfg();
    let mut mc = cache(y);
    if let Some(a) = mc.spec.abliteration.as_mut() {
        a.use_gpu = false;
    }
    let mut jobs: Vec<ObservedJob> = Vec::new();
    for step in 0..8 {
        let now = t(10 * step);
        let p = plan(&mc, &obs(jobs.clone()), &c, now);
        mc = applied(mc, &p);
        if p.status.phase == Some(CachePhase::Ready) {
            return (mc, jobs);
        }
        for j in created_jobs(&p) {
            let phase = JobPhase::ALL
                .into_iter()
                .find(|ph| j.ends_with(ph.as_str()))
                .expect("a pipeline Job");
            jobs.push(job_from(&p, phase, t(10 * step + 1), JobState::Succeeded));
        }
    }
    panic!("not Ready after 8 steps: {:?}", mc.status);
}

/// The Jobs the planner sees when the stores left out every Job the status records.
fn as_stored(mc: &ModelCache, jobs: &[ObservedJob]) -> Vec<ObservedJob> {
    jobs.iter()
        .map(|j| {
            if records(mc, j.phase, j.created, j.spec_hash.as_deref()) {
                recorded_job(mc, j.phase).expect("a recorded Job is described by the status")
            } else {
                j.clone()
            }
        })
        .collect()
}

fn same_plan(mc: &ModelCache, jobs: &[ObservedJob], now: Timestamp, what: &str) -> Plan {
    let c = cfg();
    let stored = as_stored(mc, jobs);
    let left_out = stored
        .iter()
        .filter(|j| j.pod.is_none() && j.out_dir.is_none())
        .count();
    let real = plan(mc, &obs(jobs.to_vec()), &c, now);
    let described = plan(mc, &obs(stored), &c, now);
    assert_eq!(
        format!("{:?}", real.actions),
        format!("{:?}", described.actions),
        "{what}: actions differ"
    );
    assert_eq!(real.status, described.status, "{what}: status differs");
    assert_eq!(
        real.requeue_after, described.requeue_after,
        "{what}: requeue differs"
    );
    assert!(
        left_out > 0,
        "{what}: no Job was left out, the test compares nothing"
    );
    real
}

#[test]
fn a_ready_cache_plans_the_same_without_its_jobs() {
    for y in [SIMPLE, FULL] {
        let (mc, jobs) = ready_with_jobs(y);
        assert!(
            jobs.iter()
                .all(|j| records(&mc, j.phase, j.created, j.spec_hash.as_deref())),
            "every Job of a Ready cache is recorded"
        );
        let p = same_plan(&mc, &jobs, t(500), "ready");
        assert!(created_jobs(&p).is_empty() && deleted_jobs(&p).is_empty());
    }
}

#[test]
fn reruns_delete_the_same_jobs_without_them_in_the_stores() {
    let (ready, jobs) = ready_with_jobs(FULL);
    // Trigger annotations.
    for a in [
        annotations::REDOWNLOAD,
        annotations::REABLITERATE,
        annotations::REQUANTIZE,
    ] {
        let mut mc = ready.clone();
        mc.metadata.annotations = Some(BTreeMap::from([(a.to_string(), "true".to_string())]));
        let p = same_plan(&mc, &jobs, t(500), a);
        assert!(!deleted_jobs(&p).is_empty(), "{a}: deletes finished Jobs");
    }
    // A spec change of the download (every phase re-runs).
    let mut mc = ready.clone();
    mc.spec.source = "org/other".into();
    mc.metadata.generation = Some(2);
    let p = same_plan(&mc, &jobs, t(500), "source changed");
    assert!(!deleted_jobs(&p).is_empty());
    // A phase removed from the spec.
    let mut mc = ready.clone();
    mc.spec.abliteration = None;
    mc.metadata.generation = Some(2);
    let p = same_plan(&mc, &jobs, t(500), "abliteration removed");
    assert!(deleted_jobs(&p).contains(&"mc-abliterate".to_string()));
    let mut mc = ready.clone();
    mc.spec.publish = None;
    mc.metadata.generation = Some(2);
    same_plan(&mc, &jobs, t(500), "publish removed");
    // A new worker image for one phase (a GPUProfile change).
    let c = cfg();
    let real = plan(&ready, &with_image(&jobs, "q:b", None), &c, t(500));
    let described = plan(&ready, &with_image(&jobs, "q:b", Some(&ready)), &c, t(500));
    assert_eq!(
        format!("{:?}", real.actions),
        format!("{:?}", described.actions)
    );
    assert_eq!(real.status, described.status);
}

fn with_image(jobs: &[ObservedJob], image: &str, stored_from: Option<&ModelCache>) -> Observed {
    let jobs = match stored_from {
        Some(mc) => as_stored(mc, jobs),
        None => jobs.to_vec(),
    };
    let mut o = obs(jobs);
    o.profiles = vec![profile("gfx1100", image)];
    o
}

#[test]
fn records_names_the_job_the_status_describes_only() {
    let (mc, jobs) = ready_with_jobs(SIMPLE);
    let dl = jobs
        .iter()
        .find(|j| j.phase == JobPhase::Download)
        .expect("download Job");
    assert!(records(
        &mc,
        JobPhase::Download,
        dl.created,
        dl.spec_hash.as_deref()
    ));
    // Another spec hash, a Job created after the record (a re-run's), a phase not done.
    assert!(!records(&mc, JobPhase::Download, dl.created, Some("other")));
    assert!(!records(&mc, JobPhase::Download, t(100_000), None));
    assert!(!records(&mc, JobPhase::Abliterate, dl.created, None));
    let d = recorded_job(&mc, JobPhase::Download).expect("described");
    assert_eq!(
        (
            d.name.as_str(),
            &d.state,
            d.spec_hash.as_deref(),
            d.terminating
        ),
        (
            "mc-download",
            &JobState::Succeeded,
            dl.spec_hash.as_deref(),
            false
        )
    );
    assert!(recorded_job(&mc, JobPhase::Abliterate).is_none());
    // A re-run clears the record: the new Job is not described by the status.
    let mut again = mc.clone();
    again.metadata.annotations = Some(BTreeMap::from([(
        annotations::REDOWNLOAD.to_string(),
        "true".to_string(),
    )]));
    let p = plan(&again, &obs(as_stored(&mc, &jobs)), &cfg(), t(600));
    let cleared = applied(again, &p);
    assert!(recorded_job(&cleared, JobPhase::Download).is_none());
    assert!(!records(&cleared, JobPhase::Download, dl.created, None));
}
