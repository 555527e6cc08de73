//! NCCL point-to-point between a prefill GPU (rank 0, sends) and a decode GPU (rank 1,
//! receives): the library loaded at run time, and a two-rank communicator driven by a thread of
//! its own.
//!
//! - [`load`] finds `libnccl.so.2` ([`library_candidates`]: `TANDEM_NCCL_LIBRARY`,
//!   `LD_LIBRARY_PATH`, the `nvidia-nccl-cu13`/`-cu12` wheels, distribution directories, then
//!   the dynamic loader) and resolves the handful of entry points used here. The workspace
//!   builds and its tests run without NCCL: a missing library is a [`NcclError::Missing`] that
//!   lists every path tried, never a panic. cudarc's own NCCL loader is not used: it does not
//!   look for the `libnccl.so.2` soname and panics when nothing loads.
//! - [`NcclPeer`] owns one end of a communicator: every NCCL call on it happens on the peer's
//!   thread, each transfer is posted on the peer's own stream in NCCL groups of at most
//!   [`MAX_GROUP_OPS`] operations ([`groups`]), and every wait has a deadline. Any failure
//!   aborts the communicator and leaves the peer broken for good.
//! - [`runs`] and [`pieces`] cut a transfer into pieces both ranks agree on. NCCL pairs a
//!   rank's sends with the other's receives one to one, in order, with equal byte counts; the
//!   two sides therefore cut at the same block-id runs, computed from both block lists, instead
//!   of each merging its own adjacent addresses.
//!
//! - `transfer` is the nccl kind itself: its sending and receiving halves, plugged into the
//!   session layer like every other kind.
//!
//! Invariants: no NCCL symbol is called before [`load`] succeeded; a communicator is created,
//! used and aborted (never destroyed: the ranks are separate processes, see [`NcclPeer`]) on one
//! thread; nothing here blocks without a deadline except the thread
//! itself, inside an NCCL call that does not return (then the handle stops waiting for it and
//! the thread cleans up when NCCL returns).

mod ffi;
mod library;
pub(crate) mod link;
mod peer;
mod runs;
mod transfer;

use std::time::Duration;

pub use ffi::UNIQUE_ID_BYTES;
pub use library::{decode_version, library_candidates, load, NcclLib, UniqueId, LIBRARY_ENV};
pub use peer::NcclPeer;
pub use runs::{groups, pieces, runs, MAX_GROUP_OPS};
pub(crate) use transfer::KIND;

/// NCCL failures. Messages say what was being done and, where there is one, what to do.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NcclError {
    /// No candidate library could be loaded.
    #[error("NCCL is not available: no NCCL library could be loaded (tried: {}); {hint}", tried.join("; "))]
    Missing { tried: Vec<String>, hint: String },
    /// A library loaded but lacks an entry point NCCL 2.x has.
    #[error(
        "{path} is not a usable NCCL 2.x library: symbol {name} is missing ({msg}); point TANDEM_NCCL_LIBRARY \
         at NCCL's libnccl.so.2"
    )]
    Symbol { path: String, name: String, msg: String },
    /// An NCCL call returned an error.
    #[error("NCCL {what} failed: {msg} (ncclResult_t {code})")]
    Call { what: String, code: i32, msg: String },
    /// A CUDA call the peer needs failed.
    #[error("NCCL peer: {what}: {msg}")]
    Cuda { what: String, msg: String },
    /// The other rank did not take part in time.
    #[error("NCCL: {what}: not done after {after:?}")]
    Timeout { what: String, after: Duration },
    /// An earlier failure aborted the communicator.
    #[error("NCCL communicator is broken ({0}); connect a new one")]
    Broken(String),
    /// The peer's thread could not be started or ended unexpectedly.
    #[error("NCCL peer thread: {0}")]
    Thread(String),
    /// The caller asked for something impossible (a rank other than 0 or 1).
    #[error("NCCL: {0}")]
    Invalid(String),
}

impl NcclError {
    /// Stable, low-cardinality name of the error class.
    pub fn kind(&self) -> &'static str {
        match self {
            NcclError::Missing { .. } => "missing",
            NcclError::Symbol { .. } => "symbol",
            NcclError::Call { .. } => "call",
            NcclError::Cuda { .. } => "cuda",
            NcclError::Timeout { .. } => "timeout",
            NcclError::Broken(_) => "broken",
            NcclError::Thread(_) => "thread",
            NcclError::Invalid(_) => "invalid",
        }
    }
}
