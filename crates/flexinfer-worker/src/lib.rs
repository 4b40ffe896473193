//! The FlexInfer worker: one binary for every pipeline phase.

pub mod abliterate;
pub mod common;
pub mod datasets;
pub mod download;
pub mod generations;
pub mod hf;
pub mod http;
pub mod oci;
pub mod publish;
pub mod quantize;
pub mod standin;
