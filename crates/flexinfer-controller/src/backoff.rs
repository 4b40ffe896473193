//! Requeue delays after failed reconciles: exponential per object, with jitter, capped, and reset
//! by the next successful reconcile of that object. One home for both controllers.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// First delay after a failure.
pub const MIN_DELAY: Duration = Duration::from_secs(2);
/// Largest delay, however often an object fails.
pub const MAX_DELAY: Duration = Duration::from_secs(300);

/// The delay after the `n`-th consecutive failure (0-based): `MIN_DELAY·2ⁿ` plus a random jitter
/// of up to as much again (backon's jitter), capped at `MAX_DELAY`, so objects that failed together
/// do not retry together.
pub fn delay(n: u32) -> Duration {
    ExponentialBuilder::default()
        .with_min_delay(MIN_DELAY)
        .with_max_delay(MAX_DELAY)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(n.min(64) as usize)
        .unwrap_or(MAX_DELAY)
        .min(MAX_DELAY)
}

/// Consecutive failures per object (`namespace/name`).
#[derive(Debug, Default)]
pub struct Failures(Mutex<HashMap<String, u32>>);

impl Failures {
    /// Record a failure of `key`; returns the delay before the next attempt.
    pub fn failed(&self, key: &str) -> Duration {
        delay(self.hit(key).saturating_sub(1))
    }

    /// Record a failure of `key`; returns how many in a row it has now (1 for the first).
    pub fn hit(&self, key: &str) -> u32 {
        match self.0.lock() {
            Ok(mut m) => {
                let n = m.entry(key.to_string()).or_insert(0);
                *n = n.saturating_add(1);
                *n
            }
            Err(_) => 1,
        }
    }

    /// Failures of `key` in a row (0 when its last reconcile succeeded).
    pub fn count(&self, key: &str) -> u32 {
        self.0
            .lock()
            .ok()
            .and_then(|m| m.get(key).copied())
            .unwrap_or(0)
    }

    /// A successful reconcile of `key`: the next failure starts again at `MIN_DELAY`.
    pub fn succeeded(&self, key: &str) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_with_jitter_are_capped_and_reset() {
        for n in 0..12u32 {
            let base = MIN_DELAY.saturating_mul(2u32.saturating_pow(n));
            for _ in 0..20 {
                let d = delay(n);
                assert!(d >= base.min(MAX_DELAY), "n={n}: {d:?} < {base:?}");
                assert!(d <= (base * 2).min(MAX_DELAY), "n={n}: {d:?}");
            }
        }
        assert_eq!(delay(1000), MAX_DELAY);
        // Jitter: twenty draws of one step are not all equal.
        let draws: std::collections::BTreeSet<Duration> = (0..20).map(|_| delay(1)).collect();
        assert!(draws.len() > 1, "{draws:?}");

        let f = Failures::default();
        let first = f.failed("ns/a");
        let second = f.failed("ns/a");
        assert!(first < MIN_DELAY * 2 && second >= MIN_DELAY * 2);
        assert!(
            f.failed("ns/b") < MIN_DELAY * 2,
            "objects are counted apart"
        );
        f.succeeded("ns/a");
        assert!(f.failed("ns/a") < MIN_DELAY * 2, "reset after success");
    }
}
