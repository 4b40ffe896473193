//! Which store contents meet the expectation a write left.

use super::*;

#[test]
fn job_expectations_are_met_only_by_the_store_showing_the_write() {
    use crate::modelcache::stores::{expectation_met, Expectation};
    let mut j = stored_job(JobPhase::Download, "Running");
    let created = Expectation::JobCreated {
        name: "x".into(),
        uid: "u-1".into(),
    };
    let deleted = Expectation::JobDeleted {
        name: "x".into(),
        uid: Some("u-1".into()),
    };
    assert!(!expectation_met(&created, None), "not in the store yet");
    assert!(expectation_met(&created, Some(&j)));
    assert!(expectation_met(&deleted, None), "gone");
    assert!(
        !expectation_met(&deleted, Some(&j)),
        "still there, not terminating"
    );
    j.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(5)));
    assert!(expectation_met(&deleted, Some(&j)), "terminating");
    j.metadata.deletion_timestamp = None;
    j.metadata.uid = Some("u-2".into());
    assert!(
        !expectation_met(&created, Some(&j)),
        "an older Job of that name"
    );
    assert!(expectation_met(&deleted, Some(&j)), "replaced by a new Job");
}
