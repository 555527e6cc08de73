//! The engine's error type. Every variant has a stable [`EngineError::kind`] for metrics and for the
//! status code a server maps it to; messages name the file, tensor or request field at fault.

use std::path::PathBuf;

/// Result alias used throughout the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Errors raised by the engine library.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
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
    /// A tensor the architecture needs is absent from the model files.
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },
    /// A tensor has the wrong shape.
    #[error("{path}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    Shape { path: PathBuf, tensor: String, expected: Vec<usize>, actual: Vec<usize> },
    /// The model uses something the engine does not support (architecture, dtype, rope type, ...).
    #[error("{path}: unsupported: {msg}")]
    Unsupported { path: PathBuf, msg: String },
    /// A LoRA adapter that cannot be used with this model (missing file, bad format, a base that
    /// does not match): the message names the problem.
    #[error("LoRA adapter {path}: {msg}")]
    Lora { path: PathBuf, msg: String },
    /// A request names an adapter this worker does not hold.
    #[error("unknown adapter '{0}': this worker holds no adapter of that name")]
    UnknownAdapter(String),
    /// A request expects other weights under an adapter's name than this worker holds.
    #[error("adapter '{name}' here has id {have}, the request expects {want}")]
    AdapterMismatch { name: String, have: String, want: String },
    /// Tokenizer or chat-template failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request is invalid (prompt too long, bad sampling parameter, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// KV-cache bookkeeping error (out of blocks, double free, foreign block, ...).
    #[error("kv cache: {0}")]
    Kv(#[from] crate::kv::KvError),
    /// The requested device cannot be used.
    #[error("device {device}: {msg}")]
    Device { device: crate::Device, msg: String },
    /// A reservation transition was refused (unknown reservation, not filled yet, another
    /// request's, released before it was made). The allocator's refusals become [`EngineError::Kv`].
    #[error(transparent)]
    Reservation(crate::kv::reservation::ReservationError),
    /// The request is valid but there is no room for it now (KV blocks owed to sequences
    /// already here); the caller may try again later.
    #[error("no room now: {0}")]
    Busy(String),
    /// A bug: an internal invariant does not hold.
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    /// Stable, low-cardinality name of the error class (for metrics and status mapping).
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::Io { .. } => "io",
            EngineError::Format { .. } => "format",
            EngineError::MissingTensor { .. } => "missing_tensor",
            EngineError::Shape { .. } => "shape",
            EngineError::Unsupported { .. } => "unsupported",
            EngineError::Lora { .. } => "lora",
            EngineError::UnknownAdapter(_) => "unknown_adapter",
            EngineError::AdapterMismatch { .. } => "adapter_mismatch",
            EngineError::Tokenizer(_) => "tokenizer",
            EngineError::InvalidRequest(_) => "invalid_request",
            EngineError::Kv(_) => "kv",
            EngineError::Device { .. } => "device",
            EngineError::Reservation(e) => e.kind(),
            EngineError::Busy(_) => "busy",
            EngineError::Internal(_) => "internal",
        }
    }
}

impl From<crate::kv::reservation::ReservationError> for EngineError {
    /// Out of blocks stays a KV error (callers map it to back-pressure); the rest are refusals of
    /// the reservation itself.
    fn from(e: crate::kv::reservation::ReservationError) -> Self {
        match e {
            crate::kv::reservation::ReservationError::Kv(k) => EngineError::Kv(k),
            e => EngineError::Reservation(e),
        }
    }
}

impl EngineError {
    pub(crate) fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        EngineError::Format { path: path.into(), msg: msg.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io { path: path.into(), source }
    }
}

impl From<tandem_model::ModelError> for EngineError {
    /// Each model error becomes the engine error of the same kind (same message, same
    /// [`EngineError::kind`]), so callers see one vocabulary of failures.
    fn from(e: tandem_model::ModelError) -> Self {
        use tandem_model::ModelError as M;
        match e {
            M::Io { path, source } => EngineError::Io { path, source },
            M::Format { path, msg } => EngineError::Format { path, msg },
            M::MissingTensor { path, tensor } => EngineError::MissingTensor { path, tensor },
            M::Unsupported { path, msg } => EngineError::Unsupported { path, msg },
            M::Tokenizer(m) => EngineError::Tokenizer(m),
            M::InvalidRequest(m) => EngineError::InvalidRequest(m),
            M::Internal(m) => EngineError::Internal(m),
        }
    }
}
