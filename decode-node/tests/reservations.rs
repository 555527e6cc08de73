//! The decode worker's handle on the engine's reservation table, over a real engine thread (no
//! network): the Reserved → Filling → Filled life cycle, leases that stop while a transfer runs,
//! releases that wait for a transfer to end, aborts, and the engine's blocks freed in every case.

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_decode::{Gate, ReservationState, Reservations};
use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::KvStats;
use tandem_engine::loader::load_model;
use tandem_engine::scheduler::{Engine, SchedulerOptions};
use tandem_transport::ReservationGate;
use tandem_worker::EngineHandle;

const LEASE: Duration = Duration::from_secs(3600);

fn engine() -> Engine {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
        .expect("fixture model");
    let opts = BackendOptions { num_blocks: 16, block_size: 8, max_batch_tokens: 64, ..Default::default() };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default())
}

/// The engine's counters after every job sent so far has run (jobs run in order), with its
/// invariant check.
async fn kv(h: &EngineHandle) -> KvStats {
    h.call(|core| {
        core.engine.check_kv().expect("KV invariants");
        core.engine.kv_stats()
    })
    .await
    .expect("engine thread")
}

#[tokio::test]
async fn reservation_life_cycle() {
    let e = engine();
    let shared = e.reservations();
    let (h, thread) = EngineHandle::spawn(e).unwrap();
    let table = Reservations::new(h.clone(), shared, LEASE);
    let gate = Gate(table.clone());

    // Reserved → Filling → Filled; a second transfer to it is refused.
    let (a, blocks, _) = table.reserve("a".into(), 20, Vec::new(), String::new(), 0).await.unwrap();
    assert_eq!(blocks.len(), 3);
    assert_eq!(table.state(a), Some(ReservationState::Reserved));
    assert_eq!(gate.begin(a).unwrap(), blocks);
    assert_eq!(table.state(a), Some(ReservationState::Filling { release_when_done: false }));
    assert!(gate.begin(a).unwrap_err().contains("in progress"));
    // No lease while transferring: a sweep far in the future leaves it alone.
    assert_eq!(table.sweep(Instant::now() + 2 * LEASE), 0);
    gate.complete(a);
    assert_eq!(table.state(a), Some(ReservationState::Filled));
    assert!(gate.begin(a).unwrap_err().contains("filled"));
    assert_eq!(kv(&h).await.raw_reserved, 3);
    // Filled is leased again.
    assert_eq!(table.sweep(Instant::now() + 2 * LEASE), 1);
    assert_eq!(table.state(a), None);
    assert_eq!(kv(&h).await.free, 16);

    // A release during a transfer waits for its end, then frees.
    let (b, _, _) = table.reserve("b".into(), 9, Vec::new(), String::new(), 0).await.unwrap();
    gate.begin(b).unwrap();
    assert!(table.release(0, "b"), "found by request id");
    assert_eq!(table.state(b), Some(ReservationState::Filling { release_when_done: true }));
    assert_eq!(kv(&h).await.raw_reserved, 2, "blocks kept while the transfer may write them");
    gate.complete(b);
    assert_eq!(table.state(b), None);
    assert_eq!(kv(&h).await.free, 16);

    // An aborted transfer frees at once; an abort or completion of an unknown id changes nothing.
    let (c, _, _) = table.reserve("c".into(), 5, Vec::new(), String::new(), 0).await.unwrap();
    gate.begin(c).unwrap();
    gate.abort(c, "peer vanished");
    assert_eq!(table.state(c), None);
    gate.abort(c, "again");
    gate.complete(c);
    assert!(gate.begin(c).unwrap_err().contains("unknown"));
    assert_eq!(kv(&h).await.free, 16);

    // Released before any transfer; leases of unused reservations run out.
    let (d, _, _) = table.reserve("d".into(), 5, Vec::new(), String::new(), 0).await.unwrap();
    assert!(table.release(d, ""));
    assert!(!table.release(d, ""), "second release finds nothing");
    let (e, _, _) = table.reserve("e".into(), 5, Vec::new(), String::new(), 0).await.unwrap();
    assert_eq!(table.sweep(Instant::now()), 0, "not expired yet");
    assert_eq!(table.sweep(Instant::now() + LEASE), 1);
    assert_eq!(table.state(e), None);
    assert!(table.is_empty());
    assert_eq!(kv(&h).await.free, 16);

    // Refusals come from the engine: too long for this pool, or no room now.
    let err = table.reserve("f".into(), 128, Vec::new(), String::new(), 0).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let (g, _, _) = table.reserve("g".into(), 100, Vec::new(), String::new(), 0).await.unwrap();
    let err = table.reserve("h".into(), 40, Vec::new(), String::new(), 0).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(table.release(g, ""));
    assert_eq!(kv(&h).await.free, 16);

    h.stop("test over");
    drop((h, table, gate));
    thread.join().await;
}

/// A `Release` that overtakes its request's `Reserve` (the router releases as soon as a request
/// ends, while the Reserve may still wait for the engine thread) frees the reservation as it
/// lands, instead of leaving its blocks to the lease.
#[tokio::test]
async fn a_release_before_the_reserve_lands_frees_it_on_landing() {
    let e = engine();
    let shared = e.reservations();
    let (h, thread) = EngineHandle::spawn(e).unwrap();
    let table = Reservations::new(h.clone(), shared, LEASE);

    assert!(!table.release(0, "early"), "nothing to release yet");
    assert_eq!(table.released_early(), 1, "remembered");
    let err = table.reserve("early".into(), 20, Vec::new(), String::new(), 0).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Cancelled, "{err}");
    assert!(err.message().contains("released before"), "{err}");
    assert!(table.is_empty());
    assert_eq!(table.released_early(), 0, "a remembered release is used once");
    assert_eq!(kv(&h).await.free, 16, "the blocks went back at once");

    // Other requests are untouched, and a release by reservation id is not remembered.
    assert!(!table.release(0, "gone"));
    let (a, _, _) = table.reserve("other".into(), 9, Vec::new(), String::new(), 0).await.unwrap();
    assert_eq!(table.state(a), Some(ReservationState::Reserved));
    assert!(!table.release(12345, ""));
    assert_eq!(table.released_early(), 1);
    assert!(table.release(a, ""));
    assert_eq!(kv(&h).await.free, 16);

    h.stop("test over");
    drop((h, table));
    thread.join().await;
}
