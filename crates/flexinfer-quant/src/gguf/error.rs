//! The GGUF output's typed errors live with the engine's other errors ([`crate::error::GgufError`]).

pub use crate::error::GgufError;
