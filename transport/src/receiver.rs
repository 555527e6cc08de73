//! D's KV listener: accepts one connection per transfer, pins the reservation through the
//! [`ReservationGate`], receives (tcp) or verifies (shm) the blocks, and completes or aborts the
//! reservation — exactly one of the two, exactly once, whatever the peer does.
//!
//! tcp: each BLOCKS frame is read straight into the reserved blocks (vectored reads into the
//! pool's memory where the sink lends it) and every block is checked against its checksum right
//! after it arrived, while it is still in the cache. shm: each SUMS frame goes to a verifier
//! thread that checks that group in the pool while the sender writes the next one; at DONE the
//! receiver waits for the verifier. The verifier holds the reservation's pin, so a reservation
//! is never aborted (and its blocks reused) while the verifier still reads them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::{TransferCounters, TransportOffer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::conn::{self, KvRead, KvServerTls, KvWrite};
use crate::cuda_ipc::{self, IpcHandle};
use crate::nccl::link::{RecvLinks, UNKNOWN_COMM};
use crate::nccl::{NcclPeer, UniqueId};
use crate::wire::{self, tag, Hello};
use crate::{
    block_payload_bytes, host_id, Counters, KvBlockSink, KvToken, ReservationGate, TransportError,
    TransportKind,
};
use tandem_engine::kv::BlockId;

/// Limits of a [`KvReceiver`].
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
    /// `host:port` to advertise in [`KvReceiver::offers`]. Default: the bound address, with an
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
            tls: None,
        }
    }
}

/// D: the KV listener (tokio). Serves both kinds: tcp data frames and shm control messages.
/// Dropping it (or [`KvReceiver::shutdown`]) stops accepting and aborts transfers in flight.
pub struct KvReceiver {
    local_addr: SocketAddr,
    advertise: String,
    segment_path: Option<PathBuf>,
    host_id: String,
    counters: Arc<Counters>,
    stop: tokio::sync::watch::Sender<bool>,
    accept: Option<tokio::task::JoinHandle<()>>,
    gpu: GpuPool,
    /// Blocks in the pool.
    pool_blocks: usize,
}

/// What the receiver knows of its pool when it is on a GPU.
#[derive(Default)]
struct GpuPool {
    /// The UUID of the pool's GPU; empty for a host pool.
    uuid: String,
    /// cuda-ipc: the pool's export, or why there is none.
    ipc: Option<Result<IpcHandle, String>>,
    /// nccl: whether it is offered, or why not.
    nccl: Option<Result<(), String>>,
}

struct Ctx {
    sink: Arc<dyn KvBlockSink>,
    gate: Arc<dyn ReservationGate>,
    opts: ReceiverOptions,
    counters: Arc<Counters>,
    segment: Option<String>,
    /// cuda-ipc: the exported pool's handle, which a sender's HELLO must name.
    ipc: Option<IpcHandle>,
    /// nccl: the communicators with prefill workers.
    nccl: Option<Arc<RecvLinks>>,
}

impl KvReceiver {
    /// Binds the listener and starts accepting transfers into `sink`'s blocks.
    pub async fn bind(
        addr: SocketAddr,
        sink: Arc<dyn KvBlockSink>,
        gate: Arc<dyn ReservationGate>,
        opts: ReceiverOptions,
    ) -> Result<KvReceiver, TransportError> {
        let listener = TcpListener::bind(addr).await.map_err(|e| TransportError::Io {
            peer: addr.to_string(),
            what: "cannot bind the KV listener".into(),
            source: e,
        })?;
        let local_addr = listener.local_addr().map_err(|e| TransportError::Io {
            peer: addr.to_string(),
            what: "cannot read the KV listener's address".into(),
            source: e,
        })?;
        let advertise = opts.advertise_addr.clone().unwrap_or_else(|| {
            let mut a = local_addr;
            if a.ip().is_unspecified() {
                a.set_ip(if a.is_ipv4() {
                    std::net::Ipv4Addr::LOCALHOST.into()
                } else {
                    std::net::Ipv6Addr::LOCALHOST.into()
                });
            }
            a.to_string()
        });
        let segment_path = sink.segment_path();
        let pool_blocks = sink.layout().num_blocks;
        let counters = Arc::new(Counters::default());
        let mut nccl = None;
        let gpu = match sink.device_pool() {
            None => GpuPool::default(),
            Some(pool) => GpuPool {
                uuid: pool.device_uuid().unwrap_or_default(),
                ipc: opts.enable_cuda_ipc.then(|| cuda_ipc::export(&pool).map_err(|e| e.to_string())),
                nccl: opts.enable_nccl.then(|| match RecvLinks::new(pool.clone()) {
                    Ok(l) => {
                        nccl = Some(Arc::new(l));
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                }),
            },
        };
        if let Some(Err(e)) = &gpu.ipc {
            tracing::warn!(error = %e, "cannot export the KV pool for cuda-ipc; not offering it");
        }
        if let Some(Err(e)) = &gpu.nccl {
            tracing::warn!(error = %e, "NCCL is not available; not offering nccl");
        }
        let ctx = Arc::new(Ctx {
            nccl,
            ipc: gpu.ipc.clone().and_then(Result::ok),
            segment: segment_path.as_ref().map(|p| p.to_string_lossy().into_owned()),
            sink,
            gate,
            opts,
            counters: counters.clone(),
        });
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(accept_loop(listener, ctx, stop_rx));
        tracing::info!(addr = %local_addr, shm = ?segment_path, "KV receiver listening");
        Ok(KvReceiver {
            local_addr,
            advertise,
            segment_path,
            host_id: host_id(),
            pool_blocks,
            counters,
            stop,
            accept: Some(accept),
            gpu,
        })
    }

    /// Why this receiver offers no cuda-ipc, if it does not.
    pub fn cuda_ipc_unavailable(&self) -> Option<String> {
        match &self.gpu.ipc {
            Some(Ok(_)) => None,
            Some(Err(e)) => Some(format!("the KV pool cannot be exported: {e}")),
            None if self.gpu.uuid.is_empty() => Some(
                "cuda-ipc moves KV between GPUs, and this worker's KV pool is in host memory (--device cpu)"
                    .into(),
            ),
            None => Some("cuda-ipc is turned off".into()),
        }
    }

    /// Why this receiver offers no nccl, if it does not.
    pub fn nccl_unavailable(&self) -> Option<String> {
        match &self.gpu.nccl {
            Some(Ok(())) => None,
            Some(Err(e)) => Some(e.clone()),
            None if self.gpu.uuid.is_empty() => Some(
                "nccl moves KV between GPUs, and this worker's KV pool is in host memory (--device cpu)"
                    .into(),
            ),
            None => Some("nccl is turned off".into()),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What D advertises at registration, fastest first: cuda-ipc (when the pool is on a GPU and
    /// exported), shm (when the pool is a shared segment) and tcp. The control connection of
    /// every kind is the KV listener's address.
    pub fn offers(&self) -> Vec<TransportOffer> {
        let base = TransportOffer {
            address: self.advertise.clone(),
            host_id: self.host_id.clone(),
            ..Default::default()
        };
        let mut v = Vec::new();
        if let Some(Ok(h)) = &self.gpu.ipc {
            v.push(TransportOffer {
                kind: TransportKind::CudaIpc.as_str().into(),
                ipc_handle: h.to_vec(),
                device_uuid: self.gpu.uuid.clone(),
                pool_blocks: self.pool_blocks as u32,
                ..base.clone()
            });
        }
        if let Some(Ok(())) = &self.gpu.nccl {
            v.push(TransportOffer {
                kind: TransportKind::Nccl.as_str().into(),
                device_uuid: self.gpu.uuid.clone(),
                ..base.clone()
            });
        }
        if let Some(p) = &self.segment_path {
            v.push(TransportOffer {
                kind: TransportKind::Shm.as_str().into(),
                segment_path: p.to_string_lossy().into_owned(),
                ..base.clone()
            });
        }
        v.push(TransportOffer { kind: TransportKind::Tcp.as_str().into(), ..base });
        v
    }

    /// Completed and failed transfers so far.
    pub fn counters(&self) -> TransferCounters {
        self.counters.snapshot(None)
    }

    /// Completed and failed transfers of one transport so far (a connection that failed before
    /// its HELLO named a transport counts only in [`KvReceiver::counters`]).
    pub fn counters_of(&self, kind: TransportKind) -> TransferCounters {
        self.counters.snapshot(Some(kind))
    }

    /// Stops accepting, aborts transfers in flight (their reservations are aborted) and waits
    /// until that is done.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(h) = self.accept.take() {
            let _ = h.await;
        }
    }
}

impl Drop for KvReceiver {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(Ok(h)) = &self.gpu.ipc {
            cuda_ipc::unexport(h);
        }
    }
}

async fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    if conns.len() >= ctx.opts.max_connections {
                        tracing::warn!(%peer, limit = ctx.opts.max_connections, "KV transfer refused: too many in flight");
                        let msg = format!("too many KV transfers in flight (limit {})", ctx.opts.max_connections);
                        if ctx.opts.tls.is_none() {
                            let _ = stream.try_write(&wire::frame(tag::ERROR, msg.as_bytes()));
                        }
                        continue;
                    }
                    conns.spawn(serve_conn(stream, peer, ctx.clone()));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "KV listener accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    // Aborting drops each connection's future, whose guard aborts its reservation.
    conns.abort_all();
    while conns.join_next().await.is_some() {}
    tracing::info!("KV receiver stopped");
}

/// Holds a pinned reservation; aborts it when the last holder drops it without `complete` (error,
/// peer gone, task aborted at shutdown, panic), so abort happens exactly once. Shared with the
/// shm verifier thread while it reads the reservation's blocks.
struct Pinned {
    gate: Arc<dyn ReservationGate>,
    reservation: u64,
    why: Mutex<String>,
    done: AtomicBool,
}

impl Pinned {
    fn complete(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.gate.complete(self.reservation);
        }
    }

    fn set_why(&self, why: String) {
        *self.why.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !*self.done.get_mut() {
            let why = std::mem::take(self.why.get_mut().unwrap_or_else(|p| p.into_inner()));
            self.gate.abort(self.reservation, &why);
        }
    }
}

/// What a connection pinned, for the error path.
struct Pin {
    guard: Arc<Pinned>,
    transport: TransportKind,
}

/// shm: checks groups of blocks in the pool on a thread of its own while the sender copies later
/// groups. Dropping it stops the thread before its next block.
struct Verifier {
    jobs: Option<std::sync::mpsc::Sender<(usize, Vec<u32>)>>,
    cancel: Arc<AtomicBool>,
    /// The first mismatch (or pool error) found so far.
    failed: Arc<Mutex<Option<TransportError>>>,
    thread: Option<tokio::task::JoinHandle<()>>,
}

impl Verifier {
    fn start(sink: Arc<dyn KvBlockSink>, blocks: Vec<BlockId>, pin: Arc<Pinned>, peer: String) -> Verifier {
        let (jobs, rx) = std::sync::mpsc::channel::<(usize, Vec<u32>)>();
        let cancel = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(Mutex::new(None));
        let (c, f) = (cancel.clone(), failed.clone());
        let thread = tokio::task::spawn_blocking(move || {
            // Holding the pin keeps the reservation from being aborted while we read it.
            let _pin = pin;
            let fail = |e: TransportError| {
                f.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
            };
            for (first, sent) in rx {
                if c.load(Ordering::Acquire) {
                    return;
                }
                let ids = &blocks[first..first + sent.len()];
                // SAFETY: the blocks belong to the reservation this connection pinned (and
                // `_pin` keeps pinned): no sequence holds them. The sender wrote them before it
                // sent the SUMS frame this job comes from, and writes them no more.
                match unsafe { sink.blocks_checksums(ids) } {
                    Ok(got) => {
                        if let Some(k) = (0..sent.len()).find(|&k| got[k] != sent[k]) {
                            return fail(TransportError::Checksum {
                                peer,
                                msg: mismatch(first + k, ids[k], got[k], sent[k]),
                            });
                        }
                    }
                    Err(e) => return fail(e.into()),
                }
            }
        });
        Verifier { jobs: Some(jobs), cancel, failed, thread: Some(thread) }
    }

    fn submit(&self, first: usize, sums: Vec<u32>) -> Result<(), TransportError> {
        self.check()?;
        if let Some(j) = &self.jobs {
            // A send fails only when the thread stopped, which `check` reports.
            let _ = j.send((first, sums));
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TransportError> {
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits until every submitted group is checked.
    async fn finish(mut self) -> Result<(), TransportError> {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            t.await.map_err(|e| TransportError::Invalid(format!("checksum thread failed: {e}")))?;
        }
        self.check()
    }
}

impl Drop for Verifier {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Release);
    }
}

fn mismatch(index: usize, block: BlockId, got: u32, want: u32) -> String {
    format!(
        "block {index} (destination block {block}) has checksum {got:#010x}, the sender's is {want:#010x}"
    )
}

async fn serve_conn(stream: TcpStream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let _ = stream.set_nodelay(true);
    let peer_s = peer.to_string();
    let (rd, mut wr) = match &ctx.opts.tls {
        None => conn::split_plain(stream),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
            match tokio::time::timeout(ctx.opts.io_timeout, acceptor.accept(stream)).await {
                Ok(Ok(s)) => conn::split_tls(tokio_rustls::TlsStream::Server(s)),
                Ok(Err(e)) => {
                    ctx.counters.failure(None, false);
                    tracing::warn!(peer = %peer_s, error = %e, "KV connection refused: TLS handshake failed");
                    return;
                }
                Err(_) => {
                    ctx.counters.failure(None, false);
                    tracing::warn!(peer = %peer_s, "KV connection refused: TLS handshake timed out");
                    return;
                }
            }
        }
    };
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut pin: Option<Pin> = None;
    let mut kind: Option<TransportKind> = None;
    let result = receive(&ctx, &mut rd, &mut wr, &mut pin, &mut kind, &peer_s).await;
    match result {
        Ok(()) => {}
        Err(e) => {
            let checksum = matches!(e, TransportError::Checksum { .. });
            ctx.counters.failure(kind, checksum);
            let gone = matches!(e, TransportError::Io { .. });
            let reservation = pin.as_ref().map(|p| p.guard.reservation);
            tracing::warn!(peer = %peer_s, ?reservation, kind = e.kind(), error = %e, "KV transfer failed");
            if !gone {
                // Best effort: tell a live peer why.
                let full = e.to_string();
                let msg = truncate(&full, wire::MAX_ERROR_BYTES);
                let _ = wire::write_all_idle(
                    &mut wr,
                    &wire::frame(tag::ERROR, msg.as_bytes()),
                    ctx.opts.io_timeout,
                    &peer_s,
                    "sending an error",
                )
                .await;
            }
            let linger = ctx.opts.io_timeout.min(Duration::from_secs(1));
            match pin.take() {
                Some(p) if p.transport.writes_directly() && !gone => {
                    p.guard.set_why(e.to_string());
                    // The sender may still be writing into the reserved blocks (a bad checksum
                    // can be found while it writes later groups): wait until it closes the
                    // connection (it checks for our ERROR before every block) before the
                    // reservation is released.
                    let _ = wr.shutdown().await;
                    if !wait_for_close(&mut rd, ctx.opts.shm_close_grace).await {
                        tracing::warn!(
                            peer = %peer_s,
                            reservation = p.guard.reservation,
                            grace = ?ctx.opts.shm_close_grace,
                            "shm sender did not close after an error; releasing its reservation anyway"
                        );
                    }
                    drop(p); // aborts the reservation
                }
                other => {
                    if let Some(p) = other {
                        p.guard.set_why(e.to_string());
                        drop(p); // aborts the reservation
                    }
                    if !gone {
                        // Close gracefully so the ERROR is not lost to a reset when unread input
                        // is pending.
                        let _ = wr.shutdown().await;
                        let _ = wait_for_close(&mut rd, linger).await;
                    }
                }
            }
        }
    }
}

/// Reads and discards until EOF; false if `grace` passed first.
async fn wait_for_close<R: AsyncRead + Unpin>(rd: &mut R, grace: Duration) -> bool {
    let drain = async {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(grace, drain).await.is_ok()
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn protocol(peer: &str, msg: impl Into<String>) -> TransportError {
    TransportError::Protocol { peer: peer.into(), msg: msg.into() }
}

/// The token a HELLO presented against the one this receiver asks for (if any).
fn check_token(expected: Option<&KvToken>, presented: Option<&KvToken>) -> Result<(), String> {
    match (expected, presented) {
        (None, _) => Ok(()),
        (Some(_), None) => Err("the HELLO carries no KV auth token, and this decode worker requires one \
                                (set the same --cluster-secret on the prefill worker)"
            .into()),
        (Some(e), Some(p)) if e.matches(&p.0) => Ok(()),
        (Some(_), Some(_)) => {
            Err("wrong KV auth token (--cluster-secret differs between the prefill and decode workers)"
                .into())
        }
    }
}

/// The Hello's layout against the pool's; names every field that differs.
fn check_hello(ctx: &Ctx, h: &Hello) -> Result<(), String> {
    let l = ctx.sink.layout();
    let mut diffs = Vec::new();
    if h.layout != l.name() {
        diffs.push(format!("layout `{}` vs `{}`", h.layout, l.name()));
    }
    for (name, theirs, ours) in [
        ("num_layers", h.num_layers as usize, l.num_layers),
        ("block_size", h.block_size as usize, l.block_size),
        ("num_kv_heads", h.num_kv_heads as usize, l.num_kv_heads),
        ("head_dim", h.head_dim as usize, l.head_dim),
    ] {
        if theirs != ours {
            diffs.push(format!("{name} {theirs} vs {ours}"));
        }
    }
    if !diffs.is_empty() {
        tracing::debug!(differences = %diffs.join(", "), "kv layout mismatch (sender vs this worker)");
        return Err(format!("KV layout mismatch (sender vs this worker): {}", diffs.join(", ")));
    }
    let payload = block_payload_bytes(&l) as u64;
    if h.block_payload_bytes != payload {
        return Err(format!(
            "block payload of {} bytes, this worker's blocks are {payload}",
            h.block_payload_bytes
        ));
    }
    let n = h.num_blocks as usize;
    if n == 0 || n > wire::MAX_TRANSFER_BLOCKS || n > l.num_blocks {
        return Err(format!("transfer of {n} blocks is impossible (pool of {} blocks)", l.num_blocks));
    }
    match h.transport {
        TransportKind::Tcp if !h.segment_path.is_empty() => Err("tcp HELLO carries a segment path".into()),
        TransportKind::Tcp => Ok(()),
        TransportKind::Shm => match &ctx.segment {
            None => Err("this worker's KV pool is not in shared memory; use tcp".into()),
            Some(p) if *p != h.segment_path => {
                Err(format!("sender mapped segment {}, this worker's pool is {p}", h.segment_path))
            }
            Some(_) => Ok(()),
        },
        TransportKind::CudaIpc => match &ctx.ipc {
            None => Err("this worker offers no cuda-ipc (its KV pool is not an exported GPU pool)".into()),
            Some(ours) if h.ext != ours[..] => Err(
                "the sender opened another KV pool than this worker's (the decode worker restarted since \
                 its registration?)"
                    .into(),
            ),
            Some(_) => Ok(()),
        },
        TransportKind::Nccl if ctx.nccl.is_none() => {
            Err("this worker offers no nccl (its KV pool is not on a GPU, or NCCL is missing)".into())
        }
        TransportKind::Nccl => {
            let n = wire::NcclHello::decode(&h.ext)?;
            // A communicator named but unknown (this worker restarted, or it failed): refused
            // before the reservation is pinned, so the sender can retry with a new one.
            match (&n.unique_id, &ctx.nccl) {
                (None, Some(links)) if links.get(n.comm_key).is_none() => Err(format!(
                    "{UNKNOWN_COMM} {:#018x} (this decode worker restarted, or the communicator failed)",
                    n.comm_key
                )),
                _ => Ok(()),
            }
        }
    }
}

async fn receive(
    ctx: &Ctx,
    rd: &mut BufReader<KvRead>,
    wr: &mut KvWrite,
    pin: &mut Option<Pin>,
    kind: &mut Option<TransportKind>,
    peer: &str,
) -> Result<(), TransportError> {
    let io = ctx.opts.io_timeout;
    let started = Instant::now();
    let deadline = started + ctx.opts.max_session;

    let mut pre = [0u8; wire::PREAMBLE_BYTES];
    wire::read_exact_idle(rd, &mut pre, io, peer, "reading the preamble").await?;
    wire::check_preamble(&pre).map_err(|m| protocol(peer, m))?;
    let (_, len) = wire::read_frame_header(rd, io, peer, "waiting for HELLO", |t| {
        (t == tag::HELLO).then_some(wire::MAX_HELLO_BYTES)
    })
    .await?;
    let mut body = vec![0u8; len];
    wire::read_exact_idle(rd, &mut body, io, peer, "reading HELLO").await?;
    let hello = Hello::decode(&body).map_err(|m| protocol(peer, m))?;
    *kind = Some(hello.transport);
    // Authentication first: a peer without the secret learns nothing and touches no reservation.
    check_token(ctx.opts.token.as_ref(), hello.token.as_ref())
        .map_err(|msg| TransportError::Unauthenticated { peer: peer.into(), msg })?;
    check_hello(ctx, &hello).map_err(|m| TransportError::Refused {
        peer: peer.into(),
        msg: format!("reservation {}: {m}", hello.reservation),
    })?;
    let n = hello.num_blocks as usize;
    let res = hello.reservation;

    let blocks = ctx
        .gate
        .begin(res)
        .map_err(|m| TransportError::Refused { peer: peer.into(), msg: format!("reservation {res}: {m}") })?;
    let guard = Arc::new(Pinned {
        gate: ctx.gate.clone(),
        reservation: res,
        why: Mutex::new("transfer interrupted (KV receiver shutting down)".into()),
        done: AtomicBool::new(false),
    });
    *pin = Some(Pin { guard: guard.clone(), transport: hello.transport });
    let layout = ctx.sink.layout();
    if blocks.len() != n {
        return Err(TransportError::Refused {
            peer: peer.into(),
            msg: format!("reservation {res} has {} blocks, the sender has {n}", blocks.len()),
        });
    }
    if let Some(b) = blocks.iter().find(|&&b| b as usize >= layout.num_blocks) {
        return Err(TransportError::Invalid(format!(
            "reservation {res}: block id {b} outside the pool of {} blocks",
            layout.num_blocks
        )));
    }
    wire::write_all_idle(wr, &wire::frame(tag::OK, &[]), io, peer, "sending OK").await?;
    // nccl: the communicator, joined now (after OK, as the sender does) when it is new.
    let nccl = match (&ctx.nccl, hello.transport) {
        (Some(links), TransportKind::Nccl) => Some((links.clone(), nccl_link(links, &hello, peer).await?)),
        _ => None,
    };

    let payload = block_payload_bytes(&layout);
    let tcp = hello.transport == TransportKind::Tcp;
    let shm = hello.transport == TransportKind::Shm;
    let max_group = wire::max_group_blocks(payload);
    let mut verifier =
        shm.then(|| Verifier::start(ctx.sink.clone(), blocks.clone(), guard.clone(), peer.into()));
    drop(guard);
    // Blocks received (tcp) or announced for verification (shm) so far.
    let mut next = 0usize;
    let mut data_started: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Timeout {
                peer: peer.into(),
                what: format!("reservation {res} held open past the session limit"),
                after: ctx.opts.max_session,
            });
        }
        let wait = io.min(deadline - now);
        let what = format!("waiting for block {next} of {n} (reservation {res})");
        let (t, len) = wire::read_frame_header(rd, wait, peer, &what, |t| match t {
            tag::PING => Some(0),
            tag::ERROR => Some(wire::MAX_ERROR_BYTES),
            tag::DONE => Some(4),
            tag::BLOCKS if tcp => Some(wire::GROUP_HEAD_BYTES + max_group * (4 + payload)),
            tag::SUMS if shm => Some(wire::GROUP_HEAD_BYTES + 4 * n),
            tag::NCCL_GO if nccl.is_some() && next == 0 => Some(4 * n),
            _ => None,
        })
        .await?;
        match t {
            tag::PING => {}
            tag::ERROR => {
                let mut m = vec![0u8; len];
                wire::read_exact_idle(rd, &mut m, io, peer, "reading an ERROR frame").await?;
                return Err(TransportError::Refused {
                    peer: peer.into(),
                    msg: format!("sender gave up: {}", String::from_utf8_lossy(&m)),
                });
            }
            tag::BLOCKS | tag::SUMS => {
                data_started.get_or_insert_with(Instant::now);
                let name = wire::tag_name(t);
                if len < wire::GROUP_HEAD_BYTES {
                    return Err(protocol(peer, format!("{name} frame of {len} bytes is too short")));
                }
                let mut head = [0u8; wire::GROUP_HEAD_BYTES];
                wire::read_exact_idle(rd, &mut head, io, peer, "reading a group header").await?;
                let (first, count) = wire::parse_group_head(&head, next, n, if tcp { max_group } else { n })
                    .map_err(|m| protocol(peer, m))?;
                let per_block = if tcp { 4 + payload } else { 4 };
                let expected = wire::GROUP_HEAD_BYTES + count * per_block;
                if len != expected {
                    return Err(protocol(
                        peer,
                        format!("{name} frame of {len} bytes for {count} blocks, expected {expected}"),
                    ));
                }
                let mut sums = vec![0u8; 4 * count];
                wire::read_exact_idle(rd, &mut sums, io, peer, "reading a group's checksums").await?;
                let sums = wire::parse_u32s(&sums);
                match &verifier {
                    Some(v) => v.submit(first, sums)?,
                    None => receive_group(ctx, rd, &blocks[first..first + count], first, &sums, peer).await?,
                }
                next += count;
            }
            tag::NCCL_GO => {
                data_started.get_or_insert_with(Instant::now);
                let mut body = vec![0u8; len];
                wire::read_exact_idle(rd, &mut body, io, peer, "reading NCCL_GO").await?;
                let src = wire::parse_u32s(&body);
                if src.len() != n {
                    return Err(protocol(
                        peer,
                        format!("NCCL_GO names {} source blocks, {n} expected", src.len()),
                    ));
                }
                if let (Some((links, comm)), Some(p)) = (&nccl, pin.as_ref()) {
                    nccl_receive(links, comm, &src, &blocks, &p.guard, ctx.opts.shm_close_grace, peer)
                        .await?;
                }
                next = n;
            }
            tag::DONE => {
                data_started.get_or_insert_with(Instant::now);
                let mut body = vec![0u8; len];
                wire::read_exact_idle(rd, &mut body, io, peer, "reading DONE").await?;
                wire::parse_done(&body, n).map_err(|m| protocol(peer, m))?;
                if hello.transport == TransportKind::CudaIpc {
                    // The sender copied every block and waited for the copies before DONE.
                    next = n;
                }
                if next != n {
                    return Err(protocol(peer, format!("DONE after {next} of {n} blocks")));
                }
                if let Some(v) = verifier.take() {
                    v.finish().await?;
                }
                let bytes = (n * payload) as u64;
                let secs = data_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
                if let Some(p) = pin.take() {
                    p.guard.complete();
                }
                ctx.counters.success(hello.transport, bytes, secs);
                tracing::debug!(peer, reservation = res, blocks = n, bytes, transport = %hello.transport, "KV transfer received");
                if let Err(e) = wire::write_all_idle(
                    wr,
                    &wire::frame(tag::ACK, &bytes.to_le_bytes()),
                    io,
                    peer,
                    "sending ACK",
                )
                .await
                {
                    // The reservation is filled; a sender that cannot hear it fails its request
                    // and the router releases the reservation.
                    tracing::warn!(peer, reservation = res, error = %e, "cannot acknowledge a completed KV transfer");
                }
                let _ = wr.shutdown().await;
                return Ok(());
            }
            other => return Err(protocol(peer, format!("unexpected {} frame", wire::tag_name(other)))),
        }
    }
}

/// tcp: reads the payloads of one BLOCKS group (blocks `first..` of the transfer, going into
/// `dest`) and checks each block against `sums` as soon as it is in. Where the sink lends its
/// memory the payload is read straight into the pool; otherwise through a buffer.
async fn receive_group(
    ctx: &Ctx,
    rd: &mut BufReader<KvRead>,
    dest: &[BlockId],
    first: usize,
    sums: &[u32],
    peer: &str,
) -> Result<(), TransportError> {
    let io = ctx.opts.io_timeout;
    let layout = ctx.sink.layout();
    let bb = layout.block_bytes();
    let mut staging: Vec<u8> = Vec::new();
    for (k, (&dst, &want)) in dest.iter().zip(sums).enumerate() {
        let i = first + k;
        let what = format!("reading block {i}");
        // SAFETY: `dst` belongs to the reservation this connection pinned: no sequence holds it
        // and no other transfer writes it until this connection completes or aborts it; the
        // slices are dropped at the end of this iteration.
        let got = match unsafe { ctx.sink.block_slices_mut(dst) }? {
            Some(mut slices) => {
                wire::read_into_slices(rd, &mut slices, io, peer, &what).await?;
                let mut h = crc32fast::Hasher::new();
                for s in &slices {
                    h.update(s);
                }
                h.finalize()
            }
            None => {
                staging.resize(block_payload_bytes(&layout), 0);
                wire::read_exact_idle(rd, &mut staging, io, peer, &what).await?;
                for (layer, kv) in staging.chunks_exact(2 * bb).enumerate() {
                    let (k, v) = kv.split_at(bb);
                    // SAFETY: as above.
                    unsafe { ctx.sink.write_block(layer, dst, k, v) }?;
                }
                wire::checksum(&staging)
            }
        };
        if got != want {
            return Err(TransportError::Checksum { peer: peer.into(), msg: mismatch(i, dst, got, want) });
        }
    }
    Ok(())
}

/// nccl: the communicator a HELLO names: joined now (as rank 1) when the HELLO brings a unique
/// id, else one made by an earlier transfer.
async fn nccl_link(
    links: &Arc<RecvLinks>,
    hello: &Hello,
    peer: &str,
) -> Result<Arc<NcclPeer>, TransportError> {
    let h = wire::NcclHello::decode(&hello.ext).map_err(|m| protocol(peer, m))?;
    let gpu = |e: crate::nccl::NcclError| TransportError::Gpu { peer: peer.into(), msg: e.to_string() };
    match h.unique_id {
        Some(id) => {
            let links = links.clone();
            tokio::task::spawn_blocking(move || links.join(h.comm_key, UniqueId(id)))
                .await
                .map_err(|e| TransportError::Invalid(format!("NCCL join task failed: {e}")))?
                .map_err(gpu)
        }
        None => links.get(h.comm_key).ok_or_else(|| TransportError::Refused {
            peer: peer.into(),
            msg: format!("{UNKNOWN_COMM} {:#018x} (this decode worker restarted, or it failed)", h.comm_key),
        }),
    }
}

/// nccl: receives the transfer of P's blocks `src` into the reserved `dst` and waits for it. On
/// a failure the communicator is aborted; if its thread is still inside NCCL after `grace`, a
/// task keeps the reservation pinned until it is out, so no late write lands in a block the
/// engine reuses (the blocks stay claimed meanwhile, and a warning says so).
async fn nccl_receive(
    links: &Arc<RecvLinks>,
    comm: &Arc<NcclPeer>,
    src: &[BlockId],
    dst: &[BlockId],
    pinned: &Arc<Pinned>,
    grace: Duration,
    peer: &str,
) -> Result<(), TransportError> {
    let gpu = |e: crate::nccl::NcclError| TransportError::Gpu { peer: peer.into(), msg: e.to_string() };
    let pieces = links.pieces(src, dst).map_err(gpu)?;
    let deadline = crate::sender::nccl_deadline(pieces.iter().map(|p| p.1).sum());
    let c = comm.clone();
    // SAFETY: the pieces are blocks of the reservation this connection pinned: no sequence holds
    // them and no other transfer writes them until this connection completes or aborts it, which
    // happens only after this call, and after a failure only once NCCL is done with them.
    let r = tokio::task::spawn_blocking(move || unsafe { c.recv(pieces, deadline) })
        .await
        .map_err(|e| TransportError::Invalid(format!("NCCL receive task failed: {e}")))?;
    if let Err(e) = r {
        let until = Instant::now() + grace;
        while comm.is_busy() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if comm.is_busy() {
            tracing::warn!(
                peer,
                reservation = pinned.reservation,
                "NCCL receive still in flight after an error; its reservation stays claimed until NCCL returns"
            );
            let (comm, hold) = (comm.clone(), pinned.clone());
            tokio::spawn(async move {
                while comm.is_busy() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                drop(hold);
            });
        }
        return Err(gpu(e));
    }
    Ok(())
}
