//! What every Tandem server process shares. The router and the two worker roles build on it; it
//! knows nothing of either role's protocol beyond the messages they all exchange.
//!
//! - [`config`]: flags, environment and config file; logging; shutdown signals; the listening line.
//! - [`auth`]: API key and cluster secret checks.
//! - [`tls`]: TLS on every port: certificates from flags, reloaded on SIGHUP, the handshaking
//!   acceptor of the servers and the TLS connector of the clients.
//! - [`ops`]: `/health`, `/ready` and `/metrics` over HTTP, on every binary.
//! - [`identity`]: where the default model lives, the model read once at start-up (weights and
//!   identity together), and the compatibility record workers register with.
//! - [`speculation`]: the speculative decoding flags, the drafter they describe, and what a
//!   worker reports about it.
//! - [`worker`]: what both worker roles share: flags, the engine built from the loaded model, the
//!   engine thread, the request table, readiness, the gRPC server and registration with the router.
//!
//! Errors are typed per concern ([`config::ConfigError`], [`auth::SecretError`],
//! [`identity::IdentityError`], [`speculation::SpeculationError`], [`worker::WorkerError`]);
//! binaries print them with their causes.
//! - [`worker_metrics`]: the workers' Prometheus metrics.

pub mod auth;
pub mod config;
pub mod identity;
pub mod ops;
pub mod speculation;
pub mod tls;
pub mod worker;
pub mod worker_metrics;
