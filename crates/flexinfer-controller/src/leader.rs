//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's leaderelection rules
//! (hand-written: kube-rs has no built-in elector and the third-party crates lag kube 5).
//!
//! - **Expiry never compares clocks.** A candidate does not read another replica's `renewTime`
//!   against its own clock. It remembers the lease record it last saw (holder, `renewTime`,
//!   `resourceVersion`) and when, on its own monotonic clock, that record last changed; the lease
//!   is free once the record has stayed unchanged for `leaseDurationSeconds`.
//! - **Renewals have a deadline.** The holder renews every `retry_period`; every API call has a
//!   timeout; when no renewal succeeded for `renew_deadline` (shorter than the lease duration),
//!   [`Leadership::keep`] returns and the caller stops reconciling (the binary exits), before a
//!   standby can consider the lease expired.
//! - Writes use optimistic concurrency (`replace` carries `resourceVersion`): of two candidates
//!   only one wins.

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::Client;
use tokio::time::Instant;
use tracing::{info, warn};

/// `d · num / den` without overflow (saturating; `den` 0 gives `d`).
fn fraction(d: Duration, num: u32, den: u32) -> Duration {
    d.saturating_mul(num).checked_div(den).unwrap_or(d)
}

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    /// `leaseDurationSeconds`: how long a standby waits after the last change it saw.
    pub duration: Duration,
    /// How long the holder keeps leading without a successful renewal (< `duration`).
    pub renew_deadline: Duration,
    /// Time between acquire/renew attempts.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// client-go's proportions (15 s / 10 s / 2 s): renew deadline 2/3 and retry period 2/15 of
    /// the lease duration (at least 1 s lease, 100 ms retry).
    pub fn new(namespace: String, name: String, identity: String, duration: Duration) -> Self {
        let duration = duration.max(Duration::from_secs(1));
        LeaseConfig {
            namespace,
            name,
            identity,
            renew_deadline: fraction(duration, 2, 3),
            retry_period: fraction(duration, 2, 15).max(Duration::from_millis(100)),
            duration,
        }
    }

    /// The settings made consistent: renew deadline below the lease duration, retry period below
    /// the renew deadline.
    fn checked(mut self) -> Self {
        self.duration = self.duration.max(Duration::from_secs(1));
        if self.renew_deadline.is_zero() || self.renew_deadline >= self.duration {
            self.renew_deadline = fraction(self.duration, 2, 3);
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            self.retry_period = fraction(self.renew_deadline, 1, 5).max(Duration::from_millis(50));
        }
        self
    }

    /// The timeout of one API call: never longer than the renew deadline allows.
    fn call_timeout(&self) -> Duration {
        fraction(self.renew_deadline, 1, 2).max(Duration::from_millis(50))
    }
}

/// The lease record as last observed, and when (on this process's monotonic clock) it changed.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    holder: Option<String>,
    renew_time: Option<Timestamp>,
    resource_version: Option<String>,
    duration: Duration,
    changed_at: Instant,
}

/// One acquire/renew decision against the observed record; pure, tested without a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    /// Write the lease with us as holder.
    Take,
    /// Another replica holds it and its record changed less than a lease duration ago.
    Wait,
}

/// Updates `seen` with the lease read now and decides. `now` is the monotonic clock.
fn decide(
    seen: &mut Option<Observed>,
    lease: &Lease,
    identity: &str,
    default_duration: Duration,
    now: Instant,
) -> Decision {
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
    let record = (
        holder.clone(),
        spec.renew_time.as_ref().map(|t| t.0),
        lease.metadata.resource_version.clone(),
    );
    let duration = spec
        .lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map_or(default_duration, Duration::from_secs);
    let unchanged = seen
        .as_ref()
        .is_some_and(|o| (o.holder.clone(), o.renew_time, o.resource_version.clone()) == record);
    if !unchanged {
        *seen = Some(Observed {
            holder: record.0,
            renew_time: record.1,
            resource_version: record.2,
            duration,
            changed_at: now,
        });
    }
    let Some(o) = seen.as_ref() else {
        return Decision::Wait;
    };
    match &o.holder {
        None => Decision::Take,
        Some(h) if h == identity => Decision::Take,
        Some(_) if now.saturating_duration_since(o.changed_at) >= o.duration => Decision::Take,
        Some(_) => Decision::Wait,
    }
}

/// A held Lease.
pub struct Leadership {
    api: Api<Lease>,
    cfg: LeaseConfig,
    seen: Mutex<Option<Observed>>,
}

/// Why an attempt did not end with us holding the lease.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    #[error("lease API call timed out after {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Api(#[from] kube::Error),
}

impl Leadership {
    /// Block until this process holds the Lease.
    pub async fn acquire(client: Client, cfg: LeaseConfig) -> anyhow::Result<Self> {
        let cfg = cfg.checked();
        let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
        let me = Self {
            api,
            cfg,
            seen: Mutex::new(None),
        };
        loop {
            match me.try_acquire().await {
                Ok(true) => {
                    info!(lease = %me.cfg.name, identity = %me.cfg.identity, "acquired leadership");
                    return Ok(me);
                }
                Ok(false) => {}
                Err(e) => warn!(error = %e, "leader election attempt failed"),
            }
            tokio::time::sleep(me.cfg.retry_period).await;
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.cfg
    }

    fn spec(&self, now: Timestamp, acquire: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        let secs = i32::try_from(self.cfg.duration.as_secs().max(1)).unwrap_or(i32::MAX);
        LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(secs),
            acquire_time: acquire.or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// One API call, bounded by `limit`.
    async fn timed<T>(
        limit: Duration,
        call: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, AttemptError> {
        match tokio::time::timeout(limit, call).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(AttemptError::Timeout(limit)),
        }
    }

    /// One acquire-or-renew attempt; `Ok(true)` when we hold the Lease afterwards.
    pub async fn try_acquire(&self) -> Result<bool, AttemptError> {
        self.attempt(self.cfg.call_timeout()).await
    }

    async fn attempt(&self, limit: Duration) -> Result<bool, AttemptError> {
        let now = Timestamp::now();
        match Self::timed(limit, self.api.get_opt(&self.cfg.name)).await? {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(self.spec(now, None, 0)),
                };
                match Self::timed(limit, self.api.create(&PostParams::default(), &lease)).await {
                    Ok(l) => {
                        self.observe(&l);
                        Ok(true)
                    }
                    Err(AttemptError::Api(kube::Error::Api(e))) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Some(mut lease) => {
                let decision = {
                    let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
                    decide(
                        &mut seen,
                        &lease,
                        &self.cfg.identity,
                        self.cfg.duration,
                        Instant::now(),
                    )
                };
                if decision == Decision::Wait {
                    return Ok(false);
                }
                let spec = lease.spec.clone().unwrap_or_default();
                let mine = spec.holder_identity.as_deref() == Some(self.cfg.identity.as_str());
                let transitions = spec
                    .lease_transitions
                    .unwrap_or(0)
                    .saturating_add(i32::from(!mine));
                let acquire = if mine {
                    spec.acquire_time.clone()
                } else {
                    None
                };
                lease.spec = Some(self.spec(now, acquire, transitions));
                // replace() carries resourceVersion: a concurrent writer makes this fail with 409.
                match Self::timed(
                    limit,
                    self.api
                        .replace(&self.cfg.name, &PostParams::default(), &lease),
                )
                .await
                {
                    Ok(l) => {
                        self.observe(&l);
                        Ok(true)
                    }
                    Err(AttemptError::Api(kube::Error::Api(e))) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Our own successful write is the newest record.
    fn observe(&self, lease: &Lease) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        decide(
            &mut seen,
            lease,
            &self.cfg.identity,
            self.cfg.duration,
            Instant::now(),
        );
    }

    /// Renew until leadership can no longer be guaranteed, then return: another replica took the
    /// Lease, or no renewal succeeded within the renew deadline (each call timed out or failed).
    /// The caller must stop reconciling when this returns.
    pub async fn keep(&self) {
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(self.cfg.retry_period).await;
            let left = self.cfg.renew_deadline.saturating_sub(last_ok.elapsed());
            if left.is_zero() {
                warn!(lease = %self.cfg.name, deadline = ?self.cfg.renew_deadline, "no lease renewal within the renew deadline");
                return;
            }
            match self.attempt(self.cfg.call_timeout().min(left)).await {
                Ok(true) => last_ok = Instant::now(),
                Ok(false) => {
                    warn!(lease = %self.cfg.name, "lost leadership to another replica");
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "lease renewal failed");
                    if last_ok.elapsed() >= self.cfg.renew_deadline {
                        warn!(lease = %self.cfg.name, deadline = ?self.cfg.renew_deadline, "no lease renewal within the renew deadline");
                        return;
                    }
                }
            }
        }
    }

    /// Give the Lease up on shutdown so a standby takes over at once.
    pub async fn release(&self) {
        let limit = self.cfg.call_timeout();
        if let Ok(Some(mut lease)) = Self::timed(limit, self.api.get_opt(&self.cfg.name)).await {
            let mine = lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref())
                == Some(self.cfg.identity.as_str());
            if mine {
                if let Some(s) = lease.spec.as_mut() {
                    s.holder_identity = None;
                    s.renew_time = None;
                }
                let _ = Self::timed(
                    limit,
                    self.api
                        .replace(&self.cfg.name, &PostParams::default(), &lease),
                )
                .await;
                info!(lease = %self.cfg.name, "released leadership");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, renew_s: i64, rv: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                renew_time: Some(MicroTime(
                    Timestamp::from_second(renew_s).unwrap_or_default(),
                )),
                lease_duration_seconds: Some(15),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn expiry_is_measured_on_the_local_clock_from_the_last_change() {
        let d = Duration::from_secs(15);
        let t0 = Instant::now();
        let mut seen = None;
        // A renewTime far in the past (another replica's clock is behind): not expired on sight.
        let old = lease(Some("other"), 1, "1");
        assert_eq!(decide(&mut seen, &old, "me", d, t0), Decision::Wait);
        assert_eq!(
            decide(&mut seen, &old, "me", d, t0 + Duration::from_secs(14)),
            Decision::Wait
        );
        // Still renewed (the record changes): the wait starts again.
        let renewed = lease(Some("other"), 2, "2");
        let t1 = t0 + Duration::from_secs(14);
        assert_eq!(decide(&mut seen, &renewed, "me", d, t1), Decision::Wait);
        assert_eq!(
            decide(&mut seen, &renewed, "me", d, t1 + Duration::from_secs(14)),
            Decision::Wait
        );
        // Unchanged for a whole lease duration: free, whatever renewTime says (even the future).
        assert_eq!(decide(&mut seen, &renewed, "me", d, t1 + d), Decision::Take);
        let mut seen = None;
        let future = lease(Some("other"), 4_000_000_000, "3");
        assert_eq!(decide(&mut seen, &future, "me", d, t0), Decision::Wait);
        assert_eq!(decide(&mut seen, &future, "me", d, t0 + d), Decision::Take);
        // Ours, or nobody's: take (renew) at once.
        assert_eq!(
            decide(&mut None, &lease(Some("me"), 1, "4"), "me", d, t0),
            Decision::Take
        );
        assert_eq!(
            decide(&mut None, &lease(None, 1, "5"), "me", d, t0),
            Decision::Take
        );
    }

    #[test]
    fn the_renew_deadline_is_shorter_than_the_lease() {
        let c = LeaseConfig::new(
            "ns".into(),
            "l".into(),
            "me".into(),
            Duration::from_secs(15),
        );
        assert_eq!(c.renew_deadline, Duration::from_secs(10));
        assert_eq!(c.retry_period, Duration::from_secs(2));
        let bad = LeaseConfig {
            renew_deadline: Duration::from_secs(30),
            retry_period: Duration::from_secs(30),
            ..c
        }
        .checked();
        assert!(bad.renew_deadline < bad.duration && bad.retry_period < bad.renew_deadline);
        assert!(bad.call_timeout() < bad.renew_deadline);
    }
}
