//! What the fault-injection suites share: seeded kill points and the tally of what a kill broke.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report
#![allow(dead_code)]

/// What the kills of one suite did.
#[derive(Debug, Default)]
pub struct Tally {
    pub points: usize,
    pub killed_mid_run: usize,
    pub lost_or_different: usize,
    pub unverified: usize,
    pub leftovers: usize,
    pub previous_changed: usize,
}

/// Deterministic fractions in (0.02, 1.1): kill points spread over the whole run and just after it.
pub fn fraction(seed: u64) -> f64 {
    let x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    0.02 + (x >> 11) as f64 / (1u64 << 53) as f64 * 1.08
}

/// Zero of every kind of damage, and enough kills that hit a running worker to prove something.
pub fn check(what: &str, t: &Tally, min_mid_run: usize) {
    eprintln!("fault injection {what}: {t:?}");
    assert_eq!(
        t.lost_or_different, 0,
        "{what}: lost or different after a kill"
    );
    assert_eq!(
        t.unverified, 0,
        "{what}: artifacts or files that do not verify"
    );
    assert_eq!(
        t.leftovers, 0,
        "{what}: staging, partial or lock entries left behind"
    );
    assert_eq!(
        t.previous_changed, 0,
        "{what}: the promoted neighbour changed"
    );
    assert!(
        t.killed_mid_run >= min_mid_run,
        "{what}: only {} of {} kills hit a running worker (the test would prove nothing)",
        t.killed_mid_run,
        t.points
    );
}
