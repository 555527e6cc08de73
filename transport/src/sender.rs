//! P's side: open a session to D (pinning the reservation), stage the blocks on the engine
//! thread (tcp: into a buffer of ready-made frames; shm: straight into D's mapped pool), then
//! finish on the async side and wait for D's acknowledgement.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::{KvDestination, TransferCounters, TransportOffer};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::wire::{self, tag, Hello};
use crate::{block_payload_bytes, host_id, Counters, KvBlockSource, KvToken, TransportError, TransportKind};
use tandem_engine::backend::Backend;
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
    /// Token sent in every HELLO (from the cluster secret). Default none.
    pub token: Option<KvToken>,
}

impl Default for SenderOptions {
    fn default() -> Self {
        SenderOptions {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(1),
            ack_timeout: Duration::from_secs(30),
            enable_shm: true,
            token: None,
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
    /// Copying the blocks out of the source (shm: into the destination).
    pub stage_seconds: f64,
    /// Sending (tcp) and waiting for the acknowledgement.
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
}

impl KvSender {
    /// A sender for blocks of `layout` (the prefill backend's; its `num_blocks` is irrelevant).
    pub fn new(layout: KvLayout, opts: SenderOptions) -> KvSender {
        KvSender {
            layout,
            opts,
            host_id: host_id(),
            segments: Mutex::new(HashMap::new()),
            counters: Arc::default(),
        }
    }

    /// The kinds this sender can send with (address and segment empty), with this host's id.
    pub fn offers(&self) -> Vec<TransportOffer> {
        let mut kinds = Vec::new();
        if self.opts.enable_shm {
            kinds.push(TransportKind::Shm);
        }
        kinds.push(TransportKind::Tcp);
        kinds
            .into_iter()
            .map(|k| TransportOffer {
                kind: k.as_str().into(),
                address: String::new(),
                segment_path: String::new(),
                host_id: self.host_id.clone(),
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
        let r = self.open_inner(dest).await;
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
        let segment = match kind {
            TransportKind::Tcp => None,
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
        };
        let stream = match tokio::time::timeout(self.opts.connect_timeout, TcpStream::connect(&peer)).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    peer,
                    what: "connecting".into(),
                    after: self.opts.connect_timeout,
                })
            }
            Ok(Err(e)) => return Err(TransportError::Connect { peer, source: e }),
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        let (mut rd, mut wr) = stream.into_split();
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
            return Err(TransportError::Refused { peer, msg: String::from_utf8_lossy(&m).into_owned() });
        }
        let stop = Arc::new(Mutex::new(None));
        let (ctrl, ctrl_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(keepalive(rd, wr, ctrl_rx, stop.clone(), self.opts.clone(), peer.clone()));
        Ok(TransferSession {
            kind,
            peer,
            reservation: dest.reservation_id,
            dest_blocks: dest.block_ids.clone(),
            layout: self.layout,
            payload,
            segment,
            staged: None,
            crcs: Vec::new(),
            stage_seconds: 0.0,
            stopped: stop,
            ctrl: Some(ctrl),
            task: Some(task),
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

type Halves = (OwnedReadHalf, OwnedWriteHalf, Vec<u8>);

/// Runs while the session waits for `stage`/`finish`: sends PINGs, and notes in `stop` if D
/// speaks (an ERROR: it gave up) or the connection breaks. Keeps the connection open in every
/// case until the session finishes or is dropped, so D never sees it close while the engine
/// thread may still be writing into D's memory. Returns the halves and any bytes D sent.
async fn keepalive(
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
    mut ctrl: tokio::sync::oneshot::Receiver<()>,
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
    let mut alive = true;
    loop {
        tokio::select! {
            _ = &mut ctrl => break,
            _ = tick.tick(), if alive => {
                if let Err(e) = wire::write_all_idle(&mut wr, &ping, opts.io_timeout, &peer, "sending a keep-alive").await {
                    set(e.to_string());
                    alive = false;
                }
            }
            r = rd.read(&mut buf), if alive => match r {
                Ok(0) => {
                    set(format!("KV transfer with {peer}: the decode worker closed the connection"));
                    alive = false;
                }
                Ok(n) => {
                    early.extend_from_slice(&buf[..n]);
                    if let Some(m) = parse_error_frame(&early) {
                        set(format!("KV transfer with {peer}: refused by the peer: {m}"));
                        alive = false;
                    } else if early.len() > wire::FRAME_HEADER_BYTES + wire::MAX_ERROR_BYTES {
                        set(format!("KV transfer with {peer}: unexpected data from the decode worker"));
                        alive = false;
                    }
                }
                Err(e) => {
                    set(format!("KV transfer with {peer}: connection failed: {e}"));
                    alive = false;
                }
            },
        }
    }
    (rd, wr, early)
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

enum Staged {
    /// Every BLOCK frame, ready to send.
    Tcp(Vec<u8>),
    /// The blocks are already in D's pool.
    Shm,
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
    segment: Option<Arc<KvMemory>>,
    staged: Option<Staged>,
    crcs: Vec<u32>,
    stage_seconds: f64,
    /// Set by the keep-alive task when D gave up or the connection broke.
    stopped: Arc<Mutex<Option<String>>>,
    ctrl: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Halves>>,
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
    /// destination's block ids) of every layer out of `backend`.
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
        if self.staged.is_some() {
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
        let bb = self.layout.block_bytes();
        let layers = self.layout.num_layers;
        let mut crcs = Vec::with_capacity(src_blocks.len());
        match self.kind {
            TransportKind::Tcp => {
                let frame_len = wire::FRAME_HEADER_BYTES + wire::BLOCK_META_BYTES + self.payload;
                let mut buf = vec![0u8; frame_len * src_blocks.len()];
                for (i, (&sb, f)) in src_blocks.iter().zip(buf.chunks_exact_mut(frame_len)).enumerate() {
                    let (head, payload) = f.split_at_mut(wire::FRAME_HEADER_BYTES + wire::BLOCK_META_BYTES);
                    for (layer, kv) in payload.chunks_exact_mut(2 * bb).enumerate() {
                        let (k, v) = kv.split_at_mut(bb);
                        src.read_block_into(layer, sb, k, v)?;
                    }
                    let crc = wire::checksum(payload);
                    head[..wire::FRAME_HEADER_BYTES].copy_from_slice(&wire::frame_header(
                        tag::BLOCK,
                        wire::BLOCK_META_BYTES + self.payload,
                    ));
                    head[5..9].copy_from_slice(&(i as u32).to_le_bytes());
                    head[9..13].copy_from_slice(&crc.to_le_bytes());
                    crcs.push(crc);
                }
                self.staged = Some(Staged::Tcp(buf));
            }
            TransportKind::Shm => {
                let Some(seg) = self.segment.clone() else {
                    return Err(bad("shm session without a segment".into()));
                };
                for (&sb, &db) in src_blocks.iter().zip(&self.dest_blocks) {
                    // D may have given up (timeout): then it waits for us to close before it
                    // reuses the blocks, and we must not write another one.
                    self.check_stopped()?;
                    for layer in 0..layers {
                        // SAFETY: `db` is a block of the reservation D pinned for this session
                        // (it answered OK to our HELLO, and the connection is open): D's engine
                        // does not touch it, and D frees it only after this connection closes or
                        // after it told us to stop, which we checked just above.
                        let (k, v) =
                            unsafe { seg.block_bytes_mut(layer, db) }.map_err(TransportError::from)?;
                        src.read_block_into(layer, sb, k, v)?;
                    }
                    // SAFETY: as above; only this session writes the block.
                    crcs.push(unsafe { seg.block_checksum(db) }.map_err(TransportError::from)?);
                }
                self.staged = Some(Staged::Shm);
            }
        }
        self.crcs = crcs;
        self.stage_seconds = t0.elapsed().as_secs_f64();
        Ok(())
    }

    fn check_stopped(&self) -> Result<(), TransportError> {
        match self.stopped.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(m) => Err(TransportError::Refused { peer: self.peer.clone(), msg: m }),
            None => Ok(()),
        }
    }

    /// Sends what is staged (tcp) and the checksums; waits for D's acknowledgement.
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
        let Some(staged) = self.staged.take() else {
            return Err(TransportError::Invalid(format!(
                "reservation {}: finish before the blocks were staged",
                self.reservation
            )));
        };
        if let Some(c) = self.ctrl.take() {
            let _ = c.send(());
        }
        let Some(task) = self.task.take() else {
            return Err(TransportError::Invalid("session already finished".into()));
        };
        let (rd, mut wr, early) =
            task.await.map_err(|e| TransportError::Invalid(format!("keep-alive task failed: {e}")))?;
        self.check_stopped()?;
        let io = self.opts.io_timeout;
        if let Staged::Tcp(frames) = &staged {
            wire::write_all_idle(&mut wr, frames, io, &peer, "sending blocks").await?;
        }
        let done = wire::frame(tag::DONE, &wire::done_body(&self.crcs));
        wire::write_all_idle(&mut wr, &done, io, &peer, "sending DONE").await?;
        let mut rd = AsyncReadExt::chain(&early[..], rd);
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
