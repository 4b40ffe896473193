//! What bounds the proxy's memory and load: admission gates (global, with a bounded queue, and per
//! Model) that refuse with 429 when full, and a byte budget for the request bodies held in memory.
//!
//! The memory rule (docs/user/serving.md, "Limits"): request bodies are the only memory that grows
//! with what clients send. A body is held from its read until the backend's response headers
//! arrive (a cold start included), and for a moment twice (the read chunks joined, or the body and
//! its rewrite), so each admitted request reserves [`BODY_COPIES`] × its size (its declared length,
//! or the body cap when it declares none) from the budget before it is read, and waits while the
//! budget is spent. The budget defaults to half the container's memory limit, the rest being the
//! proxy's own (caches, connections, streaming buffers); the body cap defaults to the budget over
//! `BODY_COPIES × MIN_FULL_BODIES`, at most 8 MiB — at the chart's 256 MiB limit: a 128 MiB budget,
//! an 8 MiB cap, and 8 bodies of the cap in memory at once, however many requests come.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

use crate::cluster::ModelKey;

/// How many copies of a body may exist at once while it is handled.
pub const BODY_COPIES: usize = 2;
/// Bodies of the cap the budget holds at least, by the default rule.
pub const MIN_FULL_BODIES: usize = 4;
/// The body cap by default, when the budget allows it.
pub const MAX_DEFAULT_BODY_BYTES: usize = 8 << 20;
/// The body budget when no memory limit is known (half the chart's 256 MiB limit).
pub const DEFAULT_BODY_MEMORY_BYTES: usize = 128 << 20;
/// The budget is counted in units of this many bytes (a semaphore's permits).
const UNIT: usize = 1024;

/// The default body cap for a budget: `budget / (BODY_COPIES × MIN_FULL_BODIES)`, at most 8 MiB.
pub fn default_max_body_bytes(budget: usize) -> usize {
    (budget / BODY_COPIES / MIN_FULL_BODIES).min(MAX_DEFAULT_BODY_BYTES)
}

/// The default body budget for a container memory limit: half of it (128 MiB without a limit).
pub fn default_body_memory_bytes(memory_limit: Option<u64>) -> usize {
    memory_limit
        .and_then(|l| usize::try_from(l / 2).ok())
        .unwrap_or(DEFAULT_BODY_MEMORY_BYTES)
}

/// The container's memory limit from its cgroup (v2, then v1); `None` when unlimited or unknown.
pub fn container_memory_limit() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let v2 = read("/sys/fs/cgroup/memory.max");
    let text = v2.or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))?;
    // v2 writes "max"; v1 writes a huge number for "no limit".
    text.trim().parse::<u64>().ok().filter(|l| *l < (1 << 60))
}

/// A body cap the body budget cannot hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a body of the cap ({max_body_bytes} bytes) needs {BODY_COPIES}× its size from the body \
     budget ({body_memory_bytes} bytes): lower the cap or raise the budget"
)]
pub struct CapOverBudget {
    pub max_body_bytes: usize,
    pub body_memory_bytes: usize,
}

/// Why the settings cannot work together.
pub fn check(max_body_bytes: usize, body_memory_bytes: usize) -> Result<(), CapOverBudget> {
    match max_body_bytes.checked_mul(BODY_COPIES) {
        Some(need) if need <= body_memory_bytes => Ok(()),
        _ => Err(CapOverBudget {
            max_body_bytes,
            body_memory_bytes,
        }),
    }
}

/// Refused at admission: the gate is full (429).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

/// A counting gate with a bounded queue: `permits` at once, `max_queued` more may wait.
pub struct Gate {
    permits: Arc<Semaphore>,
    queued: AtomicUsize,
    max_queued: usize,
}

/// Decrements the queue length when a waiter leaves it (admitted, refused or gone).
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    pub fn new(permits: usize, max_queued: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(permits.min(Semaphore::MAX_PERMITS))),
            queued: AtomicUsize::new(0),
            max_queued,
        }
    }

    /// A permit now, or after waiting in the queue when it has room; `Full` otherwise.
    pub async fn enter(&self) -> Result<OwnedSemaphorePermit, Full> {
        match self.permits.clone().try_acquire_owned() {
            Ok(p) => return Ok(p),
            Err(TryAcquireError::Closed) => return Err(Full),
            Err(TryAcquireError::NoPermits) => {}
        }
        if self.queued.fetch_add(1, Ordering::SeqCst) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(Full);
        }
        let _queued = Queued(&self.queued);
        self.permits.clone().acquire_owned().await.map_err(|_| Full)
    }
}

/// The budget of bytes that request bodies hold together.
pub struct BodyBudget {
    units: Arc<Semaphore>,
    total_units: usize,
}

impl BodyBudget {
    pub fn new(bytes: usize) -> Self {
        let total_units = bytes.div_ceil(UNIT).clamp(1, Semaphore::MAX_PERMITS);
        Self {
            units: Arc::new(Semaphore::new(total_units)),
            total_units,
        }
    }

    /// Reserve room for a body of `len` bytes (× [`BODY_COPIES`]), waiting while the budget is
    /// spent. A reservation never exceeds the whole budget, so it can always be met.
    pub async fn reserve(&self, len: usize) -> Option<OwnedSemaphorePermit> {
        let units = len
            .saturating_mul(BODY_COPIES)
            .div_ceil(UNIT)
            .clamp(1, self.total_units);
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        self.units.clone().acquire_many_owned(units).await.ok()
    }

    /// Bytes not reserved right now.
    pub fn available_bytes(&self) -> usize {
        self.units.available_permits().saturating_mul(UNIT)
    }
}

/// Per-Model state: the admission cap and the release of a cold start's waiters.
pub struct ModelLimits {
    pub admitted: Arc<Semaphore>,
    pub release: Arc<Semaphore>,
}

/// The gates of every Model requests were resolved to (only Models in the cluster view, so
/// clients cannot create entries).
pub struct PerModel {
    max_requests: usize,
    release: usize,
    models: Mutex<HashMap<ModelKey, Arc<ModelLimits>>>,
}

impl PerModel {
    pub fn new(max_requests: usize, release: usize) -> Self {
        Self {
            max_requests: max_requests.min(Semaphore::MAX_PERMITS),
            release: release.clamp(1, Semaphore::MAX_PERMITS),
            models: Mutex::default(),
        }
    }

    pub fn of(&self, key: &ModelKey) -> Arc<ModelLimits> {
        let make = || {
            Arc::new(ModelLimits {
                admitted: Arc::new(Semaphore::new(self.max_requests)),
                release: Arc::new(Semaphore::new(self.release)),
            })
        };
        match self.models.lock() {
            Ok(mut m) => m.entry(key.clone()).or_insert_with(make).clone(),
            Err(_) => make(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn the_default_rule() {
        // The chart's 256 MiB limit: 128 MiB of bodies, 8 MiB cap (8 bodies of the cap at once).
        let budget = default_body_memory_bytes(Some(256 << 20));
        assert_eq!(budget, 128 << 20);
        assert_eq!(default_max_body_bytes(budget), 8 << 20);
        // A small pod: the cap shrinks so that 4 bodies (and their copies) still fit.
        assert_eq!(default_max_body_bytes(32 << 20), 4 << 20);
        assert_eq!(default_body_memory_bytes(None), DEFAULT_BODY_MEMORY_BYTES);
        assert!(check(8 << 20, 16 << 20).is_ok());
        let e = check(8 << 20, 15 << 20).unwrap_err().to_string();
        assert!(e.contains("8388608") && e.contains("15728640"), "{e}");
        assert!(check(usize::MAX, usize::MAX).is_err());
    }

    #[tokio::test]
    async fn a_gate_admits_queues_and_refuses() {
        let g = Arc::new(Gate::new(1, 1));
        let first = g.enter().await.unwrap();
        let g2 = g.clone();
        let queued = tokio::spawn(async move { g2.enter().await.map(|_| ()) });
        while g.queued.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(g.enter().await.err(), Some(Full), "queue full");
        drop(first);
        assert_eq!(queued.await.unwrap(), Ok(()));
        assert_eq!(g.queued.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn the_body_budget_bounds_the_bytes_held() {
        let b = BodyBudget::new(10 * UNIT);
        let r1 = b.reserve(3 * UNIT).await.unwrap(); // 6 units
        assert_eq!(b.available_bytes(), 4 * UNIT);
        // Larger than the budget: clamped to all of it, so it waits for r1 instead of hanging.
        let b = Arc::new(b);
        let b2 = b.clone();
        let big = tokio::spawn(async move { b2.reserve(100 * UNIT).await.is_some() });
        tokio::task::yield_now().await;
        assert!(!big.is_finished());
        drop(r1);
        assert!(big.await.unwrap());
    }
}
