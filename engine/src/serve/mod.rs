//! The serving processes: the router and the prefill and decode workers. The binaries are thin
//! `main`s over these modules.
//!
//! - [`config`]: flags, environment and config file; logging; shutdown signals.
//! - [`auth`]: API key and cluster secret checks.
//! - [`ops`]: `/health`, `/ready` and `/metrics` over HTTP, on every binary.
//! - [`identity`]: model fingerprint and the compatibility record workers register with.
//! - [`worker`], [`prefill`], [`decode`]: the worker processes (engine thread + gRPC service).
//! - [`router`]: the router (client API, worker registry, request orchestration).
//! - [`loadgen`]: a load generator for a running cluster (`tandem bench --router`).

pub mod auth;
pub mod config;
pub mod decode;
pub mod identity;
pub mod loadgen;
pub mod ops;
pub mod prefill;
pub mod router;
pub mod worker;
pub mod worker_metrics;
