//! The one retry schedule of the transfer phases (hub listing and file fetches, registry requests
//! and blob uploads): exponential delays with jitter (backon's), a cap, and a bounded number of
//! attempts, so that many pods failing together do not retry together.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Attempts left and the delays before them.
#[derive(Debug)]
pub struct Retry {
    first: Duration,
    max: Duration,
    times: usize,
    delays: ExponentialBackoff,
    attempt: u32,
}

impl Retry {
    /// Up to `times` retries; the first waits `first` (plus up to as much again of jitter), each
    /// next one twice as long, never more than `max` (plus jitter).
    pub fn new(first: Duration, max: Duration, times: usize) -> Self {
        Self {
            first,
            max,
            times,
            delays: Self::schedule(first, max, times),
            attempt: 0,
        }
    }

    fn schedule(first: Duration, max: Duration, times: usize) -> ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(first)
            .with_max_delay(max)
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(times)
            .build()
    }

    /// The delay before the next attempt, counting it; `None` once every retry is used.
    pub fn next_delay(&mut self) -> Option<Duration> {
        let d = self.delays.next()?;
        self.attempt = self.attempt.saturating_add(1);
        Some(d)
    }

    /// Retries taken so far (1 after the first [`Retry::next_delay`]).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Start over (the failed attempt made progress, e.g. a download moved forward).
    pub fn reset(&mut self) {
        self.delays = Self::schedule(self.first, self.max, self.times);
        self.attempt = 0;
    }

    /// Wait before the next attempt; `false` (without waiting) once every retry is used.
    pub async fn wait(&mut self) -> bool {
        match self.next_delay() {
            Some(d) => {
                tokio::time::sleep(d).await;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_with_jitter_within_the_cap_and_run_out() {
        let first = Duration::from_millis(100);
        let max = Duration::from_millis(350);
        let mut r = Retry::new(first, max, 4);
        let d: Vec<Duration> = std::iter::from_fn(|| r.next_delay()).collect();
        assert_eq!(d.len(), 4, "{d:?}");
        assert_eq!(r.attempt(), 4);
        // Each delay is its exponential step (capped) plus a jitter of at most as much again.
        for (i, step) in [100u64, 200, 350, 350].into_iter().enumerate() {
            let step = Duration::from_millis(step);
            assert!(d[i] >= step && d[i] <= step * 2, "delay {i}: {:?}", d[i]);
        }
        assert_eq!(r.next_delay(), None);
        r.reset();
        assert_eq!(r.attempt(), 0);
        assert!(r.next_delay().is_some());
    }
}
