//! Reasons: of the Kubernetes Events and conditions the controller writes, and of a failed
//! pipeline Job ([`FailureReason`]).

use serde::{Deserialize, Serialize};

// ModelCache pipeline.
pub const DOWNLOAD_COMPLETE: &str = "DownloadComplete";
pub const ABLITERATION_COMPLETE: &str = "AbliterationComplete";
pub const QUANTIZATION_COMPLETE: &str = "QuantizationComplete";
pub const PUBLISHED: &str = "Published";
pub const CACHE_READY: &str = "CacheReady";
pub const QUANTIZER_IMAGE_DRIFT: &str = "QuantizerImageDrift";
pub const JOB_CREATED: &str = "JobCreated";
pub const PHASE_FAILED: &str = "PhaseFailed";
pub const RETRYING: &str = "Retrying";
pub const UNSUPPORTED_FORMAT: &str = "UnsupportedFormat";
pub const BACKEND_UNSUPPORTED: &str = "BackendUnsupported";
pub const CACHE_NOT_READY: &str = "CacheNotReady";
/// A trigger annotation or a spec change made a phase (and what follows) run again.
pub const RERUN_REQUESTED: &str = "RerunRequested";
/// `flexinfer.ai/reset-retries` cleared the retry state.
pub const RETRIES_RESET: &str = "RetriesReset";
/// The spec can't run (no image configured, bad annotation, bad path).
pub const INVALID_SPEC: &str = "InvalidSpec";
/// Another ModelCache already uses the same claim and `modelPath`: the two would overwrite each
/// other's files.
pub const CLAIM_CONFLICT: &str = "ClaimConflict";
/// A cache asks for `storageStrategy: NodeLocal`, which this FlexInfer version does not serve yet; no Job
/// is created.
pub const STORAGE_STRATEGY_UNSUPPORTED: &str = "StorageStrategyUnsupported";
/// The PVC the cache created is kept on deletion because other caches use it (`existingClaimName`).
pub const CLAIM_KEPT: &str = "ClaimKept";
/// A gate rejected a new generation; the promoted artifact is unchanged.
pub const GENERATION_REJECTED: &str = "GenerationRejected";
/// A new generation passed its checks and is now the phase's output.
pub const GENERATION_PROMOTED: &str = "GenerationPromoted";
/// A spec change of a run-only setting (deadline, memory) applies to the next attempt.
pub const APPLIES_NEXT_ATTEMPT: &str = "AppliesToNextAttempt";
/// No image could be resolved for a phase, or for a Model's backend on its GPU (ConfigValid=False).
pub const IMAGE_NOT_CONFIGURED: &str = "ImageNotConfigured";
/// The phase's GPUProfile sets a variable in its `env` that FlexInfer sets itself (e.g. `OUT_DIR`); the
/// Job is not created until the profile drops it.
pub const PROFILE_ENV_PROTECTED: &str = "ProfileEnvProtected";
/// A cache would send its Secret's registry credentials (publish target, `oci://` source) to a registry the
/// controller is not configured to give them to (`FLEXINFER_CREDENTIAL_REGISTRIES`); no Job is created.
pub const CREDENTIAL_REGISTRY_NOT_ALLOWED: &str = "CredentialRegistryNotAllowed";
/// A quantization with `useGPU: true` ran its GPTQ solves on the CPU (`GPTQ_DEVICE=auto` found no usable GPU;
/// the note carries the worker's reason).
pub const QUANTIZED_ON_CPU: &str = "QuantizedOnCPU";

// Model serving.
/// A Model's phase changed (note: `Old -> New`).
pub const PHASE_CHANGED: &str = "PhaseChanged";
/// A gated Model asked for warm-primary service without validation.
pub const PROMOTION_BLOCKED: &str = "PromotionBlocked";
/// A Model's configuration is invalid (ConfigValid=False).
pub const INVALID_CONFIG: &str = "InvalidConfig";
/// A Model's serving image is recognisably built for another GPU vendor than its GPUProfile's (a CUDA
/// image on AMD, a ROCm image on NVIDIA): ConfigValid=False and a Warning event, nothing deployed.
pub const IMAGE_VENDOR_MISMATCH: &str = "ImageVendorMismatch";
/// A Model's backend, image and GPU form a combination known not to work (vLLM on gfx906, vLLM's
/// Marlin kernels on AMD): ConfigValid=False and a Warning event, nothing deployed.
pub const UNSUPPORTED_COMBINATION: &str = "UnsupportedCombination";
/// A Model of a shared GPU group took the lane (note names the group and the previous holder).
pub const SHARED_GROUP_ACTIVE: &str = "SharedGroupActive";
/// A Model of a shared GPU group waits for the lane (Ready=False reason `Queued` too).
pub const SHARED_GROUP_QUEUED: &str = "SharedGroupQueued";
/// A higher-priority Model took this Model's lane (Ready=False reason `Preempted` once drained).
pub const SHARED_GROUP_PREEMPTED: &str = "SharedGroupPreempted";
/// A Model of a shared GPU group has no demand any more and released the lane.
pub const SHARED_GROUP_IDLE: &str = "SharedGroupIdle";
// (A Model held back by its group has Ready=False with the group state's name as the reason:
// `SharedGroupState::{Queued, Preempted}.as_str()`.)

/// Why a pipeline Job failed, as classified by the controller from the Job, its pod and the
/// worker's exit code. The string form goes into the `Degraded` condition's reason, the failure
/// message and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FailureReason {
    /// The container was OOM-killed.
    #[serde(rename = "OOMKilled")]
    OomKilled,
    /// The Job ran past `activeDeadlineSeconds`.
    DeadlineExceeded,
    /// The image could not be pulled.
    ImagePullBackOff,
    /// The pod could not be scheduled (no node fits its selector, tolerations or resources) within
    /// the stuck-pod threshold.
    Unschedulable,
    /// The Job's pods failed `backoffLimit` times.
    BackoffLimitExceeded,
    /// Worker exit code 2: the input is unusable.
    BadInput,
    /// Worker exit code 3: a quality gate failed.
    QualityGateFailed,
    /// Worker exit code 4: the worker image speaks another contract version.
    ScriptVersionMismatch,
    /// Anything else.
    JobFailed,
}

impl FailureReason {
    /// Every reason, for code that must enumerate them (metric series cleanup, docs).
    pub const ALL: [FailureReason; 9] = [
        FailureReason::OomKilled,
        FailureReason::DeadlineExceeded,
        FailureReason::ImagePullBackOff,
        FailureReason::Unschedulable,
        FailureReason::BackoffLimitExceeded,
        FailureReason::BadInput,
        FailureReason::QualityGateFailed,
        FailureReason::ScriptVersionMismatch,
        FailureReason::JobFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::OomKilled => "OOMKilled",
            FailureReason::DeadlineExceeded => "DeadlineExceeded",
            FailureReason::ImagePullBackOff => "ImagePullBackOff",
            FailureReason::Unschedulable => "Unschedulable",
            FailureReason::BackoffLimitExceeded => "BackoffLimitExceeded",
            FailureReason::BadInput => "BadInput",
            FailureReason::QualityGateFailed => "QualityGateFailed",
            FailureReason::ScriptVersionMismatch => "ScriptVersionMismatch",
            FailureReason::JobFailed => "JobFailed",
        }
    }

    /// The reason a deterministic worker exit code stands for.
    pub fn from_exit_code(code: i32) -> Option<FailureReason> {
        match code {
            crate::exit_codes::BAD_INPUT => Some(FailureReason::BadInput),
            crate::exit_codes::QUALITY_GATE => Some(FailureReason::QualityGateFailed),
            crate::exit_codes::VERSION_MISMATCH => Some(FailureReason::ScriptVersionMismatch),
            _ => None,
        }
    }
}

impl std::fmt::Display for FailureReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::FailureReason;

    #[test]
    fn failure_reasons_serialize_as_their_names() {
        for r in FailureReason::ALL {
            assert_eq!(
                serde_json::to_value(r).ok(),
                Some(serde_json::Value::String(r.as_str().into()))
            );
        }
        assert_eq!(
            FailureReason::from_exit_code(2),
            Some(FailureReason::BadInput)
        );
        assert_eq!(FailureReason::from_exit_code(1), None);
    }
}
