//! `flexinfer-worker devices`: what this worker finds on the machine it runs on, as one JSON object on
//! stdout: each GPU runtime probed (as `GPTQ_DEVICE=auto` probes it; no device is opened) and each runtime's
//! vendor math libraries (BLAS and solver, as `GPTQ_VENDOR_LIBS=auto` loads them) with the reason for each
//! one that is not used; and the HIP code objects the binary embeds (target, size, SHA-256), the files of
//! `$FLEXINFER_KERNEL_DIR`, and the AMD targets of the node's KFD topology. For checking an image or a node
//! before a quantize Job runs there.

use flexinfer_quant::device::driver::code_objects::EMBEDDED_HIP_CODE_OBJECTS as EMBEDDED;
use flexinfer_quant::device::driver::code_objects::{
    code_object_files, kfd_targets, DRI_DIR, KERNEL_DIR_ENV, KFD_TOPOLOGY,
};
use flexinfer_quant::device::driver::math_libraries;
use flexinfer_quant::device::{DeviceKind, Platform, SystemPlatform};
use serde_json::{json, Value};

/// The report (see the module docs).
pub fn report() -> Value {
    let platform = SystemPlatform::default();
    let mut out = serde_json::Map::new();
    for kind in [DeviceKind::Hip, DeviceKind::Cuda] {
        let runtime = match platform.probe(kind) {
            Ok(info) => json!({
                "usable": true, "library": info.library, "devices": info.devices, "name": info.name,
            }),
            Err(e) => json!({"usable": false, "reason": flexinfer_contract::error::chain(&e)}),
        };
        let (libs, missing) = math_libraries(kind);
        out.insert(
            kind.as_str().to_string(),
            json!({
                "runtime": runtime,
                "vendorLibs": {"blas": libs.blas, "solver": libs.solver, "notUsed": missing},
            }),
        );
    }
    out.insert("hipCodeObjects".to_string(), hip_code_objects());
    Value::Object(out)
}

/// The HIP code objects the session would try (see `device::driver::code_objects`).
fn hip_code_objects() -> Value {
    use sha2::Digest as _;
    let embedded: Vec<Value> = EMBEDDED
        .iter()
        .map(|(target, bytes)| {
            json!({"target": target, "bytes": bytes.len(), "sha256": hex::encode(sha2::Sha256::digest(bytes))})
        })
        .collect();
    let dir = std::env::var_os(KERNEL_DIR_ENV).filter(|d| !d.is_empty());
    let mut files: Vec<String> = dir
        .as_ref()
        .map(|d| code_object_files(std::path::Path::new(d)))
        .unwrap_or_default()
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    json!({
        "embedded": embedded,
        "kernelDir": dir.map(|d| d.to_string_lossy().into_owned()),
        "kernelDirFiles": files,
        "nodeTargets": kfd_targets(std::path::Path::new(KFD_TOPOLOGY), std::path::Path::new(DRI_DIR)),
    })
}

#[cfg(test)]
mod tests {
    /// Both runtimes are reported with a usable flag (and a reason when not usable) and their libraries with
    /// the reasons for those not used; on a machine without them (CI), every reason is there.
    #[test]
    fn the_report_names_each_runtime_and_library_and_why_not() {
        let r = super::report();
        for kind in ["hip", "cuda"] {
            let k = &r[kind];
            let usable = k["runtime"]["usable"].as_bool().expect("usable");
            assert!(usable || k["runtime"]["reason"].is_string(), "{k}");
            let libs = &k["vendorLibs"];
            let (blas, solver) = (libs["blas"].as_bool(), libs["solver"].as_bool());
            assert!(blas.is_some() && solver.is_some(), "{libs}");
            let not_used = libs["notUsed"].as_array().expect("notUsed");
            let said = |what: &str| {
                not_used
                    .iter()
                    .any(|w| w.as_str().is_some_and(|w| w.starts_with(what)))
            };
            assert_eq!(blas == Some(false), said("BLAS:"), "{libs}");
            assert_eq!(solver == Some(false), said("solver:"), "{libs}");
        }
        // The embedded code objects as the build gave them: each with its size and hash.
        let embedded = r["hipCodeObjects"]["embedded"]
            .as_array()
            .expect("embedded");
        assert_eq!(embedded.len(), super::EMBEDDED.len(), "{r}");
        for (e, (target, bytes)) in embedded.iter().zip(super::EMBEDDED) {
            assert_eq!(e["target"], *target);
            assert_eq!(e["bytes"], bytes.len());
            assert_eq!(e["sha256"].as_str().map(str::len), Some(64), "{e}");
        }
        assert!(r["hipCodeObjects"]["nodeTargets"].is_array(), "{r}");
    }
}
