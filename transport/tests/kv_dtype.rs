//! The KV dtype is part of the layout name a transfer checks: pools of different dtypes never
//! exchange a byte, over tcp (the receiver refuses the HELLO by name) or shm (the sender refuses
//! the segment, whose header names the dtype); pools of one 16-bit dtype move blocks intact, at
//! half the bytes of f32.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::{State, TestGate};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_transport::{
    block_payload_bytes, KvDestination, KvReceiver, KvSender, ReceiverOptions, SenderOptions, TransportError,
    TransportKind,
};

fn layout(dtype: KvDtype) -> KvLayout {
    KvLayout { num_layers: 2, num_blocks: 8, block_size: 4, num_kv_heads: 2, head_dim: 8, dtype }
}

/// A pool whose every value differs (as f32, before its conversion to the dtype).
fn filled(l: KvLayout) -> CpuKvPool {
    let mut p = CpuKvPool::new(l);
    let te = l.token_elems();
    for layer in 0..l.num_layers {
        for slot in 0..l.num_slots() {
            let k: Vec<f32> = (0..te).map(|e| (layer * 1000 + slot * 10 + e) as f32 * 0.013 + 0.1).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            p.write_token(layer, slot, &k, &v).unwrap();
        }
    }
    p
}

fn dest(rx: &KvReceiver, kind: TransportKind, reservation: u64, blocks: &[BlockId]) -> KvDestination {
    common::destination(rx, kind, reservation, blocks, 0)
}

#[test]
fn pools_of_different_dtypes_refuse_each_other_by_name() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let d = CpuKvPool::try_new_shared(layout(KvDtype::F16)).unwrap();
        let gate = Arc::new(TestGate::default());
        let rx = KvReceiver::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            d.sink(),
            gate.clone(),
            ReceiverOptions::default(),
        )
        .await
        .unwrap();
        let sender = KvSender::new(layout(KvDtype::F32), SenderOptions::default());

        // tcp: D refuses the HELLO, naming both layouts; the reservation is never pinned.
        gate.add(1, vec![3, 5]);
        let e = sender.open(&dest(&rx, TransportKind::Tcp, 1, &[3, 5])).await.unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("layout `tandem-f32-lkv-v1` vs `tandem-f16-lkv-v1`"),
            "the refusal should name both layouts: {msg}"
        );
        assert_eq!(gate.calls(1).begins, 0, "a refused HELLO pinned the reservation");

        // shm: P maps D's segment, reads the dtype from its header and refuses before writing.
        gate.add(2, vec![3, 5]);
        let e = sender.open(&dest(&rx, TransportKind::Shm, 2, &[3, 5])).await.unwrap_err();
        assert!(matches!(e, TransportError::Invalid(_)), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("dtype: f16 vs f32") && msg.contains("tandem-f16-lkv-v1"), "{msg}");
        assert_eq!(gate.calls(2).begins, 0);
        let untouched = |b: BlockId| {
            (0..2).all(|l| {
                let (k, v) = d.block_bytes(l, b);
                k.iter().chain(v).all(|&x| x == 0)
            })
        };
        assert!(untouched(3) && untouched(5), "bytes reached the destination pool");
        rx.shutdown().await;
    });
}

#[test]
fn a_16_bit_pool_moves_intact_at_half_the_bytes_of_f32() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for dtype in [KvDtype::F16, KvDtype::Bf16] {
        for kind in [TransportKind::Tcp, TransportKind::Shm] {
            let l = layout(dtype);
            assert_eq!(2 * block_payload_bytes(&l), block_payload_bytes(&layout(KvDtype::F32)));
            let src = filled(l);
            let d = CpuKvPool::try_new_shared(l).unwrap();
            let gate = Arc::new(TestGate::default());
            let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = (vec![6, 1, 4], vec![2, 7, 0]);
            gate.add(9, dst_blocks.clone());
            let bytes = rt.block_on(async {
                let rx = KvReceiver::bind(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    d.sink(),
                    gate.clone(),
                    ReceiverOptions::default(),
                )
                .await
                .unwrap();
                let sender = KvSender::new(l, SenderOptions::default());
                let mut s = sender.open(&dest(&rx, kind, 9, &dst_blocks)).await.unwrap();
                s.stage_from(&src, &src_blocks).unwrap();
                let report = s.finish().await.unwrap();
                assert_eq!(gate.settled(9).await.state, State::Filled);
                rx.shutdown().await;
                report.bytes
            });
            assert_eq!(bytes as usize, src_blocks.len() * block_payload_bytes(&l), "{dtype} {kind}");
            for layer in 0..l.num_layers {
                for (&sb, &db) in src_blocks.iter().zip(&dst_blocks) {
                    assert_eq!(
                        src.block_bytes(layer, sb),
                        d.block_bytes(layer, db),
                        "{dtype} {kind} layer {layer}"
                    );
                }
            }
        }
    }
}
