//! Optional bearer-token auth: the accepted keys come from env or a file (a mounted Secret).

use http::HeaderMap;

/// Accepted API keys; empty means auth is off.
#[derive(Clone, Default)]
pub struct ApiKeys(Vec<Vec<u8>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// Keys from text: separated by newlines or commas, surrounding whitespace trimmed, empty
    /// entries and `#` comment lines skipped.
    pub fn parse(text: &str) -> Self {
        Self(
            text.lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .flat_map(|l| l.split(','))
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(|k| k.as_bytes().to_vec())
                .collect(),
        )
    }

    pub fn is_enabled(&self) -> bool {
        !self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Merge two key sets.
    pub fn extend(mut self, other: ApiKeys) -> Self {
        self.0.extend(other.0);
        self
    }

    /// Whether the request may pass: auth off, or `Authorization: Bearer <one of the keys>`.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        if !self.is_enabled() {
            return true;
        }
        let Some(value) = headers.get(http::header::AUTHORIZATION) else {
            return false;
        };
        let value = value.as_bytes();
        let Some(token) = value
            .get(..7)
            .filter(|p| p.eq_ignore_ascii_case(b"bearer "))
            .and_then(|_| value.get(7..))
        else {
            return false;
        };
        let token = token.trim_ascii();
        // Compare against every key without stopping early: the timing tells nothing about
        // which key or how much of it matched.
        self.0
            .iter()
            .fold(false, |ok, key| constant_time_eq(key, token) | ok)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(
                http::header::AUTHORIZATION,
                http::HeaderValue::from_str(a).unwrap_or_else(|e| panic!("{e}")),
            );
        }
        h
    }

    #[test]
    fn parse_keys() {
        let k = ApiKeys::parse("# comment\n sk-one \nsk-two,sk-three\n\n,");
        assert_eq!(k.len(), 3);
        assert!(!ApiKeys::parse("  \n# only\n").is_enabled());
    }

    #[test]
    fn auth_table() {
        let keys = ApiKeys::parse("sk-one\nsk-two");
        let cases = [
            (None, false),
            (Some("Bearer sk-one"), true),
            (Some("bearer sk-two"), true),
            (Some("Bearer  sk-one "), true),
            (Some("Bearer sk-on"), false),
            (Some("Bearer sk-one2"), false),
            (Some("Bearer "), false),
            (Some("Basic sk-one"), false),
            (Some("sk-one"), false),
            (Some("Bearer"), false),
        ];
        for (h, want) in cases {
            assert_eq!(keys.allows(&headers(h)), want, "{h:?}");
        }
        assert!(ApiKeys::default().allows(&headers(None)));
    }
}
