//! KV parity across the transports on tiny real models: a prefill backend computes a prompt, its
//! blocks go over tcp and over shm into a decode backend's reserved blocks (different ids), every
//! layer's K and V bytes at the destination equal the source's, and decoding continued on the
//! decode backend gives exactly the single-process result.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use common::{State, TestGate};
use tandem_engine::backend::{Backend, BackendOptions, LogitsRequest, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::{BlockAllocator, BlockId, WriteMode};
use tandem_engine::loader::load_model;
use tandem_transport::{KvDestination, KvReceiver, KvSender, ReceiverOptions, SenderOptions, TransportKind};

const BS: usize = 4;
const BLOCKS: usize = 32;

fn backend(name: &str, kv_shared: bool) -> CpuBackend {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name))
        .unwrap();
    let opts = BackendOptions {
        num_blocks: BLOCKS,
        block_size: BS,
        max_batch_tokens: 64,
        kv_shared,
        ..Default::default()
    };
    CpuBackend::new(m.config, m.weights, opts).unwrap()
}

fn step(be: &mut CpuBackend, tokens: &[u32], start: usize, table: &[BlockId]) -> Vec<f32> {
    let c = SeqChunk {
        tokens,
        start_pos: start,
        block_table: table,
        logits: LogitsRequest::Last,
        write: WriteMode::Direct,
        adapter: None,
    };
    be.forward(&[c]).unwrap().remove(0)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn kv_bytes_and_continuation_match_over_tcp_and_shm() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for name in ["llama-gqa", "qwen3"] {
        for kind in [TransportKind::Tcp, TransportKind::Shm] {
            let mut p = backend(name, false);
            let mut d = backend(name, true);
            let vocab = p.config().vocab_size as u32;
            let prompt: Vec<u32> = (0..13u32).map(|i| (i * 37 + 5) % vocab).collect();
            let steps = 6;

            // P: the prompt's blocks come after another sequence's, so ids differ from D's.
            let mut alloc = BlockAllocator::new(BLOCKS, BS);
            alloc.add_sequence(99, 9).unwrap();
            alloc.add_sequence(1, prompt.len() + steps).unwrap();
            let p_table = alloc.block_table(1).unwrap().to_vec();
            let n = prompt.len().div_ceil(BS);
            let logits = step(&mut p, &prompt, 0, &p_table);
            let first = argmax(&logits);

            // D: a reservation of scattered blocks for the prompt, plus blocks to decode into.
            let d_table: Vec<BlockId> = vec![17, 3, 29, 8, 21, 12];
            assert!(d_table.len() * BS >= prompt.len() + steps);
            let gate = Arc::new(TestGate::default());
            gate.add(7, d_table[..n].to_vec());

            let report = rt.block_on(async {
                let rx = KvReceiver::bind(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    d.kv_sink().unwrap(),
                    gate.clone(),
                    ReceiverOptions::default(),
                )
                .await
                .unwrap();
                let offer = rx.offers().into_iter().find(|o| o.kind == kind).unwrap();
                let dest = KvDestination {
                    worker_id: "d".into(),
                    transport: kind,
                    address: offer.address.clone(),
                    segment_path: offer.segment_path.clone(),
                    reservation_id: 7,
                    block_ids: d_table[..n].to_vec(),
                    skip_blocks: 0,
                    ..Default::default()
                };
                let sender = KvSender::new(p.kv_layout(), SenderOptions::default());
                let mut session = sender.open(&dest).await.unwrap();
                // The engine thread's part.
                session.stage(&p, &p_table[..n]).unwrap();
                let report = session.finish().await.unwrap();
                assert_eq!(gate.settled(7).await.state, State::Filled);
                let c = rx.counters();
                assert_eq!((c.transfers, c.failures, c.bytes), (1, 0, report.bytes));
                assert_eq!(sender.counters().transfers, 1);
                rx.shutdown().await;
                report
            });
            let layout = p.kv_layout();
            assert_eq!(report.blocks, n);
            assert_eq!(report.bytes as usize, n * 2 * layout.num_layers * layout.block_bytes());

            // KV parity: every layer, K and V, byte for byte.
            for l in 0..layout.num_layers {
                for i in 0..n {
                    let (pk, pv) = p.read_block(l, p_table[i]).unwrap();
                    let (dk, dv) = d.read_block(l, d_table[i]).unwrap();
                    assert!(pk.iter().any(|&b| b != 0), "{name}: source block is empty");
                    assert_eq!(pk, dk, "{name} {kind}: layer {l} block {i} K differs");
                    assert_eq!(pv, dv, "{name} {kind}: layer {l} block {i} V differs");
                }
            }

            // Continuation: D decodes from the transferred cache exactly as P does in one process.
            let (mut tp, mut td) = (first, first);
            for s in 0..steps {
                let pos = prompt.len() + s;
                let lp = step(&mut p, &[tp], pos, &p_table);
                let ld = step(&mut d, &[td], pos, &d_table);
                assert_eq!(bits(&lp), bits(&ld), "{name} {kind}: logits differ at step {s}");
                tp = argmax(&lp);
                td = argmax(&ld);
            }
            assert_eq!(tp, td);
        }
    }
}
