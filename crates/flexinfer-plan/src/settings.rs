//! The controller's environment settings, read strictly: an unset or empty variable takes its
//! default, and a set value that does not parse is an error naming the variable, so a typo in the
//! chart's `extraEnv` stops the controller at start-up with a clear message instead of being
//! silently replaced by the default.

use std::time::Duration;

/// A set but invalid setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?}: {expected}")]
pub struct SettingError {
    pub name: String,
    pub value: String,
    pub expected: String,
}

/// Typed reads from an environment lookup (`std::env::var` in the binary, a map in tests).
pub struct Settings<F: Fn(&str) -> Option<String>> {
    get: F,
}

/// The process environment.
pub fn process_env() -> Settings<impl Fn(&str) -> Option<String>> {
    Settings::new(|k: &str| std::env::var(k).ok())
}

impl<F: Fn(&str) -> Option<String>> Settings<F> {
    pub fn new(get: F) -> Self {
        Self { get }
    }

    /// The trimmed value, `None` when unset or empty.
    pub fn text(&self, name: &str) -> Option<String> {
        (self.get)(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    fn invalid(name: &str, value: &str, expected: impl Into<String>) -> SettingError {
        SettingError {
            name: name.to_string(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// A duration in seconds (fractions allowed), at most `max`; `default` when unset.
    pub fn seconds(
        &self,
        name: &str,
        default: Duration,
        max: Duration,
    ) -> Result<Duration, SettingError> {
        let Some(v) = self.text(name) else {
            return Ok(default);
        };
        let expected = || format!("expected a number of seconds from 0 to {}", max.as_secs());
        let secs: f64 = v.parse().map_err(|_| Self::invalid(name, &v, expected()))?;
        Duration::try_from_secs_f64(secs)
            .ok()
            .filter(|d| *d <= max)
            .ok_or_else(|| Self::invalid(name, &v, expected()))
    }

    /// Whole seconds greater than zero, at most `max`; `None` when unset.
    pub fn positive_seconds(
        &self,
        name: &str,
        max: Duration,
    ) -> Result<Option<Duration>, SettingError> {
        let Some(v) = self.text(name) else {
            return Ok(None);
        };
        let expected = || format!("expected whole seconds from 1 to {}", max.as_secs());
        let secs: u64 = v.parse().map_err(|_| Self::invalid(name, &v, expected()))?;
        let d = Duration::from_secs(secs);
        if secs == 0 || d > max {
            return Err(Self::invalid(name, &v, expected()));
        }
        Ok(Some(d))
    }

    /// A count from 0 to `max`; `default` when unset.
    pub fn count(&self, name: &str, default: usize, max: usize) -> Result<usize, SettingError> {
        let Some(v) = self.text(name) else {
            return Ok(default);
        };
        v.parse::<usize>()
            .ok()
            .filter(|n| *n <= max)
            .ok_or_else(|| {
                Self::invalid(name, &v, format!("expected a whole number from 0 to {max}"))
            })
    }

    /// A value checked by `parse`, whose error text says what was expected; `None` when unset.
    pub fn parsed<T, E: std::fmt::Display>(
        &self,
        name: &str,
        parse: impl Fn(&str) -> Result<T, E>,
    ) -> Result<Option<T>, SettingError> {
        let Some(v) = self.text(name) else {
            return Ok(None);
        };
        parse(&v)
            .map(Some)
            .map_err(|e| Self::invalid(name, &v, e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn with(pairs: &[(&str, &str)]) -> Settings<impl Fn(&str) -> Option<String>> {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::new(move |k: &str| m.get(k).cloned())
    }

    #[test]
    fn unset_and_empty_take_the_default_and_bad_values_name_the_variable() {
        let max = Duration::from_secs(3600);
        let s = with(&[
            ("A", " 2.5 "),
            ("EMPTY", "  "),
            ("TYPO", "30s"),
            ("HUGE", "1e300"),
            ("NEG", "-1"),
            ("ZERO", "0"),
            ("N", "3"),
        ]);
        let d = Duration::from_secs(7);
        assert_eq!(s.seconds("A", d, max), Ok(Duration::from_millis(2500)));
        assert_eq!(s.seconds("UNSET", d, max), Ok(d));
        assert_eq!(s.seconds("EMPTY", d, max), Ok(d));
        for bad in ["TYPO", "HUGE", "NEG"] {
            let e = s.seconds(bad, d, max).unwrap_err();
            assert_eq!(e.name, bad);
            assert!(e.to_string().starts_with(&format!("{bad}=")), "{e}");
            assert!(e.to_string().contains("seconds"), "{e}");
        }
        assert_eq!(s.seconds("ZERO", d, max), Ok(Duration::ZERO));
        assert!(s.positive_seconds("ZERO", max).is_err());
        assert_eq!(
            s.positive_seconds("N", max),
            Ok(Some(Duration::from_secs(3)))
        );
        assert_eq!(s.positive_seconds("UNSET", max), Ok(None));
        assert_eq!(s.count("N", 1, 16), Ok(3));
        assert!(s.count("N", 1, 2).is_err());
        assert!(s.count("TYPO", 1, 16).is_err());
        assert_eq!(s.count("UNSET", 1, 16), Ok(1));
        let e = s
            .parsed("TYPO", |v| {
                v.parse::<u8>().map_err(|_| "a byte".to_string())
            })
            .unwrap_err();
        assert_eq!(e.to_string(), "TYPO=\"30s\": a byte");
    }
}
