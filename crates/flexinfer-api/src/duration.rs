//! Durations as the CRDs spell them (`30s`, `5m`, `1h30m`, `250ms`): the Go-style subset the
//! CRD validation rules accept. Shared by the controller (idle timeout) and the proxy
//! (cold-start timeout, keepalive interval).

use std::time::Duration;

/// Parse a Go-style duration made of `<number><unit>` parts (`ms`, `s`, `m`, `h`), e.g. `1h30m`.
/// `None` for anything else, including values too large for a `Duration`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let value: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let (unit, len) = if rest.starts_with("ms") {
            (0.001, 2)
        } else if rest.starts_with('s') {
            (1.0, 1)
        } else if rest.starts_with('m') {
            (60.0, 1)
        } else if rest.starts_with('h') {
            (3600.0, 1)
        } else {
            return None;
        };
        total += value * unit;
        rest = &rest[len..];
    }
    // `from_secs_f64` panics on overflow; a huge value is not a duration we can use.
    Duration::try_from_secs_f64(total).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        for bad in [
            "",
            "5",
            "m",
            "5d",
            "-5m",
            "5m3",
            "1e400s",
            "99999999999999999999h",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
