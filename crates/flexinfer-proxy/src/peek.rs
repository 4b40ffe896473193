//! The request body's `model`, found without building a JSON tree, and rewritten in place.
//!
//! serde_json reads the top-level object key by key: every value but `model` is skipped (validated,
//! not stored: skipping keeps one byte per open bracket, so deep nesting is neither a stack nor a
//! memory problem), and `model` is borrowed as the raw text of its value. Nothing is allocated in
//! proportion to the body except the name itself (and a key or string with escapes, decoded once
//! into serde_json's scratch buffer). The rewrite copies the body once, with the value's bytes
//! replaced.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// Why a body has no usable `model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeekError {
    /// Not a JSON object, or not valid JSON (the parser's message).
    NotAnObject(String),
    /// No `model`, or one that is not a non-empty string.
    NoModel,
    /// `model` appears more than once (a backend could read another one than the proxy routed on).
    Duplicate,
}

/// The body's `model`: its text, and where its JSON value (quotes included) lies in the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelField<'a> {
    pub name: Cow<'a, str>,
    pub span: Range<usize>,
}

/// A key of the top-level object: only whether it is `model` matters (decoded, so `"mod\u0065l"`
/// counts too).
struct IsModel;

impl<'de> DeserializeSeed<'de> for IsModel {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for IsModel {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(v == "model")
    }
}

/// The top-level object: the raw text of its one `model` value (if any).
struct Top<'a> {
    duplicate: &'a mut bool,
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = Option<&'de RawValue>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut model: Option<&'de RawValue> = None;
        while let Some(is_model) = map.next_key_seed(IsModel)? {
            if is_model {
                let raw: &'de RawValue = map.next_value()?;
                if model.is_some() {
                    *self.duplicate = true;
                }
                model = Some(raw);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(model)
    }
}

/// The `model` of a request body, which must be a JSON object.
pub fn find_model(body: &[u8]) -> Result<ModelField<'_>, PeekError> {
    // serde would also read a map from other shapes in some formats; only an object is a request.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(PeekError::NotAnObject(
            "the request body must be a JSON object".into(),
        ));
    }
    let mut duplicate = false;
    let mut de = serde_json::Deserializer::from_slice(body);
    let raw = de
        .deserialize_map(Top {
            duplicate: &mut duplicate,
        })
        .and_then(|raw| de.end().map(|()| raw))
        .map_err(|e| PeekError::NotAnObject(format!("the request body is not valid JSON: {e}")))?;
    if duplicate {
        return Err(PeekError::Duplicate);
    }
    let raw = raw.ok_or(PeekError::NoModel)?;
    let text = raw.get();
    // The raw value is borrowed from `body`: its offset is the distance between the two.
    let start = (text.as_ptr() as usize)
        .checked_sub(body.as_ptr() as usize)
        .ok_or(PeekError::NoModel)?;
    let span = start..start.saturating_add(text.len());
    if body.get(span.clone()) != Some(text.as_bytes()) {
        return Err(PeekError::NoModel);
    }
    // A string is `"`-quoted; anything else (an 8 MB array included) is refused without reading it.
    if !text.starts_with('"') {
        return Err(PeekError::NoModel);
    }
    // Borrowed when the name has no escapes; decoded into a String otherwise.
    let name: Cow<'_, str> = match serde_json::from_str::<&str>(text) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(serde_json::from_str::<String>(text).map_err(|_| PeekError::NoModel)?),
    };
    if name.is_empty() {
        return Err(PeekError::NoModel);
    }
    Ok(ModelField { name, span })
}

/// `body` with the bytes at `span` (a `model` value found by [`find_model`]) replaced by `served`
/// as a JSON string: one copy of the body, everything else byte for byte.
pub fn replace_model(body: &[u8], span: Range<usize>, served: &str) -> Option<Bytes> {
    let before = body.get(..span.start)?;
    let after = body.get(span.end..)?;
    let quoted = serde_json::to_string(served).ok()?;
    let len = before
        .len()
        .checked_add(quoted.len())?
        .checked_add(after.len())?;
    let mut out = BytesMut::with_capacity(len);
    out.extend_from_slice(before);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(after);
    Some(out.freeze())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn finds_the_model_and_its_place() {
        let body = br#"{"a":[1,{"model":"inner"}],"model":"m\u0031","z":"x"}"#;
        let f = find_model(body).unwrap();
        assert_eq!(f.name, "m1");
        assert_eq!(&body[f.span.clone()], br#""m\u0031""#);
        let out = replace_model(body, f.span, "served \"q\"").unwrap();
        assert_eq!(
            &out[..],
            br#"{"a":[1,{"model":"inner"}],"model":"served \"q\"","z":"x"}"#
        );
    }

    #[test]
    fn refusals() {
        let cases: [(&[u8], PeekError); 6] = [
            (br#"{"model":"a","model":"b"}"#, PeekError::Duplicate),
            (br#"{"mod\u0065l":"a","model":"b"}"#, PeekError::Duplicate),
            (br#"{"model":[0,0,0]}"#, PeekError::NoModel),
            (br#"{"model":null}"#, PeekError::NoModel),
            (br#"{"prompt":"x"}"#, PeekError::NoModel),
            (br#"{"model":""}"#, PeekError::NoModel),
        ];
        for (body, want) in cases {
            assert_eq!(
                find_model(body),
                Err(want),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [&br#"{"model":"m"} x"#[..], b"[1]", br#"{"model":"m""#] {
            assert!(matches!(find_model(body), Err(PeekError::NotAnObject(_))));
        }
    }
}
