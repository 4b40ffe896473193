//! The planner's inputs and outputs: what the reconciler observed for one cache ([`Observed`]) and what
//! one reconcile does ([`Plan`], [`Action`], [`Outcome`]). The planning steps and the reconciler
//! share these; they depend on no planning step.

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::contract::{JobPhase, ProgressEvent};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::ModelCacheStatus;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;

use super::nodelocal::{NodeView, Task};
use super::observe::ObservedJob;

/// Everything the reconciler read from the cluster for one cache.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub jobs: BTreeMap<JobPhase, ObservedJob>,
    /// Whether the PVC the controller creates exists (ignored with `existingClaimName`).
    pub pvc_exists: bool,
    /// GPUProfiles visible to the cache.
    pub profiles: Vec<GPUProfile>,
    /// Bounded tail of the active Job's pod log: `None` = not read.
    pub log_tail: Option<LogTail>,
    /// Directories on this cache's claim that Models serve (from their `status.servedPath`): kept by
    /// generation garbage collection.
    pub served_dirs: Vec<String>,
    /// Other ModelCaches of the namespace that use the same claim.
    pub claim_peers: Vec<ClaimPeer>,
    /// Models of the namespace that read from this cache's claim (`pvc://` source or served path):
    /// deleting the cache keeps the claim while any does.
    pub claim_models: Vec<String>,
    /// The nodes and node-copy Jobs of a `storageStrategy: NodeLocal` cache (or of one that has
    /// copies left from when it was); `None`: not read.
    pub node_local: Option<NodeLocalObserved>,
}

/// The pod log tail as the reconciler read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTail {
    Read(String),
    /// The read failed (the reconciler logs why): progress keeps its last trustworthy value.
    Unreadable,
}

/// Another cache on the same PersistentVolumeClaim.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimPeer {
    pub name: String,
    pub model_dir: String,
    /// Created before this cache (or same time and a smaller name): it keeps the directory.
    pub older: bool,
}

/// One side effect of a reconcile.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    AddFinalizer,
    RemoveFinalizer,
    CreatePvc(Box<PersistentVolumeClaim>),
    DeletePvc(String),
    CreateJob(Box<Job>),
    DeleteJob(String),
    /// Set (`Some`) or remove (`None`) label `key` on node `node` (`storageStrategy: NodeLocal`).
    LabelNode {
        node: String,
        key: String,
        value: Option<String>,
    },
    RemoveAnnotations(Vec<String>),
    Event {
        warning: bool,
        reason: String,
        note: String,
        /// Name of the Job the event is about (recorded as the related object, which also keeps
        /// events about different Jobs from being folded into one series).
        job: Option<String>,
    },
}

/// Facts for metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Phases that completed in this reconcile.
    pub completed: Vec<JobPhase>,
    /// `(phase, classified reason)` of Jobs that failed in this reconcile.
    pub failed: Vec<(JobPhase, String)>,
    /// The newest telemetry of the running Job.
    pub telemetry: Option<ProgressEvent>,
    /// Running Job: phase, deadline seconds, elapsed seconds.
    pub running: Option<(JobPhase, i64, i64)>,
    /// The running quantization's GPTQ device, when this reconcile read its report: whether a `useGPU`
    /// quantization runs on the CPU unasked (the `QuantizedOnCPU` condition).
    pub gptq_on_cpu: Option<bool>,
}

/// Result of planning.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub status: ModelCacheStatus,
    /// `status` differs from what the object carries (only then is it written).
    pub status_changed: bool,
    pub actions: Vec<Action>,
    pub requeue_after: Option<Duration>,
    pub outcome: Outcome,
}

/// What the reconciler read for the node copies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeLocalObserved {
    pub nodes: Vec<NodeView>,
    /// The cache's node-copy Jobs.
    pub tasks: Vec<Task>,
    /// Why the nodes or Jobs could not be read (e.g. the controller may not list nodes): nothing is
    /// changed on the nodes and the status says why.
    pub problem: Option<String>,
}
