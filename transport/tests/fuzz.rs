//! Fuzzing the KV transport's decoders with arbitrary and structure-aware inputs (stable Rust:
//! proptest and a seeded generator). What must hold for every input:
//! - no decoder panics, and what one accepts is exactly what the encoder writes (the HELLO and
//!   NCCL HELLO decoders are the inverse of their encoders on everything they accept);
//! - the live receiver answers every stream, however malformed, by closing it within its idle
//!   timeout, never allocates from a length field (the largest allocation while it is fuzzed stays
//!   far below any length a frame header claims), pins no reservation it does not settle, and goes
//!   on serving valid transfers.
//!
//! Cases: `TANDEM_FUZZ_CASES` (default 256 per property, and 300 streams against the receiver) so
//! that CI runs a bounded count; a longer campaign sets it higher ([docs/testing.md]).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{State, TestGate};
use proptest::prelude::*;
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_transport::wire::{self, tag, Hello, NcclHello};
use tandem_transport::{
    block_payload_bytes, KvReceiver, KvSender, KvToken, ReceiverOptions, SenderOptions, TransportKind,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Tracks the largest single allocation while `WATCH` is on.
struct Watch;

static WATCH: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCH.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if WATCH.load(Ordering::Relaxed) {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Watch = Watch;

fn cases() -> u32 {
    std::env::var("TANDEM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

const LAYOUT: KvLayout = KvLayout {
    num_layers: 2,
    num_blocks: 16,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F16,
};

fn kinds() -> impl Strategy<Value = TransportKind> {
    prop::sample::select(TransportKind::ALL.to_vec())
}

prop_compose! {
    fn hellos()(
        transport in kinds(),
        reservation in any::<u64>(),
        num_blocks in any::<u32>(),
        block_payload_bytes in any::<u64>(),
        dims in prop::array::uniform4(any::<u32>()),
        layout in "[ -~]{0,40}",
        segment_path in "\\PC{0,40}",
        token in prop::option::of(prop::array::uniform32(any::<u8>())),
        ext in prop::collection::vec(any::<u8>(), 0..200),
        adapter_id in prop_oneof![Just(String::new()), "[0-9a-f]{32}", "\\PC{1,20}"],
    ) -> Hello {
        Hello {
            transport,
            reservation,
            num_blocks,
            block_payload_bytes,
            num_layers: dims[0],
            block_size: dims[1],
            num_kv_heads: dims[2],
            head_dim: dims[3],
            layout,
            segment_path,
            token: token.map(KvToken),
            ext: if transport.needs_gpu() { ext } else { Vec::new() },
            adapter_id,
        }
    }
}

/// A mutation of an encoding: flip a byte, cut it, or append bytes.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Cut(usize),
    Append(Vec<u8>),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    prop::collection::vec(
        prop_oneof![
            (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Flip(i, x)),
            any::<usize>().prop_map(Mutation::Cut),
            prop::collection::vec(any::<u8>(), 1..8).prop_map(Mutation::Append),
        ],
        1..4,
    )
}

fn mutate(mut b: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        match m {
            Mutation::Flip(i, x) if !b.is_empty() => {
                let n = b.len();
                b[i % n] ^= x;
            }
            Mutation::Cut(i) => b.truncate(i % (b.len() + 1)),
            Mutation::Append(x) => b.extend_from_slice(x),
            Mutation::Flip(..) => {}
        }
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn hello_decoding_is_total_and_the_inverse_of_encoding(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(h) = Hello::decode(&bytes) {
            prop_assert_eq!(h.encode(), bytes, "accepted bytes re-encode to themselves");
        }
    }

    #[test]
    fn hellos_round_trip_and_their_mutations_never_panic(h in hellos(), ms in mutations()) {
        let b = h.encode();
        let back = Hello::decode(&b).expect("an encoded HELLO decodes");
        prop_assert_eq!(back.encode(), b.clone());
        prop_assert_eq!((back.transport, back.reservation, back.num_blocks), (h.transport, h.reservation, h.num_blocks));
        prop_assert_eq!(&back.layout, &h.layout);
        prop_assert_eq!(back.token.map(|t| t.0), h.token.as_ref().map(|t| t.0));
        let m = mutate(b, &ms);
        if let Ok(x) = Hello::decode(&m) {
            prop_assert_eq!(x.encode(), m);
        }
    }

    #[test]
    fn nccl_hellos_decode_totally(bytes in prop::collection::vec(any::<u8>(), 0..300), key in any::<u64>(),
                                  id in prop::option::of(prop::collection::vec(any::<u8>(), 128)), ms in mutations()) {
        if let Ok(h) = NcclHello::decode(&bytes) {
            prop_assert_eq!(h.encode(), bytes);
        }
        let h = NcclHello { comm_key: key, unique_id: id.map(|v| v.try_into().unwrap()) };
        let b = h.encode();
        prop_assert_eq!(NcclHello::decode(&b).unwrap().encode(), b.clone());
        if let Ok(x) = NcclHello::decode(&mutate(b, &ms)) {
            prop_assert!(x.encode().len() == 9 || x.encode().len() == 137);
        }
    }

    #[test]
    fn preambles_group_heads_and_done_bodies_are_checked(
        pre in prop::array::uniform12(any::<u8>()),
        head in prop::array::uniform8(any::<u8>()),
        next in 0usize..64, n in 0usize..64, max in 0usize..64,
        done in prop::collection::vec(any::<u8>(), 0..8), expected in 0usize..100,
    ) {
        let ok = wire::check_preamble(&pre).is_ok();
        prop_assert_eq!(ok, pre == wire::preamble(wire::KV_WIRE_VERSION));
        if let Ok((first, count)) = wire::parse_group_head(&head, next, n, max) {
            prop_assert!(first == next && count >= 1 && first + count <= n && count <= max);
        }
        prop_assert_eq!(wire::parse_done(&done, expected).is_ok(), done == wire::done_body(expected));
    }
}

/// Writes `bytes` (tolerating a receiver that closes first) and reads until the receiver closes;
/// returns how long that took.
async fn throw(addr: SocketAddr, bytes: &[u8], close: bool) -> Duration {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    if close {
        let _ = s.shutdown().await;
    }
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Err(_) => panic!("the receiver never closed a connection that sent {} bytes", bytes.len()),
            Ok(Ok(0)) | Ok(Err(_)) => return t0.elapsed(),
            Ok(Ok(_)) => {}
        }
    }
}

/// A small deterministic generator (the streams are reproducible from the case number).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// One structure-aware hostile stream: a valid (or slightly broken) opening for reservation `r`
/// followed by frames of random tags, with lengths that are honest, short, or absurd.
fn hostile_stream(g: &mut Gen, r: u64, good: &Hello) -> Vec<u8> {
    let mut b = match g.below(10) {
        0 => {
            let n = g.below(64) as usize;
            g.bytes(n)
        }
        1 => {
            let mut p = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
            let i = g.below(12) as usize;
            p[i] ^= 1 + g.below(255) as u8;
            p
        }
        _ => wire::preamble(wire::KV_WIRE_VERSION).to_vec(),
    };
    let mut hello = Hello { reservation: r, ..good.clone() };
    match g.below(6) {
        0 => hello.num_blocks = g.next() as u32,
        1 => hello.block_payload_bytes = g.next(),
        2 => hello.layout = String::from_utf8_lossy(&g.bytes(8)).into_owned(),
        _ => {}
    }
    let body = hello.encode();
    let body = if g.below(4) == 0 {
        let ms =
            [Mutation::Flip(g.next() as usize, 1 + g.below(255) as u8), Mutation::Cut(g.next() as usize)];
        mutate(body, &ms[..1 + g.below(2) as usize])
    } else {
        body
    };
    b.extend_from_slice(&wire::frame(tag::HELLO, &body));
    for _ in 0..g.below(5) {
        let t =
            [tag::BLOCKS, tag::SUMS, tag::DONE, tag::PING, tag::NCCL_GO, tag::BLOCK_V2, tag::HELLO, 0, 200]
                [g.below(9) as usize];
        let real = g.below(600) as usize;
        let claimed = match g.below(5) {
            0 => u32::MAX as usize,
            1 => (1 << 30) + g.below(1 << 20) as usize,
            2 => real + g.below(64) as usize,
            _ => real,
        };
        b.extend_from_slice(&wire::frame_header(t, claimed.min(u32::MAX as usize)));
        let mut body = g.bytes(real);
        if t == tag::BLOCKS && real >= 8 {
            body[..4].copy_from_slice(&0u32.to_le_bytes());
            body[4..8].copy_from_slice(&(1 + g.below(3) as u32).to_le_bytes());
        }
        b.extend_from_slice(&body);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_survives_hostile_streams_and_serves_after_them() {
    let dst = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let gate = Arc::new(TestGate::default());
    let opts = ReceiverOptions { io_timeout: Duration::from_millis(300), ..Default::default() };
    let rx = KvReceiver::bind(SocketAddr::from(([127, 0, 0, 1], 0)), dst.sink(), gate.clone(), opts)
        .await
        .unwrap();
    let addr = rx.local_addr();
    let good = Hello {
        transport: TransportKind::Tcp,
        reservation: 0,
        num_blocks: 2,
        block_payload_bytes: block_payload_bytes(&LAYOUT) as u64,
        num_layers: LAYOUT.num_layers as u32,
        block_size: LAYOUT.block_size as u32,
        num_kv_heads: LAYOUT.num_kv_heads as u32,
        head_dim: LAYOUT.head_dim as u32,
        layout: LAYOUT.name().into(),
        segment_path: String::new(),
        token: None,
        ext: Vec::new(),
        adapter_id: String::new(),
    };
    let streams = (cases() as u64 * 300).div_ceil(256);
    let mut reservations = Vec::new();
    let mut slowest = Duration::ZERO;
    LARGEST.store(0, Ordering::SeqCst);
    WATCH.store(true, Ordering::SeqCst);
    for case in 0..streams {
        let mut g = Gen(0x9E37_79B9_7F4A_7C15 ^ (case + 1));
        let r = 1000 + case;
        gate.add(r, vec![(case % 16) as BlockId, ((case + 5) % 16) as BlockId]);
        reservations.push(r);
        let bytes = hostile_stream(&mut g, r, &good);
        slowest = slowest.max(throw(addr, &bytes, g.below(2) == 0).await);
    }
    WATCH.store(false, Ordering::SeqCst);
    let largest = LARGEST.load(Ordering::SeqCst);
    eprintln!(
        "fuzz: {streams} hostile streams, largest allocation {largest} bytes, slowest close {slowest:?}"
    );
    // The pool is 16 small blocks: nothing the receiver does for a hostile stream needs more than
    // a few MiB, whatever length a header claims (claims of 1 GiB to 4 GiB were sent).
    assert!(largest < 16 << 20, "an allocation of {largest} bytes while fuzzing");
    // Every connection was closed within the idle timeout, plus slack for a loaded machine.
    assert!(slowest < Duration::from_secs(5), "a hostile stream held its connection for {slowest:?}");
    // No reservation was left pinned: each one pinned was aborted once, and no garbage completed
    // one. (A mutated HELLO may name another stream's reservation: the gate refuses a second
    // begin, so it changes nothing.)
    for r in reservations {
        let c = gate.calls(r);
        assert!(c.completes == 0 && c.aborts.len() <= 1, "reservation {r}: {c:?}");
        if c.state != State::Reserved {
            let c = gate.settled(r).await;
            assert_eq!((c.aborts.len(), c.state), (1, State::Released), "reservation {r}: {c:?}");
        }
    }
    // And a valid transfer still goes through, byte for byte.
    let sender = KvSender::new(LAYOUT, SenderOptions::default());
    let mut src = CpuKvPool::new(LAYOUT);
    let bb = LAYOUT.block_bytes();
    for l in 0..LAYOUT.num_layers {
        let k: Vec<u8> = (0..bb).map(|i| (i * 3 + l) as u8).collect();
        src.write_block_bytes(l, 4, &k, &k).unwrap();
    }
    gate.add(1, vec![7]);
    let mut s = sender.open(&common::destination(&rx, TransportKind::Tcp, 1, &[7], 0)).await.unwrap();
    s.stage_from(&src, &[4]).unwrap();
    s.finish().await.unwrap();
    assert_eq!(gate.settled(1).await.state, State::Filled);
    for l in 0..LAYOUT.num_layers {
        assert_eq!(src.block_bytes(l, 4), dst.block_bytes(l, 7));
    }
    let c = rx.counters();
    assert!(c.failures > 0, "{c:?}");
    rx.shutdown().await;
}
