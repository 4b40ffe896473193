//! Parsers of command-line and env flag values shared by the subcommands.

use flexinfer_contract as contract;

/// A flag value that is not a boolean.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a boolean: {0:?} (use true/false/1/0)")]
pub struct NotABool(pub String);

/// clap parser for SPEC booleans (`True`, `false`, `1`, `0`, …).
pub fn parse_bool_arg(s: &str) -> Result<bool, NotABool> {
    contract::parse_bool(s).ok_or_else(|| NotABool(s.to_string()))
}
