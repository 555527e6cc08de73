//! P's side of the session: open a transfer to D (connect, TLS, preamble and HELLO, wait until D
//! pinned the reservation), keep it alive while the prompt is computed, let the kind stage the
//! blocks on the engine thread, then send DONE and wait for D's acknowledgement.
//!
//! What differs by kind (checking the destination, the HELLO's extra fields, copying the blocks)
//! is the kind's [`Outbound`]; everything else is here, once. Staging is a pipeline: the kind
//! hands each finished group to the session's writer task at once (tcp: a BLOCKS frame; shm: a
//! SUMS frame), so the network (tcp) or D's verification (shm) of one group overlaps the copy of
//! the next. The engine thread never waits for the network: it only copies and hands over. The
//! writer sends keep-alives while nothing else is written and notes at once when D gives up, so
//! a kind that writes D's memory stops before its next layer.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::conn::{self, KvRead, KvWrite};
use crate::kind::{AnySource, Link, Outbound, Outgoing, SendKind, SenderEnv};
use crate::options::SenderOptions;
use crate::registry::registration;
use crate::types::{Counters, KvDestination, TransferCounters, TransportOffer};
use crate::wire::{self, tag, Hello};
use crate::{block_payload_bytes, host_id, KvBlockSource, TransportError, TransportKind};
use tandem_engine::backend::Backend;
use tandem_engine::kv::{BlockId, KvLayout};

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

/// P: opens sessions over every kind this worker can send with. One per prefill node; each
/// kind's half keeps what it caches between transfers (shm mappings, cuda-ipc mappings, NCCL
/// communicators, staging buffers).
pub struct KvSender {
    layout: KvLayout,
    opts: SenderOptions,
    host_id: String,
    counters: Arc<Counters>,
    /// Each kind's sending half, in [`TransportKind::ALL`] order.
    halves: Vec<(TransportKind, Box<dyn SendKind>)>,
}

impl KvSender {
    /// A sender for blocks of `layout` (the prefill backend's; its `num_blocks` is irrelevant).
    pub fn new(layout: KvLayout, opts: SenderOptions) -> KvSender {
        let env = SenderEnv { layout, opts: &opts };
        let halves = TransportKind::ALL.into_iter().map(|k| (k, (registration(k).sender)(&env))).collect();
        KvSender { layout, host_id: host_id(), counters: Arc::default(), halves, opts }
    }

    fn half(&self, kind: TransportKind) -> &dyn SendKind {
        let found = self.halves.iter().find(|(k, _)| *k == kind);
        // Every kind of `TransportKind::ALL` has its half (built in `new`).
        found.map(|(_, h)| h.as_ref()).unwrap_or_else(|| unreachable!("no sending half for {kind}"))
    }

    /// The kinds this sender can send with, fastest first.
    pub fn kinds(&self) -> Vec<TransportKind> {
        self.halves.iter().filter(|(_, h)| h.unavailable().is_none()).map(|(k, _)| *k).collect()
    }

    /// Why `kind` is not among [`KvSender::kinds`].
    pub fn why_not(&self, kind: TransportKind) -> String {
        self.half(kind).unavailable().unwrap_or_else(|| format!("{kind} is available"))
    }

    /// The kinds this sender can send with (address and segment empty), with this host's id
    /// and, for the GPU kinds, its GPU's UUID (and, for cuda-ipc, the GPUs it can write).
    pub fn offers(&self) -> Vec<TransportOffer> {
        self.halves
            .iter()
            .filter(|(_, h)| h.unavailable().is_none())
            .map(|(kind, h)| {
                let mut o =
                    TransportOffer { kind: *kind, host_id: self.host_id.clone(), ..Default::default() };
                h.offer(&mut o);
                o
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
        self.open_for_adapter(dest, "").await
    }

    /// [`KvSender::open`] for blocks computed under the LoRA adapter `adapter_id` (empty: the
    /// base model): the HELLO carries it, and D refuses the transfer when its reservation was
    /// made for another adapter.
    pub async fn open_for_adapter(
        &self,
        dest: &KvDestination,
        adapter_id: &str,
    ) -> Result<TransferSession, TransportError> {
        let mut r = self.open_once(dest, adapter_id).await;
        if let Err(e) = &r {
            if self.half(dest.transport).retry_after(e, &dest.address) {
                r = self.open_once(dest, adapter_id).await;
            }
        }
        if r.is_err() {
            self.counters.failure(Some(dest.transport), false);
        }
        r
    }

    async fn open_once(
        &self,
        dest: &KvDestination,
        adapter_id: &str,
    ) -> Result<TransferSession, TransportError> {
        let kind = dest.transport;
        let peer = dest.address.clone();
        let invalid = |m: String| TransportError::Invalid(format!("destination {peer}: {m}"));
        if peer.is_empty() {
            return Err(invalid("no KV address".into()));
        }
        let n = dest.block_ids.len();
        if n == 0 || n > wire::MAX_TRANSFER_BLOCKS {
            return Err(invalid(format!("{n} destination blocks")));
        }
        if adapter_id.len() > wire::MAX_ADAPTER_ID_BYTES {
            return Err(invalid(format!(
                "LoRA adapter id of {} bytes (at most {})",
                adapter_id.len(),
                wire::MAX_ADAPTER_ID_BYTES
            )));
        }
        let mut out = self.half(kind).prepare(dest)?;
        let hello = Hello {
            transport: kind,
            reservation: dest.reservation_id,
            num_blocks: n as u32,
            block_payload_bytes: block_payload_bytes(&self.layout) as u64,
            num_layers: self.layout.num_layers as u32,
            block_size: self.layout.block_size as u32,
            num_kv_heads: self.layout.num_kv_heads as u32,
            head_dim: self.layout.head_dim as u32,
            layout: self.layout.name().into(),
            segment_path: out.segment_path(),
            token: self.opts.token,
            ext: out.hello_ext(),
            adapter_id: adapter_id.to_owned(),
        };
        let (mut rd, mut wr) = self.connect(&peer, out.as_ref()).await?;
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
            out.refused(&msg);
            return Err(TransportError::Refused { peer, msg });
        }
        out.accepted(&peer).await?;
        let stop = Arc::new(Mutex::new(None));
        let (tx, out_rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(writer(rd, wr, out_rx, stop.clone(), self.opts.clone(), peer.clone()));
        let link = Link::new(
            peer,
            dest.reservation_id,
            dest.block_ids.clone(),
            self.layout,
            self.opts.group_bytes,
            tx,
            stop,
        );
        Ok(TransferSession {
            kind,
            link,
            out,
            staged: false,
            stage_seconds: 0.0,
            task: Some(task),
            opts: self.opts.clone(),
            counters: self.counters.clone(),
        })
    }

    /// The connection to D's KV listener, TLS when configured. A listener that refuses the
    /// connection tells the kind its peer is gone.
    async fn connect(&self, peer: &str, out: &dyn Outbound) -> Result<(KvRead, KvWrite), TransportError> {
        let timeout = self.opts.connect_timeout;
        let stream = match tokio::time::timeout(timeout, TcpStream::connect(peer)).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    peer: peer.into(),
                    what: "connecting".into(),
                    after: timeout,
                })
            }
            Ok(Err(e)) => {
                out.unreachable();
                return Err(TransportError::Connect { peer: peer.into(), source: e });
            }
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        let Some(tls) = &self.opts.tls else {
            return Ok(conn::split_plain(stream));
        };
        let name = server_name(peer).map_err(|msg| TransportError::Tls { peer: peer.into(), msg })?;
        let connector = tokio_rustls::TlsConnector::from(tls.client_config());
        match tokio::time::timeout(timeout, connector.connect(name, stream)).await {
            Err(_) => Err(TransportError::Timeout {
                peer: peer.into(),
                what: "the TLS handshake".into(),
                after: timeout,
            }),
            Ok(Err(e)) => Err(TransportError::Tls { peer: peer.into(), msg: e.to_string() }),
            Ok(Ok(s)) => Ok(conn::split_tls(tokio_rustls::TlsStream::Client(s))),
        }
    }
}

type Halves = (KvRead, KvWrite, Vec<u8>);

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
                let (frame, pool) = match m {
                    Outgoing::Pooled(frame, pool) => (frame, Some(pool)),
                    Outgoing::Frame(frame) => (frame, None),
                };
                if writing {
                    if let Err(e) =
                        wire::write_all_idle(&mut wr, &frame, opts.io_timeout, &peer, "sending blocks").await
                    {
                        set(e.to_string());
                        writing = false;
                    }
                    wrote = true;
                }
                if frame.first() == Some(&tag::DONE) {
                    break;
                }
                if let Some(pool) = pool {
                    pool.put(frame);
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

/// One transfer. `Send`: moved to the engine thread for [`TransferSession::stage`], back to the
/// async side for [`TransferSession::finish`]. Dropping it without finishing closes the
/// connection, and D releases the reservation.
pub struct TransferSession {
    kind: TransportKind,
    link: Link,
    /// The kind's side of this transfer.
    out: Box<dyn Outbound>,
    staged: bool,
    stage_seconds: f64,
    task: Option<tokio::task::JoinHandle<Halves>>,
    opts: SenderOptions,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for TransferSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferSession")
            .field("transport", &self.kind)
            .field("peer", &self.link.peer)
            .field("reservation", &self.link.reservation)
            .field("blocks", &self.link.dest_blocks.len())
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
        self.link.reservation
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
        let bad = |m: String| TransportError::Invalid(format!("reservation {}: {m}", self.link.reservation));
        if self.staged {
            return Err(bad("blocks already staged".into()));
        }
        if src_blocks.len() != self.link.dest_blocks.len() {
            return Err(bad(format!(
                "{} source blocks for {} destination blocks",
                src_blocks.len(),
                self.link.dest_blocks.len()
            )));
        }
        let (a, b) = (src.source_layout(), self.link.layout);
        if (a.num_layers, a.block_size, a.num_kv_heads, a.head_dim)
            != (b.num_layers, b.block_size, b.num_kv_heads, b.head_dim)
        {
            return Err(bad(format!("source layout {a:?} differs from the sender's {b:?}")));
        }
        self.link.check_stopped()?;
        self.out.stage(&AnySource(src), src_blocks, &self.link)?;
        self.staged = true;
        self.stage_seconds = t0.elapsed().as_secs_f64();
        Ok(())
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
        let peer = self.link.peer.clone();
        if !self.staged {
            return Err(TransportError::Invalid(format!(
                "reservation {}: finish before the blocks were staged",
                self.link.reservation
            )));
        }
        self.link
            .send(Outgoing::Frame(wire::frame(tag::DONE, &wire::done_body(self.link.dest_blocks.len()))))?;
        // The writer task writes everything queued, DONE last, then hands the connection back.
        self.link.close();
        let Some(task) = self.task.take() else {
            return Err(TransportError::Invalid("session already finished".into()));
        };
        let (rd, _wr, early) =
            task.await.map_err(|e| TransportError::Invalid(format!("writer task failed: {e}")))?;
        let io = self.opts.io_timeout;
        let mut rd = AsyncReadExt::chain(&early[..], rd);
        if let Err(e) = self.link.check_stopped() {
            // A write that failed because D closed after an ERROR: D's words say more.
            if !matches!(&e, TransportError::Refused { msg, .. } if msg.contains("refused by the peer")) {
                if let Some(m) = read_error_frame(&mut rd, io.min(Duration::from_millis(500)), &peer).await {
                    return Err(TransportError::Refused { peer, msg: m });
                }
            }
            return Err(e);
        }
        let what = format!("waiting for the acknowledgement of reservation {}", self.link.reservation);
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
        let bytes = (self.link.dest_blocks.len() * self.link.payload) as u64;
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
            reservation: self.link.reservation,
            blocks: self.link.dest_blocks.len(),
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
