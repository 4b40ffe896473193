//! The watch-namespace setting shared by the controller and the proxy
//! (`FLEXINFER_WATCH_NAMESPACE`, `FLEXINFER_PROXY_WATCH_NAMESPACE`): empty means all namespaces,
//! else a comma-separated list of namespace names (a namespace-scoped install).

/// An entry of the list that is not a namespace name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotANamespace(pub String);

impl std::fmt::Display for NotANamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} is not a namespace name (lower-case letters, digits and '-', at most 63, starting and ending alphanumeric)",
            self.0
        )
    }
}

impl std::error::Error for NotANamespace {}

/// Parse a comma-separated list of namespace names (blanks around names are ignored, duplicates
/// dropped, order kept). Empty input → empty list (all namespaces). A name that is not a valid
/// namespace (RFC 1123 label) is an error naming it.
pub fn parse_list(s: &str) -> Result<Vec<String>, NotANamespace> {
    let mut out: Vec<String> = Vec::new();
    for part in s.split(',') {
        let n = part.trim();
        if n.is_empty() {
            continue;
        }
        if !is_namespace_name(n) {
            return Err(NotANamespace(n.to_string()));
        }
        if !out.iter().any(|o| o == n) {
            out.push(n.to_string());
        }
    }
    Ok(out)
}

fn is_namespace_name(n: &str) -> bool {
    let b = n.as_bytes();
    let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| ok(c) || *c == b'-')
        && b.first().is_some_and(ok)
        && b.last().is_some_and(ok)
}

#[cfg(test)]
mod tests {
    use super::parse_list;

    #[test]
    fn lists_parse_and_bad_names_are_named() {
        let cases: [(&str, Result<Vec<&str>, &str>); 7] = [
            ("", Ok(vec![])),
            (" , ", Ok(vec![])),
            ("ml", Ok(vec!["ml"])),
            ("ml, team-b ,ml", Ok(vec!["ml", "team-b"])),
            ("ML", Err("\"ML\"")),
            ("ok,-bad", Err("\"-bad\"")),
            ("a/b", Err("\"a/b\"")),
        ];
        for (input, want) in cases {
            match (parse_list(input), want) {
                (Ok(got), Ok(w)) => assert_eq!(got, w, "{input:?}"),
                (Err(e), Err(w)) => assert!(e.to_string().contains(w), "{input:?}: {e}"),
                (got, w) => panic!("{input:?}: got {got:?}, want {w:?}"),
            }
        }
        assert!(parse_list(&"a".repeat(64)).is_err());
    }
}
