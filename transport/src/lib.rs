//! KV transports: move a sequence's KV blocks from a prefill worker's pool into blocks a decode
//! worker reserved, and say when they have arrived intact.
//!
//! # Module map
//! One module per kind, each holding both halves of its kind (what the prefill worker, P, does
//! to send; what the decode worker, D, does to receive), over one session layer:
//!
//! | module | what |
//! |---|---|
//! | `tcp` | blocks in the connection: BLOCKS frames read straight into the reserved blocks, checked per block |
//! | `shm` | same host: P writes D's shared-memory segment itself, D verifies each group (SUMS) on a thread |
//! | [`cuda_ipc`] | same host, GPUs: P copies device to device into D's exported pool |
//! | [`nccl`] | GPUs anywhere NCCL reaches: a two-rank communicator per pair |
//! | [`nixl`] | any hosts, through NIXL (UCX: RDMA, shared memory, TCP): P writes D's registered pool, D verifies each group (SUMS) |
//! | `session` | the layer written once: HELLO handshake, token, reservation pinning, keep-alives, deadlines, DONE/ACK, checksum bookkeeping, cancellation, refusal by name ([`KvSender`], [`TransferSession`], [`KvReceiver`]) |
//! | `kind` | the trait pair a kind implements (`SendKind`/`Outbound` on P, `ReceiveKind`/`Inbound` on D) and what the session lends it |
//! | `registry` | the one match from [`TransportKind`] to each kind's registration |
//! | `types`, `options` | the API's own values ([`KvDestination`], [`TransportOffer`], [`TransferCounters`]) and [`SenderOptions`] / [`ReceiverOptions`] |
//! | [`wire`], `conn` | the frame format (shared by every kind) and plain or TLS streams |
//! | [`bench`] | the transfer benchmark |
//!
//! Dependencies inside the crate point one way: `session` → `registry` → each kind → `kind` →
//! `wire`, `conn`. The session names no kind, and no kind sees the gate, the counters or the
//! connection. This crate knows no protobuf: the worker services convert its types at their edge.
//!
//! **Adding a kind**: a new module implementing the trait pair (see `kind`) with a
//! `Registration` (its name and HELLO code), a variant of [`TransportKind`] in its place in
//! [`TransportKind::ALL`], and its line in `registry`.
//!
//! # The session
//! P opens a session ([`KvSender::open`]) before it computes the prompt: the open connection pins
//! the reservation on D (its lease no longer runs), and if P dies the connection drops and D
//! frees the reservation at once ([`ReservationGate::abort`]). P sends keep-alive frames while it
//! computes; D gives up on a silent peer after [`ReceiverOptions::io_timeout`]. D acknowledges
//! only after every block arrived (and, for tcp and shm, matched its checksum); a block that does
//! not is refused with an error naming its index in the transfer and its destination block, and
//! the reservation is released.
//!
//! On tcp and shm, P computes a block's checksum piece by piece (one layer's K or V at a time)
//! right after copying the piece, while it is still in the cache, and copies a group layer by
//! layer across its blocks so that consecutive block ids make long runs.
//!
//! When the cluster has a secret, every HELLO carries a [`KvToken`] derived from it
//! (`Secret::kv_token`), and D refuses a HELLO without it or with another one before it looks up
//! the reservation: an unauthenticated peer can neither pin nor abort anybody's reservation.
//!
//! # TLS
//! With [`ReceiverOptions::tls`] and [`SenderOptions::tls`] a transfer's connection is TLS
//! (rustls; the configurations come from the caller, so this crate loads no certificates). The
//! receiver handshakes each connection in its own task; with a configuration that requires
//! client certificates, a sender without a valid one is refused during the handshake, before
//! its HELLO is read. The HELLO's token then travels encrypted. The control connection of shm
//! and the GPU kinds is the same connection and is protected the same way. Without TLS the
//! token, the control frames and (tcp) the KV bytes cross the network in clear.
//!
//! # Byte layout ([`KvLayout::name`]: `tandem-f32-lkv-v1`, `tandem-f16-lkv-v1`, `tandem-bf16-lkv-v1`)
//! A pool is, per layer `l` in order, the K tensor then the V tensor of that layer, each
//! `[num_blocks, block_size, num_kv_heads, head_dim]` of little-endian values of the layout's
//! dtype (IEEE-754 `f32` or `f16`, or bfloat16), row-major. The name carries the dtype, so a
//! HELLO between pools of different dtypes is refused by name before a byte moves.
//! A shared-memory segment holds exactly that after a one-page header ([`tandem_engine::kv::shm`]). On
//! the wire a *block payload* is, for every layer in order, that layer's K bytes of the block
//! then its V bytes: `2 * num_layers * KvLayout::block_bytes()` bytes (the element size is the
//! pool's KV dtype). Block checksums are CRC-32 (IEEE, [`tandem_engine::kv::checksum`]) over a
//! block payload, in the same order for tcp and shm; a sender computes them in the pass that
//! copies the blocks ([`KvBlockSource::read_block_summed`]).
//!
//! # Safety of writes into D's memory
//! With shm and cuda-ipc, P writes into D's memory without D's involvement, so D must not reuse a
//! reservation's blocks while P might still write them. P writes only while its session's
//! connection is open, and only after D accepted the Hello; D frees the blocks when the connection
//! is closed (P's session dropped or P's process gone) or, after telling P to stop, once
//! [`ReceiverOptions::shm_close_grace`] has passed. P checks for such a stop before every layer
//! it writes.

pub mod bench;
mod conn;
pub mod cuda_ipc;
mod kind;
pub mod nccl;
pub mod nixl;
mod options;
mod registry;
mod session;
mod shm;
mod tcp;
mod types;
pub mod wire;

use std::str::FromStr;
use std::time::Duration;

use tandem_engine::kv::{BlockId, KvError, KvLayout};
pub use tandem_engine::kv::{KvBlockSink, KvBlockSource};

pub use bench::{run_transfer_bench, TransferBenchOptions, TransferBenchRow};
pub use conn::{KvClientTls, KvServerTls};
pub use options::{NixlConfig, ReceiverOptions, SenderOptions};
pub use session::{KvReceiver, KvSender, TransferReport, TransferSession};
pub use types::{KvDestination, TransferCounters, TransportOffer};

/// Identity of this host for pairing same-host transports (shm, cuda-ipc): the kernel's boot id,
/// plus the device number of the directory segments live in (so two containers on one host that
/// do not share `/dev/shm` get different ids). Falls back to the host name where the boot id
/// cannot be read. The shm offer adds the PID namespace (see the `shm` module).
pub fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_owned()))
        .unwrap_or_else(|| "unknown-host".into());
    match std::fs::metadata(tandem_engine::kv::shm::segment_dir()) {
        Ok(m) => format!("{boot}/shm-dev-{:x}", m.dev()),
        Err(_) => boot,
    }
}

/// Whether the NCCL library can be used on this machine; the error says what is missing.
pub fn nccl_library() -> Result<(), String> {
    nccl::load().map(|_| ()).map_err(|e| e.to_string())
}

/// Whether NIXL's C API loads from `dir` (else `TANDEM_NIXL_LIB`, else the loader's path);
/// the error says what is missing and how to install it.
pub fn nixl_library(dir: Option<&std::path::Path>) -> Result<(), String> {
    nixl::load(dir).map(|_| ()).map_err(|e| e.to_string())
}

/// A KV transport. The default is tcp, the kind every pair of workers can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportKind {
    /// Shared memory on one host.
    Shm,
    /// TCP, anywhere.
    #[default]
    Tcp,
    /// CUDA IPC: GPU to GPU on one host, device-to-device copies into the decode worker's pool.
    CudaIpc,
    /// NCCL: GPU to GPU, on any host the NCCL bootstrap reaches.
    Nccl,
    /// NIXL: host pools on any hosts its backend (UCX) reaches, loaded at run time.
    Nixl,
}

impl TransportKind {
    /// Every kind, fastest first (the order `--transport auto` prefers).
    pub const ALL: [TransportKind; 5] = [
        TransportKind::CudaIpc,
        TransportKind::Nccl,
        TransportKind::Shm,
        TransportKind::Nixl,
        TransportKind::Tcp,
    ];

    /// `"shm"`, `"tcp"`, `"cuda-ipc"`, `"nccl"` or `"nixl"` (the names in [`TransportOffer::kind`] and
    /// [`KvDestination::transport`] on the wire).
    pub fn as_str(self) -> &'static str {
        registry::registration(self).name
    }

    /// Whether the sender writes the destination blocks itself, outside the connection (shm,
    /// cuda-ipc, nixl): then the receiver must not reuse them before the sender closed.
    pub fn writes_directly(self) -> bool {
        registry::registration(self).writes_directly
    }

    /// Whether both pools must be on GPUs.
    pub fn needs_gpu(self) -> bool {
        registry::registration(self).needs_gpu
    }

    /// Whether a HELLO of this kind carries [`wire::Hello::ext`].
    pub(crate) fn hello_ext(self) -> bool {
        registry::registration(self).hello_ext
    }

    /// Code of the kind in a Hello frame.
    pub(crate) fn wire_code(self) -> u8 {
        registry::registration(self).wire_code
    }

    pub(crate) fn from_wire_code(c: u8) -> Option<TransportKind> {
        TransportKind::ALL.into_iter().find(|k| k.wire_code() == c)
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self, TransportError> {
        TransportKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            TransportError::Invalid(format!(
                "unknown KV transport `{s}` (expected cuda-ipc, nccl, shm, nixl or tcp)"
            ))
        })
    }
}

/// D: the reservation table the receiver consults (implemented by the decode node).
///
/// Between a successful [`begin`](ReservationGate::begin) and the matching
/// [`complete`](ReservationGate::complete) or [`abort`](ReservationGate::abort) (exactly one of
/// them is called, exactly once), the receiver — or, for shm, the sender's process — writes the
/// reservation's blocks: the gate must neither free them nor hand them to a sequence before then
/// (a `Release` arriving meanwhile can only mark the reservation for release).
pub trait ReservationGate: Send + Sync + 'static {
    /// A sender opened a transfer for `reservation`: return its block ids if it exists and is in
    /// state Reserved, and mark it Filling (its lease no longer expires). Err: message sent
    /// back to the sender.
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String>;
    /// All blocks arrived and match the sender's checksums: mark it Filled (lease restarts).
    fn complete(&self, reservation: u64);
    /// The transfer failed (peer vanished, bad frame, checksum mismatch, timeout): release it.
    fn abort(&self, reservation: u64, why: &str);
    /// The id of the LoRA adapter `reservation` was made for ([`wire::Hello::adapter_id`]):
    /// empty for the base model. Asked once the reservation is pinned, before OK: a transfer
    /// whose HELLO carries another id is refused (naming both) and the reservation aborted,
    /// before any block is written. The default, for gates that never reserve under an adapter,
    /// is the base model.
    fn adapter_id(&self, _reservation: u64) -> String {
        String::new()
    }
}

/// Bytes of one block payload on the wire: every layer's K and V of one block.
pub fn block_payload_bytes(layout: &KvLayout) -> usize {
    2 * layout.num_layers * layout.block_bytes()
}

/// Transport failures. Messages name the peer (its address) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer cannot be reached.
    #[error("KV transfer to {peer}: cannot connect: {source}")]
    Connect {
        peer: String,
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the connection failed (reset, EOF, ...).
    #[error("KV transfer with {peer}: {what}: {source}")]
    Io {
        peer: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The peer was silent for too long.
    #[error("KV transfer with {peer}: no progress for {after:?} while {what}")]
    Timeout { peer: String, what: String, after: Duration },
    /// The peer sent something that breaks the protocol.
    #[error("KV transfer with {peer}: protocol error: {msg}")]
    Protocol { peer: String, msg: String },
    /// The peer refused or ended the transfer and said why.
    #[error("KV transfer with {peer}: refused by the peer: {msg}")]
    Refused { peer: String, msg: String },
    /// Received bytes do not match the sender's checksum.
    #[error("KV transfer with {peer}: {msg}")]
    Checksum { peer: String, msg: String },
    /// The TLS handshake failed (the receiver's certificate is not signed by the CA, or it
    /// refused this sender's certificate).
    #[error("KV transfer with {peer}: TLS: {msg}")]
    Tls { peer: String, msg: String },
    /// A GPU transport's driver or NCCL call failed (the message says which and why).
    #[error("KV transfer with {peer}: {msg}")]
    Gpu { peer: String, msg: String },
    /// A NIXL call failed or did not finish in time (the message says which and why).
    #[error("KV transfer with {peer}: NIXL: {msg}")]
    Nixl { peer: String, msg: String },
    /// The peer presented no KV auth token, or the wrong one (the cluster secrets differ).
    #[error("KV transfer with {peer}: unauthenticated: {msg}")]
    Unauthenticated { peer: String, msg: String },
    /// The local request is unusable (bad destination, wrong number of blocks, layout mismatch).
    #[error("KV transfer: {0}")]
    Invalid(String),
    /// Local pool access failed (segment cannot be mapped, block out of range).
    #[error("KV transfer: {0}")]
    Kv(#[from] KvError),
}

impl TransportError {
    /// Stable, low-cardinality name of the error class.
    pub fn kind(&self) -> &'static str {
        match self {
            TransportError::Connect { .. } => "connect",
            TransportError::Io { .. } => "io",
            TransportError::Timeout { .. } => "timeout",
            TransportError::Protocol { .. } => "protocol",
            TransportError::Refused { .. } => "refused",
            TransportError::Checksum { .. } => "checksum",
            TransportError::Unauthenticated { .. } => "unauthenticated",
            TransportError::Tls { .. } => "tls",
            TransportError::Gpu { .. } => "gpu",
            TransportError::Nixl { .. } => "nixl",
            TransportError::Invalid(_) => "invalid",
            TransportError::Kv(_) => "kv",
        }
    }
}

/// The token a KV transfer's HELLO carries to prove the sender holds the cluster secret
/// (`Secret::kv_token`). `Debug` never prints it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KvToken(pub [u8; 32]);

impl std::fmt::Debug for KvToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvToken(..)")
    }
}

impl KvToken {
    /// Whether `presented` is this token (constant time in the token's content).
    pub fn matches(&self, presented: &[u8]) -> bool {
        presented.len() == self.0.len()
            && self.0.iter().zip(presented).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}
