//! What a transport kind plugs into the session layer: the trait pair every kind implements, once
//! for each side, and the handles the session lends it.
//!
//! - P's side: a [`SendKind`] per kind lives in each [`KvSender`](crate::KvSender) (built once,
//!   it may cache mappings or communicators). For each transfer it checks the destination and
//!   prepares an [`Outbound`], which adds its part to the HELLO, reacts to the peer's answer,
//!   and copies the blocks on the engine thread through the session's [`Link`].
//! - D's side: a [`ReceiveKind`] per kind lives in each [`KvReceiver`](crate::KvReceiver) (built
//!   at bind, it may export the pool). It says what it offers, checks its part of a HELLO before
//!   the reservation is pinned, and for each accepted transfer starts an [`Inbound`] that takes
//!   the kind's data frames and, at DONE, verifies what arrived.
//!
//! The session layer (handshake, token, reservation pinning, keep-alives, deadlines, DONE/ACK,
//! refusals, counters) calls these and nothing else of a kind; a kind never sees the gate, the
//! counters or the connection's write half. Invariants a kind keeps: [`Outbound::stage`] writes
//! into D's memory only while [`Link::check_stopped`] says D has not given up; an [`Inbound`]
//! reads or writes only the reservation's blocks it was given, and whatever keeps using them
//! after it returns (a verifier thread, a late NCCL receive) holds the [`Pinned`] guard.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::BufReader;

use crate::conn::KvRead;
use crate::options::{ReceiverOptions, SenderOptions};
use crate::types::{KvDestination, TransportOffer};
use crate::wire::{self, Hello};
use crate::{KvBlockSink, KvBlockSource, ReservationGate, TransportError, TransportKind};
use tandem_engine::kv::{BlockId, KvLayout};

/// A boxed future, so the kinds' asynchronous steps can sit behind trait objects.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One kind's entry in the registry: its name and codes, and how its two halves are built.
pub(crate) struct Registration {
    /// The kind's name in offers, destinations and flags.
    pub name: &'static str,
    /// Its code in a HELLO frame (never reused: it is part of the wire format).
    pub wire_code: u8,
    /// Both pools must be on GPUs.
    pub needs_gpu: bool,
    /// The sender writes D's blocks itself, outside the connection: D must not reuse them
    /// before the sender closed.
    pub writes_directly: bool,
    /// Its HELLO carries [`Hello::ext`] (the kind's own fields).
    pub hello_ext: bool,
    /// P's half, one per [`KvSender`](crate::KvSender).
    pub sender: fn(&SenderEnv<'_>) -> Box<dyn SendKind>,
    /// D's half, one per [`KvReceiver`](crate::KvReceiver).
    pub receiver: fn(&ReceiverEnv<'_>) -> Box<dyn ReceiveKind>,
}

/// What P's half of a kind is built from.
pub(crate) struct SenderEnv<'a> {
    /// The prefill pool's layout.
    pub layout: KvLayout,
    pub opts: &'a SenderOptions,
}

/// What D's half of a kind is built from.
pub(crate) struct ReceiverEnv<'a> {
    /// The pool the blocks go into.
    pub sink: &'a Arc<dyn KvBlockSink>,
    pub opts: &'a ReceiverOptions,
}

/// P's half of a kind.
pub(crate) trait SendKind: Send + Sync {
    /// Why this worker cannot send with the kind; `None` when it can.
    fn unavailable(&self) -> Option<String>;
    /// Adds the kind's fields to this worker's offer of it.
    fn offer(&self, _offer: &mut TransportOffer) {}
    /// Checks `dest` against what this worker has (errors name the destination, see
    /// [`bad_destination`]) and prepares the transfer.
    fn prepare(&self, dest: &KvDestination) -> Result<Box<dyn Outbound>, TransportError>;
    /// Whether a failed open is worth one more try (the peer lost state this side cached).
    fn retry_after(&self, _error: &TransportError, _peer: &str) -> bool {
        false
    }
}

/// P's half of one transfer, between [`SendKind::prepare`] and the end of the session.
pub(crate) trait Outbound: Send + Sync {
    /// shm: the segment the sender mapped, named in the HELLO; empty for the others.
    fn segment_path(&self) -> String {
        String::new()
    }
    /// What the HELLO carries for the kind (kinds with `hello_ext` only; see [`Hello::ext`]).
    fn hello_ext(&self) -> Vec<u8> {
        Vec::new()
    }
    /// D's listener refused the connection: drop what was cached for a peer that is gone.
    fn unreachable(&self) {}
    /// D refused the HELLO with `msg`.
    fn refused(&self, _msg: &str) {}
    /// D accepted the HELLO (and pinned the reservation): finish setting up.
    fn accepted<'a>(&'a mut self, _peer: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }
    /// Engine thread: copies every layer of `src_blocks` (as many as the destination's blocks)
    /// to D, handing frames to the session through `link` as they are ready.
    fn stage(
        &mut self,
        src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError>;
}

/// D's half of a kind.
pub(crate) trait ReceiveKind: Send + Sync {
    /// Why this worker does not offer the kind; `None` when it does.
    fn unavailable(&self) -> Option<String>;
    /// Adds the kind's fields to this worker's offer of it.
    fn offer(&self, _offer: &mut TransportOffer) {}
    /// The kind's part of a HELLO, checked before the reservation is pinned; the error is sent
    /// back to the sender.
    fn check_hello(&self, hello: &Hello) -> Result<(), String>;
    /// The receiver is going away: undo what building the half did outside it (an export).
    fn close(&self) {}
    /// The reservation is pinned and OK was sent: set up the transfer's receiving side.
    fn start<'a>(
        &'a self,
        hello: &'a Hello,
        transfer: Transfer,
    ) -> BoxFuture<'a, Result<Box<dyn Inbound>, TransportError>>;
}

/// What the session hands an [`Inbound`]: one accepted transfer on D.
pub(crate) struct Transfer {
    pub peer: String,
    /// The reservation's blocks, in transfer order.
    pub blocks: Vec<BlockId>,
    pub sink: Arc<dyn KvBlockSink>,
    /// The reservation's pin; whatever may still touch its blocks after the session gave up
    /// holds a clone.
    pub pin: Arc<Pinned>,
    /// Longest wait for the next bytes.
    pub io: Duration,
    /// How long a peer that writes D's memory is given to stop after an error.
    pub grace: Duration,
}

/// D's half of one transfer.
pub(crate) trait Inbound: Send + Sync {
    /// Most body bytes of a data frame `tag` the kind takes after `next` blocks, or `None` if
    /// it takes no such frame now (the session refuses it).
    fn frame_limit(&self, tag: u8, next: usize) -> Option<usize>;
    /// Reads the body (`len` bytes) of a data frame `tag` that [`Inbound::frame_limit`]
    /// allowed, and takes its blocks; returns how many blocks of the transfer are in so far.
    fn on_frame<'a>(
        &'a mut self,
        tag: u8,
        len: usize,
        next: usize,
        rd: &'a mut BufReader<KvRead>,
    ) -> BoxFuture<'a, Result<usize, TransportError>>;
    /// At DONE: how many blocks arrived, given `next` counted from the frames (cuda-ipc,
    /// whose sender copies without data frames, says all `n`).
    fn arrived(&self, next: usize, _n: usize) -> usize {
        next
    }
    /// At DONE, once every block arrived: waits until they are verified.
    fn verify(&mut self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The session's side of a transfer on P, as a kind's [`Outbound::stage`] sees it: where the
/// blocks go, and the way to the writer task.
pub(crate) struct Link {
    pub peer: String,
    pub reservation: u64,
    /// D's blocks, in transfer order.
    pub dest_blocks: Vec<BlockId>,
    pub layout: KvLayout,
    /// Bytes of one block payload.
    pub payload: usize,
    /// Blocks per BLOCKS / SUMS frame.
    pub group_blocks: usize,
    /// Frames for the writer task; `None` once the session finished.
    out: Option<tokio::sync::mpsc::UnboundedSender<Outgoing>>,
    /// Set by the writer task when D gave up or the connection broke.
    stopped: Arc<Mutex<Option<String>>>,
}

impl Link {
    pub(crate) fn new(
        peer: String,
        reservation: u64,
        dest_blocks: Vec<BlockId>,
        layout: KvLayout,
        group_bytes: usize,
        out: tokio::sync::mpsc::UnboundedSender<Outgoing>,
        stopped: Arc<Mutex<Option<String>>>,
    ) -> Link {
        let payload = crate::block_payload_bytes(&layout);
        let group_blocks = (group_bytes / payload).clamp(1, wire::max_group_blocks(payload));
        Link { peer, reservation, dest_blocks, layout, payload, group_blocks, out: Some(out), stopped }
    }

    /// Hands a frame to the writer task.
    pub(crate) fn send(&self, frame: Outgoing) -> Result<(), TransportError> {
        let Some(out) = &self.out else {
            return Err(TransportError::Invalid("session already finished".into()));
        };
        out.send(frame).map_err(|_| TransportError::Invalid("the session's writer task is gone".into()))
    }

    /// No more frames: the writer task ends after what is queued.
    pub(crate) fn close(&mut self) {
        self.out = None;
    }

    /// Err when D gave up or the connection broke: nothing more may be written, into D's memory
    /// least of all.
    pub(crate) fn check_stopped(&self) -> Result<(), TransportError> {
        match self.stopped.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(m) => Err(TransportError::Refused { peer: self.peer.clone(), msg: m }),
            None => Ok(()),
        }
    }
}

/// A whole frame for the writer task.
pub(crate) enum Outgoing {
    /// A frame in a staging buffer, given back to its pool once written.
    Pooled(Vec<u8>, Arc<BufferPool>),
    /// Any other frame (SUMS, NCCL_GO, DONE).
    Frame(Vec<u8>),
}

/// Staging buffers of finished transfers, kept (up to a byte budget) for the next ones (a fresh
/// buffer costs a page fault per page on first use).
#[derive(Debug)]
pub(crate) struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    budget: usize,
}

impl BufferPool {
    pub(crate) fn new(budget: usize) -> BufferPool {
        BufferPool { free: Mutex::new(Vec::new()), budget }
    }

    /// A buffer of exactly `len` bytes (contents unspecified).
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter().position(|b| b.capacity() >= len).map(|i| free.swap_remove(i))
        };
        let mut b = reused.unwrap_or_default();
        b.resize(len, 0);
        b
    }

    /// Keeps `b` for later if the budget allows.
    pub(crate) fn put(&self, b: Vec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + b.capacity() <= self.budget {
            free.push(b);
        }
    }
}

/// Holds a pinned reservation; aborts it when the last holder drops it without `complete`
/// (error, peer gone, task aborted at shutdown, panic), so abort happens exactly once. Shared
/// with whatever still reads or writes the reservation's blocks (shm's verifier thread, a late
/// NCCL receive).
pub(crate) struct Pinned {
    gate: Arc<dyn ReservationGate>,
    pub(crate) reservation: u64,
    why: Mutex<String>,
    done: AtomicBool,
}

impl Pinned {
    /// Pins `reservation` (after a successful [`ReservationGate::begin`]); `why` is the abort
    /// message should nothing better be set.
    pub(crate) fn new(gate: Arc<dyn ReservationGate>, reservation: u64, why: &str) -> Pinned {
        Pinned { gate, reservation, why: Mutex::new(why.into()), done: AtomicBool::new(false) }
    }

    pub(crate) fn complete(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.gate.complete(self.reservation);
        }
    }

    pub(crate) fn set_why(&self, why: String) {
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

/// Any block source as a trait object (the session takes `?Sized` sources such as
/// `dyn Backend`, which do not coerce to `dyn KvBlockSource` themselves).
pub(crate) struct AnySource<'a, S: ?Sized>(pub &'a S);

impl<S: KvBlockSource + ?Sized> KvBlockSource for AnySource<'_, S> {
    fn source_layout(&self) -> KvLayout {
        self.0.source_layout()
    }

    fn read_block_into(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), tandem_engine::kv::KvError> {
        self.0.read_block_into(layer, block, k, v)
    }

    fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32, tandem_engine::kv::KvError> {
        self.0.read_block_summed(layer, block, k, v, state)
    }

    fn host_region(&self) -> Option<(usize, usize)> {
        self.0.host_region()
    }
}

/// A destination this worker cannot send to, named.
pub(crate) fn bad_destination(dest: &KvDestination, msg: impl std::fmt::Display) -> TransportError {
    TransportError::Invalid(format!("destination {}: {msg}", dest.address))
}

/// The first destination block outside a pool of `pool_blocks` blocks, named.
pub(crate) fn check_block_range(dest: &KvDestination, pool_blocks: usize) -> Result<(), TransportError> {
    match dest.block_ids.iter().find(|&&b| b as usize >= pool_blocks) {
        Some(b) => Err(bad_destination(
            dest,
            format!("block id {b} outside the destination pool of {pool_blocks} blocks"),
        )),
        None => Ok(()),
    }
}

/// The peer broke the protocol.
pub(crate) fn protocol(peer: &str, msg: impl Into<String>) -> TransportError {
    TransportError::Protocol { peer: peer.into(), msg: msg.into() }
}

/// A GPU call failed.
pub(crate) fn gpu_error(peer: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Gpu { peer: peer.into(), msg: e.to_string() }
}

/// Why a GPU kind is impossible with a host pool.
pub(crate) fn host_pool(kind: TransportKind) -> String {
    format!("{kind} moves KV between GPUs, and this worker's KV pool is in host memory (--device cpu)")
}

/// A block whose bytes do not match the sender's checksum, named.
pub(crate) fn mismatch(index: usize, block: BlockId, got: u32, want: u32) -> String {
    format!(
        "block {index} (destination block {block}) has checksum {got:#010x}, the sender's is {want:#010x}"
    )
}

/// Reads the head and checksums of a group frame (BLOCKS or SUMS, `len` bytes, at most `max`
/// blocks of `per_block` bytes each in the frame) that must start at block `next` of `n`;
/// returns the group's first block and its checksums. The rest of the frame (tcp's payloads)
/// is the caller's to read.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn read_group_sums(
    rd: &mut BufReader<KvRead>,
    tag: u8,
    len: usize,
    next: usize,
    n: usize,
    max: usize,
    per_block: usize,
    io: Duration,
    peer: &str,
) -> Result<(usize, Vec<u32>), TransportError> {
    let name = wire::tag_name(tag);
    if len < wire::GROUP_HEAD_BYTES {
        return Err(protocol(peer, format!("{name} frame of {len} bytes is too short")));
    }
    let mut head = [0u8; wire::GROUP_HEAD_BYTES];
    wire::read_exact_idle(rd, &mut head, io, peer, "reading a group header").await?;
    let (first, count) = wire::parse_group_head(&head, next, n, max).map_err(|m| protocol(peer, m))?;
    let expected = wire::GROUP_HEAD_BYTES + count * per_block;
    if len != expected {
        return Err(protocol(
            peer,
            format!("{name} frame of {len} bytes for {count} blocks, expected {expected}"),
        ));
    }
    let mut sums = vec![0u8; 4 * count];
    wire::read_exact_idle(rd, &mut sums, io, peer, "reading a group's checksums").await?;
    Ok((first, wire::parse_u32s(&sums)))
}

/// Copies a group of blocks of every layer from `src` into the slices `dst(layer, i)` gives for
/// `blocks[i]`, and returns the CRC-32 of each block payload. The copy goes layer by layer
/// across the group (consecutive block ids make long runs in both pools, which the hardware
/// prefetches well), and each piece is checksummed as it is copied
/// ([`KvBlockSource::read_block_summed`]: from host memory, in the same pass that copies it), so
/// checksumming costs no second pass over memory. `before(layer)` runs before
/// each layer's pieces are written and may stop the copy.
pub(crate) fn copy_group_checksummed<'a>(
    src: &dyn KvBlockSource,
    blocks: &[BlockId],
    layers: usize,
    mut before: impl FnMut(usize) -> Result<(), TransportError>,
    mut dst: impl FnMut(usize, usize) -> Result<(&'a mut [u8], &'a mut [u8]), TransportError>,
) -> Result<Vec<u32>, TransportError> {
    let mut sums = vec![0u32; blocks.len()];
    for layer in 0..layers {
        before(layer)?;
        for (i, (&block, sum)) in blocks.iter().zip(&mut sums).enumerate() {
            let (k, v) = dst(layer, i)?;
            *sum = src.read_block_summed(layer, block, k, v, *sum)?;
        }
    }
    Ok(sums)
}

/// D's check of blocks a sender wrote into the pool itself (shm, nixl): each SUMS frame's group
/// is checked on a thread of its own while the sender writes later groups. Dropping it stops the thread before its next block.
pub(crate) struct Verifier {
    jobs: Option<std::sync::mpsc::Sender<(usize, Vec<u32>)>>,
    cancel: Arc<AtomicBool>,
    /// The first mismatch (or pool error) found so far.
    failed: Arc<Mutex<Option<TransportError>>>,
    thread: Option<tokio::task::JoinHandle<()>>,
}

impl Verifier {
    pub(crate) fn start(
        sink: Arc<dyn KvBlockSink>,
        blocks: Vec<BlockId>,
        pin: Arc<Pinned>,
        peer: String,
    ) -> Verifier {
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

    pub(crate) fn submit(&self, first: usize, sums: Vec<u32>) -> Result<(), TransportError> {
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
    pub(crate) async fn finish(mut self) -> Result<(), TransportError> {
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

/// D's half of a transfer whose sender writes the blocks itself (shm, nixl): it takes SUMS
/// frames, has each group checked by a [`Verifier`], and waits for the checks at DONE.
pub(crate) struct SumsIn {
    t: Transfer,
    verifier: Option<Verifier>,
}

impl SumsIn {
    pub(crate) fn start(t: Transfer) -> Box<dyn Inbound> {
        let verifier = Verifier::start(t.sink.clone(), t.blocks.clone(), t.pin.clone(), t.peer.clone());
        Box::new(SumsIn { t, verifier: Some(verifier) })
    }
}

impl Inbound for SumsIn {
    fn frame_limit(&self, t: u8, _next: usize) -> Option<usize> {
        (t == wire::tag::SUMS).then_some(wire::GROUP_HEAD_BYTES + 4 * self.t.blocks.len())
    }

    fn on_frame<'a>(
        &'a mut self,
        t: u8,
        len: usize,
        next: usize,
        rd: &'a mut BufReader<KvRead>,
    ) -> BoxFuture<'a, Result<usize, TransportError>> {
        Box::pin(async move {
            let (io, peer, n) = (self.t.io, self.t.peer.as_str(), self.t.blocks.len());
            let (first, sums) = read_group_sums(rd, t, len, next, n, n, 4, io, peer).await?;
            let count = sums.len();
            if let Some(v) = &self.verifier {
                v.submit(first, sums)?;
            }
            Ok(next + count)
        })
    }

    fn verify(&mut self) -> BoxFuture<'_, Result<(), TransportError>> {
        let v = self.verifier.take();
        Box::pin(async move {
            match v {
                Some(v) => v.finish().await,
                None => Ok(()),
            }
        })
    }
}
