//! Typed errors of the GGUF output. Everything but [`GgufError::Io`] and the writer's misuse
//! ([`GgufError::Order`], [`GgufError::Size`], [`GgufError::Incomplete`]) is bad input: the model
//! cannot be stored as asked, found before any output is written.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// A tensor whose rows do not split into the type's blocks (llama.cpp cannot load it either).
    #[error(
        "tensor {tensor}: a row of {cols} values is not a multiple of {ty}'s block of {block} values"
    )]
    RowNotBlockMultiple {
        tensor: String,
        ty: &'static str,
        cols: u64,
        block: usize,
    },
    #[error(
        "tensor {tensor}: shape {dims:?} is not 1 to 4 positive dimensions that fit in memory"
    )]
    Dims { tensor: String, dims: Vec<u64> },
    #[error("tensor name {name:?} is empty or longer than ggml's 63 bytes")]
    TensorName { name: String },
    #[error("tensor {name} is declared twice")]
    DuplicateTensor { name: String },
    #[error("metadata key {key:?} is declared twice or is empty")]
    DuplicateKey { key: String },
    #[error("general.alignment {value} is not a power of two")]
    Alignment { value: u64 },
    /// The model's architecture has no llama.cpp mapping here.
    #[error(
        "architecture {arch:?} cannot be written as GGUF: supported are {}",
        .supported.join(", ")
    )]
    Architecture {
        arch: String,
        supported: &'static [&'static str],
    },
    /// A model setting llama.cpp's loader for this architecture cannot represent.
    #[error("{key}: {reason}")]
    Unsupported { key: String, reason: String },
    /// The tokenizer cannot be mapped to `tokenizer.ggml.*`; `key` names the GGUF key or the
    /// tokenizer.json field at fault.
    #[error("tokenizer: {key}: {reason}")]
    Tokenizer { key: String, reason: String },
    #[error("tensor {name} (needed for {gguf}) is not in the model")]
    MissingTensor { name: String, gguf: String },
    #[error("tensor {tensor}: importance vector has {len} entries for rows of {cols}")]
    Importance {
        tensor: String,
        len: usize,
        cols: usize,
    },
    #[error("GGUF writer: expected tensor {expected}, got {got}")]
    Order { expected: String, got: String },
    #[error("GGUF writer: tensor {tensor} has {got} bytes, its info says {expected}")]
    Size {
        tensor: String,
        expected: u64,
        got: u64,
    },
    #[error("GGUF writer: {written} of {declared} tensors written")]
    Incomplete { written: usize, declared: usize },
    #[error("I/O error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl GgufError {
    pub fn is_bad_input(&self) -> bool {
        !matches!(
            self,
            GgufError::Io { .. }
                | GgufError::Order { .. }
                | GgufError::Size { .. }
                | GgufError::Incomplete { .. }
        )
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        GgufError::Io {
            path: path.into(),
            source,
        }
    }
}
