//! The source URI forms of a ModelCache's `spec.source` (the worker's `SOURCE`) and of the OCI
//! references the controller hands on: the schemes are spelled here once, matched case-insensitively
//! (`HF://org/repo` is `hf://org/repo`).

/// A hub model: `hf://org/repo`.
pub const HF: &str = "hf://";
/// The same as [`HF`].
pub const HUGGINGFACE: &str = "huggingface://";
/// An OCI artifact: `oci://registry/repository[:tag|@sha256:…]`.
pub const OCI: &str = "oci://";
/// A directory the download Job can already read: `local:///path`.
pub const LOCAL: &str = "local://";
/// Every scheme [`SourceUri::parse`] knows, as users write them in messages.
pub const SCHEMES: &str = "HF://, huggingface://, oci:// or local://";

/// A parsed source URI. The parts are not validated here (a repo id, a reference or a path is each
/// checked by its reader, which names what is wrong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceUri<'a> {
    /// A hub repository: `hf://org/repo`, `huggingface://org/repo` (slashes around the id trimmed) or a
    /// bare `org/repo` (`scheme` false).
    Hub { repo: &'a str, scheme: bool },
    /// `oci://…`: the reference after the scheme.
    Oci(&'a str),
    /// `local://…`: the path after the scheme.
    Local(&'a str),
    /// `scheme://…` with a scheme none of the above.
    Unknown { scheme: &'a str },
}

impl<'a> SourceUri<'a> {
    /// Parse `s` (surrounding whitespace ignored).
    pub fn parse(s: &'a str) -> Self {
        let s = s.trim();
        for prefix in [HF, HUGGINGFACE] {
            if let Some(rest) = strip_scheme(s, prefix) {
                return SourceUri::Hub {
                    repo: rest.trim_matches('/'),
                    scheme: true,
                };
            }
        }
        if let Some(rest) = strip_scheme(s, OCI) {
            return SourceUri::Oci(rest);
        }
        if let Some(rest) = strip_scheme(s, LOCAL) {
            return SourceUri::Local(rest);
        }
        match s.split_once("://") {
            Some((scheme, _)) => SourceUri::Unknown { scheme },
            None => SourceUri::Hub {
                repo: s,
                scheme: false,
            },
        }
    }

    /// `s` without a leading hub scheme (`hf://`, `huggingface://`, any case), if it has one.
    pub fn strip_hub_scheme(s: &str) -> Option<&str> {
        [HF, HUGGINGFACE].iter().find_map(|p| strip_scheme(s, p))
    }
}

/// `s` after `scheme` (matched case-insensitively), if it starts with it.
pub fn strip_scheme<'s>(s: &'s str, scheme: &str) -> Option<&'s str> {
    let head = s.get(..scheme.len())?;
    head.eq_ignore_ascii_case(scheme)
        .then(|| s.get(scheme.len()..))
        .flatten()
}

/// An OCI reference without its leading `oci://` (any case, repeated ones too), trimmed: the reference
/// the worker contacts, and so the one whose registry the controller checks credentials against.
pub fn oci_reference(s: &str) -> &str {
    let mut s = s.trim();
    while let Some(rest) = strip_scheme(s, OCI) {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        let hub = |repo, scheme| SourceUri::Hub { repo, scheme };
        for (s, want) in [
            ("hf://org/repo", hub("org/repo", true)),
            ("HF://org/repo/", hub("org/repo", true)),
            (" huggingface://org/repo ", hub("org/repo", true)),
            ("Huggingface:///org/repo", hub("org/repo", true)),
            ("org/repo", hub("org/repo", false)),
            ("oci://reg:5000/m:v1", SourceUri::Oci("reg:5000/m:v1")),
            ("OCI://reg/m@sha256:ab", SourceUri::Oci("reg/m@sha256:ab")),
            ("local:///models/x", SourceUri::Local("/models/x")),
            ("s3://bucket/x", SourceUri::Unknown { scheme: "s3" }),
            ("", hub("", false)),
        ] {
            assert_eq!(SourceUri::parse(s), want, "{s:?}");
        }
    }

    #[test]
    fn strips_schemes_case_insensitively_and_never_splits_a_character() {
        assert_eq!(SourceUri::strip_hub_scheme("Hf://a/b"), Some("a/b"));
        assert_eq!(SourceUri::strip_hub_scheme("a/b"), None);
        assert_eq!(oci_reference(" oci://r/m:t "), "r/m:t");
        assert_eq!(oci_reference("r/m:t"), "r/m:t");
        assert_eq!(oci_reference("oci://OCI://r/m"), "r/m");
        // a multi-byte character where the scheme would end
        assert_eq!(strip_scheme("oci:/é", OCI), None);
        assert_eq!(strip_scheme("hé", HF), None);
    }
}
