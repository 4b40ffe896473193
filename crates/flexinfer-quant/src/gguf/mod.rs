//! GGUF output for llama.cpp: the ggml block types ([`blocks`], [`types`]), the GGUF v3 container
//! ([`writer`], read back by [`reader`]), llama.cpp's tensor names and metadata for the Llama family
//! ([`llama`], [`tokenizer`]), the presets' per-tensor type mix ([`preset`]) and the whole model
//! ([`export`]), as an artifact directory with `.save-complete` ([`artifact`]).

pub mod artifact;
pub mod blocks;
pub mod error;
pub mod export;
pub mod importance;
pub mod llama;
pub mod preset;
pub mod reader;
pub mod tokenizer;
pub mod types;
pub mod writer;

pub use artifact::{gguf_file_name, write_gguf_artifact, GgufArtifactJob, GgufOutcome};
pub use error::GgufError;
pub use export::{write_gguf, GgufJob, GgufSummary};
pub use types::{FileType, GgmlType};
