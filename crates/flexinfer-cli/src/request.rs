//! The rules of a quantization request (the CRD's, checked before the patch is sent, with messages
//! that name the flag) and the JSON merge patch it becomes.

use flexinfer_api::formats::{self, FORMATS};

use crate::args::QuantizeRequest;
use crate::{bad, CliError};

/// Check a quantization request against the CRD's rules; messages name the flag.
pub fn check_request(r: &QuantizeRequest) -> Result<&'static formats::FormatInfo, CliError> {
    let fmt = r.format.as_deref().unwrap_or_default();
    let info = formats::by_name(fmt).ok_or_else(|| {
        bad(format!(
            "--format {fmt}: unknown format (one of {})",
            FORMATS
                .iter()
                .map(|f| f.name)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    if let Some(b) = r.bits {
        if !info.bits.contains(&b) {
            return Err(bad(format!(
                "--bits {b} is not valid for --format {}: allowed {}",
                info.name,
                info.bits
                    .iter()
                    .map(|b| b.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    if let Some(g) = r.group_size {
        if !(g == -1 || (g > 0 && g <= 8192 && (g as u32).is_power_of_two())) {
            return Err(bad(format!(
                "--group-size {g} must be -1 or a power of two (32, 64, 128, ...) up to 8192"
            )));
        }
    }
    if let Some(t) = &r.gguf_type {
        if info.name != "GGUF" {
            return Err(bad(format!(
                "--type {t} is only valid with --format GGUF (got --format {})",
                info.name
            )));
        }
        if !valid_gguf_type(t) {
            return Err(bad(format!(
                "--type {t}: not a GGUF type FlexInfer writes (one of {})",
                flexinfer_api::contract::env::GGUF_TYPES.join(", ")
            )));
        }
    }
    Ok(info)
}

/// A type the engine writes (the controller refuses the others before a Job runs); the CRD's pattern is
/// wider. Spelled as the API stores it: upper case.
fn valid_gguf_type(t: &str) -> bool {
    flexinfer_api::contract::env::GGUF_TYPES.contains(&t)
}

/// The JSON merge patch of a request.
pub fn request_patch(r: &QuantizeRequest, info: &formats::FormatInfo) -> serde_json::Value {
    let mut q = serde_json::Map::new();
    q.insert("format".into(), info.name.into());
    if let Some(b) = r.bits {
        q.insert("bits".into(), b.into());
    }
    if let Some(g) = r.group_size {
        q.insert("groupSize".into(), g.into());
    }
    if r.use_gpu {
        q.insert("useGPU".into(), true.into());
    }
    match &r.gguf_type {
        Some(t) => {
            q.insert("ggufType".into(), t.clone().into());
        }
        // ggufType is only valid with GGUF: clear a leftover when switching formats.
        None if info.name != "GGUF" => {
            q.insert("ggufType".into(), serde_json::Value::Null);
        }
        None => {}
    }
    serde_json::json!({"spec": {"quantization": q}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(format: &str) -> QuantizeRequest {
        QuantizeRequest {
            cache: Some("c".into()),
            format: Some(format.into()),
            gguf_type: None,
            bits: None,
            group_size: None,
            use_gpu: false,
        }
    }

    #[test]
    fn request_rules_name_the_flag() {
        assert_eq!(check_request(&req("gptq")).unwrap().name, "GPTQ");
        let e = check_request(&req("MP3"))
            .map_err(|e| flexinfer_api::contract::error::chain(&e))
            .unwrap_err();
        assert!(e.starts_with("--format MP3"), "{e}");
        for (fmt, bits, ok) in [
            ("GPTQ", 4, true),
            ("GPTQ", 3, true),
            ("GPTQ", 5, false),
            ("AWQ", 4, true),
            ("AWQ", 8, false),
            ("FP8", 8, true),
            ("FP8", 4, false),
            ("GGUF", 6, true),
            ("EXL2", 5, true),
        ] {
            let mut r = req(fmt);
            r.bits = Some(bits);
            let res = check_request(&r);
            assert_eq!(res.is_ok(), ok, "{fmt} {bits}");
            if let Err(e) = res {
                assert!(
                    flexinfer_api::contract::error::chain(&e)
                        .starts_with(&format!("--bits {bits}")),
                    "{e}"
                );
                assert_eq!(e.exit_code(), 2);
            }
        }
        for (g, ok) in [
            (-1, true),
            (32, true),
            (128, true),
            (100, false),
            (0, false),
            (-2, false),
            (16384, false),
        ] {
            let mut r = req("GPTQ");
            r.group_size = Some(g);
            let res = check_request(&r);
            assert_eq!(res.is_ok(), ok, "{g}");
            if let Err(e) = res {
                assert!(
                    flexinfer_api::contract::error::chain(&e)
                        .starts_with(&format!("--group-size {g}")),
                    "{e}"
                );
            }
        }
        let mut r = req("GPTQ");
        r.gguf_type = Some("Q4_K_M".into());
        let e = check_request(&r)
            .map_err(|e| flexinfer_api::contract::error::chain(&e))
            .unwrap_err();
        assert!(
            e.contains("--type Q4_K_M is only valid with --format GGUF"),
            "{e}"
        );
        let mut r = req("GGUF");
        r.gguf_type = Some("Q4_K_M".into());
        assert!(check_request(&r).is_ok());
        r.gguf_type = Some("q4".into());
        assert!(check_request(&r)
            .map_err(|e| flexinfer_api::contract::error::chain(&e))
            .unwrap_err()
            .starts_with("--type q4"));
        for t in ["Q8_0", "IQ4_XS", "F16", "BF16", "Q5_K_S", "Q2_K"] {
            assert!(valid_gguf_type(t), "{t}");
        }
        // The CRD's pattern admits these; no engine writes them.
        for t in ["Q9_0", "IQ2_XXS", "Q3_K_S", "F32", "F8", "Q4", "q4_k_m", ""] {
            assert!(!valid_gguf_type(t), "{t}");
        }
    }

    #[test]
    fn patches() {
        let mut r = req("GPTQ");
        r.bits = Some(4);
        r.group_size = Some(128);
        r.use_gpu = true;
        let info = check_request(&r).unwrap();
        let p = request_patch(&r, info);
        assert_eq!(
            p,
            serde_json::json!({"spec": {"quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "useGPU": true, "ggufType": null}}})
        );
        let mut r = req("gguf");
        r.gguf_type = Some("Q4_K_M".into());
        let info = check_request(&r).unwrap();
        assert_eq!(
            request_patch(&r, info),
            serde_json::json!({"spec": {"quantization": {"format": "GGUF", "ggufType": "Q4_K_M"}}})
        );
    }
}
