//! Pure summaries of what the reconciler observed (Jobs and their pods), in the shape `plan` needs,
//! and the pure decisions of what to read: which Jobs' pods, which log tails and how often, which
//! caches share the claim, which directories Models serve.

use std::time::{Duration, Instant};

use flexinfer_api::contract::{self, JobPhase};
use flexinfer_api::modelcache::{ModelCache, ModelCacheStatus};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use super::jobs;
use super::phase::get_common;

/// Lifecycle of a pipeline Job.
#[derive(Debug, Clone, PartialEq)]
pub enum JobState {
    Active,
    Succeeded,
    /// Failed, with the Job condition reason (`BackoffLimitExceeded`, `DeadlineExceeded`, …).
    Failed {
        reason: String,
        message: String,
    },
}

/// What the newest pod of a Job says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ObservedPod {
    pub name: String,
    pub running: bool,
    /// `state.terminated.reason` of the worker container (`OOMKilled`, `Error`, `Completed`).
    pub terminated_reason: Option<String>,
    pub exit_code: Option<i32>,
    /// `state.terminated.message` (the termination message).
    pub termination_message: Option<String>,
    /// `state.waiting.reason` (`ImagePullBackOff`, `ErrImagePull`, …).
    pub waiting_reason: Option<String>,
    pub waiting_message: Option<String>,
    /// `metadata.creationTimestamp` of the pod (how long it has been stuck, if it is).
    pub created: Option<Timestamp>,
    /// The scheduler's message when the pod's `PodScheduled` condition is `False` with reason
    /// `Unschedulable`.
    pub unschedulable: Option<String>,
}

/// One pipeline Job, summarised.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedJob {
    pub phase: JobPhase,
    pub name: String,
    pub image: String,
    /// `flexinfer.ai/spec-hash` annotation.
    pub spec_hash: Option<String>,
    pub created: Timestamp,
    /// `status.startTime` (falls back to creation).
    pub started: Timestamp,
    pub terminating: bool,
    pub state: JobState,
    pub pod: Option<ObservedPod>,
    /// `spec.activeDeadlineSeconds` the Job was created with (the deadline in force).
    pub deadline_seconds: Option<i64>,
    /// The directory (relative to the claim) the Job writes: its `OUT_DIR`.
    pub out_dir: Option<String>,
}

/// Whether the status of `mc` records `phase` as done by the Job created at `created` (the record is
/// made after that Job ended, and a re-run clears it before its own Job is created), built at
/// `spec_hash` when given. Such a Job, and its pods, are not kept in the watch stores
/// ([`super::stores`]): a Ready cache keeps none of its Jobs in memory.
pub fn records(
    mc: &ModelCache,
    phase: JobPhase,
    created: Timestamp,
    spec_hash: Option<&str>,
) -> bool {
    let Some(st) = mc.status.as_ref() else {
        return false;
    };
    let c = get_common(st, phase);
    let Some(done) = c.completed_at.as_ref() else {
        return false;
    };
    created <= done.0 && spec_hash.is_none_or(|h| c.spec_hash.as_deref() == Some(h))
}

/// The Job of a phase whose completion the status records, as the status describes it: what the
/// planner reads in place of a finished Job the stores no longer keep ([`records`]). It reads such a
/// Job only to delete it (a re-run, a phase removed from the spec), and by its name, state and spec
/// hash otherwise (a completed phase is judged by its status).
pub fn recorded_job(mc: &ModelCache, phase: JobPhase) -> Option<ObservedJob> {
    let c = get_common(mc.status.as_ref()?, phase);
    let done = c.completed_at.as_ref()?.0;
    let created = c.started_at.as_ref().map_or(done, |t| t.0);
    Some(ObservedJob {
        phase,
        name: phase.job_name(mc.metadata.name.as_deref()?),
        image: c.image.clone().unwrap_or_default(),
        spec_hash: Some(c.spec_hash.clone()?),
        created,
        started: created,
        terminating: false,
        state: JobState::Succeeded,
        pod: None,
        deadline_seconds: None,
        out_dir: None,
    })
}

/// The `OUT_DIR` of a pipeline Job's worker container, relative to the claim.
pub fn job_out_dir(job: &Job) -> Option<String> {
    let c = job
        .spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .containers
        .first()?;
    let v = c
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == contract::env::OUT_DIR)?
        .value
        .as_deref()?;
    let rel = v
        .strip_prefix(contract::CACHE_MOUNT)
        .unwrap_or(v)
        .trim_matches('/');
    contract::check_relative_path(rel)
        .ok()
        .map(|_| rel.to_string())
}

/// Summarise a Job and its pods. `None` for Jobs that are not pipeline Jobs.
/// How a Job stands by its conditions: `Complete` or `SuccessCriteriaMet` is success, `Failed` or
/// `FailureTarget` failure (with the condition's reason and message), anything else active.
pub fn job_state(job: &Job) -> JobState {
    let conds = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let is = |t: &str| conds.iter().find(|c| c.type_ == t && c.status == "True");
    if is("Complete").is_some() || is("SuccessCriteriaMet").is_some() {
        JobState::Succeeded
    } else if let Some(c) = is("Failed").or_else(|| is("FailureTarget")) {
        JobState::Failed {
            reason: c
                .reason
                .clone()
                .unwrap_or_else(|| contract::FailureReason::JobFailed.as_str().into()),
            message: c.message.clone().unwrap_or_default(),
        }
    } else {
        JobState::Active
    }
}

pub fn observe_job(job: &Job, pods: &[Pod]) -> Option<ObservedJob> {
    let labels = job.metadata.labels.as_ref()?;
    let phase = JobPhase::parse(labels.get(contract::labels::PHASE)?)?;
    let spec = job.spec.as_ref();
    let image = spec
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default();
    let created = job
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or_default();
    let status = job.status.as_ref();
    let started = status
        .and_then(|s| s.start_time.as_ref())
        .map(|t| t.0)
        .unwrap_or(created);
    let state = job_state(job);
    let job_name = job.metadata.name.clone().unwrap_or_default();
    let pod = pods
        .iter()
        .filter(|p| {
            p.metadata.labels.as_ref().and_then(|l| {
                l.get("batch.kubernetes.io/job-name")
                    .or_else(|| l.get("job-name"))
            }) == Some(&job_name)
        })
        .max_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .map(observe_pod);
    let deadline_seconds = spec.and_then(|s| s.active_deadline_seconds);
    Some(ObservedJob {
        deadline_seconds,
        out_dir: job_out_dir(job),
        phase,
        name: job_name,
        image,
        spec_hash: job
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(contract::annotations::JOB_SPEC_HASH).cloned()),
        created,
        started,
        terminating: job.metadata.deletion_timestamp.is_some(),
        state,
        pod,
    })
}

fn observe_pod(p: &Pod) -> ObservedPod {
    let st = p.status.as_ref();
    let cs = st
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|v| v.first());
    let term = cs
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .or_else(|| {
            cs.and_then(|c| c.last_state.as_ref())
                .and_then(|s| s.terminated.as_ref())
        });
    let waiting = cs
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref());
    ObservedPod {
        name: p.metadata.name.clone().unwrap_or_default(),
        running: st.and_then(|s| s.phase.as_deref()) == Some("Running"),
        terminated_reason: term.and_then(|t| t.reason.clone()),
        exit_code: term.map(|t| t.exit_code),
        termination_message: term
            .and_then(|t| t.message.clone())
            .filter(|m| !m.trim().is_empty()),
        waiting_reason: waiting.and_then(|w| w.reason.clone()),
        waiting_message: waiting.and_then(|w| w.message.clone()),
        created: p.metadata.creation_timestamp.as_ref().map(|t| t.0),
        unschedulable: st
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| {
                cs.iter().find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })
            })
            .map(|c| c.message.clone().unwrap_or_else(|| "Unschedulable".into())),
    }
}

/// Why a pod that has not started is stuck, if it is: the scheduler cannot place it, or the
/// kubelet cannot pull its image. `(reason, message)`.
pub fn stuck_reason(p: &ObservedPod) -> Option<(contract::FailureReason, String)> {
    if p.running || p.terminated_reason.is_some() {
        return None;
    }
    if let Some(m) = &p.unschedulable {
        return Some((contract::FailureReason::Unschedulable, m.clone()));
    }
    match p.waiting_reason.as_deref() {
        Some(r @ ("ImagePullBackOff" | "ErrImagePull")) => Some((
            contract::FailureReason::ImagePullBackOff,
            match &p.waiting_message {
                Some(m) => format!("{r}: {m}"),
                None => r.to_string(),
            },
        )),
        _ => None,
    }
}

/// Whether the scheduler's message says the pod waits for capacity: some node that would take it is
/// full ("Insufficient amd.com/gpu", "Insufficient memory", "Too many pods") — a queue that drains
/// as other pods finish, not a pod no node can ever take (selector, affinity, taints only).
pub fn waits_for_capacity(message: &str) -> bool {
    // "0/5 nodes are available: 1 Insufficient amd.com/gpu, 4 node(s) didn't match …. preemption: …"
    let placement = message.split("preemption:").next().unwrap_or(message);
    placement.contains("Insufficient ") || placement.contains("Too many pods")
}

/// Whether the scheduler's message says the pod waits for its volume claim to be bound ("pod has
/// unbound immediate PersistentVolumeClaims"): the storage system's work (the PV controller or a
/// provisioner), which a new Job cannot speed up — not a claim no volume fits ("didn't find
/// available persistent volumes to bind", which stays a fault).
pub fn waits_for_volume_binding(message: &str) -> bool {
    message.contains("unbound immediate PersistentVolumeClaims")
}

/// What an unschedulable pod waits for when that is a queue rather than a fault: node capacity or
/// its claim's binding. Such a wait never fails the attempt.
pub fn waits_for(message: &str) -> Option<&'static str> {
    if waits_for_capacity(message) {
        Some("node capacity")
    } else if waits_for_volume_binding(message) {
        Some("its volume claim to be bound")
    } else {
        None
    }
}

/// GPUProfiles are listed only for a live cache with a GPU phase.
pub fn needs_profiles(mc: &ModelCache) -> bool {
    mc.metadata.deletion_timestamp.is_none() && JobPhase::ALL.iter().any(|p| jobs::uses_gpu(mc, *p))
}

/// Pods are read only for Jobs whose outcome or progress matters now: not being deleted, and not a
/// success that status already recorded.
pub fn needs_pods(job: &ObservedJob, status: &ModelCacheStatus) -> bool {
    let recorded = get_common(status, job.phase).completed_at.is_some();
    !job.terminating
        && match job.state {
            JobState::Succeeded => !recorded,
            _ => true,
        }
}

/// A pod log tail is wanted for a running pod (progress) or a failed pod without a termination
/// message (the failure text).
pub fn wants_log_tail(job: &ObservedJob) -> bool {
    match (&job.state, &job.pod) {
        (JobState::Active, Some(p)) => p.running,
        (JobState::Failed { .. }, Some(p)) => p.termination_message.is_none(),
        _ => false,
    }
}

/// Running pods: at most one log read per half poll interval per cache (every Job status change
/// triggers a reconcile; progress does not need them all). `last` is the cache's last read.
pub fn log_read_due(last: Option<Instant>, now: Instant, progress_poll: Duration) -> bool {
    let min_gap = progress_poll.checked_div(2).unwrap_or_default();
    last.is_none_or(|t| now.duration_since(t) >= min_gap)
}

/// Of two caches on one claim, whether `other` is the older one (it keeps the directory): created
/// earlier, or, at the same or an unknown time, the smaller name.
pub fn is_older_peer(other: (Option<Timestamp>, &str), me: (Option<Timestamp>, &str)) -> bool {
    match (other.0, me.0) {
        (Some(a), Some(b)) if a != b => a < b,
        _ => other.1 < me.1,
    }
}

/// The directory a Model's `status.servedPath` (`<claim>:<dir>`) serves from `claim`, if on it.
pub fn served_dir_on(served_path: &str, claim: &str) -> Option<String> {
    let (c, dir) = served_path.split_once(':')?;
    (c == claim).then(|| dir.trim_end_matches('/').to_string())
}

/// Whether a Model with `source` (and `status.servedPath`) reads from claim `claim`: a `pvc://<claim>/…`
/// source, or what it serves now is on the claim (a `modelcache://` Model).
pub fn model_uses_claim(source: &str, served_path: Option<&str>, claim: &str) -> bool {
    let by_source = matches!(
        crate::model_source::parse_source(source),
        Ok(crate::model_source::Source::Pvc { claim: c, .. }) if c == claim
    );
    by_source || served_path.is_some_and(|p| served_dir_on(p, claim).is_some())
}

/// Once the download completed on it, the created PVC exists: it is read only before that, and
/// while the cache is being deleted (deletion checks again itself).
pub fn pvc_known_to_exist(mc: &ModelCache) -> bool {
    let Some(status) = mc.status.as_ref() else {
        return false;
    };
    let downloaded = status
        .download
        .as_ref()
        .is_some_and(|d| d.completed_at.is_some())
        && status.claim_name.is_some();
    downloaded && mc.metadata.deletion_timestamp.is_none()
}

/// Drop what no reader of a stored Job needs (managed fields; of the pod template all but the worker
/// container's image and `OUT_DIR`): the Job store holds every pipeline Job of the watched
/// namespaces, and a full Job is ~10 KB. [`observe_job`] reads the same from a pruned Job.
pub fn prune_job(job: &mut Job) {
    job.metadata.managed_fields = None;
    let Some(spec) = job.spec.as_mut() else {
        return;
    };
    spec.selector = None;
    spec.template.metadata = None;
    if let Some(pod) = spec.template.spec.as_mut() {
        pod.containers.truncate(1);
        if let Some(c) = pod.containers.first_mut() {
            let image = c.image.take();
            let out_dir = c
                .env
                .take()
                .unwrap_or_default()
                .into_iter()
                .find(|e| e.name == contract::env::OUT_DIR);
            *c = k8s_openapi::api::core::v1::Container {
                name: std::mem::take(&mut c.name),
                image,
                env: out_dir.map(|e| vec![e]),
                ..Default::default()
            };
        }
        *pod = k8s_openapi::api::core::v1::PodSpec {
            containers: std::mem::take(&mut pod.containers),
            ..Default::default()
        };
    }
}

/// The controller-wide budget of progress log reads (a token bucket: `per_second` tokens a
/// second, at most `2 × per_second` saved up). A read that finds no token is skipped: progress keeps
/// its last value until the next poll. `per_second = 0` turns progress log reads off.
#[derive(Debug, Clone)]
pub struct LogBudget {
    per_second: f64,
    tokens: f64,
    at: Instant,
}

impl LogBudget {
    pub fn new(per_second: u32, now: Instant) -> Self {
        let per_second = f64::from(per_second);
        Self {
            per_second,
            tokens: per_second.max(1.0),
            at: now,
        }
    }

    /// Take a token if there is one at `now`.
    pub fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        let cap = (self.per_second * 2.0).max(1.0);
        self.tokens = (self.tokens + elapsed * self.per_second).min(cap);
        if self.per_second > 0.0 && self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}
