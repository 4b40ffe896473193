//! Unit tests of `error.rs`.

use super::*;
use flexinfer_contract::error::chain;
use std::error::Error as _;

#[test]
fn the_caller_s_errors_are_bad_input_and_the_engine_s_are_not() {
    let bad: Vec<QuantError> = vec![
        ConfigError::TooLarge {
            field: "hidden_size".into(),
        }
        .into(),
        TensorError::NotFound { name: "w".into() }.into(),
        DatasetError::NotAFile {
            what: "calibration dataset",
            path: "d.txt".into(),
        }
        .into(),
        SpecError::BlockSize.into(),
        FileError::NoWeightFiles { dir: "m".into() }.into(),
        TokenizerError::Encode {
            what: "a prompt".into(),
            source: "no model".into(),
        }
        .into(),
    ];
    for e in &bad {
        assert!(e.is_bad_input(), "{e}");
    }
    let numeric: QuantError = NumericError::LayerNotCached { layer: 3 }.into();
    assert!(!numeric.is_bad_input());
    assert_eq!(numeric.to_string(), "numerical failure");
    assert_eq!(
        chain(&numeric),
        "numerical failure: layer 3 missing from cache"
    );
}

#[test]
fn messages_name_the_field_and_keep_the_underlying_error_as_source() {
    let e: QuantError = ConfigError::WrongType {
        field: "per_layer_config.2.head_dim".into(),
        expected: "a non-negative integer",
        found: Some(serde_json::json!("x")),
    }
    .into();
    assert_eq!(e.to_string(), "invalid input");
    assert_eq!(
        chain(&e),
        "invalid input: config.json: per_layer_config.2.head_dim must be a non-negative integer, found \"x\""
    );
    let source = serde_json::from_str::<Value>("{").unwrap_err();
    let e: QuantError = DatasetError::Json {
        what: "prompt dataset",
        path: "p.jsonl".into(),
        line: Some(4),
        source,
    }
    .into();
    assert!(
        chain(&e).starts_with("invalid input: prompt dataset p.jsonl line 4: invalid JSON: "),
        "{}",
        chain(&e)
    );
    let inner = e.source().and_then(|d| d.source());
    assert!(inner.is_some_and(|s| s.is::<serde_json::Error>()), "{e:?}");
    let e: QuantError = ConfigError::AttentionShape {
        layer: Some(1),
        heads: 8,
        kv_heads: 3,
        head_dim: 64,
    }
    .into();
    assert_eq!(
        chain(&e),
        "invalid input: config.json: layer 1: inconsistent attention shape (heads 8, kv heads 3, head_dim 64)"
    );
}

#[test]
fn chain_names_every_cause_once() {
    let gone = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
    let e = QuantError::io("b.bin", gone());
    assert_eq!(e.to_string(), "I/O error on b.bin");
    assert_eq!(chain(&e), "I/O error on b.bin: no such file");
    let e: QuantError = FileError::Refused {
        source: std::io::Error::other("file name \"../x\" contains '..'"),
    }
    .into();
    assert_eq!(chain(&e), "invalid input: file name \"../x\" contains '..'");
    assert_eq!(chain(&SpecError::BlockSize), "block size must be positive");
}

#[test]
fn json_and_safetensors_errors_keep_the_underlying_error() {
    let source = serde_json::from_str::<Value>("{").unwrap_err();
    let text = source.to_string();
    let e = QuantError::Json {
        path: "c.json".into(),
        source,
    };
    assert!(e.is_bad_input());
    assert_eq!(e.to_string(), "JSON error in c.json");
    assert!(e.source().is_some_and(|s| s.is::<serde_json::Error>()));
    assert_eq!(chain(&e), format!("JSON error in c.json: {text}"));
    let e = QuantError::Safetensors {
        path: "l.safetensors".into(),
        tensor: Some("w".into()),
        source: "bad view".into(),
    };
    assert_eq!(chain(&e), "safetensors error in l.safetensors: w: bad view");
    let e = QuantError::Index {
        path: "i.json".into(),
        problem: IndexProblem::NotAFileName { tensor: "w".into() },
    };
    assert!(e.is_bad_input());
    assert_eq!(
        chain(&e),
        "JSON error in i.json: weight_map[\"w\"] is not a file name"
    );
}
