//! The nixl kind over NIXL's UCX backend on this host: blocks arrive intact in scattered
//! destination blocks over several groups, bad metadata and stale agents are refused by name
//! before a byte is written, and a missing library is a refusal, never an abort.
//!
//! The library comes from `TANDEM_NIXL_LIB` (scripts/test.sh sets it from
//! scripts/fetch-nixl.sh); without it the tests that need it skip, and fail under
//! `TANDEM_REQUIRE_EXTERNAL=1`.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{destination, State, TestGate};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_test_support::{skip_test, Prerequisite};
use tandem_transport::{
    nixl, KvBlockSource, KvReceiver, KvSender, NixlConfig, ReceiverOptions, SenderOptions, TransportError,
    TransportKind,
};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    num_blocks: 40,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 16,
    dtype: KvDtype::F16,
};

/// The library directory, or `None` after reporting the skip.
fn library(test: &str) -> Option<PathBuf> {
    match std::env::var_os(nixl::LIBRARY_ENV).filter(|v| !v.is_empty()).map(PathBuf::from) {
        Some(d) => Some(d),
        None => {
            skip_test(
                Prerequisite::External,
                test,
                "TANDEM_NIXL_LIB is not set (no NIXL library)",
                "run scripts/fetch-nixl.sh and set TANDEM_NIXL_LIB to the directory it prints",
            );
            None
        }
    }
}

fn config(dir: &Path) -> Option<NixlConfig> {
    Some(NixlConfig { lib_dir: Some(dir.to_path_buf()), ..Default::default() })
}

/// A pool whose every block of every layer holds bytes derived from (seed, layer, block).
fn filled_pool(seed: u8) -> CpuKvPool {
    let mut pool = CpuKvPool::try_new(LAYOUT).unwrap();
    let n = LAYOUT.block_bytes();
    for l in 0..LAYOUT.num_layers {
        for b in 0..LAYOUT.num_blocks {
            let k: Vec<u8> = (0..n)
                .map(|i| (i as u8) ^ seed ^ (l as u8).wrapping_mul(31) ^ (b as u8).wrapping_mul(7))
                .collect();
            let v: Vec<u8> = k.iter().map(|x| x.wrapping_add(101)).collect();
            pool.write_block_bytes(l, b as BlockId, &k, &v).unwrap();
        }
    }
    pool
}

/// A source that reads blocks but lends no memory (as a GPU pool).
struct Unlent<'a>(&'a CpuKvPool);

impl KvBlockSource for Unlent<'_> {
    fn source_layout(&self) -> KvLayout {
        self.0.layout()
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
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

#[test]
fn blocks_arrive_intact_over_several_groups_into_scattered_blocks() {
    let Some(dir) = library("blocks_arrive_intact_over_several_groups_into_scattered_blocks") else { return };
    let src = filled_pool(3);
    let dst = CpuKvPool::try_new(LAYOUT).unwrap();
    // Runs of consecutive ids (merged into one descriptor per layer and K or V) and jumps.
    let dest: Vec<BlockId> = vec![5, 6, 7, 20, 21, 2, 30, 31, 32, 33, 11, 9, 10];
    let from: Vec<BlockId> = vec![1, 2, 3, 4, 8, 9, 12, 13, 14, 15, 16, 0, 39];
    let gate = Arc::new(TestGate::default());
    gate.add(1, dest.clone());
    gate.add(2, dest[..4].to_vec());
    let payload = 2 * LAYOUT.num_layers * LAYOUT.block_bytes();
    rt().block_on(async {
        let rx = KvReceiver::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            dst.sink(),
            gate.clone(),
            ReceiverOptions { nixl: config(&dir), ..Default::default() },
        )
        .await
        .unwrap();
        assert_eq!(rx.unavailable(TransportKind::Nixl), None);
        // Groups of three blocks: five groups, both staging halves used twice.
        let sender = KvSender::new(
            LAYOUT,
            SenderOptions { nixl: config(&dir), group_bytes: 3 * payload, ..Default::default() },
        );
        assert!(sender.offers().iter().any(|o| o.kind == TransportKind::Nixl));
        // Reservation 1 from a source that cannot lend its memory (through the staging halves),
        // reservation 2 from the pool itself (registered, written in place).
        for (res, n) in [(1u64, dest.len()), (2, 4)] {
            let d = destination(&rx, TransportKind::Nixl, res, &dest[..n], 0);
            let mut session = sender.open(&d).await.unwrap();
            if res == 1 {
                session.stage_from(&Unlent(&src), &from[..n]).unwrap();
            } else {
                session.stage_from(&src, &from[..n]).unwrap();
            }
            let report = session.finish().await.unwrap();
            assert_eq!((report.blocks, report.bytes as usize), (n, n * payload));
            assert_eq!(gate.settled(res).await.state, State::Filled);
        }
        let c = rx.counters_of(TransportKind::Nixl);
        assert_eq!((c.transfers, c.failures), (2, 0));
        rx.shutdown().await;
    });
    for l in 0..LAYOUT.num_layers {
        for (i, (&s, &d)) in from.iter().zip(&dest).enumerate() {
            assert_eq!(src.block_bytes(l, s), dst.block_bytes(l, d), "layer {l} block {i}");
        }
    }
    // Blocks outside the reservation were not touched.
    for l in 0..LAYOUT.num_layers {
        for b in (0..LAYOUT.num_blocks as BlockId).filter(|b| !dest.contains(b)) {
            let (k, v) = dst.block_bytes(l, b);
            assert!(k.iter().chain(v).all(|&x| x == 0), "layer {l} block {b} was written");
        }
    }
}

#[test]
fn bad_metadata_and_stale_agents_are_refused_by_name_before_any_write() {
    let Some(dir) = library("bad_metadata_and_stale_agents_are_refused_by_name_before_any_write") else {
        return;
    };
    let src = filled_pool(9);
    let gate = Arc::new(TestGate::default());
    gate.add(1, vec![0, 1]);
    let dst_old = CpuKvPool::try_new(LAYOUT).unwrap();
    let dst_new = CpuKvPool::try_new(LAYOUT).unwrap();
    rt().block_on(async {
        let opts = || ReceiverOptions { nixl: config(&dir), ..Default::default() };
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let old = KvReceiver::bind(any, dst_old.sink(), gate.clone(), opts()).await.unwrap();
        let new = KvReceiver::bind(any, dst_new.sink(), gate.clone(), opts()).await.unwrap();
        let sender = KvSender::new(LAYOUT, SenderOptions { nixl: config(&dir), ..Default::default() });
        let good = destination(&old, TransportKind::Nixl, 1, &[0, 1], 0);

        let refused = |r: Result<_, TransportError>| match r {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        };
        let mut truncated = good.clone();
        truncated.nixl_metadata.truncate(truncated.nixl_metadata.len() - 5);
        let e = refused(sender.open(&truncated).await);
        assert!(e.contains("nixl metadata: truncated in agent metadata"), "{e}");
        let mut foreign = good.clone();
        foreign.nixl_metadata = b"{\"agent\": \"someone else\"}".to_vec();
        let e = refused(sender.open(&foreign).await);
        assert!(e.contains("not Tandem's nixl metadata"), "{e}");
        let mut none = good.clone();
        none.nixl_metadata.clear();
        assert!(refused(sender.open(&none).await).contains("no nixl metadata"));
        let mut shape = good.clone();
        let other = KvLayout { head_dim: 8, ..LAYOUT };
        let env = nixl::Envelope::decode(&good.nixl_metadata).unwrap();
        shape.nixl_metadata = nixl::Envelope { layout: other, ..env }.encode();
        let e = refused(sender.open(&shape).await);
        assert!(e.contains("head_dim: 8 vs 16"), "{e}");
        let mut far = good.clone();
        far.block_ids = vec![0, LAYOUT.num_blocks as BlockId];
        assert!(refused(sender.open(&far).await).contains("outside the destination pool"));

        // The old agent's metadata sent to another worker (say, a restarted one on the same
        // address): refused in the handshake, before the reservation is pinned.
        let mut stale = good.clone();
        stale.address = destination(&new, TransportKind::Nixl, 1, &[0, 1], 0).address;
        let e = refused(sender.open(&stale).await);
        assert!(e.contains("this worker's agent is") && e.contains("restarted?"), "{e}");
        assert_eq!(gate.calls(1).begins, 0);

        // The right destination still works afterwards.
        let mut s = sender.open(&good).await.unwrap();
        s.stage_from(&src, &[4, 5]).unwrap();
        s.finish().await.unwrap();
        assert_eq!(gate.settled(1).await.state, State::Filled);
        old.shutdown().await;
        new.shutdown().await;
    });
    let (k, v) = dst_new.block_bytes(0, 0);
    assert!(k.iter().chain(v).all(|&x| x == 0), "the other worker's pool was written");
    assert_eq!(src.block_bytes(2, 5), dst_old.block_bytes(2, 1));
}

#[test]
fn a_missing_library_is_refused_by_name_not_an_abort() {
    let nowhere = std::env::temp_dir().join(format!("tandem-no-nixl-{}", std::process::id()));
    let e = tandem_transport::nixl_library(Some(&nowhere)).unwrap_err();
    assert!(e.contains("NIXL is not available") && e.contains("libnixl_capi.so"), "{e}");
    assert!(e.contains("no such file") && e.contains("scripts/fetch-nixl.sh"), "{e}");
    // A directory holding some other library under the name: refused, naming the symbol.
    // (Another directory: a load's outcome is remembered per path for the process's life.)
    let fake = nowhere.join("fake");
    std::fs::create_dir_all(&fake).unwrap();
    let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    if let Some(libc) = libc {
        std::fs::copy(libc, fake.join(nixl::CAPI)).unwrap();
        let e = tandem_transport::nixl_library(Some(&fake)).unwrap_err();
        assert!(e.contains("is not NIXL's C API: symbol nixl_capi_"), "{e}");
    }
    // Workers with such a setting offer no nixl, and say why.
    let cfg = Some(NixlConfig { lib_dir: Some(nowhere.join("missing")), ..Default::default() });
    let sender = KvSender::new(LAYOUT, SenderOptions { nixl: cfg.clone(), ..Default::default() });
    assert!(!sender.offers().iter().any(|o| o.kind == TransportKind::Nixl));
    assert!(sender.why_not(TransportKind::Nixl).contains("NIXL is not available"));
    let pool = CpuKvPool::try_new(LAYOUT).unwrap();
    rt().block_on(async {
        let gate = Arc::new(TestGate::default());
        let rx = KvReceiver::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            pool.sink(),
            gate,
            ReceiverOptions { nixl: cfg, ..Default::default() },
        )
        .await
        .unwrap();
        assert!(rx.offers().iter().all(|o| o.kind != TransportKind::Nixl));
        assert!(rx.unavailable(TransportKind::Nixl).unwrap().contains("NIXL is not available"));
        // Without the option, nixl is not loaded at all, and says how to turn it on.
        let off = KvSender::new(LAYOUT, SenderOptions::default());
        assert!(off.why_not(TransportKind::Nixl).contains("--transport nixl"));
        rx.shutdown().await;
    });
    let _ = std::fs::remove_dir_all(&nowhere);
}

/// Two workers whose agents start at the same moment and then send to each other at once (the
/// case where two UCX agents connecting to each other simultaneously could hang), 20 times:
/// every transfer completes, within the sender's deadlines.
#[test]
fn workers_starting_at_the_same_moment_come_up_every_time() {
    let Some(dir) = library("workers_starting_at_the_same_moment_come_up_every_time") else { return };
    let src = Arc::new(filled_pool(5));
    let rt = rt();
    for round in 0..20 {
        let barrier = Arc::new(std::sync::Barrier::new(2));
        // Each side: its pool, receiver and sender, all built after the barrier.
        let sides: Vec<_> = (0..2)
            .map(|_| {
                let (barrier, dir, handle) = (barrier.clone(), dir.clone(), rt.handle().clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let pool = CpuKvPool::try_new(LAYOUT).unwrap();
                    let gate = Arc::new(TestGate::default());
                    gate.add(1, vec![3, 4, 5]);
                    let rx = handle
                        .block_on(KvReceiver::bind(
                            SocketAddr::from(([127, 0, 0, 1], 0)),
                            pool.sink(),
                            gate.clone(),
                            ReceiverOptions { nixl: config(&dir), ..Default::default() },
                        ))
                        .unwrap();
                    let tx =
                        KvSender::new(LAYOUT, SenderOptions { nixl: config(&dir), ..Default::default() });
                    (pool, gate, rx, tx)
                })
            })
            .collect();
        let sides: Vec<_> = sides.into_iter().map(|h| h.join().unwrap()).collect();
        let dests: Vec<_> = sides
            .iter()
            .map(|(_, _, rx, _)| destination(rx, TransportKind::Nixl, 1, &[3, 4, 5], 0))
            .collect();
        rt.block_on(async {
            // A sends to B while B sends to A.
            let sends = (0..2).map(|i| {
                let (tx, dest, src) = (&sides[i].3, dests[1 - i].clone(), src.clone());
                async move {
                    let mut s = tx.open(&dest).await?;
                    let staged = tokio::task::block_in_place(|| s.stage_from(&*src, &[7, 8, 9]));
                    staged?;
                    s.finish().await
                }
            });
            let results = tokio::time::timeout(std::time::Duration::from_secs(60), futures_join(sends)).await;
            let results =
                results.unwrap_or_else(|_| panic!("round {round}: the simultaneous transfers hung"));
            for r in results {
                r.unwrap_or_else(|e| panic!("round {round}: {e}"));
            }
            for (_, gate, _, _) in &sides {
                assert_eq!(gate.settled(1).await.state, State::Filled, "round {round}");
            }
        });
        for (pool, _, _, _) in &sides {
            assert_eq!(pool.block_bytes(1, 4), src.block_bytes(1, 8), "round {round}");
        }
        for (_, _, rx, _) in sides {
            rt.block_on(rx.shutdown());
        }
    }
}

/// Awaits every future, in order of the results.
async fn futures_join<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = fs.collect();
    let mut pinned: Vec<_> = handles.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in pinned.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.expect("ready")).collect()
}
