//! cuda-ipc and nccl at the transport level.
//!
//! Without a GPU: a host pool offers neither, a GPU HELLO sent to it is refused by name before
//! any reservation is pinned, and a sender without a GPU pool refuses GPU destinations naming
//! why. With a GPU (skipped visibly without one, failing under `TANDEM_REQUIRE_GPU=1`): a
//! cuda-ipc transfer between two pools of this process (cuda:0 to cuda:0, and to cuda:1 when
//! there is one) leaves the destination blocks byte for byte equal to the source, in scattered
//! block orders, and a session dropped before it staged leaves the reservation released.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::{State, TestGate};
use tandem_engine::kv::{BlockId, CpuKvPool, KvBlockSink, KvDtype, KvLayout};
use tandem_transport::wire::{self, tag, Hello, NcclHello};
use tandem_transport::{
    block_payload_bytes, KvDestination, KvReceiver, KvSender, ReceiverOptions, SenderOptions, TransportError,
    TransportKind,
};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    num_blocks: 16,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F32,
};

async fn bind(sink: Arc<dyn KvBlockSink>, gate: Arc<TestGate>) -> KvReceiver {
    KvReceiver::bind(SocketAddr::from(([127, 0, 0, 1], 0)), sink, gate, ReceiverOptions::default())
        .await
        .unwrap()
}

fn hello(kind: TransportKind, reservation: u64, ext: Vec<u8>) -> Vec<u8> {
    let h = Hello {
        transport: kind,
        reservation,
        num_blocks: 2,
        block_payload_bytes: block_payload_bytes(&LAYOUT) as u64,
        num_layers: LAYOUT.num_layers as u32,
        block_size: LAYOUT.block_size as u32,
        num_kv_heads: LAYOUT.num_kv_heads as u32,
        head_dim: LAYOUT.head_dim as u32,
        layout: LAYOUT.name().into(),
        segment_path: String::new(),
        token: None,
        ext,
        adapter_id: String::new(),
    };
    let mut b = wire::preamble(wire::KV_WIRE_VERSION).to_vec();
    b.extend_from_slice(&wire::frame(tag::HELLO, &h.encode()));
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_hellos_to_a_host_pool_are_refused_by_name() {
    let pool = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let gate = Arc::new(TestGate::default());
    let rx = bind(pool.sink(), gate.clone()).await;
    let kinds: Vec<TransportKind> = rx.offers().into_iter().map(|o| o.kind).collect();
    assert_eq!(kinds, [TransportKind::Shm, TransportKind::Tcp], "a host pool offers no GPU transport");
    assert!(rx.cuda_ipc_unavailable().unwrap().contains("host memory"));
    assert!(rx.nccl_unavailable().unwrap().contains("host memory"));

    let nccl = NcclHello { comm_key: 5, unique_id: Some([1; 128]) }.encode();
    for (r, kind, ext, words) in [
        (1, TransportKind::CudaIpc, vec![0u8; 64], "offers no cuda-ipc"),
        (2, TransportKind::Nccl, nccl, "offers no nccl"),
    ] {
        gate.add(r, vec![0, 1]);
        let answer = common::exchange(rx.local_addr(), &hello(kind, r, ext), false).await;
        assert_eq!(answer.first(), Some(&tag::ERROR), "{kind}: {answer:?}");
        let text = String::from_utf8_lossy(&answer[wire::FRAME_HEADER_BYTES..]).into_owned();
        assert!(text.contains(words) && text.contains(&format!("reservation {r}")), "{kind}: {text}");
        let calls = gate.calls(r);
        assert_eq!((calls.state, calls.begins), (State::Reserved, 0), "{kind}: nothing is pinned");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_without_a_gpu_pool_refuses_gpu_destinations() {
    let sender = KvSender::new(LAYOUT, SenderOptions::default());
    assert_eq!(sender.kinds(), [TransportKind::Shm, TransportKind::Tcp]);
    assert!(sender
        .offers()
        .iter()
        .all(|o| o.kind != TransportKind::CudaIpc && o.kind != TransportKind::Nccl));
    for kind in [TransportKind::CudaIpc, TransportKind::Nccl] {
        let dest = KvDestination {
            transport: kind,
            address: "127.0.0.1:9".into(),
            reservation_id: 1,
            block_ids: vec![0, 1],
            ipc_handle: vec![0; 64],
            pool_blocks: 16,
            ..Default::default()
        };
        let e = sender.open(&dest).await.unwrap_err();
        assert!(matches!(e, TransportError::Invalid(_)), "{kind}: {e}");
        let m = e.to_string();
        assert!(m.contains(&format!("{kind} is not available")) && m.contains("host memory"), "{kind}: {m}");
    }
    assert_eq!(sender.counters().failures, 2, "both refusals are counted");
}

/// Every layer's K and V of `block`.
fn block(sink: &dyn KvBlockSink, b: BlockId) -> Vec<u8> {
    let n = LAYOUT.block_bytes();
    let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
    let mut out = Vec::new();
    for layer in 0..LAYOUT.num_layers {
        // SAFETY: no transfer is in flight.
        unsafe { sink.read_block(layer, b, &mut k, &mut v) }.unwrap();
        out.extend_from_slice(&k);
        out.extend_from_slice(&v);
    }
    out
}

async fn cuda_ipc_between(from: usize, to: usize) {
    let (src, src_sink) = tandem_engine::cuda::allocate_kv_pool(from, LAYOUT).unwrap();
    let (_dst, dst_sink) = tandem_engine::cuda::allocate_kv_pool(to, LAYOUT).unwrap();
    let n = LAYOUT.block_bytes();
    for b in 0..LAYOUT.num_blocks as BlockId {
        for layer in 0..LAYOUT.num_layers {
            let k: Vec<u8> = (0..n).map(|i| (i as u32 * 7 + b * 31 + layer as u32 * 3) as u8).collect();
            let v: Vec<u8> = k.iter().map(|x| x ^ 0x5a).collect();
            // SAFETY: nothing else uses the fresh pool.
            unsafe { src_sink.write_block(layer, b, &k, &v) }.unwrap();
        }
    }
    let gate = Arc::new(TestGate::default());
    let rx = bind(dst_sink.clone(), gate.clone()).await;
    let offer = rx
        .offers()
        .into_iter()
        .find(|o| o.kind == TransportKind::CudaIpc)
        .expect("a GPU pool offers cuda-ipc");
    assert_eq!((offer.ipc_handle.len(), offer.pool_blocks), (64, LAYOUT.num_blocks as u32));
    assert!(offer.device_uuid.starts_with("GPU-"), "{}", offer.device_uuid);
    let sender = KvSender::new(LAYOUT, SenderOptions { device: Some(src.clone()), ..Default::default() });
    assert!(sender.kinds().contains(&TransportKind::CudaIpc));
    let source = Arc::new(src.clone());

    // Scattered orders on both sides: runs of one, of three, and reversed ids.
    let cases: [(u64, Vec<BlockId>, Vec<BlockId>); 3] = [
        (1, vec![0, 1, 2, 9, 4], vec![5, 6, 7, 15, 0]),
        (2, vec![3], vec![12]),
        (3, vec![8, 7, 6], vec![1, 2, 3]),
    ];
    for (r, from_blocks, to_blocks) in cases {
        gate.add(r, to_blocks.clone());
        let dest = common::destination(&rx, TransportKind::CudaIpc, r, &to_blocks, 0);
        let mut session = sender.open(&dest).await.unwrap();
        let (s, b) = (source.clone(), from_blocks.clone());
        let session = tokio::task::spawn_blocking(move || session.stage_from(&*s, &b).map(|()| session))
            .await
            .unwrap()
            .unwrap();
        let report = session.finish().await.unwrap();
        assert_eq!(report.transport, TransportKind::CudaIpc);
        assert_eq!(gate.settled(r).await.state, State::Filled);
        for (&f, &t) in from_blocks.iter().zip(&to_blocks) {
            assert_eq!(
                block(&*dst_sink, t),
                block(&*src_sink, f),
                "cuda:{from} block {f} -> cuda:{to} block {t}"
            );
        }
    }
    // Cancelled after open, before staging: the reservation is released, nothing completes.
    gate.add(9, vec![10, 11]);
    let dest = common::destination(&rx, TransportKind::CudaIpc, 9, &[10, 11], 0);
    drop(sender.open(&dest).await.unwrap());
    let calls = gate.settled(9).await;
    assert_eq!((calls.state, calls.completes, calls.aborts.len()), (State::Released, 0, 1), "{calls:?}");
    rx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_moves_exact_bytes_between_gpu_pools() {
    if !tandem_test_support::gpu_for_test(
        "cuda_ipc_moves_exact_bytes_between_gpu_pools",
        0,
        tandem_engine::cuda::probe(0),
    ) {
        return;
    }
    cuda_ipc_between(0, 0).await;
    if tandem_engine::cuda::probe(1).is_ok() {
        cuda_ipc_between(0, 1).await;
    } else {
        eprintln!("cuda_ipc_moves_exact_bytes_between_gpu_pools: one GPU; the two-GPU case did not run");
    }
}
