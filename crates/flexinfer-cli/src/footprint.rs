//! A model's footprint for `quantize recommend`: parameter count and architecture facts, from a
//! local copy (`config.json`, safetensors headers), the hub metadata, or `--params`.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use flexinfer_api::contract::SourceUri;
use serde_json::Value;

/// What is known about the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Footprint {
    /// Total parameters.
    pub params: f64,
    /// Where `params` came from (for the reason text).
    pub source: String,
    /// `model_type` from config.json.
    pub model_type: Option<String>,
    /// Mixture of experts (num_experts / num_local_experts > 1).
    pub moe: bool,
    /// Hybrid linear-attention (GatedDeltaNet) + attention stack.
    pub hybrid: bool,
}

/// Parse `8B`, `14.8b`, `770M`, `1.5T` or a plain count.
pub fn parse_params(s: &str) -> Result<f64> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('B' | 'b') => (&t[..t.len() - 1], 1e9),
        Some('M' | 'm') => (&t[..t.len() - 1], 1e6),
        Some('T' | 't') => (&t[..t.len() - 1], 1e12),
        Some('K' | 'k') => (&t[..t.len() - 1], 1e3),
        _ => (t, 1.0),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| anyhow!("--params {s:?}: expected a count such as 8B, 14.8B or 770M"))?;
    if !v.is_finite() || v <= 0.0 {
        bail!("--params {s:?}: must be greater than zero");
    }
    let count = v * mult;
    if !count.is_finite() {
        bail!("--params {s:?}: too large");
    }
    Ok(count)
}

/// The text config (`text_config` of multimodal configs, else the top level).
fn text_config(cfg: &Value) -> &Value {
    match cfg.get("text_config") {
        Some(t) if t.is_object() => t,
        _ => cfg,
    }
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// Architecture facts from config.json.
pub fn arch_facts(cfg: &Value) -> (Option<String>, bool, bool) {
    let t = text_config(cfg);
    let model_type = cfg
        .get("model_type")
        .and_then(Value::as_str)
        .map(str::to_string);
    let experts = ["num_experts", "num_local_experts", "n_routed_experts"]
        .iter()
        .filter_map(|k| num(t, k))
        .fold(0.0, f64::max);
    let layer_types_hybrid = t
        .get("layer_types")
        .and_then(Value::as_array)
        .is_some_and(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .any(|s| s.contains("linear_attention") || s.contains("gdn"))
        });
    let mt = model_type.clone().unwrap_or_default();
    let hybrid = layer_types_hybrid
        || mt.contains("qwen3_next")
        || mt.contains("qwen3_5")
        || t.get("linear_num_value_heads").is_some();
    (model_type, experts > 1.0, hybrid)
}

/// Estimate the parameter count from config.json (decoder-only transformer).
pub fn params_from_config(cfg: &Value) -> Option<f64> {
    let t = text_config(cfg);
    let h = num(t, "hidden_size")?;
    let layers = num(t, "num_hidden_layers")?;
    let vocab = num(t, "vocab_size")?;
    let inter = num(t, "intermediate_size").unwrap_or(4.0 * h);
    let heads = num(t, "num_attention_heads").unwrap_or(h / 128.0);
    let kv = num(t, "num_key_value_heads").unwrap_or(heads);
    let hd = num(t, "head_dim").unwrap_or(h / heads.max(1.0));
    let attn = h * heads * hd * 2.0 + h * kv * hd * 2.0;
    let experts = ["num_experts", "num_local_experts", "n_routed_experts"]
        .iter()
        .filter_map(|k| num(t, k))
        .fold(0.0, f64::max);
    let mlp = if experts > 1.0 {
        let mi = num(t, "moe_intermediate_size").unwrap_or(inter);
        experts * 3.0 * h * mi + num(t, "shared_expert_intermediate_size").unwrap_or(0.0) * 3.0 * h
    } else {
        3.0 * h * inter
    };
    let tied = cfg
        .get("tie_word_embeddings")
        .or_else(|| t.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let embed = vocab * h * if tied { 1.0 } else { 2.0 };
    // Negative, zero or overflowing sizes are not a model.
    Some(layers * (attn + mlp) + embed).filter(|p| p.is_finite() && *p > 0.0)
}

/// Elements described by one safetensors header (the file's first 8 + n bytes).
pub fn params_from_safetensors_header(path: &Path) -> Result<f64> {
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .with_context(|| format!("{}: too short for a safetensors header", path.display()))?;
    let n = u64::from_le_bytes(len);
    if n > 100 * 1024 * 1024 {
        bail!(
            "{}: safetensors header of {n} bytes is implausible",
            path.display()
        );
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .with_context(|| format!("{}: truncated safetensors header", path.display()))?;
    let hdr: BTreeMap<String, Value> = serde_json::from_slice(&buf)
        .with_context(|| format!("{}: safetensors header is not JSON", path.display()))?;
    let mut total = 0.0;
    for (name, t) in hdr {
        if name == "__metadata__" {
            continue;
        }
        let shape = t
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| anyhow!("{}: tensor {name} has no shape", path.display()))?;
        total += shape.iter().filter_map(Value::as_f64).product::<f64>();
    }
    Ok(total)
}

/// Footprint from a local model directory: safetensors headers first (exact), else config.json.
pub fn from_dir(dir: &Path) -> Result<Footprint> {
    if !dir.is_dir() {
        bail!("--model-dir {}: not a directory", dir.display());
    }
    let cfg: Option<Value> = std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let mut shards: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort();
    let (model_type, moe, hybrid) = cfg.as_ref().map(arch_facts).unwrap_or_default();
    if !shards.is_empty() {
        let mut total = 0.0;
        for s in &shards {
            total += params_from_safetensors_header(s)?;
        }
        return Ok(Footprint {
            params: total,
            source: format!(
                "safetensors headers of {} shard(s) in {}",
                shards.len(),
                dir.display()
            ),
            model_type,
            moe,
            hybrid,
        });
    }
    match cfg.as_ref().and_then(params_from_config) {
        Some(p) => Ok(Footprint {
            params: p,
            source: format!("config.json in {}", dir.display()),
            model_type,
            moe,
            hybrid,
        }),
        None => bail!(
            "{} has neither *.safetensors nor a config.json with hidden_size/num_hidden_layers/vocab_size",
            dir.display()
        ),
    }
}

/// Footprint from the hub's `/api/models/{id}` JSON (`safetensors.total`, `config`).
pub fn from_hub_json(id: &str, v: &Value) -> Result<Footprint> {
    let total = v
        .pointer("/safetensors/total")
        .and_then(Value::as_f64)
        .ok_or_else(|| anyhow!("hub metadata of {id} has no safetensors.total"))?;
    if !total.is_finite() || total <= 0.0 {
        bail!("hub metadata of {id}: safetensors.total {total} is not a parameter count");
    }
    let model_type = v
        .pointer("/config/model_type")
        .and_then(Value::as_str)
        .map(str::to_string);
    let cfg = v.get("config").cloned().unwrap_or(Value::Null);
    let (_, moe, hybrid) = arch_facts(&cfg);
    Ok(Footprint {
        params: total,
        source: format!("hub metadata of {id} (safetensors.total)"),
        model_type,
        moe,
        hybrid,
    })
}

/// The hub repo id of a ModelCache source, if it is a hub source.
pub fn hub_id(source: &str) -> Option<String> {
    match SourceUri::parse(source) {
        SourceUri::Hub { repo, scheme: true } => Some(repo.to_string()),
        SourceUri::Hub {
            repo,
            scheme: false,
        } => (repo.split('/').count() == 2).then(|| repo.to_string()),
        _ => None,
    }
}

/// GET `{endpoint}/api/models/{id}` (http or https), with an optional bearer token.
pub async fn fetch_hub(endpoint: &str, id: &str, token: Option<&str>) -> Result<Value> {
    use http_body_util::{BodyExt, Empty};
    use hyper::body::Bytes;
    let url = format!("{}/api/models/{}", endpoint.trim_end_matches('/'), id);
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("--hub-endpoint {endpoint}: invalid URL"))?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_native_roots()
        .context("load the system's TLS roots")?
        .https_or_http()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Empty<Bytes>>(https);
    let mut req = http::Request::get(uri).header("user-agent", "flexinfer-cli");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req.body(Empty::new()).context("build hub request")?;
    let resp = tokio::time::timeout(Duration::from_secs(15), client.request(req))
        .await
        .map_err(|_| anyhow!("{url}: no answer within 15s"))?
        .map_err(|e| anyhow!("{url}: {e}"))?;
    let status = resp.status();
    let body = tokio::time::timeout(Duration::from_secs(30), resp.into_body().collect())
        .await
        .map_err(|_| anyhow!("{url}: body not received within 30s"))?
        .map_err(|e| anyhow!("{url}: {e}"))?
        .to_bytes();
    if !status.is_success() {
        bail!("{url}: HTTP {status}");
    }
    serde_json::from_slice(&body).with_context(|| format!("{url}: response is not JSON"))
}

#[cfg(test)]
#[path = "../tests/support/one_shot_http.rs"]
mod one_shot_http;

#[cfg(test)]
mod tests {
    use super::one_shot_http::serve_json_once;
    use super::*;

    #[test]
    fn params_flag() {
        assert_eq!(parse_params("8B").unwrap(), 8e9);
        assert_eq!(parse_params("14.8b").unwrap(), 14.8e9);
        assert_eq!(parse_params("770M").unwrap(), 770e6);
        assert_eq!(parse_params("1000").unwrap(), 1000.0);
        assert!(parse_params("eight").is_err());
        assert!(parse_params("0B").is_err());
    }

    #[test]
    fn hub_ids() {
        assert_eq!(
            hub_id("HF://meta-llama/Llama-3-8B").as_deref(),
            Some("meta-llama/Llama-3-8B")
        );
        assert_eq!(hub_id("huggingface://a/b").as_deref(), Some("a/b"));
        assert_eq!(hub_id("a/b").as_deref(), Some("a/b"));
        assert_eq!(hub_id("oci://r/x:1"), None);
        assert_eq!(hub_id("local://x"), None);
    }

    #[test]
    fn llama3_8b_config_estimate() {
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "tie_word_embeddings": false
        });
        let p = params_from_config(&cfg).unwrap();
        assert!((p / 1e9 - 8.03).abs() < 0.05, "{p}");
        assert_eq!(arch_facts(&cfg), (Some("llama".into()), false, false));
    }

    #[test]
    fn hub_json() {
        let v = serde_json::json!({"safetensors": {"total": 14_770_033_664u64},
            "config": {"model_type": "qwen3_next", "num_experts": 512}});
        let f = from_hub_json("Qwen/X", &v).unwrap();
        assert_eq!(f.params, 14_770_033_664.0);
        assert!(f.moe && f.hybrid);
        assert!(from_hub_json("a/b", &serde_json::json!({})).is_err());
    }

    #[test]
    fn safetensors_headers_count_elements() {
        let dir = tempfile::tempdir().unwrap();
        let data = [0u8; 2 * 3 * 4 * 2];
        let views = vec![
            (
                "a".to_string(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::BF16,
                    vec![2, 3],
                    &data[..12],
                )
                .unwrap(),
            ),
            (
                "b".to_string(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::BF16,
                    vec![4, 2],
                    &data[..16],
                )
                .unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let f = from_dir(dir.path()).unwrap();
        assert_eq!(f.params, 14.0);
        assert!(f.source.contains("safetensors headers"));
    }

    /// The hub lookup speaks plain HTTP to a loopback server.
    #[tokio::test]
    async fn hub_fetch_over_loopback() {
        let (endpoint, server) = serve_json_once(r#"{"safetensors":{"total":8030261248}}"#);
        let v = fetch_hub(&endpoint, "meta-llama/Llama-3-8B", Some("tok"))
            .await
            .unwrap();
        let req = server.join().unwrap();
        assert!(
            req.starts_with("GET /api/models/meta-llama/Llama-3-8B "),
            "{req}"
        );
        assert!(req.to_lowercase().contains("authorization: bearer tok"));
        assert_eq!(from_hub_json("x", &v).unwrap().params, 8030261248.0);
    }
}
