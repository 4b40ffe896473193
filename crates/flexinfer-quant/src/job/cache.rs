//! Per-layer resume cache under `$MODEL_DIR/.flexinfer-gptq-cache/` (docs/dev/gptq.md, "Layer pipeline").
//! Any problem with the cache wipes it and the run proceeds from layer 0: resume never blocks a run.
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use crate::error::{QuantError, Result};
use crate::events::{fields, EventSink};
use crate::fsutil::{now_rfc3339, read_json, sha256_file, sha256_hex, write_json_atomic};
use crate::job::writer::OutTensor;
use flexinfer_contract::error::chain;
use flexinfer_contract::{events as names, files};
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why the cached layers cannot be resumed from (the text is the resume-fallback event's reason).
#[derive(Debug, thiserror::Error)]
enum StaleLayer {
    #[error("cached layers are not a prefix (entry {entry} is layer {layer})")]
    NotAPrefix { entry: usize, layer: usize },
    #[error("{path} missing")]
    Missing {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} has size {size}, manifest says {recorded}")]
    Size {
        path: String,
        size: u64,
        recorded: u64,
    },
    #[error(transparent)]
    Unreadable(#[from] Box<QuantError>),
    #[error("{0} sha256 mismatch (corrupted)")]
    Corrupted(String),
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LayerEntry {
    pub layer_idx: usize,
    pub path: String,
    pub size_bytes: u64,
    pub sha256: String,
    pub tensor_count: usize,
    pub completed_at: String,
    #[serde(default)]
    pub gptq_modules: u64,
    #[serde(default)]
    pub rtn_modules: u64,
    /// MoE layers: calibration tokens routed to each expert.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expert_tokens: Vec<u64>,
    /// MoE layers: modules that took RTN because their expert saw too few tokens.
    #[serde(default)]
    pub low_coverage_rtn_modules: u64,
}

/// Counts of one finished layer, kept in the manifest for a resumed run's report.
#[derive(Clone, Debug, Default)]
pub struct LayerStats {
    pub gptq_modules: u64,
    pub rtn_modules: u64,
    pub expert_tokens: Vec<u64>,
    pub low_coverage_rtn_modules: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub version: u32,
    pub config_hash: String,
    pub script_version: String,
    pub layers: Vec<LayerEntry>,
}

pub struct LayerCache {
    /// `$MODEL_DIR/.flexinfer-gptq-cache`.
    pub dir: PathBuf,
    model_dir: PathBuf,
    pub manifest: Manifest,
    calibration_fingerprint: String,
}

impl LayerCache {
    fn layers_dir(&self) -> PathBuf {
        self.model_dir.join(files::GPTQ_LAYERS_DIR)
    }

    fn manifest_path(&self) -> PathBuf {
        self.model_dir.join(files::GPTQ_LAYERS_MANIFEST)
    }

    /// Opens (or creates) the cache and validates it; on any problem the cache is wiped and events say why.
    pub fn open(
        model_dir: &Path,
        config_hash: &str,
        calibration_fingerprint: &str,
        script_version: &str,
        resume: bool,
        events: &dyn EventSink,
    ) -> Result<Self> {
        let dir = model_dir.join(files::GPTQ_CACHE_DIR);
        let fresh = Manifest {
            version: 1,
            config_hash: config_hash.to_string(),
            script_version: script_version.to_string(),
            layers: Vec::new(),
        };
        let mut cache = LayerCache {
            dir: dir.clone(),
            model_dir: model_dir.to_path_buf(),
            manifest: fresh.clone(),
            calibration_fingerprint: calibration_fingerprint.into(),
        };
        let manifest_path = model_dir.join(files::GPTQ_LAYERS_MANIFEST);
        if dir.exists() {
            let verdict: std::result::Result<Manifest, (String, bool)> = if !resume {
                Err(("resume disabled".into(), false))
            } else if !manifest_path.exists() {
                Err(("no manifest".into(), false))
            } else {
                match read_json(&manifest_path).and_then(|v| {
                    serde_json::from_value::<Manifest>(v).map_err(|e| QuantError::Json {
                        path: manifest_path.clone(),
                        source: e,
                    })
                }) {
                    Err(e) => Err((format!("unreadable manifest: {}", chain(&e)), true)),
                    Ok(m) if m.config_hash != config_hash => {
                        Err(("config hash changed".into(), false))
                    }
                    Ok(m) => match cache.verify_layers(&m) {
                        Ok(()) => Ok(m),
                        Err(reason) => Err((chain(&reason), true)),
                    },
                }
            };
            match verdict {
                Ok(m) => {
                    cache.manifest = m;
                    cache.gc_orphans();
                }
                Err((reason, fallback)) => {
                    if fallback {
                        events.emit(
                            names::QUANTIZATION_RESUME_FALLBACK,
                            fields([("reason", json!(reason))]),
                        );
                    }
                    if reason != "no manifest" || cache.layers_dir().exists() {
                        events.emit(
                            names::QUANTIZATION_LAYER_CACHE_RESET,
                            fields([("reason", json!(reason))]),
                        );
                    }
                    std::fs::remove_dir_all(&dir).map_err(|e| QuantError::io(&dir, e))?;
                }
            }
        }
        std::fs::create_dir_all(cache.layers_dir())
            .map_err(|e| QuantError::io(cache.layers_dir(), e))?;
        cache.save_manifest()?;
        if !cache.manifest.layers.is_empty() {
            events.emit(
                names::QUANTIZATION_RESUME_LOADED,
                fields([("layers", json!(cache.manifest.layers.len()))]),
            );
        }
        cache.write_checkpoint("quantizing", None)?;
        Ok(cache)
    }

    fn verify_layers(&self, m: &Manifest) -> std::result::Result<(), StaleLayer> {
        for (i, l) in m.layers.iter().enumerate() {
            if l.layer_idx != i {
                return Err(StaleLayer::NotAPrefix {
                    entry: i,
                    layer: l.layer_idx,
                });
            }
            let p = self.layers_dir().join(&l.path);
            let size =
                std::fs::metadata(&p)
                    .map(|m| m.len())
                    .map_err(|source| StaleLayer::Missing {
                        path: l.path.clone(),
                        source,
                    })?;
            if size != l.size_bytes {
                return Err(StaleLayer::Size {
                    path: l.path.clone(),
                    size,
                    recorded: l.size_bytes,
                });
            }
            let sha = sha256_file(&p).map_err(Box::new)?;
            if sha != l.sha256 {
                return Err(StaleLayer::Corrupted(l.path.clone()));
            }
        }
        Ok(())
    }

    fn gc_orphans(&self) {
        if let Ok(rd) = std::fs::read_dir(self.layers_dir()) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let known = self.manifest.layers.iter().any(|l| l.path == name);
                if !self.manifest_path().ends_with(&name) && !known {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    fn save_manifest(&self) -> Result<()> {
        let v = serde_json::to_value(&self.manifest).map_err(|e| QuantError::Json {
            path: self.layers_dir(),
            source: e,
        })?;
        write_json_atomic(&self.manifest_path(), &v)
    }

    pub fn write_checkpoint(&self, stage: &str, active_layer: Option<usize>) -> Result<()> {
        write_json_atomic(
            &self.model_dir.join(files::GPTQ_CHECKPOINT),
            &json!({
                "stage": stage,
                "completed_layers": self.manifest.layers.len(),
                "active_layer": active_layer,
                "calibration_fingerprint": self.calibration_fingerprint,
                "config_hash": self.manifest.config_hash,
                "updated_at": now_rfc3339(),
            }),
        )
    }

    pub fn completed_layers(&self) -> usize {
        self.manifest.layers.len()
    }

    pub fn layer_path(&self, layer: usize) -> Option<PathBuf> {
        self.manifest
            .layers
            .get(layer)
            .map(|l| self.layers_dir().join(&l.path))
    }

    /// Persists one finished layer's packed tensors and records it in the manifest.
    pub fn write_layer(
        &mut self,
        layer: usize,
        tensors: &[OutTensor<'_>],
        stats: LayerStats,
        events: &dyn EventSink,
    ) -> Result<()> {
        let name = format!("layer-{layer:03}.safetensors");
        let path = self.layers_dir().join(&name);
        let mut views = Vec::with_capacity(tensors.len());
        for t in tensors {
            let view = TensorView::new(t.dtype, t.shape.clone(), &t.data).map_err(|e| {
                QuantError::Safetensors {
                    path: path.clone(),
                    tensor: Some(t.name.clone()),
                    source: e.into(),
                }
            })?;
            views.push((t.name.clone(), view));
        }
        let meta: HashMap<String, String> = [("layer".to_string(), layer.to_string())]
            .into_iter()
            .collect();
        let bytes =
            safetensors::serialize(views, Some(meta)).map_err(|e| QuantError::Safetensors {
                path: path.clone(),
                tensor: None,
                source: e.into(),
            })?;
        crate::fsutil::write_atomic(&path, &bytes)?;
        self.manifest.layers.retain(|l| l.layer_idx != layer);
        self.manifest.layers.push(LayerEntry {
            layer_idx: layer,
            path: name.clone(),
            size_bytes: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
            tensor_count: tensors.len(),
            completed_at: now_rfc3339(),
            gptq_modules: stats.gptq_modules,
            rtn_modules: stats.rtn_modules,
            expert_tokens: stats.expert_tokens,
            low_coverage_rtn_modules: stats.low_coverage_rtn_modules,
        });
        self.save_manifest()?;
        self.write_checkpoint("quantizing", Some(layer.saturating_add(1)))?;
        events.emit(
            names::QUANTIZATION_LAYER_CACHED,
            fields([
                ("layer", json!(layer)),
                ("path", json!(name)),
                ("size_bytes", json!(bytes.len())),
            ]),
        );
        Ok(())
    }

    /// Removes the cache (after a successful save).
    pub fn remove(self) -> Result<()> {
        std::fs::remove_dir_all(&self.dir).map_err(|e| QuantError::io(&self.dir, e))
    }
}

/// The layer cache a finished run left: a kill between the save's rename into place and the cache's removal
/// leaves both, and the next run reuses the artifact without quantizing. That run calls this: the cache goes
/// when its manifest names this configuration, or when it has no readable manifest (a removal cut short);
/// a cache of another configuration is left to the run it belongs to. Says so with a
/// `quantization_layer_cache_reset` event.
pub fn remove_finished(model_dir: &Path, config_hash: &str, events: &dyn EventSink) -> Result<()> {
    let dir = model_dir.join(files::GPTQ_CACHE_DIR);
    if !dir.exists() {
        return Ok(());
    }
    let manifest = read_json(&model_dir.join(files::GPTQ_LAYERS_MANIFEST))
        .ok()
        .and_then(|v| serde_json::from_value::<Manifest>(v).ok());
    if manifest.is_some_and(|m| m.config_hash != config_hash) {
        return Ok(());
    }
    events.emit(
        names::QUANTIZATION_LAYER_CACHE_RESET,
        fields([(
            "reason",
            json!("left behind by the finished run whose artifact is reused"),
        )]),
    );
    std::fs::remove_dir_all(&dir).map_err(|e| QuantError::io(&dir, e))
}
