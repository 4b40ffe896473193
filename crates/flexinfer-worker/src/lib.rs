//! The FlexInfer worker: one binary for every pipeline phase.
// Integer overflow from hub, registry, pod or user values must be an error or saturate, never wrap
// or panic. Abliteration's linear algebra indexes tensors whose shapes are checked when the model
// is read; it is outside the lint (as is the quantization engine's crate).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

#[allow(clippy::arithmetic_side_effects)]
pub mod abliterate;
pub mod common;
pub mod datasets;
pub mod devices;
pub mod download;
pub mod flags;
pub mod generations;
pub mod hf;
pub mod http;
pub mod node_copy;
pub mod oci;
pub mod publish;
pub mod quantize;
pub mod remote;
pub mod retry;
