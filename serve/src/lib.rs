//! What every Tandem server process shares, without an engine or a KV transport: the router links
//! it, and so does `tandem-worker`, which adds what only workers share.
//!
//! - [`config`]: flags, environment and config file; logging; shutdown signals; the listening line.
//! - [`auth`]: API key and cluster secret checks.
//! - [`tls`]: TLS on every port: certificates from flags, reloaded on SIGHUP, the handshaking
//!   acceptor of the servers and the TLS connector of the clients.
//! - [`constraint`]: a request's structured-output constraint on the wire and back.
//! - [`ops`]: `/health`, `/ready` and `/metrics` over HTTP, on every binary.
//! - [`identity`]: where the default model lives, a model's identity without its weights, and
//!   how two compatibility records are compared.
//! - [`speculation`]: how a worker speculates, as the router prints it.
//!
//! Errors are typed per concern ([`config::ConfigError`], [`auth::SecretError`],
//! [`identity::IdentityError`], [`tls::TlsError`]); binaries print them with their causes.

pub mod auth;
pub mod config;
pub mod constraint;
pub mod identity;
pub mod ops;
pub mod speculation;
pub mod tls;
