//! What prefill and decode workers share (crate `tandem-worker`): their common flags, the model
//! read once, the engine thread, the gRPC server (the `Worker` service, `grpc.health.v1`, server
//! reflection), load and stats reports, registration with the router, the drain on
//! SIGTERM/SIGINT, speculation flags, the KV plane's TLS and the workers' metrics. What every
//! server process shares without an engine (config, TLS, auth, ops endpoints, model identity)
//! lives below in `tandem-serve`, which the router links instead of this crate.
//!
//! # The engine thread
//! One `std::thread` owns the [`Engine`](tandem_engine::scheduler::Engine). Handlers send it jobs (closures over [`EngineCore`]) over
//! a channel and get answers back over tokio channels; the thread steps the engine while there is
//! work and blocks on the channel when there is none (or when every block it needs is held by
//! reservations or prefilled sequences waiting to be released). Jobs run in the order they were
//! sent, between steps, so a cancel sent after an add always finds what the add created.
//!
//! A request's sequence is attached to a [`SeqSink`] under a [`Ticket`]; the sink receives the
//! sequence's events of every step, on the engine thread. A handler whose client went away drops
//! a [`CancelOnDrop`] guard, which cancels the ticket's sequence: nothing a request holds outlives
//! the request.
//!
//! # Draining
//! On SIGTERM/SIGINT a worker stops taking new work (`Reserve`, `Prefill` and new `Decode`s answer
//! UNAVAILABLE "draining", health turns NOT_SERVING, heartbeats say `draining`), lets requests in
//! flight finish for up to `--drain-timeout-ms`, cancels what is left, deregisters and exits 0.
//! Readiness (`GET /ready`, `tandem_worker_ready`) turns off at once; the HTTP server keeps
//! answering until the gRPC server stops, so probes see a clear 503 rather than a refused
//! connection.
//!
//! # Health
//! `GET /health` fails when the engine thread has stopped without being told to (it panicked).
//! `GET /ready` succeeds when the worker serves, is registered with the router (when `--router`
//! is given), is not draining, and its engine is not wedged: an engine with work to do must have
//! finished a step within `--ready-stall-ms` ([`readiness`]).
//!
//! # Cluster secret
//! With `--cluster-secret`, the `Worker` service refuses calls without it (UNAUTHENTICATED;
//! health and reflection stay open), registry calls carry it, and so does the KV transport's
//! handshake. A router that refuses the secret ends the worker (exit 1).
//!
//! # LoRA adapters
//! `--lora NAME=PATH` (repeatable) loads adapters at start (a bad one stops the start-up naming
//! it), `--max-loras` (8) sets how many are resident at once (0: none). The `LoadAdapter`,
//! `UnloadAdapter` and `ListAdapters` calls change and list them at run time ([`adapters`]);
//! registration, heartbeats and `Info` advertise them. A request names its adapter in
//! `EngineParams.adapter` (NOT_FOUND when the worker holds none of that name,
//! FAILED_PRECONDITION when its id is not `adapter_id`), and the KV transfer carries the
//! adapter's id, which the decode worker checks against its reservation's.
//!
//! # Modules
//! - [`args`]: the flags both worker binaries take.
//! - [`adapters`]: the LoRA adapter calls, and the adapter a request runs under.
//! - [`build`]: the engine a worker runs, built from a model loaded once.
//! - [`engine_thread`]: the actor that owns the engine, and the sinks and guards of its sequences.
//! - [`requests`]: request ids of work in flight (for `Release`), and the in-flight count.
//! - [`readiness`]: the readiness decision, a pure function.
//! - [`state`]: what every handler of a worker shares (load, stats, drain, probes).
//! - [`convert`]: wire types into domain types, and domain errors into gRPC statuses.
//! - [`kv_wire`]: the KV transport's destination, offers and counters to and from protobuf.
//! - [`server`]: the gRPC and HTTP servers, the drain, and guarded response streams.
//! - [`registration`]: registering with the router, heartbeats, deregistering.
//! - [`error`]: why a worker could not start, or had to stop.
//! - [`model`]: the model read once (weights and identity), and the compatibility record.
//! - [`speculation`]: the speculative decoding flags, the drafter they describe, and what a
//!   worker reports about it.
//! - [`metrics`]: the workers' Prometheus metrics.
//! - [`kv_tls`]: the worker's reloadable TLS as the KV transport asks for it.

pub mod adapters;
pub mod args;
pub mod build;
pub mod convert;
pub mod engine_thread;
pub mod error;
pub mod kv_tls;
pub mod kv_wire;
pub mod metrics;
pub mod model;
pub mod readiness;
pub mod registration;
pub mod requests;
pub mod server;
pub mod speculation;
pub mod state;

pub use adapters::resolve_adapter_id;
pub use args::{hostname, role_name, LoraSpec, TransportChoice, WorkerArgs};
pub use build::{build_engine, load_model, BuiltEngine};
pub use convert::{
    adapter_load_status, adapters_wire, engine_status, prompt_scores_wire, sampling_params, top_wire,
    transport_status, RequestSampling, MAX_CACHE_SALT_BYTES,
};
pub use engine_thread::{
    CancelOnDrop, EngineCore, EngineHandle, EngineSnapshot, EngineThread, SeqSink, SinkFlow, Ticket,
};
pub use error::WorkerError;
pub use kv_tls::KvTls;
pub use model::{compat_record, Model};
pub use readiness::{readiness, ReadinessOptions, ReadyInputs};
pub use requests::{InflightGuard, RequestEntry, RequestTable};
pub use server::{
    advertise_addr, bind, kv_token, local_addr, serve, GuardedStream, ServeOptions, WorkerProbe,
};
pub use state::{TransferSource, WorkerState};
