//! Why a worker could not start, or had to stop: one enum for every failure outside a request
//! (requests fail with a `tonic::Status` instead). A binary prints it with its sources and exits 1.
//!
//! Messages name the flag at fault (`--block-size`, `binding --listen ...`) so an operator knows
//! what to change; the causes (I/O, engine, secret errors) stay reachable as `source()`.

use tandem_engine::EngineError;
use tandem_transport::TransportError;

use crate::speculation::SpeculationError;
use tandem_serve::auth::SecretError;
use tandem_serve::identity::IdentityError;
use tandem_serve::tls::TlsError;

/// A worker's start-up or shutdown failure.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A flag has an unusable value; the message names the flag.
    #[error("{0}")]
    Flag(String),
    /// The model could not be found or read.
    #[error(transparent)]
    Model(#[from] IdentityError),
    /// No engine could be built over the model (device missing, pool too large, ...).
    #[error("building the engine")]
    Engine(#[source] EngineError),
    /// A `--lora` adapter could not be loaded (unreadable file, another base model, no adapter
    /// slots): the message names the adapter, its cause the problem.
    #[error("loading LoRA adapter '{}' (--lora {spec})", spec.name)]
    Lora {
        spec: Box<crate::args::LoraSpec>,
        #[source]
        source: Box<EngineError>,
    },
    /// Speculative decoding could not be set up (flags, draft model); the message names the flag.
    #[error(transparent)]
    Speculation(#[from] SpeculationError),
    /// The cluster secret flags are unusable.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The TLS flags or files are unusable; the message names the flag and the file.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A listening socket could not be bound.
    #[error("binding {flag} {addr}")]
    Bind {
        /// The flag that named the address (`--listen`, `--http-listen`, `--kv-listen`).
        flag: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// Another I/O failure at start-up; `what` says what was being done.
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The KV transport could not be set up.
    #[error("{what}")]
    Transport {
        what: String,
        #[source]
        source: TransportError,
    },
    /// The gRPC reflection service could not be built.
    #[error("building the reflection service: {0}")]
    Reflection(String),
    /// The router refused to register this worker (incompatible with the cluster).
    #[error("the router refused to register this worker: {0}")]
    Refused(String),
    /// The router refused this worker's cluster secret.
    #[error(
        "the router refused this worker's cluster secret (check --cluster-secret / \
         TANDEM_CLUSTER_SECRET: it must be the router's): {0}"
    )]
    SecretRefused(String),
    /// `--router` is not a usable address.
    #[error("{0}")]
    BadRouter(String),
}

impl WorkerError {
    /// Stable, low-cardinality name of the failure (for logs and exit reports).
    pub fn kind(&self) -> &'static str {
        match self {
            WorkerError::Flag(_) => "flag",
            WorkerError::Model(_) => "model",
            WorkerError::Engine(_) => "engine",
            WorkerError::Lora { .. } => "lora",
            WorkerError::Speculation(e) => e.kind(),
            WorkerError::Secret(_) => "secret",
            WorkerError::Tls(_) => "tls",
            WorkerError::Bind { .. } => "bind",
            WorkerError::Io { .. } => "io",
            WorkerError::Transport { .. } => "transport",
            WorkerError::Reflection(_) => "reflection",
            WorkerError::Refused(_) => "refused",
            WorkerError::SecretRefused(_) => "secret_refused",
            WorkerError::BadRouter(_) => "bad_router",
        }
    }
}
