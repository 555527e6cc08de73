//! The LoRA adapter a transfer's blocks were computed under: the HELLO carries its id as an
//! optional trailing field (a HELLO without one is encoded as before adapters), and the receiver
//! refuses a transfer whose id differs from the one its reservation was made for, naming both,
//! before any block is written; the reservation is aborted exactly once and the receiver serves on.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{error_message, exchange, State, TestGate};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_transport::wire::{self, tag, Hello};
use tandem_transport::{
    block_payload_bytes, KvReceiver, KvSender, KvToken, ReceiverOptions, SenderOptions, TransportError,
    TransportKind,
};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 2,
    num_blocks: 16,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F16,
};

const A: &str = "0123456789abcdef0123456789abcdef";
const B: &str = "fedcba9876543210fedcba9876543210";

fn hello(adapter_id: &str) -> Hello {
    Hello {
        transport: TransportKind::Tcp,
        reservation: 7,
        num_blocks: 2,
        block_payload_bytes: block_payload_bytes(&LAYOUT) as u64,
        num_layers: LAYOUT.num_layers as u32,
        block_size: LAYOUT.block_size as u32,
        num_kv_heads: LAYOUT.num_kv_heads as u32,
        head_dim: LAYOUT.head_dim as u32,
        layout: LAYOUT.name().into(),
        segment_path: String::new(),
        token: Some(KvToken([3; 32])),
        ext: Vec::new(),
        adapter_id: adapter_id.into(),
    }
}

/// A tcp HELLO body as the wire table describes it, field by field, without the adapter id:
/// what a sender before adapters wrote.
fn legacy_body(h: &Hello) -> Vec<u8> {
    let mut b = vec![1u8]; // tcp
    b.extend_from_slice(&h.reservation.to_le_bytes());
    b.extend_from_slice(&h.num_blocks.to_le_bytes());
    b.extend_from_slice(&h.block_payload_bytes.to_le_bytes());
    for d in [h.num_layers, h.block_size, h.num_kv_heads, h.head_dim] {
        b.extend_from_slice(&d.to_le_bytes());
    }
    for f in [h.layout.as_bytes(), h.segment_path.as_bytes(), &h.token.as_ref().unwrap().0[..]] {
        b.extend_from_slice(&(f.len() as u16).to_le_bytes());
        b.extend_from_slice(f);
    }
    b
}

#[test]
fn hellos_round_trip_with_and_without_an_adapter_id() {
    // Without: exactly the encoding before adapters, both ways.
    let base = hello("");
    assert_eq!(base.encode(), legacy_body(&base));
    assert_eq!(Hello::decode(&legacy_body(&base)).unwrap(), base);
    // With: the same fields, then the id.
    let with = hello(A);
    let b = with.encode();
    let mut expected = legacy_body(&base);
    expected.extend_from_slice(&(A.len() as u16).to_le_bytes());
    expected.extend_from_slice(A.as_bytes());
    assert_eq!(b, expected);
    let back = Hello::decode(&b).unwrap();
    assert_eq!(back, with);
    assert_eq!(back.adapter_id, A);
    // A kind with an extension carries the id after it.
    let nixl = Hello { transport: TransportKind::Nixl, ext: b"agent-d".to_vec(), ..hello(B) };
    let back = Hello::decode(&nixl.encode()).unwrap();
    assert_eq!((back.ext.as_slice(), back.adapter_id.as_str()), (&b"agent-d"[..], B));
    // Malformed ids are refused by name; a lone trailing byte is still trailing garbage.
    let mut one = legacy_body(&base);
    one.push(0);
    assert!(Hello::decode(&one).unwrap_err().contains("trailing"));
    let mut long = legacy_body(&base);
    let n = wire::MAX_ADAPTER_ID_BYTES + 1;
    long.extend_from_slice(&(n as u16).to_le_bytes());
    long.extend(std::iter::repeat_n(b'a', n));
    assert!(Hello::decode(&long).unwrap_err().contains("adapter id"));
}

fn source_pool() -> CpuKvPool {
    let mut p = CpuKvPool::new(LAYOUT);
    let bb = LAYOUT.block_bytes();
    for b in 0..LAYOUT.num_blocks as BlockId {
        for l in 0..LAYOUT.num_layers {
            let k: Vec<u8> = (0..bb).map(|i| (i as u32 * 13 + b * 29 + l as u32 * 7 + 1) as u8).collect();
            let v: Vec<u8> = k.iter().map(|x| x ^ 0xa5).collect();
            p.write_block_bytes(l, b, &k, &v).unwrap();
        }
    }
    p
}

fn block_bytes(pool: &CpuKvPool, blocks: &[BlockId]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for &b in blocks {
        for l in 0..LAYOUT.num_layers {
            let (k, v) = pool.block_bytes(l, b);
            out.push([k, v].concat());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_refuses_a_transfer_under_another_adapter_before_writing_a_block() {
    let dst = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let gate = Arc::new(TestGate::default());
    let opts = ReceiverOptions { io_timeout: Duration::from_millis(400), ..Default::default() };
    let rx = KvReceiver::bind(SocketAddr::from(([127, 0, 0, 1], 0)), dst.sink(), gate.clone(), opts)
        .await
        .unwrap();
    let src = source_pool();
    let sender = KvSender::new(LAYOUT, SenderOptions::default());
    let src_blocks: Vec<BlockId> = vec![3, 11];
    let mut next = 100u64;
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        // (reservation's adapter, transfer's adapter, accepted)
        for (made_for, sent_under, ok) in
            [(A, B, false), (A, "", false), ("", A, false), (A, A, true), ("", "", true)]
        {
            next += 1;
            let r = next;
            let blocks: Vec<BlockId> = vec![(r % 8) as BlockId, (r % 8 + 8) as BlockId];
            gate.add(r, blocks.clone());
            if !made_for.is_empty() {
                gate.set_adapter(r, made_for);
            }
            let before = block_bytes(&dst, &blocks);
            let dest = common::destination(&rx, kind, r, &blocks, 0);
            let opened = sender.open_for_adapter(&dest, sent_under).await;
            let case = format!("{kind}: reservation under {made_for:?}, transfer under {sent_under:?}");
            if ok {
                let mut s = opened.unwrap_or_else(|e| panic!("{case}: {e}"));
                s.stage_from(&src, &src_blocks).unwrap();
                s.finish().await.unwrap();
                let c = gate.settled(r).await;
                assert_eq!(
                    (c.begins, c.completes, c.aborts.len(), c.state),
                    (1, 1, 0, State::Filled),
                    "{case}"
                );
                assert_eq!(block_bytes(&dst, &blocks), block_bytes(&src, &src_blocks), "{case}");
                continue;
            }
            let Err(e) = opened else { panic!("{case}: accepted") };
            let TransportError::Refused { msg, .. } = &e else { panic!("{case}: {e}") };
            assert!(msg.contains(&format!("reservation {r} was made for")), "{case}: {msg}");
            for id in [made_for, sent_under] {
                let named =
                    if id.is_empty() { "the base model".to_owned() } else { format!("adapter id {id}") };
                assert!(msg.contains(&named), "{case}: {msg} should name {named}");
            }
            let c = gate.settled(r).await;
            assert_eq!(
                (c.begins, c.completes, c.aborts.len(), c.state),
                (1, 0, 1, State::Released),
                "{case}"
            );
            assert_eq!(block_bytes(&dst, &blocks), before, "{case}: a refused transfer wrote blocks");
        }
    }
    // A raw HELLO under another adapter gets the same ERROR, and no OK.
    next += 1;
    gate.add(next, vec![0, 1]);
    gate.set_adapter(next, B);
    let mut h = hello(A);
    (h.reservation, h.token) = (next, None);
    let mut opening = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
    opening.extend_from_slice(&wire::frame(tag::HELLO, &h.encode()));
    let answer = exchange(rx.local_addr(), &opening, true).await;
    assert!(common::frames(&answer).iter().all(|(t, _)| *t != tag::OK));
    let msg = error_message(&answer);
    assert!(msg.contains(A) && msg.contains(B), "{msg}");
    let c = rx.counters();
    assert_eq!((c.transfers, c.failures), (4, 7), "{c:?}");
    rx.shutdown().await;
}
