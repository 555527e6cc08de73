//! The router's error types: why a request failed, with its gRPC status code (the proto's
//! `Tandem.Generate` contract), and why the router could not start or serve ([`StartError`]).
//!
//! What a client is told never names a worker, an address or a worker's own message: a failure
//! inside the cluster is a [`RouterError::Concealed`], whose client text is a fixed sentence and
//! the request id, while its detail goes to the router's log (with the same request id) and its
//! kind to the metrics. The other variants carry text about the client's own request (a field,
//! a limit, a flag of the router) and are shown as they are.

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

/// Seconds a refused client is asked to wait before trying again (`Retry-After` over HTTP, the
/// `retry-after` metadata over gRPC). Capacity frees as sequences finish, which takes seconds, so
/// one second is soon enough to get in and long enough not to hammer a full cluster.
pub const RETRY_AFTER_SECS: u64 = 1;

/// gRPC metadata key of [`RETRY_AFTER_SECS`] on a RESOURCE_EXHAUSTED status.
pub const RETRY_AFTER_KEY: &str = "retry-after";

/// gRPC metadata key (and HTTP header) naming the request an error belongs to, as the router's
/// log and the first response's `request_id` name it.
pub const REQUEST_ID_KEY: &str = "x-request-id";

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
    /// The request names a model the router does not serve (neither its model nor a LoRA
    /// adapter a worker holds); the message names it.
    #[error("{0}")]
    NotFound(String),
    /// A bug in the router itself.
    #[error("{0}")]
    Internal(String),
    /// A failure inside the cluster (a worker unreachable, failing, full or answering the
    /// impossible). `Display` gives the detail, for the log; a client sees only `public`.
    #[error("{detail}")]
    Concealed {
        /// The status code the client gets.
        code: Code,
        /// What the client is told: a fixed sentence without worker ids, addresses or worker text.
        public: &'static str,
        /// What went wrong, for the log: which worker, which call, what it said.
        detail: String,
    },
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
            RouterError::NotFound(_) => "not_found",
            RouterError::Internal(_) => "internal",
            RouterError::Concealed { code, .. } => match code {
                Code::InvalidArgument => "invalid_argument",
                Code::Unavailable => "unavailable",
                Code::Aborted => "aborted",
                Code::ResourceExhausted => "resource_exhausted",
                Code::DeadlineExceeded => "deadline_exceeded",
                Code::Cancelled => "cancelled",
                _ => "internal",
            },
        }
    }

    /// A failure inside the cluster: the client gets `code` and `public`; the log gets `detail`.
    pub fn concealed(code: Code, public: &'static str, detail: String) -> RouterError {
        RouterError::Concealed { code, public, detail }
    }

    /// The text a client sees (without the request id).
    pub fn client_message(&self) -> String {
        match self {
            RouterError::Concealed { public, .. } => (*public).to_owned(),
            e => e.to_string(),
        }
    }

    /// The status a client gets for this error of request `request_id` (None when the request
    /// was refused before it was given one): the client message, the request id (in the text,
    /// so people can quote it, and as `x-request-id` metadata), and `retry-after` when the
    /// cluster is full.
    pub fn client_status(&self, request_id: Option<&str>) -> Status {
        let mut msg = self.client_message();
        if let Some(id) = request_id {
            msg.push_str(&format!(" (request id {id})"));
        }
        let mut st = Status::new(self.code(), msg);
        if let Some(id) = request_id.and_then(|id| MetadataValue::try_from(id).ok()) {
            st.metadata_mut().insert(REQUEST_ID_KEY, id);
        }
        if self.code() == Code::ResourceExhausted {
            st.metadata_mut().insert(RETRY_AFTER_KEY, MetadataValue::from(RETRY_AFTER_SECS));
        }
        st
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
            RouterError::NotFound(_) => Code::NotFound,
            RouterError::Internal(_) => Code::Internal,
            RouterError::Concealed { code, .. } => *code,
        }
    }
}

/// The client's view of an error of a request that has no id yet (see
/// [`RouterError::client_status`]).
impl From<RouterError> for Status {
    fn from(e: RouterError) -> Status {
        e.client_status(None)
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

    #[test]
    fn a_concealed_failure_shows_the_client_only_its_public_text_and_the_request_id() {
        let e = RouterError::concealed(
            Code::Aborted,
            "the request failed inside the cluster",
            "decode worker d-7 (10.1.2.3:5000) failed in Decode: engine thread panicked".into(),
        );
        assert_eq!(e.kind(), "aborted");
        assert!(e.to_string().contains("10.1.2.3"), "the log keeps the detail: {e}");
        let st = e.client_status(Some("r-42"));
        assert_eq!(st.code(), Code::Aborted);
        assert_eq!(st.message(), "the request failed inside the cluster (request id r-42)");
        assert_eq!(st.metadata().get(REQUEST_ID_KEY).unwrap(), "r-42");
        assert!(st.metadata().get(RETRY_AFTER_KEY).is_none());
    }

    #[test]
    fn a_refusal_for_capacity_says_when_to_retry() {
        let st = RouterError::ResourceExhausted("the router is full".into()).client_status(None);
        assert_eq!(st.metadata().get(RETRY_AFTER_KEY).unwrap(), &RETRY_AFTER_SECS.to_string());
        assert!(st.metadata().get(REQUEST_ID_KEY).is_none());
        let full = RouterError::concealed(Code::ResourceExhausted, "full", "worker d-1 said so".into());
        assert_eq!(full.client_status(Some("a")).metadata().get(RETRY_AFTER_KEY).unwrap(), "1");
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
