//! `flexinfer-worker devices`: what this worker finds on the machine it runs on, as one JSON object on
//! stdout: each GPU runtime probed (as `GPTQ_DEVICE=auto` probes it; no device is opened) and each runtime's
//! vendor math libraries (BLAS and solver, as `GPTQ_VENDOR_LIBS=auto` loads them) with the reason for each
//! one that is not used. For checking an image or a node before a quantize Job runs there.

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
            Err(e) => json!({"usable": false, "reason": e.to_string()}),
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
    Value::Object(out)
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
    }
}
