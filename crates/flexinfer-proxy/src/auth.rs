//! Optional bearer-token auth: the accepted keys come from env or a file (a mounted Secret), each
//! with the namespaces whose Models it may reach.

use std::collections::BTreeSet;

use flexinfer_api::contract::proxy::KEY_NAMESPACES_FIELD;
use flexinfer_api::namespaces;
use http::HeaderMap;

/// The namespaces a caller may reach: Models elsewhere do not exist for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace the proxy watches (auth off, or a key given without namespaces).
    All,
    /// Only these.
    Namespaces(BTreeSet<String>),
}

impl Scope {
    pub fn allows(&self, namespace: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Namespaces(n) => n.contains(namespace),
        }
    }
}

/// One accepted key and its scope.
#[derive(Clone)]
struct Key {
    token: Vec<u8>,
    scope: Scope,
}

/// Accepted API keys; empty means auth is off.
#[derive(Clone, Default)]
pub struct ApiKeys(Vec<Key>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

/// A line of the keys text that is not a key list. The text of the line is never repeated: it
/// may hold a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "line {line}: {problem} (a line holds `<key>`, `<key>,<key>,…` or `<key> {KEY_NAMESPACES_FIELD}<namespace>,…`)"
)]
pub struct KeysError {
    pub line: usize,
    pub problem: String,
}

impl ApiKeys {
    /// Keys from text, one line at a time (surrounding whitespace trimmed, empty and `#` comment
    /// lines skipped): `<key>` or `<key>,<key>,…` gives keys that reach every namespace;
    /// `<key> namespaces=<ns>,<ns>` gives one key that reaches only those namespaces.
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let mut keys: Vec<Key> = Vec::new();
        let mut first_line: Vec<usize> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i.saturating_add(1);
            let err = |problem: String| KeysError { line, problem };
            let trimmed = raw.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let mut fields = trimmed.split_whitespace();
            let first = fields.next().unwrap_or_default();
            let parsed: Vec<Key> = match fields.next() {
                None => first
                    .split(',')
                    .map(str::trim)
                    .filter(|k| !k.is_empty())
                    .map(|k| Key {
                        token: k.as_bytes().to_vec(),
                        scope: Scope::All,
                    })
                    .collect(),
                Some(field) => {
                    let Some(list) = field.strip_prefix(KEY_NAMESPACES_FIELD) else {
                        return Err(err(format!(
                            "unexpected text after the key (the only field is {KEY_NAMESPACES_FIELD})"
                        )));
                    };
                    if fields.next().is_some() {
                        return Err(err(format!(
                            "more than one field after the key (write one {KEY_NAMESPACES_FIELD} with a comma-separated list)"
                        )));
                    }
                    if first.contains(',') {
                        return Err(err(format!(
                            "a line with {KEY_NAMESPACES_FIELD} holds one key"
                        )));
                    }
                    let names = namespaces::parse_list(list)
                        .map_err(|e| err(format!("{KEY_NAMESPACES_FIELD}: {e}")))?;
                    if names.is_empty() {
                        return Err(err(format!(
                            "{KEY_NAMESPACES_FIELD} names no namespace (leave the field out for a key that reaches every namespace)"
                        )));
                    }
                    vec![Key {
                        token: first.as_bytes().to_vec(),
                        scope: Scope::Namespaces(names.into_iter().collect()),
                    }]
                }
            };
            for k in parsed {
                if let Some(j) = keys.iter().position(|o| o.token == k.token) {
                    if keys.get(j).map(|o| &o.scope) != Some(&k.scope) {
                        let earlier = first_line.get(j).copied().unwrap_or_default();
                        return Err(err(format!(
                            "the key of line {earlier} appears again with other namespaces"
                        )));
                    }
                    continue;
                }
                keys.push(k);
                first_line.push(line);
            }
        }
        Ok(Self(keys))
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

    /// Merge two key sets (a key in both keeps the first one's scope).
    pub fn extend(mut self, other: ApiKeys) -> Self {
        for k in other.0 {
            if !self.0.iter().any(|o| o.token == k.token) {
                self.0.push(k);
            }
        }
        self
    }

    /// Whether the request may pass: auth off, or `Authorization: Bearer <one of the keys>`.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        self.authorize(headers).is_some()
    }

    /// The namespaces the request may reach: every one with auth off, the key's with
    /// `Authorization: Bearer <one of the keys>`, `None` (refused) otherwise.
    pub fn authorize(&self, headers: &HeaderMap) -> Option<Scope> {
        if !self.is_enabled() {
            return Some(Scope::All);
        }
        let value = headers.get(http::header::AUTHORIZATION)?.as_bytes();
        let token = value
            .get(..7)
            .filter(|p| p.eq_ignore_ascii_case(b"bearer "))
            .and_then(|_| value.get(7..))?;
        let token = token.trim_ascii();
        // Compare against every key without stopping early: the timing tells nothing about
        // which key or how much of it matched.
        self.0.iter().fold(None, |found, key| {
            let hit = constant_time_eq(&key.token, token);
            if hit && found.is_none() {
                Some(key.scope.clone())
            } else {
                found
            }
        })
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

    fn keys(text: &str) -> ApiKeys {
        ApiKeys::parse(text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn ns(names: &[&str]) -> Scope {
        Scope::Namespaces(names.iter().map(|n| n.to_string()).collect())
    }

    #[test]
    fn parse_keys() {
        let k = keys("# comment\n sk-one \nsk-two,sk-three\n\n,");
        assert_eq!(k.len(), 3);
        assert!(!keys("  \n# only\n").is_enabled());
        // The same key twice with the same scope is one key.
        assert_eq!(keys("sk-a\nsk-a,sk-b").len(), 2);
    }

    #[test]
    fn auth_table() {
        let keys = keys("sk-one\nsk-two");
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

    #[test]
    fn a_scoped_key_is_accepted() {
        let keys = keys("sk-team namespaces=team-a,team-b\nsk-all");
        assert!(keys.allows(&headers(Some("Bearer sk-team"))));
        assert!(keys.allows(&headers(Some("Bearer sk-all"))));
        assert!(!keys.allows(&headers(Some("Bearer sk-team namespaces=team-a,team-b"))));
    }

    #[test]
    fn each_key_gets_its_scope() {
        let keys = keys(
            "# team keys\n\
             sk-a namespaces=team-a\n\
             \tsk-ab   namespaces=team-a,team-b \n\
             sk-old,sk-older\n\
             sk-a namespaces=team-a\n",
        );
        let cases = [
            ("Bearer sk-a", Some(ns(&["team-a"]))),
            ("Bearer sk-ab", Some(ns(&["team-a", "team-b"]))),
            ("Bearer sk-old", Some(Scope::All)),
            ("Bearer sk-older", Some(Scope::All)),
            ("Bearer sk-b", None),
            ("Bearer sk-a namespaces=team-a", None),
        ];
        for (h, want) in cases {
            assert_eq!(keys.authorize(&headers(Some(h))), want, "{h:?}");
        }
        assert_eq!(
            ApiKeys::default().authorize(&headers(None)),
            Some(Scope::All)
        );
        assert!(ns(&["team-a"]).allows("team-a"));
        assert!(!ns(&["team-a"]).allows("team-b"));
        assert!(Scope::All.allows("anything"));
    }

    #[test]
    fn bad_lines_are_refused_by_line_without_the_key() {
        let cases = [
            ("sk-a namespace=team-a", 1, "unexpected text after the key"),
            (
                "ok\nsk-a namespaces=team-a namespaces=b",
                2,
                "more than one field",
            ),
            ("sk-a,sk-b namespaces=team-a", 1, "holds one key"),
            ("sk-a namespaces=", 1, "names no namespace"),
            ("sk-a namespaces=,", 1, "names no namespace"),
            ("sk-a namespaces=Team_A", 1, "is not a namespace name"),
            (
                "sk-a\n#\nsk-a namespaces=b",
                3,
                "the key of line 1 appears again",
            ),
            (
                "sk-a namespaces=a\nsk-a namespaces=b",
                2,
                "the key of line 1",
            ),
            ("sk secret with spaces", 1, "unexpected text after the key"),
        ];
        for (text, line, want) in cases {
            let e = ApiKeys::parse(text)
                .err()
                .unwrap_or_else(|| panic!("{text:?} parsed"));
            assert_eq!(e.line, line, "{text:?}");
            let msg = e.to_string();
            assert!(msg.contains(want), "{text:?}: {msg}");
            assert!(!msg.contains("sk-a") && !msg.contains("secret"), "{msg}");
        }
    }

    #[test]
    fn merged_sets_keep_the_first_scope() {
        let k = keys("sk-a namespaces=a").extend(keys("sk-a\nsk-b"));
        assert_eq!(k.len(), 2);
        assert_eq!(k.authorize(&headers(Some("Bearer sk-a"))), Some(ns(&["a"])));
    }
}
