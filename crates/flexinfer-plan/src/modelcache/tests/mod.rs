//! Tests of the pure planner and the Job builders, by topic; the fixtures they share are in
//! [`super::testkit`].

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::conditions;
use flexinfer_api::contract::{annotations, JobPhase};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::{CachePhase, ModelCache};
use k8s_openapi::jiff::Timestamp;
use sha2::{Digest, Sha256};

use super::config::Config;
use super::jobs;
use super::observe::{JobState, ObservedJob, ObservedPod};
use super::plan::{classify_failure, plan, redact, Action, ClaimPeer, LogTail, Observed, Plan};

pub use super::testkit::*;

mod failures;
mod job_builders;
mod lifecycle;
mod node_copies;
mod nodelocal;
mod observe;
mod progress;
mod recorded;
mod reruns;
mod validation;
mod write_budget;
