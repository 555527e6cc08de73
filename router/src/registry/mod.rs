//! The router's table of workers: who may join, who is alive, and who takes the next request.
//!
//! Pure bookkeeping (no tokio, no tonic): the caller passes the clock in, so admission, heartbeat
//! expiry and selection are unit-tested without a network. Three parts, one [`Registry`]:
//! - `table`: the entries themselves: registration, load reports, expiry, health, lookup;
//! - `admission`: who may join: the record's form, the compatibility record, a transport
//!   shared with every worker of the other role (refusals name both workers);
//! - `scoring`: who takes a request: cached prefix and load ([`Registry::pick`]);
//! - `adapters`: the LoRA adapters each worker holds; a request under one goes only to workers
//!   holding it (same name and id).
//!
//! This file holds what all three speak of: the roles' names and the [`Target`]s and [`Plan`]s a
//! choice hands to the rest of the router.
//!
//! Invariants:
//! - Every registered worker serves the router's model (same protocol version and model id).
//! - Any two registered prefill/decode workers agree on every KV field of the compatibility record,
//!   and every prefill worker shares a usable transport with every decode worker. A worker that would
//!   break this is refused at registration, never discovered on a request.
//! - Workers are keyed by id; one gRPC address belongs to at most one worker (a worker that restarts
//!   on the same address replaces its old entry).
//! - Every worker that leaves the table or turns unhealthy is counted ([`Registry::losses`]), so
//!   that a request streaming from a worker learns that the router gave up on it.
//! - A worker's speculation record is kept and listed as it registered; it is no compatibility
//!   field (speculation changes speed, never output), but a prefill worker that claims to
//!   speculate has a malformed record.

mod adapters;
mod admission;
#[cfg(test)]
pub(crate) mod fixtures;
mod scoring;
mod table;

use tandem_proto::v1::{Role, TransportOffer, WorkerInfo};

pub use adapters::{AdapterKey, AdapterView, Holder};
pub use admission::{common_transport, AdmitError, OwnModel};
pub use scoring::{PromptBlocks, CACHE_WEIGHT, DISK_WEIGHT, HOST_WEIGHT, POOL_WEIGHT};
pub use table::{Registry, Tier, WorkerCounts, WorkerEntry, MAX_CACHE_HASHES, MISSED_HEARTBEATS};

/// The worker a request runs on, as far as the request needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub worker_id: String,
    /// gRPC address.
    pub address: String,
    pub role: Role,
    pub max_sequence_len: u32,
    pub block_size: u32,
    /// Window of each layer group of its KV pool (`[None]` without groups): a reservation holds
    /// one block (page) per group and token block, less those window groups give back.
    pub kv_windows: Vec<Option<usize>>,
    /// Leading prompt blocks this worker's cache held, as far as the router knew when it chose
    /// the worker (0: none known).
    pub overlap: u32,
    /// The admission it was chosen under ([`WorkerEntry::registration`]).
    pub registration: u64,
}

impl Target {
    fn of(e: &WorkerEntry, overlap: u32) -> Target {
        Target {
            worker_id: e.info.worker_id.clone(),
            address: e.info.address.clone(),
            role: e.role(),
            max_sequence_len: e.info.max_sequence_len,
            block_size: e.block_size(),
            kv_windows: e.kv_windows(),
            overlap,
            registration: e.registration,
        }
    }

    /// `prefill worker p-1 (127.0.0.1:5000)`.
    pub fn describe(&self) -> String {
        format!("{} worker {} ({})", role_name(self.role), self.worker_id, self.address)
    }

    /// This registration of the worker (`id@address`): a worker restarted under its id at
    /// another address is another incarnation.
    pub fn incarnation(&self) -> String {
        incarnation(&self.worker_id, &self.address)
    }
}

/// `id@address`: one registration of a worker (see [`Target::incarnation`]).
pub fn incarnation(worker_id: &str, address: &str) -> String {
    format!("{worker_id}@{address}")
}

/// Where a request runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Prefill on one worker, decode on another; KV moves over `transport` (the decode worker's offer).
    Split { prefill: Target, decode: Target, transport: Box<TransportOffer> },
    /// One worker runs the whole request: a colocated worker, or a decode worker computing the
    /// prompt itself because no prefill worker could ([`Plan::decode_prefills`]).
    Colocated { worker: Target },
}

impl Plan {
    /// Longest sequence every chosen worker can hold.
    pub fn max_sequence_len(&self) -> u32 {
        match self {
            Plan::Split { prefill, decode, .. } => prefill.max_sequence_len.min(decode.max_sequence_len),
            Plan::Colocated { worker } => worker.max_sequence_len,
        }
    }

    /// Whether a decode worker computes the prompt itself (the prefill fallback).
    pub fn decode_prefills(&self) -> bool {
        matches!(self, Plan::Colocated { worker } if worker.role == Role::Decode)
    }

    /// The worker that holds the whole sequence while it generates.
    pub fn decoder(&self) -> &Target {
        match self {
            Plan::Split { decode, .. } => decode,
            Plan::Colocated { worker } => worker,
        }
    }
}

/// "prefill", "decode", "colocated".
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Colocated => "colocated",
        Role::Unspecified => "unspecified",
    }
}

fn role_of(info: &WorkerInfo) -> Role {
    Role::try_from(info.role).unwrap_or(Role::Unspecified)
}

/// `decode worker d-1 (127.0.0.1:5000)`.
pub fn describe(info: &WorkerInfo) -> String {
    format!("{} worker {} ({})", role_name(role_of(info)), info.worker_id, info.address)
}
