//! The pipelined transfer path: blocks travel in groups (BLOCKS frames on tcp, SUMS frames
//! after each group written into the segment on shm). Transfers of every size — one block, a
//! multiple of the group size, a remainder — arrive byte for byte, partial transfers leave the
//! blocks the destination already holds alone, a corrupted block in the middle of a group is
//! refused by name, a sender that vanishes mid-transfer leaves its reservation released exactly
//! once, and a peer speaking the previous protocol is refused with words that say so.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{error_message, exchange, frames, State, TestGate};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_transport::wire::{self, tag, Hello};
use tandem_transport::{
    block_payload_bytes, KvDestination, KvReceiver, KvSender, ReceiverOptions, SenderOptions, TransportKind,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    num_blocks: 64,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F32,
};
/// Blocks per group the sender uses here: transfers of 1, 3, 4, 7, … blocks end on a full group
/// or on a remainder.
const GROUP: usize = 3;
/// What the destination pool holds outside the blocks a transfer writes.
const MARK: u8 = 0xee;

struct Rig {
    gate: Arc<TestGate>,
    rx: KvReceiver,
    addr: SocketAddr,
    src: CpuKvPool,
    dst: CpuKvPool,
    sender: KvSender,
    next_res: u64,
}

fn payload_len() -> usize {
    block_payload_bytes(&LAYOUT)
}

/// Block `b`, layer `l` of the source: bytes that differ per block, layer, K and V.
fn source_bytes(b: BlockId, l: usize) -> (Vec<u8>, Vec<u8>) {
    let k: Vec<u8> =
        (0..LAYOUT.block_bytes()).map(|i| (i as u32 * 13 + b * 71 + l as u32 * 29 + 1) as u8).collect();
    let v = k.iter().map(|x| x.wrapping_mul(3) ^ 0xa5).collect();
    (k, v)
}

async fn rig() -> Rig {
    let mut src = CpuKvPool::new(LAYOUT);
    for b in 0..LAYOUT.num_blocks as BlockId {
        for l in 0..LAYOUT.num_layers {
            let (k, v) = source_bytes(b, l);
            src.write_block_bytes(l, b, &k, &v).unwrap();
        }
    }
    let dst = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let gate = Arc::new(TestGate::default());
    let opts = ReceiverOptions { io_timeout: Duration::from_millis(500), ..Default::default() };
    let rx = KvReceiver::bind(SocketAddr::from(([127, 0, 0, 1], 0)), dst.sink(), gate.clone(), opts)
        .await
        .unwrap();
    let addr = rx.local_addr();
    let sopts = SenderOptions { group_bytes: GROUP * payload_len(), ..Default::default() };
    let mut r = Rig { gate, rx, addr, src, dst, sender: KvSender::new(LAYOUT, sopts), next_res: 0 };
    r.mark_all();
    r
}

impl Rig {
    /// Fills every destination block with [`MARK`].
    fn mark_all(&mut self) {
        let m = vec![MARK; LAYOUT.block_bytes()];
        for b in 0..LAYOUT.num_blocks as BlockId {
            for l in 0..LAYOUT.num_layers {
                self.dst.write_block_bytes(l, b, &m, &m).unwrap();
            }
        }
    }

    fn reserve(&mut self, blocks: Vec<BlockId>) -> u64 {
        self.next_res += 1;
        self.gate.add(self.next_res, blocks);
        self.next_res
    }

    fn dest(&self, kind: TransportKind, r: u64, blocks: &[BlockId], skip: u32) -> KvDestination {
        common::destination(&self.rx, kind, r, blocks, skip)
    }

    fn segment(&self, kind: TransportKind) -> String {
        match kind {
            TransportKind::Shm => self.dst.segment_path().unwrap().to_string_lossy().into_owned(),
            _ => String::new(),
        }
    }

    fn opening(&self, kind: TransportKind, r: u64, n: u32, version: u32) -> Vec<u8> {
        let h = Hello {
            transport: kind,
            reservation: r,
            num_blocks: n,
            block_payload_bytes: payload_len() as u64,
            num_layers: LAYOUT.num_layers as u32,
            block_size: LAYOUT.block_size as u32,
            num_kv_heads: LAYOUT.num_kv_heads as u32,
            head_dim: LAYOUT.head_dim as u32,
            layout: LAYOUT.name().into(),
            segment_path: self.segment(kind),
            token: None,
            ext: Vec::new(),
            adapter_id: String::new(),
        };
        let mut b = wire::preamble(version).to_vec();
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

    /// Writes a wire payload into destination block `dst` the way an shm sender does.
    fn write_payload(&self, dst: BlockId, payload: &[u8]) {
        let sink = self.dst.sink();
        let bb = LAYOUT.block_bytes();
        for (l, kv) in payload.chunks_exact(2 * bb).enumerate() {
            // SAFETY: the test holds the reservation of `dst`; nothing else touches the pool.
            unsafe { sink.write_block(l, dst, &kv[..bb], &kv[bb..]).unwrap() };
        }
    }

    /// Every layer's K and V of `dst` equal the source block `src`.
    fn assert_arrived(&self, what: &str, src: BlockId, dst: BlockId) {
        for l in 0..LAYOUT.num_layers {
            assert_eq!(
                self.src.block_bytes(l, src),
                self.dst.block_bytes(l, dst),
                "{what}: layer {l} of {dst}"
            );
        }
    }

    /// Every destination block not in `written` still holds [`MARK`].
    fn assert_untouched_but(&self, what: &str, written: &[BlockId]) {
        for b in (0..LAYOUT.num_blocks as BlockId).filter(|b| !written.contains(b)) {
            for l in 0..LAYOUT.num_layers {
                let (k, v) = self.dst.block_bytes(l, b);
                assert!(k.iter().chain(v).all(|&x| x == MARK), "{what}: block {b} layer {l} was written");
            }
        }
    }

    /// Sends `src` into `dst` with the real sender; checks the bytes and the gate.
    async fn transfer(&mut self, kind: TransportKind, src: &[BlockId], dst: &[BlockId], skip: u32) {
        let what = format!("{kind}, {} blocks, {skip} skipped", src.len());
        let r = self.reserve(dst.to_vec());
        let mut s = self.sender.open(&self.dest(kind, r, dst, skip)).await.unwrap();
        s.stage_from(&self.src, src).unwrap();
        let rep = s.finish().await.unwrap();
        assert_eq!((rep.blocks, rep.bytes as usize), (src.len(), src.len() * payload_len()), "{what}");
        let c = self.gate.settled(r).await;
        assert_eq!((c.begins, c.completes, c.aborts.len(), c.state), (1, 1, 0, State::Filled), "{what}");
        for (&s, &d) in src.iter().zip(dst) {
            self.assert_arrived(&what, s, d);
        }
    }

    /// The reservation was pinned and then aborted exactly once, never completed; the abort's
    /// reason mentions `why`.
    async fn assert_aborted_once(&self, r: u64, why: &str) {
        let c = self.gate.settled(r).await;
        assert_eq!(
            (c.begins, c.completes, c.aborts.len(), c.state),
            (1, 0, 1, State::Released),
            "{why}: {c:?}"
        );
        assert!(c.aborts[0].contains(why), "abort reason {:?} should mention {why:?}", c.aborts[0]);
    }
}

/// Distinct, scattered, unordered block ids.
fn ids(n: usize, mul: u32, add: u32) -> Vec<BlockId> {
    (0..n as u32).map(|i| (i * mul + add) % LAYOUT.num_blocks as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_of_every_size_arrive_byte_for_byte() {
    let mut g = rig().await;
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        // One block, less than a group, exactly one and two groups, remainders of 1 and 2, many.
        for n in [1, 2, 3, 4, 6, 8, 31, 64] {
            g.mark_all();
            let (src, dst) = (ids(n, 11, 3), ids(n, 7, 5));
            g.transfer(kind, &src, &dst, 0).await;
            g.assert_untouched_but(&format!("{kind} {n}"), &dst);
        }
        let c = g.rx.counters_of(kind);
        assert_eq!((c.transfers, c.failures, c.checksum_failures), (8, 0, 0), "{kind}");
    }
    g.rx.shutdown().await;
}

/// The destination already holds the prompt's first blocks (a cached prefix): only the rest is
/// reserved and sent, into blocks after them, and the held blocks keep their bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_transfers_leave_the_skipped_blocks_alone() {
    let mut g = rig().await;
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        for (blocks, skip) in [(9usize, 2usize), (5, 4), (8, 1)] {
            g.mark_all();
            let p_table = ids(blocks, 5, 1);
            let d_table = ids(blocks, 9, 2);
            // D's cached prefix: the same bytes, put there by an earlier transfer.
            for (&s, &d) in p_table.iter().zip(&d_table).take(skip) {
                g.write_payload(d, &g.payload(s));
            }
            g.transfer(kind, &p_table[skip..], &d_table[skip..], skip as u32).await;
            for (&s, &d) in p_table.iter().zip(&d_table) {
                g.assert_arrived(&format!("{kind} {blocks}/{skip}"), s, d);
            }
            g.assert_untouched_but(&format!("{kind} {blocks}/{skip}"), &d_table);
        }
    }
    g.rx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_block_in_the_middle_of_a_group_is_refused_by_name() {
    let mut g = rig().await;
    let n = 7usize;
    let src = ids(n, 3, 1);

    // tcp: the second group's middle block (transfer index 4) is damaged after its checksum was
    // computed.
    let dst = ids(n, 7, 5);
    let r = g.reserve(dst.clone());
    let payloads: Vec<Vec<u8>> = src.iter().map(|&b| g.payload(b)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
    let mut b = g.opening(TransportKind::Tcp, r, n as u32, wire::KV_WIRE_VERSION);
    b.extend_from_slice(&wire::blocks_frame(0, &refs[..3]));
    let mut f = wire::blocks_frame(3, &refs[3..6]);
    let at = wire::group_head_len(3) + payload_len() + payload_len() / 2;
    f[at] ^= 0x10;
    b.extend_from_slice(&f);
    b.extend_from_slice(&wire::blocks_frame(6, &refs[6..]));
    b.extend_from_slice(&wire::frame(tag::DONE, &wire::done_body(n)));
    let a = exchange(g.addr, &b, true).await;
    let msg = error_message(&a);
    let needle = format!("block 4 (destination block {}) has checksum", dst[4]);
    assert!(msg.contains(&needle), "{msg:?} should name {needle:?}");
    g.assert_aborted_once(r, &needle).await;
    // The blocks before the damaged one did arrive; the reservation is released all the same.
    g.assert_arrived("tcp, before the damage", src[3], dst[3]);

    // shm: the sender's checksums are right, but block 4 in the pool is not what it sent.
    let dst = ids(n, 9, 4);
    let r = g.reserve(dst.clone());
    let crcs: Vec<u32> = payloads.iter().map(|p| wire::checksum(p)).collect();
    let mut b = g.opening(TransportKind::Shm, r, n as u32, wire::KV_WIRE_VERSION);
    for (i, (&d, p)) in dst.iter().zip(&payloads).enumerate() {
        let mut p = p.clone();
        if i == 4 {
            p[7] ^= 1;
        }
        g.write_payload(d, &p);
    }
    b.extend_from_slice(&wire::sums_frame(0, &crcs[..3]));
    b.extend_from_slice(&wire::sums_frame(3, &crcs[3..6]));
    b.extend_from_slice(&wire::sums_frame(6, &crcs[6..]));
    b.extend_from_slice(&wire::frame(tag::DONE, &wire::done_body(n)));
    let a = exchange(g.addr, &b, true).await;
    let msg = error_message(&a);
    let needle = format!("block 4 (destination block {}) has checksum", dst[4]);
    assert!(msg.contains(&needle), "{msg:?} should name {needle:?}");
    g.assert_aborted_once(r, &needle).await;
    assert!(frames(&a).iter().all(|(t, _)| *t != tag::ACK), "no ACK for a corrupted transfer");

    let c = g.rx.counters();
    assert_eq!((c.failures, c.checksum_failures), (2, 2));
    // The receiver goes on serving.
    g.transfer(TransportKind::Tcp, &src, &ids(n, 5, 0), 0).await;
    g.transfer(TransportKind::Shm, &src, &ids(n, 5, 1), 0).await;
    g.rx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_vanishes_mid_transfer_frees_the_reservation() {
    let mut g = rig().await;
    let n = 8usize;
    let src = ids(n, 3, 2);
    let payloads: Vec<Vec<u8>> = src.iter().map(|&b| g.payload(b)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();

    // tcp: one whole group, then half of the next, then the socket is gone.
    let r = g.reserve(ids(n, 7, 1));
    let mut b = g.opening(TransportKind::Tcp, r, n as u32, wire::KV_WIRE_VERSION);
    b.extend_from_slice(&wire::blocks_frame(0, &refs[..3]));
    let f = wire::blocks_frame(3, &refs[3..6]);
    b.extend_from_slice(&f[..f.len() / 2]);
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    s.write_all(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
    // Closed or reset, the reason says where the transfer stopped.
    g.assert_aborted_once(r, "reading block 4").await;

    // shm: one group written and announced, then the socket is gone.
    let dst = ids(n, 7, 2);
    let r = g.reserve(dst.clone());
    for (&d, p) in dst.iter().zip(&payloads).take(3) {
        g.write_payload(d, p);
    }
    let crcs: Vec<u32> = payloads[..3].iter().map(|p| wire::checksum(p)).collect();
    let mut b = g.opening(TransportKind::Shm, r, n as u32, wire::KV_WIRE_VERSION);
    b.extend_from_slice(&wire::sums_frame(0, &crcs));
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    s.write_all(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
    g.assert_aborted_once(r, "waiting for block 3 of 8").await;

    // The real sender: every group staged (and, on tcp, sent), then the session is dropped
    // without DONE (P's request was cancelled, or P died).
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let dst = ids(n, 5, 3);
        let r = g.reserve(dst.clone());
        let mut s = g.sender.open(&g.dest(kind, r, &dst, 0)).await.unwrap();
        s.stage_from(&g.src, &src).unwrap();
        drop(s);
        let c = g.gate.settled(r).await;
        assert_eq!((c.begins, c.completes, c.aborts.len(), c.state), (1, 0, 1, State::Released), "{kind}");
    }
    // Nothing is left half-held: the receiver serves new transfers.
    g.transfer(TransportKind::Tcp, &src, &ids(n, 9, 0), 0).await;
    g.transfer(TransportKind::Shm, &src, &ids(n, 9, 1), 0).await;
    g.rx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_speaking_the_previous_protocol_is_refused_by_name() {
    let mut g = rig().await;
    let src = ids(2, 3, 0);
    let p0 = g.payload(src[0]);
    // Version 2's one-block frame: u32 index, u32 checksum, payload.
    let v2_block = |index: u32, p: &[u8]| {
        let mut body = index.to_le_bytes().to_vec();
        body.extend_from_slice(&wire::checksum(p).to_le_bytes());
        body.extend_from_slice(p);
        wire::frame(tag::BLOCK_V2, &body)
    };

    // A version 2 sender: refused by its version before anything is pinned.
    let r = g.reserve(ids(2, 5, 1));
    let mut b = g.opening(TransportKind::Tcp, r, 2, 2);
    b.extend_from_slice(&v2_block(0, &p0));
    let a = exchange(g.addr, &b, true).await;
    let msg = error_message(&a);
    assert!(msg.contains("unsupported KV protocol version 2") && msg.contains("speaks 3"), "{msg}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(g.gate.calls(r).begins, 0, "nothing pinned for an old sender");

    // A version 2 block frame behind a current preamble: named, and the reservation released.
    let r2 = g.reserve(ids(2, 5, 2));
    let mut b = g.opening(TransportKind::Tcp, r2, 2, wire::KV_WIRE_VERSION);
    b.extend_from_slice(&v2_block(0, &p0));
    let a = exchange(g.addr, &b, true).await;
    let msg = error_message(&a);
    assert!(msg.contains("unexpected BLOCK (KV protocol version 2) frame"), "{msg}");
    g.assert_aborted_once(r2, "KV protocol version 2").await;

    // Version 2's DONE carried every checksum: too long for today's DONE.
    let r3 = g.reserve(ids(1, 5, 3));
    let mut b = g.opening(TransportKind::Tcp, r3, 1, wire::KV_WIRE_VERSION);
    b.extend_from_slice(&wire::blocks_frame(0, &[&p0]));
    let mut old_done = 1u32.to_le_bytes().to_vec();
    old_done.extend_from_slice(&wire::checksum(&p0).to_le_bytes());
    b.extend_from_slice(&wire::frame(tag::DONE, &old_done));
    let a = exchange(g.addr, &b, true).await;
    let msg = error_message(&a);
    assert!(msg.contains("DONE frame of 8 bytes exceeds the limit of 4"), "{msg}");
    g.assert_aborted_once(r3, "DONE frame").await;

    // The old reservation is still usable by a current sender.
    let c = g.gate.calls(r);
    assert_eq!((c.state, c.begins), (State::Reserved, 0));
    let mut s = g.sender.open(&g.dest(TransportKind::Tcp, r, &ids(2, 5, 1), 0)).await.unwrap();
    s.stage_from(&g.src, &src).unwrap();
    s.finish().await.unwrap();
    assert_eq!(g.gate.settled(r).await.state, State::Filled);
    g.rx.shutdown().await;
}
