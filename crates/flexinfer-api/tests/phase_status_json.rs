//! The phase statuses of a ModelCache keep the common `PhaseProgress` fields flat, first and in
//! their order (what `kubectl` shows and what the CRD schema says).
#![allow(clippy::unwrap_used)]

use flexinfer_api::modelcache::{
    AbliterationStatus, DownloadStatus, PhaseProgress, PublishStatus, QuantizationStatus,
};

/// The flattened progress fields stay flat, first, and in their order, for every phase status.
#[test]
fn phase_statuses_serialize_flat_with_progress_first() {
    let run = PhaseProgress {
        spec_hash: Some("h".into()),
        progress: Some(40),
        failure_message: Some("oom".into()),
        ..Default::default()
    };
    let cases: [(String, &str); 4] = [
        (
            serde_json::to_string(&DownloadStatus {
                run: run.clone(),
                file_count: Some(3),
                ..Default::default()
            })
            .unwrap(),
            r#"{"specHash":"h","progress":40,"failureMessage":"oom","fileCount":3}"#,
        ),
        (
            serde_json::to_string(&AbliterationStatus {
                run: run.clone(),
                layer: Some(7),
                ..Default::default()
            })
            .unwrap(),
            r#"{"specHash":"h","progress":40,"failureMessage":"oom","layer":7}"#,
        ),
        (
            serde_json::to_string(&QuantizationStatus {
                run: run.clone(),
                quant_type: Some("gptq-w4-g128".into()),
                ..Default::default()
            })
            .unwrap(),
            r#"{"specHash":"h","progress":40,"failureMessage":"oom","type":"gptq-w4-g128"}"#,
        ),
        (
            serde_json::to_string(&PublishStatus {
                run: run.clone(),
                oci_digest: Some("sha256:x".into()),
                ..Default::default()
            })
            .unwrap(),
            r#"{"specHash":"h","progress":40,"failureMessage":"oom","ociDigest":"sha256:x"}"#,
        ),
    ];
    for (json, want) in cases {
        assert_eq!(json, want);
    }
    let back: QuantizationStatus = serde_json::from_str(
        r#"{"specHash":"h","progress":40,"failureMessage":"oom","type":"gptq-w4-g128"}"#,
    )
    .unwrap();
    assert_eq!(back.run, run);
    assert_eq!(back.spec_hash.as_deref(), Some("h"), "reads through Deref");
}
