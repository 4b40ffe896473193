//! The FlexInfer worker: one binary for every pipeline phase.

pub mod common;
