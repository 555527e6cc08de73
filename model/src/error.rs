//! The model crate's error type. Every variant has a stable [`ModelError::kind`]; messages name
//! the file, tensor, metadata key or request field at fault. The engine maps each variant onto
//! its own error of the same kind, so a caller sees one vocabulary of failures.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Errors reading a model's files or validating a request against it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An I/O error while reading a file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file is malformed or inconsistent (bad magic, truncated data, wrong shape, ...).
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    /// A tensor that is needed is absent from the model files.
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },
    /// The model uses something Tandem does not support (architecture, type, rope type, ...).
    #[error("{path}: unsupported: {msg}")]
    Unsupported { path: PathBuf, msg: String },
    /// Tokenizer or chat-template failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request is invalid (prompt too long, bad sampling parameter, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A bug: an internal invariant does not hold.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ModelError {
    /// Stable, low-cardinality name of the error class (for metrics and status mapping); the
    /// same names as the engine's errors of the same kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::Io { .. } => "io",
            ModelError::Format { .. } => "format",
            ModelError::MissingTensor { .. } => "missing_tensor",
            ModelError::Unsupported { .. } => "unsupported",
            ModelError::Tokenizer(_) => "tokenizer",
            ModelError::InvalidRequest(_) => "invalid_request",
            ModelError::Internal(_) => "internal",
        }
    }

    /// A format error naming `path`.
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        ModelError::Format { path: path.into(), msg: msg.into() }
    }

    /// An I/O error naming `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
}
