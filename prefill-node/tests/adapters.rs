//! LoRA adapters on the real `tandem-prefill` binary over the tiny fixture model: the adapter
//! calls and Info, a Prefill naming an adapter it does not hold (NOT_FOUND) or with another id
//! (FAILED_PRECONDITION) refused before the destination's reservation is touched, and a Prefill
//! under an adapter whose transfer carries the adapter's id: accepted by a reservation made for
//! it (the first token and the KV bytes those of an in-process prefill under the adapter), refused
//! by one made for the base model.

// The worker binaries share one test harness.
#[path = "../../decode-node/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::{tiny_model, Proc};
use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::{BlockId, CpuKvPool, KvLayout};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{
    EngineParams, InfoRequest, KvDestination, ListAdaptersRequest, LoadAdapterRequest, PrefillRequest,
    StatsRequest, UnloadAdapterRequest,
};
use tandem_transport::{KvReceiver, ReceiverOptions, ReservationGate};
use tonic::transport::Channel;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_tandem-prefill");
const BLOCK: usize = 8;

fn lora(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/lora/llama-gqa").join(name)
}

fn start(extra: &[&str]) -> Proc {
    let model = tiny_model();
    let mut args = vec![
        "--model",
        model.to_str().expect("utf-8 path"),
        "--kv-blocks",
        "32",
        "--block-size",
        "8",
        "--threads",
        "1",
        "--prefix-cache",
        "false",
    ];
    args.extend_from_slice(extra);
    Proc::start(BIN, &args)
}

/// The in-process reference (same model, block size and threads), holding fixture adapter `a`.
fn local_engine() -> Engine {
    let m = load_model(&tiny_model()).expect("fixture model");
    let config = m.config.clone();
    let opts = BackendOptions {
        num_blocks: 32,
        block_size: BLOCK,
        max_batch_tokens: 512,
        threads: 1,
        ..Default::default()
    };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    let mut e = Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default());
    e.add_adapter(tandem_engine::lora::load::load("a", &lora("a"), &config).unwrap()).unwrap();
    e
}

/// A reservation: its blocks, its state, and the adapter id it was made for.
type Entry = (Vec<BlockId>, &'static str, String);

/// A reservation table for the test's KV receiver, each reservation made for an adapter id
/// (empty: the base model).
#[derive(Default)]
struct Gate {
    states: Mutex<HashMap<u64, Entry>>,
}

impl Gate {
    fn add(&self, id: u64, blocks: Vec<BlockId>, adapter_id: &str) {
        self.states.lock().unwrap().insert(id, (blocks, "reserved", adapter_id.to_owned()));
    }
    fn state(&self, id: u64) -> &'static str {
        self.states.lock().unwrap()[&id].1
    }
    fn set(&self, id: u64, st: &'static str) {
        if let Some(s) = self.states.lock().unwrap().get_mut(&id) {
            s.1 = st;
        }
    }
}

struct GateRef(Arc<Gate>);

impl ReservationGate for GateRef {
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String> {
        let mut m = self.0.states.lock().unwrap();
        match m.get_mut(&reservation) {
            Some((blocks, st, _)) if *st == "reserved" => {
                *st = "transferring";
                Ok(blocks.clone())
            }
            Some((_, st, _)) => Err(format!("reservation {reservation} is {st}")),
            None => Err(format!("reservation {reservation} is unknown")),
        }
    }
    fn complete(&self, reservation: u64) {
        self.0.set(reservation, "filled");
    }
    fn abort(&self, reservation: u64, _why: &str) {
        self.0.set(reservation, "aborted");
    }
    fn adapter_id(&self, reservation: u64) -> String {
        self.0.states.lock().unwrap().get(&reservation).map(|s| s.2.clone()).unwrap_or_default()
    }
}

fn params(adapter: &str, adapter_id: &str) -> EngineParams {
    EngineParams {
        temperature: 0.0,
        top_p: 1.0,
        repetition_penalty: 1.0,
        seed: 1,
        max_tokens: 8,
        adapter: adapter.into(),
        adapter_id: adapter_id.into(),
        ..Default::default()
    }
}

fn request(
    rx: &KvReceiver,
    pool: &CpuKvPool,
    kind: &str,
    reservation_id: u64,
    blocks: &[BlockId],
    prompt: &[u32],
    p: EngineParams,
) -> PrefillRequest {
    PrefillRequest {
        request_id: format!("req-{reservation_id}"),
        prompt_token_ids: prompt.to_vec(),
        params: Some(p),
        destination: Some(KvDestination {
            worker_id: "test-decode".into(),
            transport: kind.into(),
            address: rx.local_addr().to_string(),
            segment_path: pool.segment_path().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default(),
            reservation_id,
            block_ids: blocks.to_vec(),
            skip_blocks: 0,
            ..Default::default()
        }),
    }
}

async fn assert_all_free(c: &mut WorkerClient<Channel>) {
    let s = c.stats(StatsRequest { check_invariants: true }).await.expect("Stats").into_inner();
    assert!(s.invariants_checked && s.invariants_ok, "{}", s.invariant_error);
    let kv = s.kv.expect("kv counters");
    assert_eq!((kv.free + kv.cached, kv.used, kv.sequences), (kv.total, 0, 0), "{kv:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_calls_on_a_prefill_worker() {
    let w = start(&["--lora", &format!("a={}", lora("a").display())]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.expect("Info").into_inner();
    assert_eq!(info.max_adapters, 8, "--max-loras defaults to 8");
    assert_eq!(info.adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["a"]);
    let req = LoadAdapterRequest { name: "c".into(), path: lora("c").display().to_string() };
    let got = c.load_adapter(req).await.expect("LoadAdapter").into_inner();
    assert_eq!((got.name.as_str(), got.id.len()), ("c", 32));
    let list = c.list_adapters(ListAdaptersRequest {}).await.unwrap().into_inner();
    assert_eq!(list.adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["a", "c"]);
    let req = LoadAdapterRequest { name: "x".into(), path: "/nonexistent/prefill-adapter".into() };
    let err = c.load_adapter(req).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("/nonexistent/prefill-adapter"), "{err}");
    assert!(c.unload_adapter(UnloadAdapterRequest { name: "c".into() }).await.unwrap().into_inner().unloaded);
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["a"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_under_an_adapter_sends_its_id_with_the_kv() {
    let w = start(&["--lora", &format!("a={}", lora("a").display())]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let id = info.adapters[0].id.clone();
    let mut reference = local_engine();
    let layout = reference.backend().kv_layout();
    let pool = CpuKvPool::try_new_shared(KvLayout { num_blocks: 16, ..layout }).expect("shared pool");
    let gate = Arc::new(Gate::default());
    let rx = KvReceiver::bind(
        "127.0.0.1:0".parse().unwrap(),
        pool.sink(),
        Arc::new(GateRef(gate.clone())),
        ReceiverOptions::default(),
    )
    .await
    .expect("KV receiver");
    let prompt: Vec<u32> = (5..24).collect();
    let n = prompt.len().div_ceil(BLOCK);
    let blocks: Vec<BlockId> = (0..n as u32).map(|i| 15 - 2 * i).collect();

    // An adapter this worker does not hold, or another id: refused before the transfer opens.
    gate.add(1, blocks.clone(), &id);
    let err =
        c.prefill(request(&rx, &pool, "tcp", 1, &blocks, &prompt, params("nope", ""))).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(err.message().contains("'nope'"), "{err}");
    assert_eq!(
        tandem_proto::adapter_refusal(&err),
        Some(tandem_proto::ADAPTER_UNKNOWN),
        "marked for the router: {err:?}"
    );
    let wrong = "11111111111111111111111111111111";
    let err =
        c.prefill(request(&rx, &pool, "tcp", 1, &blocks, &prompt, params("a", wrong))).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains(wrong) && err.message().contains(&id), "{err}");
    assert_eq!(tandem_proto::adapter_refusal(&err), Some(tandem_proto::ADAPTER_OTHER_WEIGHTS), "{err:?}");
    assert_eq!(gate.state(1), "reserved", "the reservation was not touched");
    assert_eq!(rx.counters().failures, 0, "no transfer was opened");

    // The reference: the prompt prefilled under the adapter in one process.
    let sp = SamplingParams { max_tokens: 8, seed: Some(1), adapter: "a".into(), ..SamplingParams::greedy() };
    let seq = reference.add_prefill_request(prompt.clone(), sp).unwrap();
    let mut first = None;
    while first.is_none() {
        for ev in reference.step().unwrap() {
            if let SeqEvent::Prefilled { token, .. } = ev {
                first = Some(token);
            }
        }
    }
    let table = reference.block_table(seq).unwrap().to_vec();
    let te = layout.token_bytes();

    let mut next = 1;
    for kind in ["tcp", "shm"] {
        for p in [params("a", ""), params("a", &id)] {
            next += 1;
            gate.add(next, blocks.clone(), &id);
            let out = c.prefill(request(&rx, &pool, kind, next, &blocks, &prompt, p)).await.expect("Prefill");
            assert_eq!(gate.state(next), "filled", "{kind}");
            assert_eq!(out.into_inner().first_token, first.unwrap(), "{kind}");
            for layer in 0..layout.num_layers {
                for (i, (&s, &t)) in table.iter().zip(&blocks).enumerate() {
                    let (k, v) = reference.backend().read_block(layer, s).unwrap();
                    let (gk, gv) = pool.try_block_bytes(layer, t).unwrap();
                    let rows = (prompt.len() - i * BLOCK).min(BLOCK);
                    assert!(k[..rows * te] == gk[..rows * te], "{kind}: K of layer {layer}, block {i}");
                    assert!(v[..rows * te] == gv[..rows * te], "{kind}: V of layer {layer}, block {i}");
                }
            }
        }
        // A reservation made for the base model refuses KV computed under the adapter.
        next += 1;
        gate.add(next, blocks.clone(), "");
        let err =
            c.prefill(request(&rx, &pool, kind, next, &blocks, &prompt, params("a", ""))).await.unwrap_err();
        assert!(err.message().contains(&format!("adapter id {id}")), "{kind}: {err}");
        assert!(err.message().contains("the base model"), "{kind}: {err}");
        // (An shm receiver aborts once the sender has closed the connection.)
        common::eventually("the reservation is aborted", || async { gate.state(next) == "aborted" }).await;
        assert_all_free(&mut c).await;
    }
    reference.release_prefilled(seq).unwrap();
}
