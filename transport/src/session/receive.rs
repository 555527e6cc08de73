//! D's side of the session: the KV listener. It accepts one connection per transfer, reads the
//! preamble and HELLO, checks the token and the layout, pins the reservation through the
//! [`ReservationGate`], checks that the HELLO's LoRA adapter id is the reservation's, answers
//! OK, then lets the kind's [`Inbound`] take the data frames while it enforces the inactivity
//! timeout and the session deadline, and at DONE waits for the kind to
//! verify, completes the reservation and acknowledges. On any failure it tells a live peer why
//! (ERROR, refused by name) and aborts the reservation — complete or abort, exactly one of the
//! two, exactly once, whatever the peer does (the [`Pinned`] guard).
//!
//! For kinds whose sender writes D's memory itself ([`TransportKind::writes_directly`]), an
//! aborted reservation is released only once the sender closed the connection or the close
//! grace passed, so the engine never reuses a block the sender may still write.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::conn::{self, KvRead, KvWrite};
use crate::kind::{protocol, Inbound, Pinned, ReceiveKind, ReceiverEnv, Transfer};
use crate::options::ReceiverOptions;
use crate::registry::registration;
use crate::types::{Counters, TransferCounters, TransportOffer};
use crate::wire::{self, tag, Hello};
use crate::{
    block_payload_bytes, host_id, KvBlockSink, KvToken, ReservationGate, TransportError, TransportKind,
};
use tandem_engine::kv::BlockId;

/// D: the KV listener (tokio). Serves every kind the pool allows. Dropping it (or
/// [`KvReceiver::shutdown`]) stops accepting and aborts transfers in flight.
pub struct KvReceiver {
    local_addr: SocketAddr,
    advertise: String,
    host_id: String,
    ctx: Arc<Ctx>,
    stop: tokio::sync::watch::Sender<bool>,
    accept: Option<tokio::task::JoinHandle<()>>,
}

/// What every connection of a receiver shares.
struct Ctx {
    sink: Arc<dyn KvBlockSink>,
    gate: Arc<dyn ReservationGate>,
    opts: ReceiverOptions,
    counters: Counters,
    /// Each kind's receiving half, in [`TransportKind::ALL`] order.
    halves: Vec<(TransportKind, Box<dyn ReceiveKind>)>,
}

impl Ctx {
    fn half(&self, kind: TransportKind) -> Result<&dyn ReceiveKind, String> {
        let found = self.halves.iter().find(|(k, _)| *k == kind);
        found
            .map(|(_, h)| h.as_ref())
            .ok_or_else(|| format!("this worker does not know the {kind} transport"))
    }
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
        let env = ReceiverEnv { sink: &sink, opts: &opts };
        let halves = TransportKind::ALL.into_iter().map(|k| (k, (registration(k).receiver)(&env))).collect();
        let ctx = Arc::new(Ctx { sink, gate, opts, counters: Counters::default(), halves });
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(accept_loop(listener, ctx.clone(), stop_rx));
        tracing::info!(addr = %local_addr, shm = ?segment_path, "KV receiver listening");
        Ok(KvReceiver { local_addr, advertise, host_id: host_id(), ctx, stop, accept: Some(accept) })
    }

    /// Why this receiver does not offer `kind`, if it does not.
    pub fn unavailable(&self, kind: TransportKind) -> Option<String> {
        self.ctx.half(kind).map_or_else(Some, |h| h.unavailable())
    }

    /// Why this receiver offers no cuda-ipc, if it does not.
    pub fn cuda_ipc_unavailable(&self) -> Option<String> {
        self.unavailable(TransportKind::CudaIpc)
    }

    /// Why this receiver offers no nccl, if it does not.
    pub fn nccl_unavailable(&self) -> Option<String> {
        self.unavailable(TransportKind::Nccl)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What D advertises at registration, fastest first: cuda-ipc (when the pool is on a GPU and
    /// exported), nccl (when the pool is on a GPU and NCCL loads), shm (when the pool is a shared
    /// segment) and tcp. The control connection of every kind is the KV listener's address.
    pub fn offers(&self) -> Vec<TransportOffer> {
        self.ctx
            .halves
            .iter()
            .filter(|(_, h)| h.unavailable().is_none())
            .map(|(kind, h)| {
                let mut o = TransportOffer {
                    kind: *kind,
                    address: self.advertise.clone(),
                    host_id: self.host_id.clone(),
                    ..Default::default()
                };
                h.offer(&mut o);
                o
            })
            .collect()
    }

    /// Completed and failed transfers so far.
    pub fn counters(&self) -> TransferCounters {
        self.ctx.counters.snapshot(None)
    }

    /// Completed and failed transfers of one transport so far (a connection that failed before
    /// its HELLO named a transport counts only in [`KvReceiver::counters`]).
    pub fn counters_of(&self, kind: TransportKind) -> TransferCounters {
        self.ctx.counters.snapshot(Some(kind))
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
        // Now, not when the last connection lets go of the context: a receiver bound next on
        // the same pool may export it again.
        for (_, h) in &self.ctx.halves {
            h.close();
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

/// What a connection pinned, for the error path.
struct Pin {
    guard: Arc<Pinned>,
    transport: TransportKind,
}

async fn serve_conn(stream: TcpStream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let _ = stream.set_nodelay(true);
    let peer = peer.to_string();
    let Some((rd, mut wr)) = accept_tls(&ctx, stream, &peer).await else {
        ctx.counters.failure(None, false);
        return;
    };
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut pin: Option<Pin> = None;
    let mut kind: Option<TransportKind> = None;
    if let Err(e) = receive(&ctx, &mut rd, &mut wr, &mut pin, &mut kind, &peer).await {
        ctx.counters.failure(kind, matches!(e, TransportError::Checksum { .. }));
        refuse(&ctx, rd, wr, pin, e, &peer).await;
    }
}

/// The connection's halves, after the TLS handshake when the receiver speaks TLS; `None` when
/// the handshake failed (logged).
async fn accept_tls(ctx: &Ctx, stream: TcpStream, peer: &str) -> Option<(KvRead, KvWrite)> {
    let Some(tls) = &ctx.opts.tls else {
        return Some(conn::split_plain(stream));
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
    match tokio::time::timeout(ctx.opts.io_timeout, acceptor.accept(stream)).await {
        Ok(Ok(s)) => Some(conn::split_tls(tokio_rustls::TlsStream::Server(s))),
        Ok(Err(e)) => {
            tracing::warn!(peer, error = %e, "KV connection refused: TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::warn!(peer, "KV connection refused: TLS handshake timed out");
            None
        }
    }
}

/// A failed transfer: tells a live peer why (best effort), then aborts the reservation if one
/// was pinned — for a kind whose sender writes D's memory, only once the sender closed or the
/// close grace passed.
async fn refuse(
    ctx: &Ctx,
    mut rd: BufReader<KvRead>,
    mut wr: KvWrite,
    mut pin: Option<Pin>,
    e: TransportError,
    peer: &str,
) {
    let gone = matches!(e, TransportError::Io { .. });
    let reservation = pin.as_ref().map(|p| p.guard.reservation);
    tracing::warn!(peer, ?reservation, kind = e.kind(), error = %e, "KV transfer failed");
    if !gone {
        let full = e.to_string();
        let msg = truncate(&full, wire::MAX_ERROR_BYTES);
        let frame = wire::frame(tag::ERROR, msg.as_bytes());
        let _ = wire::write_all_idle(&mut wr, &frame, ctx.opts.io_timeout, peer, "sending an error").await;
    }
    let linger = ctx.opts.io_timeout.min(Duration::from_secs(1));
    match pin.take() {
        Some(p) if p.transport.writes_directly() && !gone => {
            p.guard.set_why(e.to_string());
            // The sender may still be writing into the reserved blocks (a bad checksum can be
            // found while it writes later groups): wait until it closes the connection (it
            // checks for our ERROR before every block) before the reservation is released.
            let _ = wr.shutdown().await;
            if !wait_for_close(&mut rd, ctx.opts.shm_close_grace).await {
                tracing::warn!(
                    peer,
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
                // Close gracefully so the ERROR is not lost to a reset when unread input is
                // pending.
                let _ = wr.shutdown().await;
                let _ = wait_for_close(&mut rd, linger).await;
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
    ctx.half(h.transport)?.check_hello(h)
}

/// One transfer on an accepted connection: the handshake, then the kind's frames until DONE.
/// `pin` and `kind` say, for the error path, what was pinned and which transport was named.
async fn receive(
    ctx: &Ctx,
    rd: &mut BufReader<KvRead>,
    wr: &mut KvWrite,
    pin: &mut Option<Pin>,
    kind: &mut Option<TransportKind>,
    peer: &str,
) -> Result<(), TransportError> {
    let deadline = Instant::now() + ctx.opts.max_session;
    let hello = read_hello(ctx, rd, peer).await?;
    *kind = Some(hello.transport);
    // Authentication first: a peer without the secret learns nothing and touches no reservation.
    check_token(ctx.opts.token.as_ref(), hello.token.as_ref())
        .map_err(|msg| TransportError::Unauthenticated { peer: peer.into(), msg })?;
    check_hello(ctx, &hello).map_err(|m| TransportError::Refused {
        peer: peer.into(),
        msg: format!("reservation {}: {m}", hello.reservation),
    })?;
    let (guard, blocks) = pin_reservation(ctx, &hello, peer)?;
    *pin = Some(Pin { guard: guard.clone(), transport: hello.transport });
    check_adapter(ctx, &hello, peer)?;
    check_reserved_blocks(ctx, &hello, &blocks, peer)?;
    wire::write_all_idle(wr, &wire::frame(tag::OK, &[]), ctx.opts.io_timeout, peer, "sending OK").await?;
    let half = ctx.half(hello.transport).map_err(|m| protocol(peer, m))?;
    let transfer = Transfer {
        peer: peer.into(),
        blocks,
        sink: ctx.sink.clone(),
        pin: guard,
        io: ctx.opts.io_timeout,
        grace: ctx.opts.shm_close_grace,
    };
    let mut inbound = half.start(&hello, transfer).await?;
    let (bytes, secs) = receive_frames(ctx, rd, inbound.as_mut(), &hello, deadline, peer).await?;
    if let Some(p) = pin.take() {
        p.guard.complete();
    }
    ctx.counters.success(hello.transport, bytes, secs);
    let res = hello.reservation;
    tracing::debug!(peer, reservation = res, blocks = hello.num_blocks, bytes, transport = %hello.transport, "KV transfer received");
    let ack = wire::frame(tag::ACK, &bytes.to_le_bytes());
    if let Err(e) = wire::write_all_idle(wr, &ack, ctx.opts.io_timeout, peer, "sending ACK").await {
        // The reservation is filled; a sender that cannot hear it fails its request and the
        // router releases the reservation.
        tracing::warn!(peer, reservation = res, error = %e, "cannot acknowledge a completed KV transfer");
    }
    let _ = wr.shutdown().await;
    Ok(())
}

/// The preamble and the HELLO.
async fn read_hello(ctx: &Ctx, rd: &mut BufReader<KvRead>, peer: &str) -> Result<Hello, TransportError> {
    let io = ctx.opts.io_timeout;
    let mut pre = [0u8; wire::PREAMBLE_BYTES];
    wire::read_exact_idle(rd, &mut pre, io, peer, "reading the preamble").await?;
    wire::check_preamble(&pre).map_err(|m| protocol(peer, m))?;
    let (_, len) = wire::read_frame_header(rd, io, peer, "waiting for HELLO", |t| {
        (t == tag::HELLO).then_some(wire::MAX_HELLO_BYTES)
    })
    .await?;
    let mut body = vec![0u8; len];
    wire::read_exact_idle(rd, &mut body, io, peer, "reading HELLO").await?;
    Hello::decode(&body).map_err(|m| protocol(peer, m))
}

/// Pins the HELLO's reservation through the gate; from then on, dropping the guard without
/// completing aborts the reservation.
fn pin_reservation(
    ctx: &Ctx,
    hello: &Hello,
    peer: &str,
) -> Result<(Arc<Pinned>, Vec<BlockId>), TransportError> {
    let res = hello.reservation;
    let blocks = ctx
        .gate
        .begin(res)
        .map_err(|m| TransportError::Refused { peer: peer.into(), msg: format!("reservation {res}: {m}") })?;
    let guard =
        Arc::new(Pinned::new(ctx.gate.clone(), res, "transfer interrupted (KV receiver shutting down)"));
    Ok((guard, blocks))
}

/// The LoRA adapter the sender computed the blocks under against the one the (pinned)
/// reservation was made for: KV of one adapter is never decoded under another, or under the base
/// model. Checked before OK, so nothing is written into the reservation's blocks.
fn check_adapter(ctx: &Ctx, hello: &Hello, peer: &str) -> Result<(), TransportError> {
    let want = ctx.gate.adapter_id(hello.reservation);
    if want == hello.adapter_id {
        return Ok(());
    }
    let under = |id: &str| {
        if id.is_empty() {
            "the base model (no LoRA adapter)".to_owned()
        } else {
            format!("LoRA adapter id {id}")
        }
    };
    Err(TransportError::Refused {
        peer: peer.into(),
        msg: format!(
            "reservation {} was made for {}, but the transfer carries KV computed under {}",
            hello.reservation,
            under(&want),
            under(&hello.adapter_id)
        ),
    })
}

/// The pinned reservation's blocks against the HELLO and the pool.
fn check_reserved_blocks(
    ctx: &Ctx,
    hello: &Hello,
    blocks: &[BlockId],
    peer: &str,
) -> Result<(), TransportError> {
    let (res, n) = (hello.reservation, hello.num_blocks as usize);
    let pool = ctx.sink.layout().num_blocks;
    if blocks.len() != n {
        return Err(TransportError::Refused {
            peer: peer.into(),
            msg: format!("reservation {res} has {} blocks, the sender has {n}", blocks.len()),
        });
    }
    if let Some(b) = blocks.iter().find(|&&b| b as usize >= pool) {
        return Err(TransportError::Invalid(format!(
            "reservation {res}: block id {b} outside the pool of {pool} blocks"
        )));
    }
    Ok(())
}

/// The frames after OK: keep-alives, the sender's ERROR, the kind's data frames, DONE. Returns
/// the bytes received and the seconds since the first data frame, once every block arrived and
/// the kind verified them.
async fn receive_frames(
    ctx: &Ctx,
    rd: &mut BufReader<KvRead>,
    inbound: &mut dyn Inbound,
    hello: &Hello,
    deadline: Instant,
    peer: &str,
) -> Result<(u64, f64), TransportError> {
    let io = ctx.opts.io_timeout;
    let (n, res) = (hello.num_blocks as usize, hello.reservation);
    // Blocks in so far (received, or announced for verification).
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
        let what = format!("waiting for block {next} of {n} (reservation {res})");
        let (t, len) = wire::read_frame_header(rd, io.min(deadline - now), peer, &what, |t| match t {
            tag::PING => Some(0),
            tag::ERROR => Some(wire::MAX_ERROR_BYTES),
            tag::DONE => Some(4),
            t => inbound.frame_limit(t, next),
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
            tag::DONE => {
                data_started.get_or_insert_with(Instant::now);
                let mut body = vec![0u8; len];
                wire::read_exact_idle(rd, &mut body, io, peer, "reading DONE").await?;
                wire::parse_done(&body, n).map_err(|m| protocol(peer, m))?;
                let arrived = inbound.arrived(next, n);
                if arrived != n {
                    return Err(protocol(peer, format!("DONE after {arrived} of {n} blocks")));
                }
                inbound.verify().await?;
                let bytes = (n * block_payload_bytes(&ctx.sink.layout())) as u64;
                return Ok((bytes, data_started.map_or(0.0, |t| t.elapsed().as_secs_f64())));
            }
            t => {
                // A data frame of the kind (the header check let through only those).
                data_started.get_or_insert_with(Instant::now);
                next = inbound.on_frame(t, len, next, rd).await?;
            }
        }
    }
}
