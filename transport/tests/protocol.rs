//! The KV receiver against misbehaving peers: every malformed, oversized, out-of-order,
//! corrupted, truncated or silent transfer is refused with a clear error, its reservation is
//! aborted exactly once (or never pinned), and the receiver goes on serving valid transfers. A
//! receiver that asks for a KV auth token refuses handshakes without it or with another one
//! before it pins anything.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{error_message, exchange, frames, State, TestGate};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_transport::wire::{self, tag, Hello};
use tandem_transport::{
    block_payload_bytes, KvDestination, KvReceiver, KvSender, KvToken, ReceiverOptions, SenderOptions,
    TransportKind,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const LAYOUT: KvLayout = KvLayout {
    num_layers: 2,
    num_blocks: 16,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F16,
};

struct Rig {
    gate: Arc<TestGate>,
    rx: KvReceiver,
    addr: SocketAddr,
    src: CpuKvPool,
    dst: CpuKvPool,
    sender: KvSender,
    next_res: u64,
}

fn source_pool() -> CpuKvPool {
    let mut p = CpuKvPool::new(LAYOUT);
    let bb = LAYOUT.block_bytes();
    for b in 0..LAYOUT.num_blocks as BlockId {
        for l in 0..LAYOUT.num_layers {
            let k: Vec<u8> = (0..bb).map(|i| (i as u32 * 7 + b * 31 + l as u32 * 101) as u8).collect();
            let v: Vec<u8> = k.iter().map(|x| x ^ 0x5a).collect();
            p.write_block_bytes(l, b, &k, &v).unwrap();
        }
    }
    p
}

async fn rig(opts: ReceiverOptions, sender_opts: SenderOptions) -> Rig {
    let dst = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let gate = Arc::new(TestGate::default());
    let rx = KvReceiver::bind(SocketAddr::from(([127, 0, 0, 1], 0)), dst.sink(), gate.clone(), opts)
        .await
        .unwrap();
    let addr = rx.local_addr();
    Rig { gate, rx, addr, src: source_pool(), dst, sender: KvSender::new(LAYOUT, sender_opts), next_res: 100 }
}

fn quick() -> ReceiverOptions {
    ReceiverOptions { io_timeout: Duration::from_millis(400), ..Default::default() }
}

impl Rig {
    /// A fresh reservation of `n` blocks (ids spread over the pool, not in order).
    fn reserve(&mut self, n: usize) -> (u64, Vec<BlockId>) {
        self.next_res += 1;
        let r = self.next_res;
        let blocks: Vec<BlockId> = (0..n as BlockId).map(|i| (i * 5 + r as BlockId) % 16).collect();
        self.gate.add(r, blocks.clone());
        (r, blocks)
    }

    fn dest(&self, kind: TransportKind, r: u64, blocks: &[BlockId]) -> KvDestination {
        common::destination(&self.rx, kind, r, blocks, 0)
    }

    fn hello(&self, kind: TransportKind, r: u64, n: u32) -> Hello {
        Hello {
            transport: kind,
            reservation: r,
            num_blocks: n,
            block_payload_bytes: block_payload_bytes(&LAYOUT) as u64,
            num_layers: LAYOUT.num_layers as u32,
            block_size: LAYOUT.block_size as u32,
            num_kv_heads: LAYOUT.num_kv_heads as u32,
            head_dim: LAYOUT.head_dim as u32,
            layout: LAYOUT.name().into(),
            segment_path: match kind {
                TransportKind::Shm => self.dst.segment_path().unwrap().to_string_lossy().into_owned(),
                _ => String::new(),
            },
            token: None,
            ext: Vec::new(),
            adapter_id: String::new(),
        }
    }

    /// Preamble and HELLO frame.
    fn opening(&self, h: &Hello) -> Vec<u8> {
        let mut b = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
        b.extend_from_slice(&wire::frame(tag::HELLO, &h.encode()));
        b
    }

    /// The wire payload of source block `b`.
    fn payload(&self, b: BlockId) -> Vec<u8> {
        let mut p = Vec::new();
        for l in 0..LAYOUT.num_layers {
            let (k, v) = self.src.block_bytes(l, b);
            p.extend_from_slice(k);
            p.extend_from_slice(v);
        }
        p
    }

    /// A valid transfer through the real sender; checks the destination bytes and the gate.
    async fn valid(&mut self, kind: TransportKind) {
        let (r, blocks) = self.reserve(3);
        let src_blocks: Vec<BlockId> = vec![9, 2, 14];
        let mut s = self.sender.open(&self.dest(kind, r, &blocks)).await.unwrap();
        s.stage_from(&self.src, &src_blocks).unwrap();
        let rep = s.finish().await.unwrap();
        assert_eq!(rep.bytes, 3 * block_payload_bytes(&LAYOUT) as u64);
        let c = self.gate.settled(r).await;
        assert_eq!((c.begins, c.completes, c.aborts.len(), c.state), (1, 1, 0, State::Filled), "{kind}");
        for (&sb, &db) in src_blocks.iter().zip(&blocks) {
            for l in 0..LAYOUT.num_layers {
                assert_eq!(self.src.block_bytes(l, sb), self.dst.block_bytes(l, db), "{kind} layer {l}");
            }
        }
    }

    /// Checks a refused raw transfer: the answer's ERROR names `needle`, the reservation was
    /// aborted exactly once (`pinned`) or never pinned, and valid transfers still work.
    async fn refused(&mut self, r: u64, answer: &[u8], needle: &str, pinned: bool) {
        let msg = error_message(answer);
        assert!(msg.contains(needle), "error {msg:?} should mention {needle:?}");
        self.after(r, pinned, needle).await;
    }

    async fn after(&mut self, r: u64, pinned: bool, what: &str) {
        if pinned {
            let c = self.gate.settled(r).await;
            assert_eq!((c.begins, c.completes, c.aborts.len()), (1, 0, 1), "{what}: {c:?}");
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let c = self.gate.calls(r);
            assert_eq!((c.begins, c.completes, c.aborts.len()), (0, 0, 0), "{what}: {c:?}");
        }
        self.valid(TransportKind::Tcp).await;
        self.valid(TransportKind::Shm).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_before_the_reservation_is_pinned() {
    let mut g = rig(quick(), SenderOptions::default()).await;
    let (r, _) = g.reserve(2);

    // Random bytes.
    let mut x: u32 = 12345;
    let junk: Vec<u8> = (0..1000)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) as u8
        })
        .collect();
    let a = exchange(g.addr, &junk, true).await;
    g.refused(r, &a, "bad magic", false).await;

    // Bad magic, otherwise well-formed.
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    b[..8].copy_from_slice(b"NOTTANDM");
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "bad magic", false).await;

    // Wrong protocol version.
    let mut b = wire::preamble(99).to_vec();
    b.extend_from_slice(&wire::frame(tag::HELLO, &g.hello(TransportKind::Tcp, r, 2).encode()));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "version 99", false).await;

    // A HELLO claiming to be a gigabyte.
    let mut b = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
    b.extend_from_slice(&wire::frame_header(tag::HELLO, 1 << 30));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "exceeds the limit", false).await;

    // Another frame instead of HELLO.
    let mut b = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
    b.extend_from_slice(&wire::frame(tag::DONE, &wire::done_body(1)));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "unexpected DONE", false).await;

    // Truncated HELLO body.
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    b.truncate(b.len() - 3);
    let a = exchange(g.addr, &b, true).await;
    assert!(frames(&a).iter().all(|(t, _)| *t != tag::OK), "a truncated HELLO must not be accepted");
    g.after(r, false, "truncated hello").await;

    // Mismatched layout: every differing field is named.
    let mut h = g.hello(TransportKind::Tcp, r, 2);
    h.head_dim += 1;
    h.num_layers += 1;
    let a = exchange(g.addr, &g.opening(&h), true).await;
    let msg = error_message(&a);
    assert!(
        msg.contains("layout mismatch")
            && msg.contains("head_dim 9 vs 8")
            && msg.contains("num_layers 3 vs 2")
    );
    g.after(r, false, "layout").await;

    // More blocks than the pool has, and a wrong payload size.
    let a = exchange(g.addr, &g.opening(&g.hello(TransportKind::Tcp, r, 1000)), true).await;
    g.refused(r, &a, "1000 blocks", false).await;
    let mut h = g.hello(TransportKind::Tcp, r, 2);
    h.block_payload_bytes += 4;
    let a = exchange(g.addr, &g.opening(&h), true).await;
    g.refused(r, &a, "block payload", false).await;

    // shm HELLO naming another segment.
    let mut h = g.hello(TransportKind::Shm, r, 2);
    h.segment_path = "/dev/shm/tandem-kv-1-0000000000000000".into();
    let a = exchange(g.addr, &g.opening(&h), true).await;
    g.refused(r, &a, "sender mapped segment", false).await;

    // Unknown reservation: the gate's message comes back, nothing is aborted.
    let a = exchange(g.addr, &g.opening(&g.hello(TransportKind::Tcp, 9999, 2)), true).await;
    assert!(error_message(&a).contains("unknown reservation 9999"));

    // Connects and never sends anything.
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    let a = common::read_to_close(&mut s).await;
    g.refused(r, &a, "no progress", false).await;

    let c = g.rx.counters();
    assert!(c.failures >= 12, "{c:?}");
    assert_eq!(c.checksum_failures, 0);
    g.rx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_the_reservation_is_pinned() {
    let mut g = rig(quick(), SenderOptions::default()).await;
    let payload = block_payload_bytes(&LAYOUT);

    // Corrupted payload: the frame's checksum no longer matches.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    let mut f = wire::blocks_frame(0, &[&g.payload(3)]);
    let last = f.len() - 1;
    f[last] ^= 1;
    b.extend_from_slice(&f);
    let a = exchange(g.addr, &b, true).await;
    assert_eq!(frames(&a)[0].0, tag::OK);
    g.refused(r, &a, "checksum", true).await;
    assert_eq!(g.rx.counters().checksum_failures, 1);

    // Corrupted checksum field.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    let mut f = wire::blocks_frame(0, &[&g.payload(3)]);
    f[wire::group_head_len(0)] ^= 0x80;
    b.extend_from_slice(&f);
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "checksum", true).await;

    // Block index outside the reservation.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    b.extend_from_slice(&wire::blocks_frame(2, &[&g.payload(3)]));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "blocks 2..3 outside the reservation of 2 blocks", true).await;

    // Out of order.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    b.extend_from_slice(&wire::blocks_frame(1, &[&g.payload(3)]));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "out of order", true).await;

    // A group whose length does not match its count.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    let mut f = wire::blocks_frame(0, &[&g.payload(3), &g.payload(4)]);
    f[wire::FRAME_HEADER_BYTES + 4] = 1; // count 1, with two payloads' bytes
    b.extend_from_slice(&f);
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "for 1 blocks, expected", true).await;

    // Oversized BLOCKS length (refused from the header, before any body is read).
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    let max = wire::GROUP_HEAD_BYTES + wire::max_group_blocks(payload) * (4 + payload);
    b.extend_from_slice(&wire::frame_header(tag::BLOCKS, max + 1));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "exceeds the limit", true).await;

    // A frame the sender never sends.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    b.extend_from_slice(&wire::frame(tag::ACK, &0u64.to_le_bytes()));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "unexpected ACK", true).await;

    // DONE before every block arrived.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    b.extend_from_slice(&wire::blocks_frame(0, &[&g.payload(3)]));
    b.extend_from_slice(&wire::frame(tag::DONE, &wire::done_body(2)));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "DONE after 1 of 2 blocks", true).await;

    // Truncated BLOCK, then the sender closes: the peer is gone, no ERROR to send.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 2));
    let f = wire::blocks_frame(0, &[&g.payload(3)]);
    b.extend_from_slice(&f[..f.len() / 2]);
    let a = exchange(g.addr, &b, true).await;
    assert_eq!(frames(&a).len(), 1, "only OK: {:?}", frames(&a));
    g.after(r, true, "truncated block").await;
    assert!(g.gate.calls(r).aborts[0].contains("connection closed"), "{:?}", g.gate.calls(r));

    // The sender disappears mid-stream (one good block, then the socket is dropped).
    let (r, _) = g.reserve(3);
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    let mut b = g.opening(&g.hello(TransportKind::Tcp, r, 3));
    b.extend_from_slice(&wire::blocks_frame(0, &[&g.payload(1)]));
    s.write_all(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
    g.after(r, true, "sender vanished").await;

    // HELLO, then silence: the inactivity timeout releases the reservation.
    let (r, _) = g.reserve(2);
    let a = exchange(g.addr, &g.opening(&g.hello(TransportKind::Tcp, r, 2)), false).await;
    g.refused(r, &a, "no progress", true).await;

    // shm: checksums that do not match what is in the segment.
    let (r, _) = g.reserve(2);
    let mut b = g.opening(&g.hello(TransportKind::Shm, r, 2));
    b.extend_from_slice(&wire::sums_frame(0, &[1, 2]));
    b.extend_from_slice(&wire::frame(tag::DONE, &wire::done_body(2)));
    let a = exchange(g.addr, &b, true).await;
    g.refused(r, &a, "checksum", true).await;
    assert_eq!(g.rx.counters().checksum_failures, 3);

    // A second transfer into a reservation that is already filled is refused without aborting.
    g.valid(TransportKind::Tcp).await;
    let r = g.next_res;
    let a = exchange(g.addr, &g.opening(&g.hello(TransportKind::Tcp, r, 3)), true).await;
    assert!(error_message(&a).contains("not Reserved"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let c = g.gate.calls(r);
    assert_eq!((c.begins, c.completes, c.aborts.len(), c.state), (2, 1, 0, State::Filled));
    g.rx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lifecycle() {
    // Keep-alives hold the reservation while the prompt is "computed" for longer than the
    // receiver's inactivity timeout.
    let sopts = SenderOptions { keepalive_interval: Duration::from_millis(50), ..Default::default() };
    let mut g = rig(quick(), sopts).await;
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let (r, blocks) = g.reserve(2);
        let mut s = g.sender.open(&g.dest(kind, r, &blocks)).await.unwrap();
        assert_eq!(g.gate.calls(r).state, State::Transferring);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        s.stage_from(&g.src, &[4, 5]).unwrap();
        s.finish().await.unwrap();
        let c = g.gate.settled(r).await;
        assert_eq!((c.completes, c.aborts.len()), (1, 0), "{kind}");
    }

    // A session dropped before it finishes (the prefill request was cancelled, or P died).
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let (r, blocks) = g.reserve(2);
        let mut s = g.sender.open(&g.dest(kind, r, &blocks)).await.unwrap();
        if kind == TransportKind::Tcp {
            s.stage_from(&g.src, &[4, 5]).unwrap();
        }
        drop(s);
        g.after(r, true, "dropped session").await;
    }

    // Staging the wrong number of blocks is refused locally.
    let (r, blocks) = g.reserve(2);
    let mut s = g.sender.open(&g.dest(TransportKind::Tcp, r, &blocks)).await.unwrap();
    let e = s.stage_from(&g.src, &[1, 2, 3]).unwrap_err();
    assert!(e.to_string().contains("3 source blocks for 2 destination blocks"), "{e}");
    drop(s);
    g.after(r, true, "wrong block count").await;

    // Refusals reach the sender with the peer's message and address.
    let e = g.sender.open(&g.dest(TransportKind::Tcp, 4242, &[1, 2])).await.unwrap_err();
    let m = e.to_string();
    assert!(m.contains("unknown reservation 4242") && m.contains(&g.addr.to_string()), "{m}");
    assert_eq!(e.kind(), "refused", "the peer refused the reservation");

    // Nobody listening.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut d = g.dest(TransportKind::Tcp, 1, &[1]);
    d.address = closed.to_string();
    let e = g.sender.open(&d).await.unwrap_err();
    assert_eq!(e.kind(), "connect", "{e}");

    // A segment that does not exist.
    let mut d = g.dest(TransportKind::Shm, 1, &[1]);
    d.segment_path = "/nonexistent/tandem-kv-1-0".into();
    let e = g.sender.open(&d).await.unwrap_err();
    assert!(e.to_string().contains("/nonexistent/tandem-kv-1-0"), "{e}");

    // Transfers of different requests run concurrently.
    let mut sessions = Vec::new();
    let mut expect = Vec::new();
    for i in 0..4u32 {
        let r = 500 + i as u64;
        let blocks = vec![i * 2, i * 2 + 1];
        g.gate.add(r, blocks.clone());
        let kind = if i % 2 == 0 { TransportKind::Tcp } else { TransportKind::Shm };
        sessions.push(g.sender.open(&g.dest(kind, r, &blocks)).await.unwrap());
        expect.push((r, blocks, vec![8 + i, 12 + i]));
    }
    // All four are pinned at once.
    assert!(expect.iter().all(|(r, _, _)| g.gate.calls(*r).state == State::Transferring));
    for (s, (_, _, src)) in sessions.iter_mut().zip(&expect) {
        s.stage_from(&g.src, src).unwrap();
    }
    let reports = futures_join(sessions.into_iter().map(|s| s.finish()).collect()).await;
    assert!(reports.iter().all(|r| r.is_ok()), "{reports:?}");
    for (r, blocks, src) in &expect {
        assert_eq!(g.gate.settled(*r).await.completes, 1);
        for (&sb, &db) in src.iter().zip(blocks) {
            assert_eq!(g.src.block_bytes(1, sb), g.dst.block_bytes(1, db));
        }
    }

    // Shutdown aborts what is in flight.
    let (r, blocks) = g.reserve(2);
    let s = g.sender.open(&g.dest(TransportKind::Tcp, r, &blocks)).await.unwrap();
    g.rx.shutdown().await;
    let c = g.gate.settled(r).await;
    assert_eq!((c.completes, c.aborts.len()), (0, 1));
    drop(s);
}

/// shm: when D gives up on a silent sender it tells it to stop and keeps the blocks until the
/// sender closes, so a late `stage` cannot write into blocks D has reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_sender_told_to_stop_writes_nothing() {
    let ropts = ReceiverOptions {
        io_timeout: Duration::from_millis(300),
        shm_close_grace: Duration::from_secs(20),
        ..Default::default()
    };
    // No keep-alives: the sender looks hung.
    let sopts = SenderOptions { keepalive_interval: Duration::from_secs(3600), ..Default::default() };
    let mut g = rig(ropts, sopts).await;
    let (r, blocks) = g.reserve(2);
    let mut s = g.sender.open(&g.dest(TransportKind::Shm, r, &blocks)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    // D timed out but waits for us to close before it releases the blocks.
    assert!(g.gate.calls(r).aborts.is_empty());
    let e = s.stage_from(&g.src, &[4, 5]).unwrap_err();
    assert!(e.to_string().contains("no progress"), "{e}");
    for &b in &blocks {
        assert!(g.dst.block_bytes(0, b).0.iter().all(|&x| x == 0), "block {b} was written");
    }
    drop(s);
    let c = g.gate.settled(r).await;
    assert_eq!((c.completes, c.aborts.len()), (0, 1));
    g.rx.shutdown().await;
}

/// Awaits all futures concurrently (they are spawned so they make progress in parallel).
async fn futures_join<F>(fs: Vec<F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_token_is_checked_before_anything_is_pinned() {
    let right = KvToken([0x5a; 32]);
    let ropts = ReceiverOptions { token: Some(right), ..quick() };
    let mut g = rig(ropts, SenderOptions { token: Some(right), ..Default::default() }).await;
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let (r, blocks) = g.reserve(2);
        for (token, needle) in
            [(None, "no KV auth token"), (Some(KvToken([0x5b; 32])), "wrong KV auth token")]
        {
            let sender = KvSender::new(LAYOUT, SenderOptions { token, ..Default::default() });
            let err = sender.open(&g.dest(kind, r, &blocks)).await.unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("unauthenticated") && msg.contains(needle), "{kind}: {msg}");
            // The same, raw: an ERROR, never an OK.
            let h = Hello { token, ..g.hello(kind, r, 2) };
            let a = exchange(g.addr, &g.opening(&h), true).await;
            assert!(error_message(&a).contains(needle), "{kind}");
        }
        // Nothing was pinned or aborted; the right token then fills this very reservation.
        assert_eq!(g.gate.calls(r).begins, 0, "{kind}");
        let mut s = g.sender.open(&g.dest(kind, r, &blocks)).await.unwrap();
        s.stage_from(&g.src, &[1, 2]).unwrap();
        s.finish().await.unwrap();
        let c = g.gate.settled(r).await;
        assert_eq!((c.begins, c.completes, c.aborts.len(), c.state), (1, 1, 0, State::Filled), "{kind}");
        let k = g.rx.counters_of(kind);
        assert_eq!((k.transfers, k.failures), (1, 4), "{kind}");
    }
    g.rx.shutdown().await;

    // A receiver without a token takes transfers from a sender that has one.
    let mut g = rig(quick(), SenderOptions { token: Some(right), ..Default::default() }).await;
    g.valid(TransportKind::Tcp).await;
    g.valid(TransportKind::Shm).await;
    g.rx.shutdown().await;
}
