//! The real `tandem-decode` binary on a tiny fixture model: flag errors, start-up, Info/Stats,
//! Reserve → KV transfer (with the transport API, prefill computed in this test) → Decode, lease
//! expiry, cancellation by dropping the stream, colocated requests, the SIGTERM drain, the HTTP
//! ops endpoints (health, readiness, metrics that move with the work), and the cluster secret on
//! the Worker service and the KV transport.

mod common;

use std::path::Path;

use common::{eventually, http_get, metrics, run_to_exit, sample, tiny_model, Proc};
use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{
    DecodeRequest, EngineParams, InfoRequest, ReleaseRequest, ReserveRequest, Role, StatsRequest,
    StatsResponse, WorkerInfo,
};
use tandem_serve::auth::{cluster_request, Secret};
use tandem_transport::{block_payload_bytes, KvDestination, KvSender, KvToken, SenderOptions};
use tandem_worker::kv_wire::offer_from_wire;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const BIN: &str = env!("CARGO_BIN_EXE_tandem-decode");
const BLOCK: usize = 8;

fn start(extra: &[&str]) -> Proc {
    let model = tiny_model();
    let mut args =
        vec!["--model", model.to_str().expect("utf-8 path"), "--kv-blocks", "48", "--block-size", "8"];
    args.extend_from_slice(extra);
    Proc::start(BIN, &args)
}

/// The in-process engine this test prefills with (and the reference for whole generations).
fn local_engine() -> Engine {
    let m = load_model(&tiny_model()).expect("fixture model");
    let opts =
        BackendOptions { num_blocks: 64, block_size: BLOCK, max_batch_tokens: 512, ..Default::default() };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default())
}

fn engine_params(p: &SamplingParams) -> EngineParams {
    EngineParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u32,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        seed: p.seed.expect("tests use explicit seeds"),
        max_tokens: p.max_tokens as u32,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        logprobs: true,
        cache_salt: String::new(),
        top_logprobs: 0,
        constraint: p.constraint.as_ref().map(tandem_serve::constraint::to_wire),
        constraint_generated: p.constraint_generated as u32,
        prompt_logprobs: p.prompt_logprobs.map(|n| n as u32),
        ..Default::default()
    }
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, seed: Some(1), ..SamplingParams::greedy() }
}

fn seeded(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(4242),
        ..Default::default()
    }
}

async fn health(w: &Proc) -> ServingStatus {
    let ch =
        Channel::from_shared(format!("http://{}", w.grpc)).expect("uri").connect().await.expect("connect");
    let mut h = HealthClient::new(ch);
    let r = h.check(HealthCheckRequest { service: String::new() }).await.expect("health check");
    r.into_inner().status()
}

async fn stats(c: &mut WorkerClient<Channel>) -> StatsResponse {
    c.stats(StatsRequest { check_invariants: true }).await.expect("Stats").into_inner()
}

async fn assert_all_free(c: &mut WorkerClient<Channel>) {
    let s = stats(c).await;
    assert!(s.invariants_checked && s.invariants_ok, "invariants: {}", s.invariant_error);
    let kv = s.kv.expect("kv counters");
    assert_eq!(kv.free + kv.cached, kv.total, "blocks still in use: {kv:?}");
    assert_eq!(kv.used, 0, "{kv:?}");
    assert_eq!(kv.raw_reserved, 0);
}

async fn eventually_all_free(c: &WorkerClient<Channel>) {
    eventually("every block is free", || {
        let mut c = c.clone();
        async move {
            let s = stats(&mut c).await;
            let kv = s.kv.expect("kv counters");
            s.invariants_ok && kv.free + kv.cached == kv.total && kv.used == 0
        }
    })
    .await;
}

/// A Reserve for `num_tokens` prompt tokens without the prompt itself (no prefix-cache lookup).
fn reserve_req(request_id: &str, num_tokens: u32) -> ReserveRequest {
    ReserveRequest { request_id: request_id.into(), num_tokens, ..Default::default() }
}

fn destination(info: &WorkerInfo, kind: &str, reservation_id: u64, block_ids: Vec<u32>) -> KvDestination {
    let offer = info.transports.iter().find(|o| o.kind == kind).unwrap_or_else(|| panic!("no {kind} offer"));
    let offer = offer_from_wire(offer).expect("an offer of a known transport");
    KvDestination {
        worker_id: info.worker_id.clone(),
        ..KvDestination::for_offer(&offer, reservation_id, block_ids)
    }
}

/// Prefills `prompt` in `p` and moves its blocks into a fresh reservation on the worker; returns
/// the reservation and the first token.
async fn prefill_into(
    c: &mut WorkerClient<Channel>,
    info: &WorkerInfo,
    kind: &str,
    p: &mut Engine,
    prompt: &[u32],
    params: &SamplingParams,
) -> (u64, u32) {
    let res = c.reserve(reserve_req("r", prompt.len() as u32)).await.expect("Reserve").into_inner();
    assert_eq!(res.block_ids.len(), prompt.len().div_ceil(BLOCK));
    let sender = KvSender::new(p.backend().kv_layout(), SenderOptions::default());
    let dest = destination(info, kind, res.reservation_id, res.block_ids);
    (res.reservation_id, transfer(&sender, &dest, p, prompt, params).await)
}

/// Prefills `prompt` in `p` and moves its blocks to `dest` with `sender`; returns the first token.
async fn transfer(
    sender: &KvSender,
    dest: &KvDestination,
    p: &mut Engine,
    prompt: &[u32],
    params: &SamplingParams,
) -> u32 {
    let mut session = sender.open(dest).await.expect("open a session");
    let seq = p.add_prefill_request(prompt.to_vec(), params.clone()).expect("prefill request");
    let mut first = None;
    while first.is_none() {
        for ev in p.step().expect("step") {
            match ev {
                SeqEvent::Prefilled { token, .. } => first = Some(token),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let table = p.block_table(seq).expect("held table").to_vec();
    session.stage(p.backend(), &table).expect("stage");
    p.release_prefilled(seq).expect("release prefilled");
    let report = session.finish().await.expect("transfer acknowledged");
    assert!(report.bytes > 0);
    first.expect("first token")
}

/// Decodes a filled reservation; returns the streamed tokens and the finish reason.
async fn decode(
    c: &mut WorkerClient<Channel>,
    prompt: &[u32],
    params: &SamplingParams,
    reservation_id: u64,
    first_token: Option<u32>,
) -> Result<(Vec<u32>, String), tonic::Status> {
    decode_as(c, None, prompt, params, reservation_id, first_token).await
}

/// [`decode`], presenting `secret` as the cluster secret.
async fn decode_as(
    c: &mut WorkerClient<Channel>,
    secret: Option<&Secret>,
    prompt: &[u32],
    params: &SamplingParams,
    reservation_id: u64,
    first_token: Option<u32>,
) -> Result<(Vec<u32>, String), tonic::Status> {
    let req = DecodeRequest {
        request_id: "r".into(),
        prompt_token_ids: prompt.to_vec(),
        params: Some(engine_params(params)),
        reservation_id,
        first_token,
        n: 0,
    };
    let mut stream = c.decode(cluster_request(secret, req)).await?.into_inner();
    let mut tokens = Vec::new();
    loop {
        let msg = stream.message().await?.expect("the stream ends with a finish reason");
        assert_eq!(msg.logprobs.len(), msg.token_ids.len());
        tokens.extend(msg.token_ids);
        if let Some(r) = msg.finish_reason {
            assert!(stream.message().await?.is_none(), "nothing after the finish reason");
            return Ok((tokens, r));
        }
    }
}

#[test]
fn bad_flags_config_and_model_fail_with_exit_1() {
    // Protected mode: the KV listener on every interface with nothing authenticating the cluster.
    let model = tiny_model();
    let (st, err) = run_to_exit(BIN, &["--model", model.to_str().unwrap(), "--kv-listen", "0.0.0.0:0"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--kv-listen 0.0.0.0:0") && err.contains("--cluster-secret"), "{err}");
    assert!(!err.contains("--listen 127.0.0.1"), "{err}");

    let (st, err) = run_to_exit(BIN, &["--lease-ms", "soon"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--lease-ms"), "{err}");

    // Pacing needs a latency target; a target is at most a minute.
    let (st, err) =
        run_to_exit(BIN, &["--model", model.to_str().unwrap(), "--pace-steps", "--itl-target-ms", "0"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--pace-steps") && err.contains("--itl-target-ms"), "{err}");
    let (st, err) = run_to_exit(BIN, &["--itl-target-ms", "600000"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--itl-target-ms"), "{err}");

    let dir = std::env::temp_dir().join(format!("tandem-decode-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("decode.toml");
    std::fs::write(&cfg, "kv-blocks = 8\nlease_msec = 3\n").unwrap();
    let (st, err) = run_to_exit(BIN, &["--config", cfg.to_str().unwrap()], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("unknown key `lease_msec`"), "{err}");

    let (st, err) = run_to_exit(BIN, &["--model", "/nonexistent/tandem-model.gguf"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/tandem-model.gguf"), "{err}");

    let model = tiny_model();
    let (st, err) = run_to_exit(BIN, &["--model", model.to_str().unwrap(), "--device", "cuda:0"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("cuda:0") && err.contains("CUDA"), "{err}");
    // A GPU pool is not in host shared memory: shm is refused before anything is loaded.
    let (st, err) = run_to_exit(
        BIN,
        &["--model", model.to_str().unwrap(), "--device", "cuda:0", "--transport", "shm"],
        &[],
    );
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--transport shm") && err.contains("cuda:0"), "{err}");

    // The model may come from the environment, and then --kv-blocks from a config file; both together
    // with --kv-memory-mb conflict.
    std::fs::write(&cfg, "kv-blocks = 8\n").unwrap();
    let (st, err) = run_to_exit(
        BIN,
        &["--config", cfg.to_str().unwrap(), "--kv-memory-mb", "4"],
        &[("TANDEM_MODEL", model.to_str().unwrap())],
    );
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--kv-memory-mb") && err.contains("--kv-blocks"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_answers_info_and_stats_and_exits_0_on_sigterm() {
    let mut w = start(&["--worker-id", "d-test", "--lease-ms", "5000"]);
    assert!(w.kv.is_some(), "decode workers print kv=");
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.expect("Info").into_inner();
    assert_eq!(info.worker_id, "d-test");
    assert_eq!(info.role(), Role::Decode);
    assert_eq!(info.address, w.grpc.to_string());
    assert_eq!(info.total_blocks, 48);
    assert_eq!(info.device, "cpu");
    let compat = info.compat.expect("compat record");
    assert_eq!(compat.block_size, 8);
    // The CPU's default KV dtype, named in the record and in the layout name.
    assert_eq!(compat.kv_dtype, "f16");
    assert_eq!(compat.kv_layout, "tandem-f16-lkv-v1");
    assert!(compat.model_id.starts_with("sha256:"));
    let kinds: Vec<&str> = info.transports.iter().map(|o| o.kind.as_str()).collect();
    assert!(kinds.contains(&"tcp") && kinds.contains(&"shm"), "{kinds:?}");
    let shm = info.transports.iter().find(|o| o.kind == "shm").unwrap();
    assert!(Path::new(&shm.segment_path).exists(), "segment {} exists", shm.segment_path);
    assert!(info.transports.iter().all(|o| o.address == w.kv.unwrap().to_string()));
    assert_all_free(&mut c).await;
    assert_eq!(stats(&mut c).await.kv_dtype, "f16", "Stats names the pool's dtype");

    // Wrong role.
    let err = c.prefill(tandem_proto::v1::PrefillRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert_eq!(health(&w).await, ServingStatus::Serving);

    w.signal(libc::SIGTERM);
    let st = w.wait();
    assert_eq!(st.code(), Some(0), "stderr:\n{}", w.stderr());
    assert!(!Path::new(&shm.segment_path).exists(), "the shared segment is removed at exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_transfer_decode_matches_one_process() {
    let w = start(&["--lease-ms", "60000"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let mut p = local_engine();
    let mut reference = local_engine();
    let prompts: Vec<Vec<u32>> = vec![vec![9], (1..9).collect(), (100..131).collect()];
    for kind in ["tcp", "shm"] {
        for params in [greedy(10), seeded(10)] {
            for prompt in &prompts {
                let want = reference.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids;
                let (res, first) = prefill_into(&mut c, &info, kind, &mut p, prompt, &params).await;
                let (rest, reason) = decode(&mut c, prompt, &params, res, Some(first)).await.expect("Decode");
                let mut got = vec![first];
                got.extend(rest);
                assert_eq!(
                    got,
                    want,
                    "{kind}, temperature {}, prompt of {}",
                    params.temperature,
                    prompt.len()
                );
                assert_eq!(reason, "length");
                assert_all_free(&mut c).await;
            }
        }
    }
    let s = stats(&mut c).await;
    let t = s.transfers.expect("transfer counters");
    assert_eq!(t.transfers, 12);
    assert_eq!(t.failures, 0);
    assert_eq!(s.requests_finished, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_expire_and_misuse_is_refused() {
    let w = start(&["--lease-ms", "300"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let prompt: Vec<u32> = (1..20).collect();

    // An unused reservation expires.
    let res = c.reserve(reserve_req("a", 19)).await.unwrap().into_inner();
    assert_eq!(res.lease_ms, 300);
    assert_eq!(stats(&mut c).await.kv.unwrap().raw_reserved, 3);
    eventually_all_free(&c).await;
    let err = decode(&mut c, &prompt, &greedy(4), res.reservation_id, Some(1)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("unknown"), "{err}");

    // A filled reservation nobody decodes expires too; a transfer to it afterwards is refused.
    let mut p = local_engine();
    let (res_id, _) = prefill_into(&mut c, &info, "tcp", &mut p, &prompt, &greedy(4)).await;
    eventually_all_free(&c).await;
    let sender = KvSender::new(p.backend().kv_layout(), SenderOptions::default());
    let err = sender.open(&destination(&info, "tcp", res_id, vec![0, 1, 2])).await.unwrap_err();
    assert!(err.to_string().contains("unknown"), "{err}");

    // Decoding a reservation that was never filled.
    let res = c.reserve(reserve_req("r", 19)).await.unwrap().into_inner();
    let err = decode(&mut c, &prompt, &greedy(4), res.reservation_id, Some(1)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("not been filled"), "{err}");
    let rel =
        c.release(ReleaseRequest { request_id: "r".into(), reservation_id: 0 }).await.unwrap().into_inner();
    assert!(rel.released, "released by request id");
    assert_all_free(&mut c).await;
    let rel =
        c.release(ReleaseRequest { request_id: "r".into(), reservation_id: 0 }).await.unwrap().into_inner();
    assert!(!rel.released);

    // Limits: 48 blocks of 8 tokens.
    let err = c.reserve(reserve_req("c", 384)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let big = c.reserve(reserve_req("c", 300)).await.unwrap().into_inner();
    let err = c.reserve(reserve_req("d", 100)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    let rel =
        c.release(ReleaseRequest { request_id: String::new(), reservation_id: big.reservation_id }).await;
    assert!(rel.unwrap().into_inner().released);
    assert_all_free(&mut c).await;

    // Reservation 0 on a decode worker that is not colocated: it computes the prompt itself (the
    // router's prefill fallback), with the output a colocated worker gives; a prefilled Decode
    // without first token is refused.
    assert_eq!(info.role(), Role::Decode);
    let want = local_engine().generate(prompt.clone(), greedy(4), |_| {}).unwrap().token_ids;
    let (got, reason) = decode(&mut c, &prompt, &greedy(4), 0, None).await.expect("computed here");
    assert_eq!((got, reason.as_str()), (want, "length"));
    let err = decode(&mut c, &prompt, &greedy(4), 7, None).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_all_free(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_keep_room_for_sequences_already_here_and_refusals_are_not_errors() {
    let w = start(&["--lease-ms", "60000"]);
    let mut c = w.client().await;
    // 48 blocks of 8 tokens: a 300-token reservation takes 38.
    let big = c.reserve(reserve_req("c", 300)).await.unwrap().into_inner();
    let err = c.reserve(reserve_req("d", 100)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    // 10 blocks are free, but the big reservation keeps one to grow into.
    let err = c.reserve(reserve_req("e", 80)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("kept for the running and reserved sequences"), "{err}");
    // A reservation that states its output keeps room for it: 9 blocks for the prompt and up to
    // 64 more tokens (8 blocks) do not fit beside the big one's block, 9 alone do.
    let err = c.reserve(ReserveRequest { max_new_tokens: 64, ..reserve_req("e", 72) }).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("9 KV blocks needed"), "{err}");
    let e = c.reserve(reserve_req("e", 72)).await.unwrap().into_inner();
    assert_eq!(e.block_ids.len(), 9);
    assert!(
        c.release(ReleaseRequest { request_id: "e".into(), reservation_id: 0 })
            .await
            .unwrap()
            .into_inner()
            .released
    );
    // Refusals for lack of room are back-pressure, counted apart from errors.
    let m = metrics(&w).await;
    assert_eq!(sample(&m, "tandem_worker_reserve_refusals_total"), 3.0);
    assert_eq!(sample(&m, "tandem_worker_errors_total{code=\"RESOURCE_EXHAUSTED\"}"), 0.0);
    let rel = c.release(ReleaseRequest { request_id: String::new(), reservation_id: big.reservation_id });
    assert!(rel.await.unwrap().into_inner().released);
    assert_all_free(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_cancels_the_sequence() {
    let w = start(&["--lease-ms", "60000"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let mut p = local_engine();
    // A reservation holds 38 of the 48 blocks, so the sequence below outgrows what is left, is
    // preempted and waits without producing anything: only the dropped stream can end it.
    let hog = c.reserve(reserve_req("hog", 300)).await.unwrap().into_inner();
    let prompt: Vec<u32> = (5..30).collect();
    let params = greedy(300);
    let (res, first) = prefill_into(&mut c, &info, "shm", &mut p, &prompt, &params).await;
    let req = DecodeRequest {
        request_id: "r".into(),
        prompt_token_ids: prompt.clone(),
        params: Some(engine_params(&params)),
        reservation_id: res,
        first_token: Some(first),
        n: 0,
    };
    let mut stream = c.decode(req).await.unwrap().into_inner();
    let msg = stream.message().await.unwrap().expect("a first message");
    assert_eq!(msg.token_ids.len(), 1);
    eventually("the sequence waits for blocks", || {
        let mut c = c.clone();
        async move {
            let l = stats(&mut c).await.load.unwrap();
            l.running == 0 && l.queued == 1
        }
    })
    .await;
    drop(stream);
    eventually("the sequence is gone", || {
        let mut c = c.clone();
        async move { stats(&mut c).await.kv.unwrap().sequences == 0 }
    })
    .await;
    let s = stats(&mut c).await;
    assert!(s.invariants_ok, "{}", s.invariant_error);
    assert_eq!(s.kv.unwrap().raw_reserved, 38);
    assert_eq!(s.requests_finished, 0);
    assert_eq!(s.requests_failed, 1);
    let rel =
        c.release(ReleaseRequest { request_id: "hog".into(), reservation_id: hog.reservation_id }).await;
    assert!(rel.unwrap().into_inner().released);
    assert_all_free(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_worker_runs_whole_requests() {
    let w = start(&["--colocated"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.role(), Role::Colocated);
    let mut reference = local_engine();
    let prompt: Vec<u32> = (40..60).collect();
    for params in [greedy(12), seeded(12)] {
        let want = reference.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids;
        let (got, reason) = decode(&mut c, &prompt, &params, 0, None).await.expect("Decode");
        assert_eq!(got, want);
        assert_eq!(reason, "length");
    }
    let err = decode(&mut c, &prompt, &greedy(3), 0, Some(5)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_all_free(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_work_in_flight_then_exits_0() {
    let mut w = start(&["--lease-ms", "60000", "--drain-timeout-ms", "60000"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let mut p = local_engine();
    let mut reference = local_engine();
    let prompt: Vec<u32> = (1..12).collect();
    let params = greedy(8);
    let (res, first) = prefill_into(&mut c, &info, "tcp", &mut p, &prompt, &params).await;

    // A filled reservation is work in flight: the worker drains, it does not exit.
    w.signal(libc::SIGTERM);
    let mut c2 = c.clone();
    eventually("new reservations are refused", || {
        let mut c = c2.clone();
        async move {
            match c.reserve(reserve_req("late", 4)).await {
                Err(e) => e.code() == Code::Unavailable && e.message().contains("draining"),
                Ok(r) => {
                    let _ = c
                        .release(ReleaseRequest {
                            request_id: String::new(),
                            reservation_id: r.get_ref().reservation_id,
                        })
                        .await;
                    false
                }
            }
        }
    })
    .await;
    assert!(stats(&mut c2).await.load.unwrap().draining);
    assert_eq!(health(&w).await, ServingStatus::NotServing);
    assert!(w.running(), "a filled reservation keeps the worker draining");
    // Readiness is off, liveness is not, and the HTTP server still answers.
    let h = w.http.expect("http=");
    let (code, body) = http_get(h, "/ready").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("draining"), "{body}");
    assert_eq!(http_get(h, "/health").await.0, 200);
    let m = metrics(&w).await;
    assert_eq!((sample(&m, "tandem_worker_draining"), sample(&m, "tandem_worker_ready")), (1.0, 0.0));

    let want = reference.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids;
    let (rest, _) = decode(&mut c, &prompt, &params, res, Some(first)).await.expect("Decode while draining");
    let mut got = vec![first];
    got.extend(rest);
    assert_eq!(got, want);
    let st = w.wait();
    assert_eq!(st.code(), Some(0), "stderr:\n{}", w.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_endpoints_answer_and_metrics_move_with_the_work() {
    let w = start(&["--lease-ms", "60000"]);
    let h = w.http.expect("decode workers print http=");
    assert_eq!(http_get(h, "/health").await.0, 200);
    // No --router: a worker in a router's static list is ready once it serves.
    let (code, body) = http_get(h, "/ready").await;
    assert_eq!(code, 200, "{body}");
    let m = metrics(&w).await;
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_capacity"), 48.0);
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_free"), 48.0);
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_used"), 0.0);
    assert_eq!((sample(&m, "tandem_worker_ready"), sample(&m, "tandem_worker_draining")), (1.0, 0.0));
    let (code, _) = http_get(h, "/v1/models").await;
    assert_eq!(code, 404, "workers serve only the ops endpoints");

    // A reservation shows as used blocks.
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let res = c.reserve(reserve_req("m", 20)).await.unwrap().into_inner();
    let m = metrics(&w).await;
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_used"), 3.0);
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_free"), 45.0);
    assert_eq!(sample(&m, "tandem_worker_reservations"), 1.0);
    let rel = c.release(ReleaseRequest { request_id: String::new(), reservation_id: res.reservation_id });
    assert!(rel.await.unwrap().into_inner().released);

    // One transfer and decode per transport.
    let mut p = local_engine();
    let prompt: Vec<u32> = (1..12).collect();
    let payload = block_payload_bytes(&p.backend().kv_layout()) as f64;
    let mut decoded = 0usize;
    for kind in ["tcp", "shm"] {
        let (res, first) = prefill_into(&mut c, &info, kind, &mut p, &prompt, &greedy(6)).await;
        let (rest, _) = decode(&mut c, &prompt, &greedy(6), res, Some(first)).await.expect("Decode");
        decoded += rest.len();
    }
    assert!(decoded > 0);
    // A refused call counts under its gRPC code.
    let err = c.prefill(tandem_proto::v1::PrefillRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert_all_free(&mut c).await;

    let m = metrics(&w).await;
    for kind in ["tcp", "shm"] {
        let ok = format!("tandem_worker_kv_transfers_total{{outcome=\"ok\",transport=\"{kind}\"}}");
        assert_eq!(sample(&m, &ok), 1.0, "{kind}");
        let bytes = format!("tandem_worker_kv_transfer_bytes_total{{transport=\"{kind}\"}}");
        assert_eq!(sample(&m, &bytes), 2.0 * payload, "{kind}: two blocks");
        let secs = format!("tandem_worker_kv_transfer_seconds_total{{transport=\"{kind}\"}}");
        assert!(m.contains_key(&secs), "{kind}");
    }
    assert_eq!(sample(&m, "tandem_worker_decode_tokens_total"), decoded as f64);
    assert!(sample(&m, "tandem_worker_decode_tokens_per_second") > 0.0);
    assert_eq!(sample(&m, "tandem_worker_prefill_tokens_total"), 0.0, "prompts were prefilled elsewhere");
    assert_eq!(sample(&m, "tandem_worker_requests_total{outcome=\"ok\"}"), 2.0);
    assert_eq!(sample(&m, "tandem_worker_errors_total{code=\"UNIMPLEMENTED\"}"), 1.0);
    assert!(sample(&m, "tandem_worker_engine_steps_total") >= decoded as f64);
    assert_eq!(sample(&m, "tandem_worker_kv_blocks_used"), 0.0);
    assert_eq!(sample(&m, "tandem_worker_running_sequences"), 0.0);
    assert_eq!(sample(&m, "tandem_worker_queue_depth"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_requests_count_prefill_tokens() {
    let w = start(&["--colocated"]);
    let mut c = w.client().await;
    let prompt: Vec<u32> = (40..60).collect();
    let (got, _) = decode(&mut c, &prompt, &greedy(4), 0, None).await.expect("Decode");
    let m = metrics(&w).await;
    assert_eq!(sample(&m, "tandem_worker_prefill_tokens_total"), prompt.len() as f64);
    assert_eq!(sample(&m, "tandem_worker_decode_tokens_total"), got.len() as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_secret_guards_the_worker_service_and_the_kv_transport() {
    let w = start(&["--lease-ms", "60000", "--cluster-secret", "s3cret"]);
    let secret = Secret::new("s3cret", "test").unwrap();
    let wrong = Secret::new("not-it", "test").unwrap();
    let mut c = w.client().await;

    let err = c.info(InfoRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    assert!(err.message().contains("cluster secret"), "{err}");
    let err = c.info(cluster_request(Some(&wrong), InfoRequest {})).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    assert!(err.message().contains("wrong cluster secret"), "{err}");
    let info = c.info(cluster_request(Some(&secret), InfoRequest {})).await.expect("Info").into_inner();
    // Health, reflection's neighbour, and the HTTP endpoints stay open.
    assert_eq!(health(&w).await, ServingStatus::Serving);
    assert_eq!(http_get(w.http.unwrap(), "/ready").await.0, 200);
    // Both refusals are counted, as any refused call is.
    let m = metrics(&w).await;
    assert_eq!(sample(&m, "tandem_worker_errors_total{code=\"UNAUTHENTICATED\"}"), 2.0);

    let mut p = local_engine();
    let layout = p.backend().kv_layout();
    let prompt: Vec<u32> = (1..12).collect();
    let params = greedy(5);
    let mut reference = local_engine();
    let want = reference.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids;
    for kind in ["tcp", "shm"] {
        let req = reserve_req("r", prompt.len() as u32);
        let res = c.reserve(cluster_request(Some(&secret), req)).await.expect("Reserve").into_inner();
        let dest = destination(&info, kind, res.reservation_id, res.block_ids.clone());
        for (token, needle) in
            [(None, "no KV auth token"), (Some(KvToken(wrong.kv_token())), "wrong KV auth token")]
        {
            let sender = KvSender::new(layout, SenderOptions { token, ..Default::default() });
            let err = sender.open(&dest).await.expect_err("refused");
            assert!(err.to_string().contains(needle), "{kind}: {err}");
        }
        // The refused handshakes touched nothing: the reservation fills and decodes.
        let sender = KvSender::new(
            layout,
            SenderOptions { token: Some(KvToken(secret.kv_token())), ..Default::default() },
        );
        let first = transfer(&sender, &dest, &mut p, &prompt, &params).await;
        let (rest, _) = decode_as(&mut c, Some(&secret), &prompt, &params, res.reservation_id, Some(first))
            .await
            .expect("Decode");
        let mut got = vec![first];
        got.extend(rest);
        assert_eq!(got, want, "{kind}");
    }
    let m = metrics(&w).await;
    for kind in ["tcp", "shm"] {
        let failed = format!("tandem_worker_kv_transfers_total{{outcome=\"failed\",transport=\"{kind}\"}}");
        assert_eq!(sample(&m, &failed), 2.0, "{kind}");
        let ok = format!("tandem_worker_kv_transfers_total{{outcome=\"ok\",transport=\"{kind}\"}}");
        assert_eq!(sample(&m, &ok), 1.0, "{kind}");
    }
}

#[test]
fn an_unreadable_cluster_secret_file_fails_with_exit_1() {
    let (st, err) = run_to_exit(BIN, &["--cluster-secret-file", "/nonexistent/tandem-secret"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--cluster-secret-file"), "{err}");
}

/// Decodes `n` choices of one request; returns each choice's streamed tokens and finish reason.
async fn decode_n(
    c: &mut WorkerClient<Channel>,
    prompt: &[u32],
    params: &SamplingParams,
    reservation_id: u64,
    first_token: Option<u32>,
    n: u32,
) -> Result<Vec<(Vec<u32>, String)>, tonic::Status> {
    let req = DecodeRequest {
        request_id: "r".into(),
        prompt_token_ids: prompt.to_vec(),
        params: Some(engine_params(params)),
        reservation_id,
        first_token,
        n,
    };
    let mut stream = c.decode(req).await?.into_inner();
    let mut out: Vec<(Vec<u32>, Option<String>)> = vec![(Vec::new(), None); n as usize];
    while let Some(msg) = stream.message().await? {
        let choice = &mut out[msg.index as usize];
        assert!(choice.1.is_none(), "choice {} got a message after its finish reason", msg.index);
        choice.0.extend(msg.token_ids);
        choice.1 = msg.finish_reason;
        if out.iter().all(|c| c.1.is_some()) {
            break;
        }
    }
    Ok(out.into_iter().map(|(t, r)| (t, r.expect("every choice ends with a finish reason"))).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_transfer_and_each_equals_its_own_seed() {
    let w = start(&["--lease-ms", "60000"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let mut p = local_engine();
    let mut reference = local_engine();
    let prompt: Vec<u32> = (100..131).collect();
    let params = seeded(10);
    let (res, first) = prefill_into(&mut c, &info, "tcp", &mut p, &prompt, &params).await;
    let got = decode_n(&mut c, &prompt, &params, res, Some(first), 3).await.expect("Decode");
    for (i, (tokens, reason)) in got.iter().enumerate() {
        let mine = SamplingParams { seed: params.seed.map(|s| s + i as u64), ..params.clone() };
        let want = reference.generate(prompt.clone(), mine, |_| {}).unwrap().token_ids;
        let mut all = if i == 0 { vec![first] } else { Vec::new() };
        all.extend(tokens);
        assert_eq!(all, want, "choice {i}");
        assert_eq!(reason, "length");
    }
    assert_ne!(got[1].0, got[2].0, "choices with different seeds came out alike");
    assert_all_free(&mut c).await;
    let s = stats(&mut c).await;
    assert_eq!(s.transfers.expect("transfer counters").transfers, 1, "one transfer for every choice");
    assert_eq!(s.requests_finished, 1, "the request is counted once");

    let err = decode_n(&mut c, &prompt, &params, 0, None, 17).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("n: at most 16"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_worker_runs_n_choices() {
    let w = start(&["--colocated"]);
    let mut c = w.client().await;
    let mut reference = local_engine();
    let prompt: Vec<u32> = (40..60).collect();
    let params = seeded(8);
    let got = decode_n(&mut c, &prompt, &params, 0, None, 3).await.expect("Decode");
    for (i, (tokens, reason)) in got.iter().enumerate() {
        let mine = SamplingParams { seed: params.seed.map(|s| s + i as u64), ..params.clone() };
        let want = reference.generate(prompt.clone(), mine, |_| {}).unwrap().token_ids;
        assert_eq!(tokens, &want, "choice {i}");
        assert_eq!(reason, "length");
    }
    assert_all_free(&mut c).await;
    assert_eq!(stats(&mut c).await.requests_finished, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_worker_scores_the_prompt_in_its_first_message() {
    let w = start(&["--colocated"]);
    let mut c = w.client().await;
    let prompt: Vec<u32> = (40..60).collect();
    let mut params = engine_params(&greedy(3));
    params.prompt_logprobs = Some(2);
    let req = DecodeRequest {
        request_id: "r".into(),
        prompt_token_ids: prompt.clone(),
        params: Some(params),
        reservation_id: 0,
        first_token: None,
        n: 2,
    };
    let mut stream = c.decode(req).await.unwrap().into_inner();
    let mut scored = Vec::new();
    let mut finished = 0;
    while let Some(msg) = stream.message().await.unwrap() {
        if !msg.prompt_logprobs.is_empty() {
            assert_eq!(msg.prompt_logprobs.len(), prompt.len() - 1);
            assert_eq!(msg.prompt_top_logprobs.len(), prompt.len() - 1);
            assert!(msg
                .prompt_top_logprobs
                .iter()
                .all(|t| t.token_ids.len() == 2 && t.logprobs[0] >= t.logprobs[1]));
            assert!(msg.prompt_logprobs.iter().all(|&l| l <= 0.0));
            scored.push(msg.index);
        }
        finished += usize::from(msg.finish_reason.is_some());
        if finished == 2 {
            break;
        }
    }
    assert_eq!(scored, vec![0], "the prompt is scored once, with choice 0");
    assert_all_free(&mut c).await;
}
