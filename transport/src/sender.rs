//! P's side: open a session to D (pinning the reservation), stage the blocks on the engine
//! thread, then finish on the async side and wait for D's acknowledgement.
//!
//! Staging is a pipeline. The engine thread copies the blocks group by group (tcp: into a
//! staging buffer that is a ready-made BLOCKS frame; shm: straight into D's mapped pool),
//! computing each block's checksum piece by piece right after copying it, while the piece is
//! still in the cache. Each finished group goes to the session's writer task at once (tcp: the
//! frame; shm: a SUMS frame with the group's checksums), so the network (tcp) or D's
//! verification (shm) of one group overlaps the copy of the next. The engine thread never waits
//! for the network: it only copies and hands over.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tandem_proto::v1::{KvDestination, TransferCounters, TransportOffer};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::conn::{self, KvClientTls, KvRead, KvWrite};
use crate::cuda_ipc::{IpcSender, PeerPool};
use crate::nccl::link::{Opening, SendLinks, UNKNOWN_COMM};
use crate::nccl::NcclPeer;
use crate::wire::{self, tag, Hello};
use crate::{block_payload_bytes, host_id, Counters, KvBlockSource, KvToken, TransportError, TransportKind};
use tandem_engine::backend::Backend;
use tandem_engine::cuda::DeviceKvPool;
use tandem_engine::kv::shm::KvMemory;
use tandem_engine::kv::{BlockId, KvLayout};

/// Limits of a [`KvSender`].
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
    /// Token sent in every HELLO (from the cluster secret). Default none.
    pub token: Option<KvToken>,
    /// Block payload bytes per group: a BLOCKS frame (tcp) or a SUMS frame (shm) covers this
    /// many bytes of blocks (at least one block, at most [`wire::MAX_GROUP_BYTES`]). Smaller
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
            token: None,
            group_bytes: 4 << 20,
            staging_pool_bytes: 256 << 20,
            tls: None,
        }
    }
}

/// What a finished transfer moved.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferReport {
    pub transport: TransportKind,
    pub reservation: u64,
    pub blocks: usize,
    /// Block payload bytes moved.
    pub bytes: u64,
    /// Copying and checksumming the blocks on the engine thread (shm: into the destination);
    /// groups are sent (tcp) or verified (shm) meanwhile.
    pub stage_seconds: f64,
    /// From the end of staging: sending what is left (tcp) and waiting for the acknowledgement.
    pub send_seconds: f64,
    /// `stage_seconds + send_seconds`.
    pub seconds: f64,
}

/// P: opens sessions; caches shm mappings per segment path. One per prefill node.
pub struct KvSender {
    layout: KvLayout,
    opts: SenderOptions,
    host_id: String,
    segments: Mutex<HashMap<PathBuf, Arc<KvMemory>>>,
    counters: Arc<Counters>,
    buffers: Arc<BufferPool>,
    /// cuda-ipc: the copy stream and the decode workers' pools opened so far (made on first use).
    ipc: OnceLock<Result<Arc<IpcSender>, String>>,
    /// nccl: the communicators with decode workers (made on first use).
    nccl: OnceLock<Result<Arc<SendLinks>, String>>,
}

/// Staging buffers of finished tcp transfers, kept (up to a byte budget) for the next ones.
#[derive(Debug)]
struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    budget: usize,
}

impl BufferPool {
    /// A buffer of exactly `len` bytes (contents unspecified).
    fn take(&self, len: usize) -> Vec<u8> {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter().position(|b| b.capacity() >= len).map(|i| free.swap_remove(i))
        };
        let mut b = reused.unwrap_or_default();
        b.resize(len, 0);
        b
    }

    /// Keeps `b` for later if the budget allows.
    fn put(&self, b: Vec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + b.capacity() <= self.budget {
            free.push(b);
        }
    }
}

impl KvSender {
    /// A sender for blocks of `layout` (the prefill backend's; its `num_blocks` is irrelevant).
    pub fn new(layout: KvLayout, opts: SenderOptions) -> KvSender {
        KvSender {
            layout,
            host_id: host_id(),
            segments: Mutex::new(HashMap::new()),
            counters: Arc::default(),
            buffers: Arc::new(BufferPool { free: Mutex::new(Vec::new()), budget: opts.staging_pool_bytes }),
            ipc: OnceLock::new(),
            nccl: OnceLock::new(),
            opts,
        }
    }

    /// The kinds this sender can send with, fastest first.
    pub fn kinds(&self) -> Vec<TransportKind> {
        let gpu = self.opts.device.is_some();
        TransportKind::ALL
            .into_iter()
            .filter(|k| match k {
                TransportKind::CudaIpc => gpu && self.opts.enable_cuda_ipc,
                TransportKind::Nccl => gpu && self.opts.enable_nccl && crate::nccl_library().is_ok(),
                TransportKind::Shm => self.opts.enable_shm,
                TransportKind::Tcp => true,
            })
            .collect()
    }

    /// Why `kind` is not among [`KvSender::kinds`].
    pub fn why_not(&self, kind: TransportKind) -> String {
        match kind {
            _ if kind.needs_gpu() && self.opts.device.is_none() => {
                format!("{kind} moves KV between GPUs, and this worker's KV pool is in host memory (--device cpu)")
            }
            TransportKind::CudaIpc if !self.opts.enable_cuda_ipc => {
                "cuda-ipc is turned off (--transport)".into()
            }
            TransportKind::Nccl if !self.opts.enable_nccl => "nccl is turned off (--transport)".into(),
            TransportKind::Nccl => match crate::nccl_library() {
                Err(e) => e,
                Ok(()) => "nccl is available".into(),
            },
            TransportKind::Shm if !self.opts.enable_shm => "shm is turned off (--transport)".into(),
            _ => format!("{kind} is available"),
        }
    }

    /// nccl's sending side, made on first use.
    fn nccl(&self) -> Result<Arc<SendLinks>, TransportError> {
        let Some(own) = &self.opts.device else {
            return Err(TransportError::Invalid(self.why_not(TransportKind::Nccl)));
        };
        self.nccl
            .get_or_init(|| SendLinks::new(own.clone()).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(TransportError::Invalid)
    }

    /// cuda-ipc's sending side, made on first use.
    fn ipc(&self) -> Result<Arc<IpcSender>, TransportError> {
        let Some(own) = &self.opts.device else {
            return Err(TransportError::Invalid(
                "cuda-ipc needs this worker's KV pool on a GPU; this worker's is in host memory".into(),
            ));
        };
        self.ipc
            .get_or_init(|| IpcSender::new(own.clone()).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(TransportError::Invalid)
    }

    /// The kinds this sender can send with (address and segment empty), with this host's id
    /// and, for the GPU kinds, its GPU's UUID.
    pub fn offers(&self) -> Vec<TransportOffer> {
        let uuid = self.opts.device.as_ref().and_then(|d| d.device_uuid().ok()).unwrap_or_default();
        self.kinds()
            .into_iter()
            .map(|k| TransportOffer {
                kind: k.as_str().into(),
                host_id: self.host_id.clone(),
                device_uuid: if k.needs_gpu() { uuid.clone() } else { String::new() },
                writable_gpus: match (k, &self.opts.device) {
                    (TransportKind::CudaIpc, Some(d)) => crate::cuda_ipc::writable_gpus(d),
                    _ => Vec::new(),
                },
                ..Default::default()
            })
            .collect()
    }

    /// Completed and failed transfers so far.
    pub fn counters(&self) -> TransferCounters {
        self.counters.snapshot(None)
    }

    /// Completed and failed transfers of one transport so far.
    pub fn counters_of(&self, kind: TransportKind) -> TransferCounters {
        self.counters.snapshot(Some(kind))
    }

    /// Connects to D, sends HELLO for the destination's reservation and waits until D pinned
    /// it. From then on the session keeps the reservation pinned until it is finished or
    /// dropped. Errors name the peer.
    pub async fn open(&self, dest: &KvDestination) -> Result<TransferSession, TransportError> {
        let mut r = self.open_inner(dest).await;
        if let Err(TransportError::Refused { msg, .. }) = &r {
            if msg.contains(UNKNOWN_COMM) {
                // The decode worker restarted since our communicator with it was made: the
                // next open makes a new one.
                tracing::info!(peer = %dest.address, "decode worker lost its NCCL communicator; opening a new one");
                r = self.open_inner(dest).await;
            }
        }
        if r.is_err() {
            self.counters.failure(dest.transport.parse().ok(), false);
        }
        r
    }

    async fn open_inner(&self, dest: &KvDestination) -> Result<TransferSession, TransportError> {
        let kind: TransportKind = dest.transport.parse()?;
        let peer = dest.address.clone();
        let invalid = |m: String| TransportError::Invalid(format!("destination {peer}: {m}"));
        if peer.is_empty() {
            return Err(invalid("no KV address".into()));
        }
        let n = dest.block_ids.len();
        if n == 0 || n > wire::MAX_TRANSFER_BLOCKS {
            return Err(invalid(format!("{n} destination blocks")));
        }
        let mut ipc = None;
        let mut nccl = None;
        let mut ext = Vec::new();
        let segment = match kind {
            TransportKind::Tcp => None,
            TransportKind::CudaIpc | TransportKind::Nccl if !self.kinds().contains(&kind) => {
                return Err(invalid(format!(
                    "{kind} is not available on this worker: {}",
                    self.why_not(kind)
                )))
            }
            TransportKind::CudaIpc => {
                let sender = self.ipc()?;
                let peer_pool = sender.peer(&dest.ipc_handle, dest.pool_blocks)?;
                let nb = peer_pool.layout().num_blocks;
                if let Some(b) = dest.block_ids.iter().find(|&&b| b as usize >= nb) {
                    return Err(invalid(format!("block id {b} outside the destination pool of {nb} blocks")));
                }
                ext = dest.ipc_handle.clone();
                ipc = Some((sender, peer_pool));
                None
            }
            TransportKind::Nccl => {
                let links = self.nccl()?;
                let opening = links.opening(&peer).map_err(|e| gpu_error(&peer, e))?;
                let (comm_key, unique_id) = match &opening {
                    Opening::Reuse(k, _) => (*k, None),
                    Opening::New(k, id) => (*k, Some(id.0)),
                };
                ext = wire::NcclHello { comm_key, unique_id }.encode();
                nccl = Some((links, opening));
                None
            }
            TransportKind::Shm if !self.opts.enable_shm => {
                return Err(invalid("shm transport is disabled on this worker".into()))
            }
            TransportKind::Shm if dest.segment_path.is_empty() => {
                return Err(invalid("shm destination without a segment path".into()))
            }
            TransportKind::Shm => {
                let seg = self.segment(Path::new(&dest.segment_path))?;
                let nb = seg.layout().num_blocks;
                if let Some(b) = dest.block_ids.iter().find(|&&b| b as usize >= nb) {
                    return Err(invalid(format!("block id {b} outside the destination pool of {nb} blocks")));
                }
                Some(seg)
            }
        };
        let payload = block_payload_bytes(&self.layout);
        let hello = Hello {
            transport: kind,
            reservation: dest.reservation_id,
            num_blocks: n as u32,
            block_payload_bytes: payload as u64,
            num_layers: self.layout.num_layers as u32,
            block_size: self.layout.block_size as u32,
            num_kv_heads: self.layout.num_kv_heads as u32,
            head_dim: self.layout.head_dim as u32,
            layout: self.layout.name().into(),
            segment_path: if kind == TransportKind::Shm { dest.segment_path.clone() } else { String::new() },
            token: self.opts.token,
            ext,
        };
        let stream = match tokio::time::timeout(self.opts.connect_timeout, TcpStream::connect(&peer)).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    peer,
                    what: "connecting".into(),
                    after: self.opts.connect_timeout,
                })
            }
            Ok(Err(e)) => {
                if let Some((sender, _)) = &ipc {
                    // The decode worker is gone (or restarted with a new pool): close its mapping.
                    sender.forget(&dest.ipc_handle);
                }
                return Err(TransportError::Connect { peer, source: e });
            }
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        let (mut rd, mut wr) = match &self.opts.tls {
            None => conn::split_plain(stream),
            Some(tls) => {
                let name =
                    server_name(&peer).map_err(|msg| TransportError::Tls { peer: peer.clone(), msg })?;
                let connector = tokio_rustls::TlsConnector::from(tls.client_config());
                match tokio::time::timeout(self.opts.connect_timeout, connector.connect(name, stream)).await {
                    Err(_) => {
                        return Err(TransportError::Timeout {
                            peer,
                            what: "the TLS handshake".into(),
                            after: self.opts.connect_timeout,
                        })
                    }
                    Ok(Err(e)) => return Err(TransportError::Tls { peer, msg: e.to_string() }),
                    Ok(Ok(s)) => conn::split_tls(tokio_rustls::TlsStream::Client(s)),
                }
            }
        };
        let mut first = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
        first.extend_from_slice(&wire::frame(tag::HELLO, &hello.encode()));
        let io = self.opts.io_timeout;
        wire::write_all_idle(&mut wr, &first, io, &peer, "sending HELLO").await?;
        let what = format!("waiting for reservation {} to be accepted", dest.reservation_id);
        let (t, len) = wire::read_frame_header(&mut rd, io, &peer, &what, |t| match t {
            tag::OK => Some(0),
            tag::ERROR => Some(wire::MAX_ERROR_BYTES),
            _ => None,
        })
        .await?;
        if t == tag::ERROR {
            let mut m = vec![0u8; len];
            wire::read_exact_idle(&mut rd, &mut m, io, &peer, "reading an ERROR frame").await?;
            let msg = String::from_utf8_lossy(&m).into_owned();
            match &nccl {
                Some((links, Opening::Reuse(key, _))) if msg.contains(UNKNOWN_COMM) => {
                    links.forget(&peer, *key)
                }
                _ => {}
            }
            if let Some((sender, _)) = &ipc {
                // D restarted with another pool (or refuses it): do not keep the old mapping.
                sender.forget(&dest.ipc_handle);
            }
            return Err(TransportError::Refused { peer, msg });
        }
        // A new NCCL communicator: D accepted the reservation (nothing it would refuse is left)
        // and now joins as rank 1; join as rank 0. Neither side starts joining a communicator
        // the other may never join.
        let nccl = match nccl {
            Some((links, Opening::Reuse(key, p))) => Some((links, key, p)),
            Some((links, Opening::New(key, id))) => {
                let (l, p) = (links.clone(), peer.clone());
                let comm = tokio::task::spawn_blocking(move || l.join(&p, key, id))
                    .await
                    .map_err(|e| TransportError::Invalid(format!("NCCL join task failed: {e}")))?
                    .map_err(|e| gpu_error(&peer, e))?;
                Some((links, key, comm))
            }
            None => None,
        };
        let stop = Arc::new(Mutex::new(None));
        let (out, out_rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(writer(
            rd,
            wr,
            out_rx,
            stop.clone(),
            self.opts.clone(),
            peer.clone(),
            self.buffers.clone(),
        ));
        let group_blocks = (self.opts.group_bytes / payload).clamp(1, wire::max_group_blocks(payload));
        Ok(TransferSession {
            kind,
            peer,
            reservation: dest.reservation_id,
            dest_blocks: dest.block_ids.clone(),
            layout: self.layout,
            payload,
            group_blocks,
            segment,
            ipc,
            nccl,
            staged: false,
            stage_seconds: 0.0,
            stopped: stop,
            out: Some(out),
            task: Some(task),
            buffers: self.buffers.clone(),
            opts: self.opts.clone(),
            counters: self.counters.clone(),
        })
    }

    /// The mapping of D's segment at `path`: cached, re-mapped when the file at that path is a
    /// different one (D restarted), checked against this sender's layout.
    fn segment(&self, path: &Path) -> Result<Arc<KvMemory>, TransportError> {
        let mut cache = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        // Forget mappings whose file is gone, so a dead D's memory is not kept alive here.
        cache.retain(|p, m| file_id(p).is_some_and(|id| Some(id) == m.segment_id()));
        if let Some(m) = cache.get(path) {
            return Ok(m.clone());
        }
        let seg = Arc::new(KvMemory::open_segment(path)?);
        let diffs = seg.layout().differences(&self.layout, false);
        if !diffs.is_empty() {
            let diffs = diffs.join(", ");
            tracing::debug!(path = %path.display(), differences = %diffs, "kv layout mismatch (segment vs sender)");
            return Err(TransportError::Invalid(format!(
                "segment {}: its KV layout does not match this worker's (segment vs this worker): {diffs}",
                path.display()
            )));
        }
        cache.insert(path.to_path_buf(), seg.clone());
        Ok(seg)
    }
}

fn file_id(p: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

type Halves = (KvRead, KvWrite, Vec<u8>);

/// A whole frame for the writer task.
enum Outgoing {
    /// A staging buffer (BLOCKS): back to the pool once written.
    Staging(Vec<u8>),
    /// A small frame (SUMS).
    Control(Vec<u8>),
    /// DONE: the last frame; the writer hands the connection back after it, and what D says
    /// next (ACK or ERROR) is for [`TransferSession::finish`] to read.
    Last(Vec<u8>),
}

/// The session's connection while it is open: writes the frames the engine thread hands over
/// (in order), sends PINGs while nothing else is written, and notes in `stop` if D speaks (an
/// ERROR: it gave up) or the connection breaks; after that it writes nothing more. Keeps the
/// connection open in every case until the session finishes or is dropped (the channel
/// closes), so D never sees it close while the engine thread may still be writing into D's
/// memory. Returns the halves and any bytes D sent.
async fn writer(
    mut rd: KvRead,
    mut wr: KvWrite,
    mut out: tokio::sync::mpsc::UnboundedReceiver<Outgoing>,
    stop: Arc<Mutex<Option<String>>>,
    opts: SenderOptions,
    peer: String,
    buffers: Arc<BufferPool>,
) -> Halves {
    let set = |m: String| {
        let mut s = stop.lock().unwrap_or_else(|p| p.into_inner());
        s.get_or_insert(m);
    };
    let mut tick = tokio::time::interval(opts.keepalive_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let ping = wire::frame(tag::PING, &[]);
    let mut early = Vec::new();
    let mut buf = [0u8; 4096];
    // Writing (no error yet) and reading (D has not spoken or closed yet).
    let (mut writing, mut reading) = (true, true);
    let mut wrote = false;
    loop {
        tokio::select! {
            // D's ERROR first: once it is there, nothing more is written.
            biased;
            r = rd.read(&mut buf), if reading => match r {
                Ok(0) => {
                    set(format!("KV transfer with {peer}: the decode worker closed the connection"));
                    (reading, writing) = (false, false);
                }
                Ok(n) => {
                    early.extend_from_slice(&buf[..n]);
                    if let Some(m) = parse_error_frame(&early) {
                        set(format!("KV transfer with {peer}: refused by the peer: {m}"));
                        (reading, writing) = (false, false);
                    } else if early.len() > wire::FRAME_HEADER_BYTES + wire::MAX_ERROR_BYTES {
                        set(format!("KV transfer with {peer}: unexpected data from the decode worker"));
                        (reading, writing) = (false, false);
                    }
                }
                Err(e) => {
                    set(format!("KV transfer with {peer}: connection failed: {e}"));
                    (reading, writing) = (false, false);
                }
            },
            m = out.recv() => {
                let Some(m) = m else { break };
                let (Outgoing::Staging(frame) | Outgoing::Control(frame) | Outgoing::Last(frame)) = m;
                if writing {
                    if let Err(e) =
                        wire::write_all_idle(&mut wr, &frame, opts.io_timeout, &peer, "sending blocks").await
                    {
                        set(e.to_string());
                        writing = false;
                    }
                    wrote = true;
                }
                match frame.first() {
                    Some(&tag::DONE) => break,
                    Some(&tag::BLOCKS) => buffers.put(frame),
                    _ => {}
                }
            }
            _ = tick.tick(), if writing => {
                // Data frames keep D's inactivity timer from firing as well as a PING does.
                if !std::mem::take(&mut wrote) {
                    if let Err(e) = wire::write_all_idle(&mut wr, &ping, opts.io_timeout, &peer, "sending a keep-alive").await {
                        set(e.to_string());
                        writing = false;
                    }
                }
            }
        }
    }
    (rd, wr, early)
}

/// The TLS server name of a `host:port` destination.
fn server_name(peer: &str) -> Result<rustls::pki_types::ServerName<'static>, String> {
    let host = peer.rsplit_once(':').map_or(peer, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("{host:?} is not a host name for TLS: {e}"))
}

/// The message of a complete ERROR frame at the start of `b`.
fn parse_error_frame(b: &[u8]) -> Option<String> {
    if b.len() < wire::FRAME_HEADER_BYTES {
        return None;
    }
    let len = u32::from_le_bytes([b[1], b[2], b[3], b[4]]) as usize;
    if b[0] != tag::ERROR {
        return Some(format!("unexpected {} frame", wire::tag_name(b[0])));
    }
    let body = b.get(wire::FRAME_HEADER_BYTES..wire::FRAME_HEADER_BYTES + len)?;
    Some(String::from_utf8_lossy(body).into_owned())
}

/// Copies a group of blocks of every layer from `src` into the slices `dst(layer, i)` gives for
/// `blocks[i]`, and returns the CRC-32 of each block payload. The copy goes layer by layer
/// across the group (consecutive block ids make long runs in both pools, which the hardware
/// prefetches well), and each piece is checksummed right after it is copied, while it is still
/// in the cache, so checksumming costs no second pass over memory. `before(layer)` runs before
/// each layer's pieces are written and may stop the copy.
fn copy_group_checksummed<'a, S: KvBlockSource + ?Sized>(
    src: &S,
    blocks: &[BlockId],
    layers: usize,
    mut before: impl FnMut(usize) -> Result<(), TransportError>,
    mut dst: impl FnMut(usize, usize) -> Result<(&'a mut [u8], &'a mut [u8]), TransportError>,
) -> Result<Vec<u32>, TransportError> {
    let mut hashers = vec![crc32fast::Hasher::new(); blocks.len()];
    for layer in 0..layers {
        before(layer)?;
        for (i, (&block, h)) in blocks.iter().zip(&mut hashers).enumerate() {
            let (k, v) = dst(layer, i)?;
            src.read_block_into(layer, block, k, v)?;
            h.update(k);
            h.update(v);
        }
    }
    Ok(hashers.into_iter().map(crc32fast::Hasher::finalize).collect())
}

/// One transfer. `Send`: moved to the engine thread for [`TransferSession::stage`], back to the
/// async side for [`TransferSession::finish`]. Dropping it without finishing closes the
/// connection, and D releases the reservation.
pub struct TransferSession {
    kind: TransportKind,
    peer: String,
    reservation: u64,
    dest_blocks: Vec<BlockId>,
    layout: KvLayout,
    payload: usize,
    /// Blocks per BLOCKS / SUMS frame.
    group_blocks: usize,
    segment: Option<Arc<KvMemory>>,
    /// cuda-ipc: the copy stream's owner and D's mapped pool.
    ipc: Option<(Arc<IpcSender>, Arc<PeerPool>)>,
    /// nccl: the communicators, and the key of and the one with this session's decode worker.
    nccl: Option<(Arc<SendLinks>, u64, Arc<NcclPeer>)>,
    staged: bool,
    stage_seconds: f64,
    /// Set by the writer task when D gave up or the connection broke.
    stopped: Arc<Mutex<Option<String>>>,
    /// Frames for the writer task; dropping it ends the task.
    out: Option<tokio::sync::mpsc::UnboundedSender<Outgoing>>,
    task: Option<tokio::task::JoinHandle<Halves>>,
    buffers: Arc<BufferPool>,
    opts: SenderOptions,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for TransferSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferSession")
            .field("transport", &self.kind)
            .field("peer", &self.peer)
            .field("reservation", &self.reservation)
            .field("blocks", &self.dest_blocks.len())
            .finish()
    }
}

impl TransferSession {
    /// The transport in use.
    pub fn transport(&self) -> TransportKind {
        self.kind
    }

    /// D's reservation this session fills.
    pub fn reservation(&self) -> u64 {
        self.reservation
    }

    /// Engine thread: copy `src_blocks` (P's block table of the sequence; exactly as many as the
    /// destination's block ids) of every layer out of `backend`. Groups of blocks are sent (tcp)
    /// or announced for verification (shm) as soon as they are copied; the sources may be reused
    /// as soon as this returns.
    pub fn stage(&mut self, backend: &dyn Backend, src_blocks: &[BlockId]) -> Result<(), TransportError> {
        self.stage_from(backend, src_blocks)
    }

    /// [`TransferSession::stage`] from any [`KvBlockSource`] (a pool, in tests and benchmarks).
    pub fn stage_from<S: KvBlockSource + ?Sized>(
        &mut self,
        src: &S,
        src_blocks: &[BlockId],
    ) -> Result<(), TransportError> {
        let t0 = Instant::now();
        let bad = |m: String| TransportError::Invalid(format!("reservation {}: {m}", self.reservation));
        if self.staged {
            return Err(bad("blocks already staged".into()));
        }
        if src_blocks.len() != self.dest_blocks.len() {
            return Err(bad(format!(
                "{} source blocks for {} destination blocks",
                src_blocks.len(),
                self.dest_blocks.len()
            )));
        }
        let (a, b) = (src.source_layout(), self.layout);
        if (a.num_layers, a.block_size, a.num_kv_heads, a.head_dim)
            != (b.num_layers, b.block_size, b.num_kv_heads, b.head_dim)
        {
            return Err(bad(format!("source layout {a:?} differs from the sender's {b:?}")));
        }
        self.check_stopped()?;
        match self.kind {
            TransportKind::Tcp => self.stage_tcp(src, src_blocks)?,
            TransportKind::Shm => self.stage_shm(src, src_blocks)?,
            TransportKind::CudaIpc => self.stage_ipc(src_blocks)?,
            TransportKind::Nccl => self.stage_nccl(src_blocks)?,
        }
        self.staged = true;
        self.stage_seconds = t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// tcp: each group becomes one BLOCKS frame in a staging buffer (head, checksums, payloads),
    /// handed to the writer task as soon as it is complete.
    fn stage_tcp<S: KvBlockSource + ?Sized>(
        &mut self,
        src: &S,
        src_blocks: &[BlockId],
    ) -> Result<(), TransportError> {
        let (bb, layers, payload) = (self.layout.block_bytes(), self.layout.num_layers, self.payload);
        for (g, group) in src_blocks.chunks(self.group_blocks).enumerate() {
            self.check_stopped()?;
            let first = (g * self.group_blocks) as u32;
            let head = wire::group_head_len(group.len());
            let mut frame = self.buffers.take(head + group.len() * payload);
            wire::put_group_head(&mut frame, tag::BLOCKS, first, group.len() as u32, group.len() * payload);
            let (heads, body) = frame.split_at_mut(head);
            // Block i's payload is every layer's K then V: its pieces come in layer order.
            let mut pieces: Vec<_> =
                body.chunks_exact_mut(payload).map(|b| b.chunks_exact_mut(2 * bb)).collect();
            let crcs = copy_group_checksummed(
                src,
                group,
                layers,
                |_| Ok(()),
                |_, i| {
                    let kv = pieces[i]
                        .next()
                        .ok_or_else(|| TransportError::Invalid("short staging buffer".into()))?;
                    Ok(kv.split_at_mut(bb))
                },
            )?;
            for (i, crc) in crcs.into_iter().enumerate() {
                let at = wire::group_head_len(i);
                heads[at..at + 4].copy_from_slice(&crc.to_le_bytes());
            }
            self.send(Outgoing::Staging(frame))?;
        }
        Ok(())
    }

    /// shm: the blocks go straight into D's segment; after each group, a SUMS frame with its
    /// checksums lets D verify that group while the next one is copied.
    fn stage_shm<S: KvBlockSource + ?Sized>(
        &mut self,
        src: &S,
        src_blocks: &[BlockId],
    ) -> Result<(), TransportError> {
        let Some(seg) = self.segment.clone() else {
            return Err(TransportError::Invalid(format!(
                "reservation {}: shm session without a segment",
                self.reservation
            )));
        };
        let layers = self.layout.num_layers;
        for (g, (group, dest)) in
            src_blocks.chunks(self.group_blocks).zip(self.dest_blocks.chunks(self.group_blocks)).enumerate()
        {
            let crcs = copy_group_checksummed(
                src,
                group,
                layers,
                // D may have given up (timeout, or a bad checksum in an earlier group): then it
                // waits for us to close before it reuses the blocks, and we must not write
                // another byte. Checked before every layer of every group, so at least as often
                // as before every block.
                |_| self.check_stopped(),
                |layer, i| {
                    // SAFETY: `dest[i]` is a block of the reservation D pinned for this session
                    // (it answered OK to our HELLO, and the connection is open): D's engine does
                    // not touch it, and D frees it only after this connection closes or after it
                    // told us to stop, which we checked just before this layer. D reads it (to
                    // verify) only after the SUMS frame of its group, sent below once the whole
                    // group is written.
                    unsafe { seg.block_bytes_mut(layer, dest[i]) }.map_err(TransportError::from)
                },
            )?;
            self.send(Outgoing::Control(wire::sums_frame((g * self.group_blocks) as u32, &crcs)))?;
        }
        Ok(())
    }

    /// cuda-ipc: device-to-device copies from this worker's pool (the engine's, which `src`
    /// reads) into D's mapped pool, layer by layer, waited for before returning. D checks no
    /// checksums: the bytes never leave GPU memory and the interconnect.
    fn stage_ipc(&mut self, src_blocks: &[BlockId]) -> Result<(), TransportError> {
        let Some((sender, peer)) = self.ipc.clone() else {
            return Err(TransportError::Invalid(format!(
                "reservation {}: cuda-ipc session without a mapped pool",
                self.reservation
            )));
        };
        // D may give up meanwhile: then it waits for us to close before it reuses the blocks,
        // and nothing more may be queued.
        peer.copy_blocks(sender.stream(), src_blocks, &self.dest_blocks, |_| self.check_stopped())
    }

    /// nccl: tells D the source blocks (NCCL_GO, so both sides cut the same pieces), then sends
    /// every layer's K and V of them in one NCCL group and waits until they have left.
    fn stage_nccl(&mut self, src_blocks: &[BlockId]) -> Result<(), TransportError> {
        let Some((links, key, comm)) = self.nccl.clone() else {
            return Err(TransportError::Invalid(format!(
                "reservation {}: nccl session without a communicator",
                self.reservation
            )));
        };
        let peer = self.peer.clone();
        if comm.is_broken() {
            // Fail before NCCL_GO: D would post a receive nobody answers.
            links.forget(&peer, key);
            return Err(gpu_error(&peer, "the NCCL communicator with this decode worker failed earlier"));
        }
        let pieces = links.pieces(src_blocks, &self.dest_blocks).map_err(|e| gpu_error(&peer, e))?;
        let bytes: usize = pieces.iter().map(|p| p.1).sum();
        self.send(Outgoing::Control(wire::frame(tag::NCCL_GO, &wire::nccl_go_body(src_blocks))))?;
        // SAFETY: the pieces are this worker's own pool blocks of the sequence being sent; the
        // engine thread (this one) neither frees nor writes them until staging returns. After a
        // failure NCCL may still read them for a while (bounded below): reads only, into a
        // reservation D then releases or holds back, never into anything D uses.
        let sent = unsafe { comm.send(pieces, nccl_deadline(bytes)) };
        if let Err(e) = sent {
            links.forget(&peer, key);
            let until = Instant::now() + Duration::from_secs(5);
            while comm.is_busy() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            return Err(self.check_stopped().err().unwrap_or_else(|| gpu_error(&peer, e)));
        }
        Ok(())
    }

    /// Hands a frame to the writer task.
    fn send(&self, frame: Outgoing) -> Result<(), TransportError> {
        let Some(out) = &self.out else {
            return Err(TransportError::Invalid("session already finished".into()));
        };
        out.send(frame).map_err(|_| TransportError::Invalid("the session's writer task is gone".into()))
    }

    fn check_stopped(&self) -> Result<(), TransportError> {
        match self.stopped.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(m) => Err(TransportError::Refused { peer: self.peer.clone(), msg: m }),
            None => Ok(()),
        }
    }

    /// Sends DONE after what is staged and waits for D's acknowledgement.
    pub async fn finish(mut self) -> Result<TransferReport, TransportError> {
        let counters = self.counters.clone();
        let r = self.finish_inner().await;
        match &r {
            Ok(rep) => counters.success(rep.transport, rep.bytes, rep.seconds),
            Err(_) => counters.failure(Some(self.kind), false),
        }
        r
    }

    async fn finish_inner(&mut self) -> Result<TransferReport, TransportError> {
        let t0 = Instant::now();
        let peer = self.peer.clone();
        if !self.staged {
            return Err(TransportError::Invalid(format!(
                "reservation {}: finish before the blocks were staged",
                self.reservation
            )));
        }
        self.send(Outgoing::Last(wire::frame(tag::DONE, &wire::done_body(self.dest_blocks.len()))))?;
        // The writer task writes everything queued, DONE last, then hands the connection back.
        self.out = None;
        let Some(task) = self.task.take() else {
            return Err(TransportError::Invalid("session already finished".into()));
        };
        let (rd, _wr, early) =
            task.await.map_err(|e| TransportError::Invalid(format!("writer task failed: {e}")))?;
        let io = self.opts.io_timeout;
        let mut rd = AsyncReadExt::chain(&early[..], rd);
        if let Err(e) = self.check_stopped() {
            // A write that failed because D closed after an ERROR: D's words say more.
            if !matches!(&e, TransportError::Refused { msg, .. } if msg.contains("refused by the peer")) {
                if let Some(m) = read_error_frame(&mut rd, io.min(Duration::from_millis(500)), &peer).await {
                    return Err(TransportError::Refused { peer, msg: m });
                }
            }
            return Err(e);
        }
        let what = format!("waiting for the acknowledgement of reservation {}", self.reservation);
        let (t, len) = wire::read_frame_header(&mut rd, self.opts.ack_timeout, &peer, &what, |t| match t {
            tag::ACK => Some(8),
            tag::ERROR => Some(wire::MAX_ERROR_BYTES),
            _ => None,
        })
        .await?;
        let mut body = vec![0u8; len];
        wire::read_exact_idle(&mut rd, &mut body, io, &peer, "reading the acknowledgement").await?;
        if t == tag::ERROR {
            return Err(TransportError::Refused { peer, msg: String::from_utf8_lossy(&body).into_owned() });
        }
        let bytes = (self.dest_blocks.len() * self.payload) as u64;
        let acked = body.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        if acked != Some(bytes) {
            return Err(TransportError::Protocol {
                peer,
                msg: format!("ACK for {acked:?} bytes, {bytes} were sent"),
            });
        }
        let send_seconds = t0.elapsed().as_secs_f64();
        Ok(TransferReport {
            transport: self.kind,
            reservation: self.reservation,
            blocks: self.dest_blocks.len(),
            bytes,
            stage_seconds: self.stage_seconds,
            send_seconds,
            seconds: self.stage_seconds + send_seconds,
        })
    }
}

/// An ERROR frame's message, if D's next frame is one (read within `wait`).
async fn read_error_frame<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    wait: Duration,
    peer: &str,
) -> Option<String> {
    let what = "reading the decode worker's error";
    let (_, len) =
        wire::read_frame_header(rd, wait, peer, what, |t| (t == tag::ERROR).then_some(wire::MAX_ERROR_BYTES))
            .await
            .ok()?;
    let mut m = vec![0u8; len];
    wire::read_exact_idle(rd, &mut m, wait, peer, what).await.ok()?;
    Some(String::from_utf8_lossy(&m).into_owned())
}

fn gpu_error(peer: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Gpu { peer: peer.into(), msg: e.to_string() }
}

/// How long one NCCL transfer of `bytes` may take: 10 s, plus a second per GB (far below what
/// any GPU interconnect moves, so only a stuck peer reaches it).
pub(crate) fn nccl_deadline(bytes: usize) -> Duration {
    Duration::from_secs(10) + Duration::from_secs_f64(bytes as f64 / 1e9)
}
