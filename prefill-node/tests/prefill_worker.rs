//! The real `tandem-prefill` binary on a tiny fixture model: flag errors, start-up, Info/Stats,
//! Prefill into a KV receiver run by this test (both transports; the received bytes and the first
//! token equal an in-process prefill), failures with clear statuses and no leaked blocks, the
//! SIGTERM drain, the HTTP ops endpoints and metrics, and the cluster secret (on the Worker
//! service and in the KV handshake).

// The worker binaries share one test harness.
#[path = "../../decode-node/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{eventually, http_get, metrics, run_to_exit, sample, tiny_model, Proc};
use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::{BlockId, CpuKvPool, KvLayout};
use tandem_engine::loader::load_model;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{
    EngineParams, InfoRequest, KvDestination, PrefillRequest, PrefillResponse, ReserveRequest, Role,
    StatsRequest,
};
use tandem_serve::auth::{cluster_request, Secret};
use tandem_transport::{KvReceiver, KvToken, ReceiverOptions, ReservationGate};
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const BIN: &str = env!("CARGO_BIN_EXE_tandem-prefill");
const BLOCK: usize = 8;

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
    ];
    args.extend_from_slice(extra);
    Proc::start(BIN, &args)
}

/// The in-process reference: same model, block size and thread count as the worker.
fn local_engine() -> Engine {
    let m = load_model(&tiny_model()).expect("fixture model");
    let opts = BackendOptions {
        num_blocks: 32,
        block_size: BLOCK,
        max_batch_tokens: 512,
        threads: 1,
        ..Default::default()
    };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default())
}

/// A reservation table for the test's KV receiver.
#[derive(Default)]
struct TestGate {
    states: Mutex<HashMap<u64, (Vec<BlockId>, &'static str)>>,
}

impl TestGate {
    fn add(&self, id: u64, blocks: Vec<BlockId>) {
        self.states.lock().unwrap().insert(id, (blocks, "reserved"));
    }
    fn state(&self, id: u64) -> Option<&'static str> {
        self.states.lock().unwrap().get(&id).map(|s| s.1)
    }
    fn set(&self, id: u64, st: &'static str) {
        if let Some(s) = self.states.lock().unwrap().get_mut(&id) {
            s.1 = st;
        }
    }
}

/// The gate as the receiver holds it.
struct GateRef(Arc<TestGate>);

impl ReservationGate for GateRef {
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String> {
        let mut m = self.0.states.lock().unwrap();
        match m.get_mut(&reservation) {
            Some((blocks, st)) if *st == "reserved" => {
                *st = "transferring";
                Ok(blocks.clone())
            }
            Some((_, st)) => Err(format!("reservation {reservation} is {st}")),
            None => Err(format!("reservation {reservation} is unknown")),
        }
    }
    fn complete(&self, reservation: u64) {
        self.0.set(reservation, "filled");
    }
    fn abort(&self, reservation: u64, _why: &str) {
        self.0.set(reservation, "aborted");
    }
}

/// A decode side run by the test: a shared pool of 16 blocks behind a KV receiver.
struct Dest {
    pool: CpuKvPool,
    gate: Arc<TestGate>,
    receiver: KvReceiver,
}

async fn dest(layout: KvLayout) -> Dest {
    dest_with(layout, ReceiverOptions::default()).await
}

async fn dest_with(layout: KvLayout, opts: ReceiverOptions) -> Dest {
    let pool = CpuKvPool::try_new_shared(KvLayout { num_blocks: 16, ..layout }).expect("shared pool");
    let gate = Arc::new(TestGate::default());
    let receiver =
        KvReceiver::bind("127.0.0.1:0".parse().unwrap(), pool.sink(), Arc::new(GateRef(gate.clone())), opts)
            .await
            .expect("KV receiver");
    Dest { pool, gate, receiver }
}

fn params(temperature: f32, seed: u64) -> EngineParams {
    EngineParams {
        temperature,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        seed,
        max_tokens: 8,
        stop_token_ids: vec![],
        ignore_eos: false,
        logprobs: true,
        cache_salt: String::new(),
        top_logprobs: 0,
        constraint: None,
        constraint_generated: 0,
        prompt_logprobs: None,
        ..Default::default()
    }
}

fn sampling(p: &EngineParams) -> tandem_engine::sampler::SamplingParams {
    tandem_engine::sampler::SamplingParams {
        temperature: p.temperature,
        seed: Some(p.seed),
        max_tokens: p.max_tokens as usize,
        ..Default::default()
    }
}

fn request(
    d: &Dest,
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
            address: d.receiver.local_addr().to_string(),
            segment_path: d.pool.segment_path().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default(),
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
    assert_eq!(kv.free + kv.cached, kv.total, "{kv:?}");
    assert_eq!(kv.used, 0, "{kv:?}");
    assert_eq!(kv.sequences, 0);
}

async fn health(w: &Proc) -> ServingStatus {
    let ch =
        Channel::from_shared(format!("http://{}", w.grpc)).expect("uri").connect().await.expect("connect");
    let r = HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await.expect("health");
    r.into_inner().status()
}

#[test]
fn bad_flags_config_and_model_fail_with_exit_1() {
    // Protected mode: the gRPC port on every interface with nothing authenticating the cluster.
    let model = tiny_model();
    let (st, err) = run_to_exit(BIN, &["--model", model.to_str().unwrap(), "--listen", "0.0.0.0:0"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--listen 0.0.0.0:0") && err.contains("--insecure-cluster"), "{err}");
    // A router list with no address in it.
    let (st, err) = run_to_exit(BIN, &["--model", model.to_str().unwrap(), "--router", " , "], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--router") && err.contains("one to 64 addresses"), "{err}");

    let (st, err) = run_to_exit(BIN, &["--transport", "pigeon"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--transport") && err.contains("pigeon"), "{err}");

    let dir = std::env::temp_dir().join(format!("tandem-prefill-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("prefill.toml");
    std::fs::write(&cfg, "block-size = 8\nkv-listen = \"127.0.0.1:0\"\n").unwrap();
    let (st, err) = run_to_exit(BIN, &["--config", cfg.to_str().unwrap()], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("unknown key `kv-listen`"), "a decode-only key is refused: {err}");

    let (st, err) = run_to_exit(BIN, &[], &[("TANDEM_MODEL", "/nonexistent/tandem-prefill-model")]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/tandem-prefill-model"), "{err}");

    let model = tiny_model();
    let (st, err) = run_to_exit(BIN, &["--model", model.to_str().unwrap(), "--block-size", "0"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--block-size"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_answers_info_and_stats_and_exits_0_on_sigterm() {
    // Settings from a config file, one overridden by a flag.
    let dir = std::env::temp_dir().join(format!("tandem-prefill-cfg-ok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("prefill.toml");
    std::fs::write(
        &cfg,
        "worker-id = \"pf-from-config\"\ntransport = \"tcp\"\nadvertise = \"elsewhere:1\"\n",
    )
    .unwrap();
    let mut w = start(&["--config", cfg.to_str().unwrap(), "--advertise", "prefill.example:7000"]);
    assert_eq!(w.kv, None, "prefill workers have no KV listener");
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.expect("Info").into_inner();
    assert_eq!(info.role(), Role::Prefill);
    assert_eq!(info.address, "prefill.example:7000");
    assert_eq!(info.worker_id, "pf-from-config");
    assert_eq!(info.total_blocks, 32);
    let kinds: Vec<&str> = info.transports.iter().map(|o| o.kind.as_str()).collect();
    assert_eq!(kinds, ["tcp"]);
    let compat = info.compat.expect("compat record");
    assert_eq!(compat.block_size, 8);
    assert_eq!(compat.protocol_version, tandem_proto::PROTOCOL_VERSION);
    assert_all_free(&mut c).await;
    assert_eq!(health(&w).await, ServingStatus::Serving);
    let err = c
        .reserve(ReserveRequest { request_id: "x".into(), num_tokens: 3, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);

    w.signal(libc::SIGTERM);
    let st = w.wait();
    assert_eq!(st.code(), Some(0), "stderr:\n{}", w.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_moves_the_prompt_kv_and_returns_the_first_token() {
    let w = start(&[]);
    let mut c = w.client().await;
    // The worker keeps a prefix cache (its default): repeated prompts compute only their last
    // block, in a smaller pass whose results agree with a full one to rounding only. A reference
    // with a cache of its own, fed the same prompts in the same order, hits the same blocks.
    let mut reference = local_engine().with_prefix_cache("reference");
    let layout = reference.backend().kv_layout();
    let d = dest(layout).await;
    let te = layout.token_bytes();
    let mut next_res = 1u64;
    let mut bytes_total = 0u64;
    let mut bytes_by_kind = HashMap::new();
    let mut prompt_tokens = 0usize;
    for kind in ["tcp", "shm"] {
        for p in [params(0.0, 1), params(1.1, 77)] {
            for prompt in [vec![3u32], (10..18).collect::<Vec<u32>>(), (20..43).collect()] {
                // Scattered destination blocks, to catch any mix-up of source and destination ids.
                let n = prompt.len().div_ceil(BLOCK);
                let blocks: Vec<BlockId> = (0..n as u32).map(|i| 15 - 2 * i).collect();
                let res = next_res;
                next_res += 1;
                d.gate.add(res, blocks.clone());
                let out: PrefillResponse = c
                    .prefill(request(&d, kind, res, &blocks, &prompt, p.clone()))
                    .await
                    .expect("Prefill")
                    .into_inner();
                assert_eq!(d.gate.state(res), Some("filled"));

                let seq = reference.add_prefill_request(prompt.clone(), sampling(&p)).unwrap();
                let mut first = None;
                while first.is_none() {
                    for ev in reference.step().unwrap() {
                        if let SeqEvent::Prefilled { token, logprob, finish, .. } = ev {
                            first = Some((token, logprob, finish));
                        }
                    }
                }
                let (token, logprob, finish) = first.unwrap();
                // The worker applies the token rules to its first token, as its engine does.
                assert_eq!(out.finish_reason.as_deref(), finish.as_ref().map(|f| f.as_str()));
                assert_eq!(
                    out.first_token,
                    token,
                    "{kind}, temperature {}, prompt of {}",
                    p.temperature,
                    prompt.len()
                );
                assert_eq!(out.logprob, logprob);
                let table = reference.block_table(seq).unwrap().to_vec();
                for layer in 0..layout.num_layers {
                    for (i, (&s, &t)) in table.iter().zip(&blocks).enumerate() {
                        let (k, v) = reference.backend().read_block(layer, s).unwrap();
                        let (gk, gv) = d.pool.try_block_bytes(layer, t).unwrap();
                        // Only the prompt's token rows are meaningful in the last block.
                        let rows = (prompt.len() - i * BLOCK).min(BLOCK);
                        assert!(k[..rows * te] == gk[..rows * te], "K of layer {layer}, block {i} differs");
                        assert!(v[..rows * te] == gv[..rows * te], "V of layer {layer}, block {i} differs");
                    }
                }
                reference.release_prefilled(seq).unwrap();
                let payload = 2 * layout.num_layers * layout.block_bytes();
                assert_eq!(out.transfer_bytes, (n * payload) as u64);
                bytes_total += out.transfer_bytes;
                *bytes_by_kind.entry(kind).or_insert(0u64) += out.transfer_bytes;
                prompt_tokens += prompt.len();
                assert!(out.queue_ms >= 0.0 && out.compute_ms >= 0.0 && out.transfer_ms >= 0.0);
                assert_all_free(&mut c).await;
            }
        }
    }
    let s = c.stats(StatsRequest::default()).await.unwrap().into_inner();
    let t = s.transfers.expect("transfer counters");
    assert_eq!((t.transfers, t.bytes, t.failures), (12, bytes_total, 0));
    assert_eq!(s.requests_finished, 12);
    assert_eq!(d.receiver.counters().transfers, 12);

    // The same, as metrics.
    let h = w.http.expect("prefill workers print http=");
    assert_eq!(http_get(h, "/health").await.0, 200);
    assert_eq!(http_get(h, "/ready").await.0, 200);
    let m = metrics(&w).await;
    for kind in ["tcp", "shm"] {
        let ok = format!("tandem_worker_kv_transfers_total{{outcome=\"ok\",transport=\"{kind}\"}}");
        assert_eq!(sample(&m, &ok), 6.0, "{kind}");
        let bytes = format!("tandem_worker_kv_transfer_bytes_total{{transport=\"{kind}\"}}");
        assert_eq!(sample(&m, &bytes), bytes_by_kind[kind] as f64, "{kind}");
        let secs = format!("tandem_worker_kv_transfer_seconds_total{{transport=\"{kind}\"}}");
        assert!(sample(&m, &secs) > 0.0, "{kind}");
    }
    assert_eq!(sample(&m, "tandem_worker_prefill_tokens_total"), prompt_tokens as f64);
    assert!(sample(&m, "tandem_worker_prefill_tokens_per_second") > 0.0);
    assert_eq!(sample(&m, "tandem_worker_decode_tokens_total"), 0.0);
    assert_eq!(sample(&m, "tandem_worker_requests_total{outcome=\"ok\"}"), 12.0);
    assert_eq!(sample(&m, "tandem_worker_requests_total{outcome=\"error\"}"), 0.0);
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_capacity"), 32.0);
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_used"), 0.0);
    assert!(sample(&m, "tandem_worker_engine_steps_total") >= 12.0);

    // max_tokens 1: the first token ends the sequence, and the answer says so.
    let mut one = params(0.0, 1);
    one.max_tokens = 1;
    d.gate.add(next_res, vec![15]);
    let out = c.prefill(request(&d, "tcp", next_res, &[15], &[3], one)).await.expect("Prefill").into_inner();
    assert_eq!(out.finish_reason.as_deref(), Some("length"));
    assert_all_free(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_give_clear_statuses_and_free_the_scratch_blocks() {
    let w = start(&[]);
    let mut c = w.client().await;
    let layout = local_engine().backend().kv_layout();
    let d = dest(layout).await;
    let prompt: Vec<u32> = (1..12).collect();

    // Nothing listens at the destination.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut req = request(&d, "tcp", 1, &[0, 1], &prompt, params(0.0, 1));
    req.destination.as_mut().unwrap().address = closed.to_string();
    let err = c.prefill(req).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains(&closed.to_string()), "the message names the peer: {err}");

    // The destination does not know the reservation.
    let err = c.prefill(request(&d, "tcp", 99, &[0, 1], &prompt, params(0.0, 1))).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err}");
    assert!(err.message().contains("reservation 99 is unknown"), "{err}");

    // The destination goes away as soon as it is reached.
    let vanishing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let vaddr = vanishing.local_addr().unwrap();
    let closer = tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = vanishing.accept().await else { break };
            drop(sock);
        }
    });
    let mut req = request(&d, "tcp", 2, &[0, 1], &prompt, params(0.0, 1));
    req.destination.as_mut().unwrap().address = vaddr.to_string();
    let err = c.prefill(req).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err}");
    closer.abort();

    // Bad requests.
    let err = c.prefill(request(&d, "tcp", 3, &[0], &prompt, params(0.0, 1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("block ids"), "{err}");
    let err =
        c.prefill(request(&d, "carrier-pigeon", 3, &[0, 1], &prompt, params(0.0, 1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let mut req = request(&d, "tcp", 3, &[0, 1], &prompt, params(0.0, 1));
    req.params = None;
    assert_eq!(c.prefill(req).await.unwrap_err().code(), Code::InvalidArgument);
    d.gate.add(4, vec![0, 1]);
    let mut p = params(0.0, 1);
    p.top_p = 0.0;
    let err = c.prefill(request(&d, "tcp", 4, &[0, 1], &prompt, p)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("top_p"), "{err}");
    // The session to the destination was opened first and is closed again.
    eventually("the destination aborted the transfer", || async { d.gate.state(4) == Some("aborted") }).await;

    assert_all_free(&mut c).await;
    let s = c.stats(StatsRequest::default()).await.unwrap().into_inner();
    assert_eq!(s.requests_finished, 0);
    assert!(s.requests_failed >= 7);
    let m = metrics(&w).await;
    assert_eq!(sample(&m, "tandem_worker_requests_total{outcome=\"error\"}"), 7.0);
    assert_eq!(sample(&m, "tandem_worker_errors_total{code=\"INVALID_ARGUMENT\"}"), 4.0);
    assert_eq!(sample(&m, "tandem_worker_errors_total{code=\"UNAVAILABLE\"}"), 1.0);
    assert_eq!(sample(&m, "tandem_worker_errors_total{code=\"ABORTED\"}"), 2.0);
    assert!(sample(&m, "tandem_worker_kv_transfers_total{outcome=\"failed\",transport=\"tcp\"}") >= 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_the_prefill_in_flight_and_refuses_new_ones() {
    let mut w = start(&["--drain-timeout-ms", "60000"]);
    let mut c = w.client().await;
    let layout = local_engine().backend().kv_layout();
    let d = dest(layout).await;
    let prompt: Vec<u32> = (1..12).collect();
    // A destination that accepts the transfer connection and then says nothing: the prefill stays
    // in flight (waiting for its reservation to be accepted) until the test closes the socket.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let saddr = silent.local_addr().unwrap();
    let mut req = request(&d, "tcp", 1, &[4, 5], &prompt, params(0.0, 1));
    req.destination.as_mut().unwrap().address = saddr.to_string();
    let mut c1 = c.clone();
    let first = tokio::spawn(async move { c1.prefill(req).await });
    let (sock, _) = silent.accept().await.expect("the worker connects");

    w.signal(libc::SIGTERM);
    eventually("new prefills are refused", || {
        let mut c = c.clone();
        let req = request(&d, "tcp", 2, &[0, 1], &prompt, params(0.0, 1));
        async move {
            match c.prefill(req).await {
                Err(e) => e.code() == Code::Unavailable && e.message().contains("draining"),
                Ok(_) => false,
            }
        }
    })
    .await;
    assert_eq!(health(&w).await, ServingStatus::NotServing);
    let s = c.stats(StatsRequest::default()).await.unwrap().into_inner();
    assert!(s.load.unwrap().draining);
    assert!(w.running(), "the prefill in flight keeps the worker draining");
    let h = w.http.expect("http=");
    let (code, body) = http_get(h, "/ready").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("draining"), "{body}");
    assert_eq!(http_get(h, "/health").await.0, 200);
    assert_eq!(sample(&metrics(&w).await, "tandem_worker_draining"), 1.0);

    drop(sock);
    let err = first.await.unwrap().expect_err("its destination went away");
    assert_eq!(err.code(), Code::Aborted, "{err}");
    let st = w.wait();
    assert_eq!(st.code(), Some(0), "stderr:\n{}", w.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_secret_guards_the_worker_service_and_travels_in_the_kv_handshake() {
    let w = start(&["--cluster-secret", "s3cret"]);
    let secret = Secret::new("s3cret", "test").unwrap();
    let mut c = w.client().await;
    let err = c.info(InfoRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    let wrong = Secret::new("other", "test").unwrap();
    let err = c.info(cluster_request(Some(&wrong), InfoRequest {})).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    c.info(cluster_request(Some(&secret), InfoRequest {})).await.expect("Info with the secret");
    assert_eq!(health(&w).await, ServingStatus::Serving);

    let layout = local_engine().backend().kv_layout();
    let prompt: Vec<u32> = (1..12).collect();
    for kind in ["tcp", "shm"] {
        // A decode side with the same secret accepts the transfer.
        let good = dest_with(
            layout,
            ReceiverOptions { token: Some(KvToken(secret.kv_token())), ..Default::default() },
        )
        .await;
        good.gate.add(1, vec![3, 4]);
        let req = request(&good, kind, 1, &[3, 4], &prompt, params(0.0, 1));
        c.prefill(cluster_request(Some(&secret), req)).await.expect("Prefill");
        assert_eq!(good.gate.state(1), Some("filled"), "{kind}");

        // One with another secret refuses the handshake and its reservation stays untouched.
        let other = dest_with(
            layout,
            ReceiverOptions { token: Some(KvToken(wrong.kv_token())), ..Default::default() },
        )
        .await;
        other.gate.add(1, vec![3, 4]);
        let req = request(&other, kind, 1, &[3, 4], &prompt, params(0.0, 1));
        let err = c.prefill(cluster_request(Some(&secret), req)).await.unwrap_err();
        assert!(err.message().contains("wrong KV auth token"), "{kind}: {err}");
        assert_eq!(other.gate.state(1), Some("reserved"), "{kind}");
    }
    let s = c.stats(cluster_request(Some(&secret), StatsRequest { check_invariants: true })).await;
    let s = s.expect("Stats").into_inner();
    assert!(s.invariants_ok, "{}", s.invariant_error);
    let kv = s.kv.unwrap();
    assert_eq!((kv.free + kv.cached, kv.used), (32, 0), "the scratch blocks are free or cached: {kv:?}");
}
