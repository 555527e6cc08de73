//! The router's error types: why a request failed, with its gRPC status code (the proto's
//! `Tandem.Generate` contract), and why the router could not start or serve ([`StartError`]).

use tonic::{Code, Status};

/// Why a request failed, as the client is told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    /// The request is malformed; the message names the field.
    #[error("{0}")]
    InvalidArgument(String),
    /// No worker can take the request (none registered, none healthy, or one was unreachable
    /// before anything was streamed).
    #[error("{0}")]
    Unavailable(String),
    /// A worker failed after the request started.
    #[error("{0}")]
    Aborted(String),
    /// Too many requests in flight, or a worker is out of KV blocks.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The request ran past `--request-timeout-ms`.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The client went away.
    #[error("{0}")]
    Cancelled(String),
    /// The client presented no API key, or a wrong one.
    #[error("{0}")]
    Unauthenticated(String),
    /// A bug or an impossible answer from a worker.
    #[error("{0}")]
    Internal(String),
}

impl RouterError {
    /// Stable, low-cardinality name (for logs and metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            RouterError::InvalidArgument(_) => "invalid_argument",
            RouterError::Unavailable(_) => "unavailable",
            RouterError::Aborted(_) => "aborted",
            RouterError::ResourceExhausted(_) => "resource_exhausted",
            RouterError::DeadlineExceeded(_) => "deadline_exceeded",
            RouterError::Cancelled(_) => "cancelled",
            RouterError::Unauthenticated(_) => "unauthenticated",
            RouterError::Internal(_) => "internal",
        }
    }

    /// The gRPC status code.
    pub fn code(&self) -> Code {
        match self {
            RouterError::InvalidArgument(_) => Code::InvalidArgument,
            RouterError::Unavailable(_) => Code::Unavailable,
            RouterError::Aborted(_) => Code::Aborted,
            RouterError::ResourceExhausted(_) => Code::ResourceExhausted,
            RouterError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            RouterError::Cancelled(_) => Code::Cancelled,
            RouterError::Unauthenticated(_) => Code::Unauthenticated,
            RouterError::Internal(_) => Code::Internal,
        }
    }
}

impl From<RouterError> for Status {
    fn from(e: RouterError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

/// Whether a failed call means the worker itself could not be reached or went away (connection
/// refused or reset, HTTP/2 error, keepalive timeout), as opposed to the worker answering with an
/// error of its own. Statuses the client library synthesises from a transport error carry that
/// error as their source; a status a server sent has none.
pub fn is_transport_failure(st: &Status) -> bool {
    use std::error::Error;
    st.source().is_some() || matches!(st.code(), Code::Unknown | Code::Cancelled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_proto_contract() {
        let s: Status = RouterError::InvalidArgument("max_tokens: must be at least 1".into()).into();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "max_tokens: must be at least 1");
        assert_eq!(Status::from(RouterError::Unavailable("x".into())).code(), Code::Unavailable);
        assert_eq!(Status::from(RouterError::Aborted("x".into())).code(), Code::Aborted);
        assert_eq!(RouterError::ResourceExhausted("x".into()).kind(), "resource_exhausted");
        // A status a server sends is not a transport failure; an unknown-code one is.
        assert!(!is_transport_failure(&Status::failed_precondition("reservation 7 is gone")));
        assert!(is_transport_failure(&Status::unknown("h2 protocol error")));
    }
}

/// Why the router could not start, or stopped serving: bad flags, an unreadable model, a port
/// that cannot be bound. The binary prints it with its causes and exits 1.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag has an unusable value; the message names the flag.
    #[error("{0}")]
    Flag(String),
    /// The model could not be found or read.
    #[error(transparent)]
    Model(#[from] tandem_serve::identity::IdentityError),
    /// `--api-key` or `--cluster-secret` (or their files) are unusable.
    #[error(transparent)]
    Secret(#[from] tandem_serve::auth::SecretError),
    /// The TLS flags or files are unusable; the message names the flag and the file.
    #[error(transparent)]
    Tls(#[from] tandem_serve::tls::TlsError),
    /// A listening socket could not be bound.
    #[error("binding {flag} {addr}")]
    Bind {
        /// `--listen` or `--http-listen`.
        flag: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// Another I/O failure; `what` says what was being done.
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The gRPC reflection service could not be built.
    #[error("building the reflection service: {0}")]
    Reflection(String),
    /// A server stopped on its own while the router was serving.
    #[error("{0}")]
    ServerStopped(String),
}

impl StartError {
    /// Stable, low-cardinality name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            StartError::Flag(_) => "flag",
            StartError::Model(_) => "model",
            StartError::Secret(_) => "secret",
            StartError::Tls(_) => "tls",
            StartError::Bind { .. } => "bind",
            StartError::Io { .. } => "io",
            StartError::Reflection(_) => "reflection",
            StartError::ServerStopped(_) => "server_stopped",
        }
    }
}
