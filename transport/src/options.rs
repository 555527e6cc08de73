//! The limits and switches of the two ends of a transfer: [`SenderOptions`] for a prefill
//! worker's [`KvSender`](crate::KvSender), [`ReceiverOptions`] for a decode worker's
//! [`KvReceiver`](crate::KvReceiver). Every field has a documented default; the session layer and
//! each kind's halves read them, nobody writes them after construction.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::cuda::DeviceKvPool;

use crate::conn::{KvClientTls, KvServerTls};
use crate::KvToken;

/// Limits of a [`KvSender`](crate::KvSender).
#[derive(Debug, Clone)]
pub struct SenderOptions {
    /// Longest wait for the connection to D. Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for D to read or answer (per read or write). Default 5 s.
    pub io_timeout: Duration,
    /// Interval of keep-alive frames while the session waits for the prompt to be computed;
    /// must be well below D's inactivity timeout. Default 1 s.
    pub keepalive_interval: Duration,
    /// Longest wait for D's acknowledgement after the last block (D verifies checksums).
    /// Default 30 s.
    pub ack_timeout: Duration,
    /// Offer and use the shm transport. Default true.
    pub enable_shm: bool,
    /// This worker's KV pool when it is on a GPU: then the sender offers and uses cuda-ipc
    /// (when `enable_cuda_ipc`) and nccl (when `enable_nccl` and the NCCL library loads).
    /// Default none.
    pub device: Option<DeviceKvPool>,
    /// Offer and use cuda-ipc (with a device pool). Default true.
    pub enable_cuda_ipc: bool,
    /// Offer and use nccl (with a device pool). Default true.
    pub enable_nccl: bool,
    /// Offer and use nixl, with this library and backend. Default none: nixl is not loaded.
    pub nixl: Option<NixlConfig>,
    /// Token sent in every HELLO (from the cluster secret). Default none.
    pub token: Option<KvToken>,
    /// Block payload bytes per group: a BLOCKS frame (tcp) or a SUMS frame (shm) covers this
    /// many bytes of blocks (at least one block, at most [`crate::wire::MAX_GROUP_BYTES`]). Smaller
    /// groups start the overlap sooner; larger ones cost fewer frames. Default 4 MiB.
    pub group_bytes: usize,
    /// tcp: staging buffers kept for later transfers (a fresh buffer costs a page fault per page
    /// on first use). Default 256 MiB.
    pub staging_pool_bytes: usize,
    /// TLS to the receiver (its certificate is verified for the host of the destination
    /// address; under mutual TLS the configuration carries this worker's certificate). Default
    /// none: plaintext.
    pub tls: Option<Arc<dyn KvClientTls>>,
}

impl Default for SenderOptions {
    fn default() -> Self {
        SenderOptions {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(1),
            ack_timeout: Duration::from_secs(30),
            enable_shm: true,
            device: None,
            enable_cuda_ipc: true,
            enable_nccl: true,
            nixl: None,
            token: None,
            group_bytes: 4 << 20,
            staging_pool_bytes: 256 << 20,
            tls: None,
        }
    }
}

/// Limits of a [`KvReceiver`](crate::KvReceiver).
#[derive(Debug, Clone)]
pub struct ReceiverOptions {
    /// Longest wait for the next bytes from a sender (senders send keep-alives every second
    /// while they compute). Default 5 s.
    pub io_timeout: Duration,
    /// Longest a transfer may stay open, keep-alives or not (a backstop against a sender that
    /// never finishes). Default 10 min.
    pub max_session: Duration,
    /// shm: after telling a live sender to stop, how long to wait for it to close the connection
    /// before the reservation is released anyway (the sender checks for a stop before every
    /// block it writes). Default 5 s.
    pub shm_close_grace: Duration,
    /// Most transfers in flight; further connections are refused at once. Default 256.
    pub max_connections: usize,
    /// `host:port` to advertise in [`KvReceiver::offers`](crate::KvReceiver::offers). Default: the bound address, with an
    /// unspecified IP (`0.0.0.0`, `::`) replaced by the loopback address.
    pub advertise_addr: Option<String>,
    /// Token every HELLO must carry (from the cluster secret); a HELLO without it or with another
    /// one is refused before its reservation is looked up. Default none: no token asked for.
    pub token: Option<KvToken>,
    /// Offer cuda-ipc when the pool is on a GPU (the pool is exported once, at bind). Default
    /// true.
    pub enable_cuda_ipc: bool,
    /// Offer nccl when the pool is on a GPU and the NCCL library loads. Default true.
    pub enable_nccl: bool,
    /// Offer nixl (the pool is registered once, at bind), with this library and backend.
    /// Default none: nixl is not loaded.
    pub nixl: Option<NixlConfig>,
    /// TLS for every connection (the server configuration decides whether a client certificate
    /// is required). Each connection is handshaken in its own task, bounded by `io_timeout`, so
    /// a silent client never stalls the others; a failed handshake ends the connection before
    /// a byte of it is read as KV protocol. Default none: plaintext.
    pub tls: Option<Arc<dyn KvServerTls>>,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            io_timeout: Duration::from_secs(5),
            max_session: Duration::from_secs(600),
            shm_close_grace: Duration::from_secs(5),
            max_connections: 256,
            advertise_addr: None,
            token: None,
            enable_cuda_ipc: true,
            enable_nccl: true,
            nixl: None,
            tls: None,
        }
    }
}

/// Where NIXL comes from and which of its backends moves the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlConfig {
    /// Directory holding `libnixl_capi.so` (`--nixl-lib`); `None`: `TANDEM_NIXL_LIB`, then the
    /// dynamic loader's search path.
    pub lib_dir: Option<std::path::PathBuf>,
    /// The backend plugin (`--nixl-backend`). Default `UCX`.
    pub backend: String,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig { lib_dir: None, backend: "UCX".into() }
    }
}
