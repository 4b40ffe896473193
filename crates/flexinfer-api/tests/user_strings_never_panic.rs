//! Property tests of the API crate's parsers of user strings (durations in Model and ModelCache specs,
//! the controller's namespace list): an error or a value for any input, never a panic (100 000 cases
//! each; `PROPTEST_CASES` overrides). Twenty-digit durations used to overflow.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_api::duration::parse_duration;
use flexinfer_api::namespaces::parse_list;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn durations(s in prop_oneof![
        any::<String>(),
        r"[+\-]?([0-9]{0,25}(\.[0-9]{0,12})?(ns|us|µs|ms|s|m|h|d|y)?){0,4}",
    ]) {
        if let Some(d) = parse_duration(&s) {
            // A parsed duration is a usable one.
            let _ = d.as_secs_f64();
        }
    }

    #[test]
    fn namespace_lists(s in prop_oneof![any::<String>(), r"[a-z0-9\-, ]{0,80}"]) {
        if let Ok(v) = parse_list(&s) {
            prop_assert!(v.iter().all(|n| !n.is_empty()));
        }
    }
}
