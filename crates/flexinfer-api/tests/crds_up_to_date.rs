//! The checked-in CRD YAML must be exactly what the types generate (`make crds`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::path::PathBuf;

use flexinfer_api::crdgen::{crds, to_yaml, OUTPUT_DIRS};

#[test]
fn checked_in_crds_match_the_types() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut stale = Vec::new();
    for dir in OUTPUT_DIRS {
        for (name, crd) in crds() {
            let want = to_yaml(&crd).expect("serialize CRD");
            let path = root.join(dir).join(name);
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            if have != want {
                stale.push(path.display().to_string());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "generated CRDs differ from the checked-in YAML; run `make crds`: {stale:?}"
    );
}

#[test]
fn crds_carry_names_short_names_and_status() {
    let all = crds();
    let by_kind = |k: &str| {
        all.iter()
            .find(|(_, c)| c.spec.names.kind == k)
            .map(|(_, c)| c.clone())
            .expect(k)
    };
    let mc = by_kind("ModelCache");
    assert_eq!(mc.spec.versions[0].name, "v1alpha1");
    let model = by_kind("Model");
    assert_eq!(model.spec.versions[0].name, "v1alpha2");
    assert_eq!(model.spec.names.short_names, Some(vec!["mdl".to_string()]));
    let gp = by_kind("GPUProfile");
    assert_eq!(
        gp.spec.names.short_names,
        Some(vec!["gpup".to_string(), "gpuprofile".to_string()])
    );
    for (_, c) in &all {
        let v = &c.spec.versions[0];
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{} has no status subresource",
            c.spec.names.kind
        );
    }
    let cols: Vec<String> = mc.spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(
        cols,
        ["Phase", "Current", "Progress", "Format", "Ratio", "Age", "Path", "Retries"]
    );
}

#[test]
fn spec_defaults_are_in_the_schema() {
    let yaml = to_yaml(&crds()[0].1).unwrap();
    for needle in [
        "default: main",
        "default: 50Gi",
        "default: 3\n",
        "default: 128\n",
        "default: 4096",
        "default: 256",
        "default: mit-han-lab/pile-val-backup",
        "default: '0.80'",
        "default: '100'",
        "default: 14400",
        "default: 7200",
        "default: overwrite",
        "- o_proj\n",
        "- down_proj\n",
    ] {
        assert!(yaml.contains(needle), "ModelCache schema lacks {needle:?}");
    }
}
