//! Leader election on a `coordination.k8s.io/v1` Lease. Hand-written (acquire / renew with
//! optimistic concurrency on `resourceVersion`): kube-rs has no built-in elector and the
//! third-party crates lag kube 5.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::Client;
use tracing::{info, warn};

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
}

/// A held Lease.
pub struct Leadership {
    api: Api<Lease>,
    cfg: LeaseConfig,
}

fn expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    let Some(renew) = spec.renew_time.as_ref().map(|t| t.0) else {
        return true;
    };
    let dur = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    now.as_second() - renew.as_second() > dur
}

impl Leadership {
    /// Block until this process holds the Lease.
    pub async fn acquire(client: Client, cfg: LeaseConfig) -> anyhow::Result<Self> {
        let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
        let me = Self { api, cfg };
        let retry = (me.cfg.duration / 3).max(Duration::from_millis(500));
        loop {
            match me.try_acquire().await {
                Ok(true) => {
                    info!(lease = %me.cfg.name, identity = %me.cfg.identity, "acquired leadership");
                    return Ok(me);
                }
                Ok(false) => {}
                Err(e) => warn!(error = %e, "leader election attempt failed"),
            }
            tokio::time::sleep(retry).await;
        }
    }

    fn spec(&self, now: Timestamp, acquire: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(self.cfg.duration.as_secs().max(1) as i32),
            acquire_time: acquire.or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// One acquire-or-renew attempt; `Ok(true)` when we hold the Lease afterwards.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        match self.api.get_opt(&self.cfg.name).await? {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(self.spec(now, None, 0)),
                };
                match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Some(mut lease) => {
                let spec = lease.spec.clone().unwrap_or_default();
                let mine = spec.holder_identity.as_deref() == Some(self.cfg.identity.as_str());
                let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
                if !mine && !free && !expired(&spec, now) {
                    return Ok(false);
                }
                let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!mine);
                let acquire = if mine {
                    spec.acquire_time.clone()
                } else {
                    None
                };
                lease.spec = Some(self.spec(now, acquire, transitions));
                // replace() carries resourceVersion: a concurrent writer makes this fail with 409.
                match self
                    .api
                    .replace(&self.cfg.name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Renew until the Lease is lost; returns when leadership can no longer be guaranteed.
    pub async fn keep(&self) {
        let every = (self.cfg.duration / 3).max(Duration::from_millis(300));
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(every).await;
            match self.try_acquire().await {
                Ok(true) => last_ok = tokio::time::Instant::now(),
                Ok(false) => {
                    warn!(lease = %self.cfg.name, "lost leadership to another replica");
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "lease renewal failed");
                    if last_ok.elapsed() >= self.cfg.duration * 2 / 3 {
                        return;
                    }
                }
            }
        }
    }

    /// Give the Lease up on shutdown so a standby takes over at once.
    pub async fn release(&self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.cfg.name).await {
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
                let _ = self
                    .api
                    .replace(&self.cfg.name, &PostParams::default(), &lease)
                    .await;
                info!(lease = %self.cfg.name, "released leadership");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_expiry() {
        let now = Timestamp::from_second(1_000_000).unwrap_or_default();
        let at = |s: i64| Some(MicroTime(Timestamp::from_second(s).unwrap_or_default()));
        let spec = |renew, dur| LeaseSpec {
            renew_time: renew,
            lease_duration_seconds: Some(dur),
            ..Default::default()
        };
        assert!(!expired(&spec(at(999_990), 15), now));
        assert!(expired(&spec(at(999_980), 15), now));
        assert!(expired(&spec(None, 15), now), "never renewed = free");
    }
}
