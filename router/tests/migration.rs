//! A request whose decode (or colocated) worker is lost mid-stream (or while the prompt's blocks
//! are moved into it) moves to another worker, against fake workers with scripted tokens: the
//! client's stream goes on without a gap or a repeat, logprobs go on, the new worker is asked for
//! what is left (`max_tokens`, the context limit), the number of moves is bounded by
//! `--max-migrations`, a worker that answers with an error of its own ends the request instead of
//! moving it, and a worker dropped only for missed heartbeats is followed while it streams or
//! while there is nowhere to move.

mod common;

use std::time::Duration;

use common::*;
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::{self, Role};
use tandem_serve::identity::model_identity;
use tonic::Code;

/// Tokens the fakes generate: ordinary vocabulary entries of the tiny model (no EOS, id 2).
const SCRIPT: [u32; 10] = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309];

fn tok() -> tandem_model::tokenizer::Tokenizer {
    model_identity(&tiny_model()).unwrap().tokenizer
}

/// A fake worker `id` of `role` serving on a port of its own, behind a proxy that can be cut when
/// `behind_proxy`.
async fn start_worker(
    id: &str,
    role: Role,
    hold_after: Option<usize>,
    behind_proxy: bool,
) -> (FakeWorker, Option<Proxy>) {
    let w = FakeWorker::new(
        worker_info(id, role, "127.0.0.1:1".parse().unwrap(), 16),
        SCRIPT.to_vec(),
        hold_after,
    );
    let addr = serve(w.clone()).await;
    let proxy = if behind_proxy { Some(Proxy::start(addr).await) } else { None };
    w.0.info.lock().unwrap().address = proxy.as_ref().map_or(addr, |p| p.addr).to_string();
    (w, proxy)
}

async fn register(router: &RouterProc, workers: &[&FakeWorker]) {
    let mut reg = RegistryClient::new(router.channel().await);
    for w in workers {
        let info = w.0.info.lock().unwrap().clone();
        reg.register(info).await.unwrap();
    }
}

/// A Generate stream read message by message.
struct Stream {
    inner: tonic::Streaming<v1::GenerateResponse>,
    got: Collected,
    logprobs: std::sync::Arc<std::sync::Mutex<Vec<f32>>>,
}

impl Stream {
    async fn open(router: &RouterProc, req: v1::GenerateRequest) -> Stream {
        let mut client = v1::tandem_client::TandemClient::new(router.channel().await);
        let inner = client.generate(req).await.unwrap().into_inner();
        Stream { inner, got: Collected::default(), logprobs: Default::default() }
    }

    /// Reads until the client holds `n` tokens.
    async fn until(&mut self, n: usize) {
        while self.got.token_ids.len() < n {
            let m = self.inner.message().await.unwrap().expect("the stream is still open");
            self.take(m);
        }
    }

    fn take(&mut self, m: v1::GenerateResponse) {
        self.got.messages += 1;
        self.logprobs.lock().unwrap().extend(&m.logprobs);
        self.got.token_ids.extend(&m.token_ids);
        self.got.text.push_str(&m.text);
        if m.finish_reason.is_some() {
            self.got.finish_reason = m.finish_reason;
            self.got.usage = m.usage;
        }
    }

    /// Reads to the end: the whole output, or the status that ended it.
    async fn finish(mut self) -> Result<Collected, tonic::Status> {
        let read = async {
            while let Some(m) = self.inner.message().await? {
                self.take(m);
            }
            Ok(self.got)
        };
        tokio::time::timeout(Duration::from_secs(20), read).await.expect("the stream ends")
    }
}

/// `tandem_router_migrations_total{phase="decode"}`.
fn migrations(metrics: &str) -> f64 {
    migrations_in(metrics, "decode")
}

fn migrations_in(metrics: &str, phase: &str) -> f64 {
    metric_value(metrics, &format!("tandem_router_migrations_total{{phase=\"{phase}\"}}"))
        .expect("the migrations counter")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_worker_hands_the_stream_to_another_without_gap_or_repeat() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    // d-1 is chosen first (equal load, lowest id); it streams 3 tokens and then dies.
    let (d1, proxy) = start_worker("d-1", Role::Decode, Some(3), true).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    register(&router, &[&p, &d1, &d2]).await;

    let prompt: Vec<u32> = (10..30).collect();
    let mut s = Stream::open(&router, token_prompt(prompt.clone(), 8)).await;
    s.until(3).await;
    proxy.unwrap().kill();
    let logprobs = s.logprobs.clone();
    let c = s.finish().await.expect("the request survives its decode worker");
    // Logprobs go on: each prefill worker's first token (-0.5), then the decode workers' (-1).
    let want: Vec<f32> = vec![-0.5, -1.0, -1.0, -0.5, -1.0, -1.0, -1.0, -1.0];
    assert_eq!(*logprobs.lock().unwrap(), want);

    assert_eq!(c.token_ids, SCRIPT[..8].to_vec(), "no token lost or repeated");
    assert_eq!(c.text, tok().decode(&SCRIPT[..8], true).unwrap());
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    assert_eq!(c.usage, Some(v1::Usage { prompt_tokens: 20, completion_tokens: 8, cached_tokens: 0 }));
    // d-2 computed the prompt and the 3 streamed tokens, and was asked for the 5 left.
    let mut input = prompt.clone();
    input.extend(&SCRIPT[..3]);
    assert_eq!(d2.0.reserves.lock().unwrap()[0].prompt_token_ids, input);
    let pre = p.0.prefills.lock().unwrap()[1].clone();
    assert_eq!(pre.prompt_token_ids, input);
    assert_eq!(pre.destination.unwrap().worker_id, "d-2");
    assert_eq!(pre.params.unwrap().max_tokens, 5);
    let dec = d2.0.decodes.lock().unwrap()[0].clone();
    assert_eq!((dec.prompt_token_ids, dec.first_token), (input, Some(SCRIPT[3])));
    assert_eq!(dec.params.unwrap().max_tokens, 5);
    assert_eq!(migrations(&router_metrics(&router).await), 1.0);
}

/// Heartbeats every 20 ms for the workers named in the returned list, as live workers send them.
async fn heartbeats(router: &RouterProc, ids: &[&str]) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let beating =
        std::sync::Arc::new(std::sync::Mutex::new(ids.iter().map(|s| s.to_string()).collect::<Vec<_>>()));
    let mut reg = RegistryClient::new(router.channel().await);
    let list = beating.clone();
    tokio::spawn(async move {
        loop {
            let ids = list.lock().unwrap().clone();
            for worker_id in ids {
                let _ = reg
                    .heartbeat(v1::HeartbeatRequest {
                        worker_id,
                        load: None,
                        cache: None,
                        ..Default::default()
                    })
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    beating
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_heartbeating_and_streaming_loses_its_streams_to_another() {
    // The worker's stream neither ends nor fails (as with a stuck process whose connection stays
    // up): missed heartbeats and a silent stream are what move the request.
    let router = RouterProc::start(&["--heartbeat-ms", "100"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, _) = start_worker("d-1", Role::Decode, Some(2), false).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    register(&router, &[&p, &d1, &d2]).await;
    let beating = heartbeats(&router, &["p-1", "d-1", "d-2"]).await;

    let mut s = Stream::open(&router, token_prompt((10..30).collect(), 6)).await;
    s.until(2).await;
    beating.lock().unwrap().retain(|id| id != "d-1");
    let c = s.finish().await.expect("the request moves to d-2");
    assert_eq!(c.token_ids, SCRIPT[..6].to_vec());
    assert_eq!(d2.0.decodes.lock().unwrap().len(), 1);
    // d-1 is told to let the sequence go, and its stream is dropped.
    eventually("d-1 released", || d1.releases().iter().any(|r| r.reservation_id == 7)).await;
    eventually("d-1's stream dropped", || d1.0.decode_dropped.load(std::sync::atomic::Ordering::SeqCst) == 1)
        .await;
    assert_eq!(migrations(&router_metrics(&router).await), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropped_for_missed_heartbeats_is_followed_when_there_is_nowhere_to_move() {
    // A worker too busy to heartbeat in time is dropped from the table, yet its sequences live:
    // with no other worker, the request waits for its stream instead of failing.
    let router = RouterProc::start(&["--heartbeat-ms", "100"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, _) = start_worker("d-1", Role::Decode, None, false).await;
    register(&router, &[&p, &d1]).await;
    let beating = heartbeats(&router, &["p-1", "d-1"]).await;

    d1.0.paused.send_replace(true);
    let mut s = Stream::open(&router, token_prompt((10..30).collect(), 8)).await;
    s.until(1).await;
    beating.lock().unwrap().retain(|id| id != "d-1");
    let ch = router.channel().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let h = v1::tandem_client::TandemClient::new(ch.clone()).health(v1::HealthRequest {}).await.unwrap();
        if !h.into_inner().workers.iter().any(|w| w.worker_id == "d-1") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "d-1 was never dropped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Silent for longer than the registry waits for heartbeats, then it streams again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    d1.0.paused.send_replace(false);
    let c = s.finish().await.expect("the request is followed to its end");
    assert_eq!(c.token_ids, SCRIPT[..8].to_vec());
    assert_eq!(migrations(&router_metrics(&router).await), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_into_a_dead_decode_worker_moves_the_request_to_another() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, proxy) = start_worker("d-1", Role::Decode, None, true).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    register(&router, &[&p, &d1, &d2]).await;
    // d-1 reserves, then dies while the prefill worker sends it the blocks.
    let proxy = proxy.unwrap();
    *p.0.prefill_hook.lock().unwrap() = Some(Box::new(move || {
        proxy.kill();
        tonic::Status::unavailable("connecting to the KV receiver: connection refused")
    }));
    let c =
        generate(router.channel().await, token_prompt((10..30).collect(), 5)).await.expect("moved to d-2");
    assert_eq!(c.token_ids, SCRIPT[..5].to_vec());
    assert_eq!(d1.calls(), vec!["Reserve 20".to_string()]);
    assert_eq!(d2.0.decodes.lock().unwrap().len(), 1);
    assert_eq!(migrations(&router_metrics(&router).await), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_refusal_with_a_live_decode_worker_is_not_a_loss() {
    // A draining prefill worker answers UNAVAILABLE too; the decode worker still answers, so it
    // is not taken as lost. The prefill worker is (it is going away), and with no other one the
    // request fails under `--prefill-fallback fail`.
    // (Nor does it wait for a prefill worker to come back: --lost-worker-wait-ms 0.)
    let router = RouterProc::start(&[
        "--heartbeat-ms",
        "60000",
        "--prefill-fallback",
        "fail",
        "--lost-worker-wait-ms",
        "0",
    ]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, _) = start_worker("d-1", Role::Decode, None, false).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    register(&router, &[&p, &d1, &d2]).await;
    *p.0.prefill_hook.lock().unwrap() =
        Some(Box::new(|| tonic::Status::unavailable("the worker is draining (shutting down)")));
    let err = generate(router.channel().await, token_prompt((10..30).collect(), 5))
        .await
        .expect_err("the prefill worker's refusal ends the request");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(d2.calls().is_empty(), "{:?}", d2.calls());
    assert_eq!(migrations(&router_metrics(&router).await), 0.0);
}

/// `tandem_router_decode_prefills_total{reason}`.
fn decode_prefills(metrics: &str, reason: &str) -> f64 {
    metric_value(metrics, &format!("tandem_router_decode_prefills_total{{reason=\"{reason}\"}}"))
        .expect("the decode prefills counter")
}

/// A router (waiting `wait_ms` for lost workers) with one prefill worker and one decode worker
/// that reserves, then dies while the prefill worker sends it the blocks.
async fn lone_decode_worker_dying_in_the_transfer(wait_ms: &str) -> RouterProc {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--lost-worker-wait-ms", wait_ms]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, proxy) = start_worker("d-1", Role::Decode, None, true).await;
    register(&router, &[&p, &d1]).await;
    let proxy = proxy.unwrap();
    *p.0.prefill_hook.lock().unwrap() = Some(Box::new(move || {
        proxy.kill();
        // What a prefill worker answers when its KV connection dies mid-transfer.
        tonic::Status::aborted("KV transfer with 127.0.0.1:1: connection reset by peer")
    }));
    router
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_only_decode_worker_dies_before_its_first_token_waits_for_it_to_come_back() {
    let router = lone_decode_worker_dying_in_the_transfer("20000").await;
    let s = Stream::open(&router, token_prompt((10..30).collect(), 5)).await;
    eventually("the router waits for a decode worker", || {
        router.stderr().contains("no other worker can take the request now; waiting for one")
    })
    .await;
    // d-1 comes back: restarted, at another address, under its id.
    let (d1_again, _) = start_worker("d-1", Role::Decode, None, false).await;
    register(&router, &[&d1_again]).await;
    let c = s.finish().await.expect("the request waits for the restarted worker");
    assert_eq!(c.token_ids, SCRIPT[..5].to_vec(), "the output of an undisturbed run");
    assert_eq!(d1_again.0.decodes.lock().unwrap().len(), 1);
    let m = router_metrics(&router).await;
    assert_eq!(metric_value(&m, r#"tandem_router_lost_worker_waits_total{outcome="resumed"}"#), Some(1.0));
    assert_eq!(migrations(&m), 1.0);

    // Nobody comes back within the wait: UNAVAILABLE, naming the request.
    let router = lone_decode_worker_dying_in_the_transfer("300").await;
    let err = generate(router.channel().await, token_prompt((10..30).collect(), 5)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // The log names what failed: d-1, lost in the transfer p-1 reported cut.
    assert_concealed(&err, &router, &["decode worker d-1", "connection reset"]).await;
    let m = router_metrics(&router).await;
    assert_eq!(metric_value(&m, r#"tandem_router_lost_worker_waits_total{outcome="gave_up"}"#), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_prefill_worker_left_the_decode_worker_computes_the_prompt() {
    // The only prefill worker dies mid-prefill: the decode worker is asked for the whole request
    // (reservation 0), as a colocated worker would be, and the output is the undisturbed run's.
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p, proxy) = start_worker("p-1", Role::Prefill, None, true).await;
    let (d, _) = start_worker("d-1", Role::Decode, None, false).await;
    p.0.prefill_hang.store(true, std::sync::atomic::Ordering::SeqCst);
    register(&router, &[&p, &d]).await;
    let prompt: Vec<u32> = (10..30).collect();
    let s = Stream::open(&router, token_prompt(prompt.clone(), 6)).await;
    eventually("p-1 has the prompt", || p.0.prefills.lock().unwrap().len() == 1).await;
    proxy.unwrap().kill();
    let c = s.finish().await.expect("the decode worker computes the prompt");
    assert_eq!(c.token_ids, SCRIPT[..6].to_vec(), "the output of an undisturbed run");
    let decodes = d.0.decodes.lock().unwrap().clone();
    assert_eq!(decodes.len(), 1, "{:?}", d.calls());
    assert_eq!((decodes[0].reservation_id, decodes[0].first_token), (0, None));
    assert_eq!(decodes[0].prompt_token_ids, prompt);
    eventually("the reservation p-1 was filling is released", || {
        d.releases().iter().any(|r| r.reservation_id == 7 && r.request_id.is_empty())
    })
    .await;
    let m = router_metrics(&router).await;
    assert_eq!(migrations_in(&m, "prefill"), 1.0);
    assert_eq!(decode_prefills(&m, "no_prefill_worker"), 1.0);
    assert_eq!(decode_prefills(&m, "kv_transfer_failed"), 0.0);

    // While no prefill worker is registered at all, requests go to the decode worker directly,
    // and the router says it serves that way.
    let h = v1::tandem_client::TandemClient::new(router.channel().await)
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(h.serving && h.message.contains("--prefill-fallback decode"), "{h:?}");
    let c = generate(router.channel().await, token_prompt((40..50).collect(), 3)).await.expect("served");
    assert_eq!(c.token_ids, SCRIPT[..3].to_vec());
    assert_eq!(d.0.decodes.lock().unwrap().len(), 2);
    assert_eq!(decode_prefills(&router_metrics(&router).await, "no_prefill_worker"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_prefill_fallback_fail_a_decode_only_cluster_refuses_with_a_retryable_error() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--prefill-fallback", "fail"]);
    let (d, _) = start_worker("d-1", Role::Decode, None, false).await;
    register(&router, &[&d]).await;
    let err = generate(router.channel().await, token_prompt((10..30).collect(), 5)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("no usable prefill worker"), "{err:?}");
    assert!(d.0.decodes.lock().unwrap().is_empty());
    assert_eq!(decode_prefills(&router_metrics(&router).await, "no_prefill_worker"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_kv_transfer_is_recomputed_on_the_decode_worker_unless_told_to_fail() {
    for (policy, recomputes) in [("decode", true), ("fail", false)] {
        let router = RouterProc::start(&["--heartbeat-ms", "60000", "--prefill-fallback", policy]);
        let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
        let (d, _) = start_worker("d-1", Role::Decode, None, false).await;
        register(&router, &[&p, &d]).await;
        // The prefill worker computed the prompt, but the blocks did not arrive whole.
        *p.0.prefill_hook.lock().unwrap() = Some(Box::new(|| {
            tonic::Status::aborted("KV transfer with 127.0.0.1:1: block 3: checksum mismatch")
        }));
        let prompt: Vec<u32> = (10..30).collect();
        let r = generate(router.channel().await, token_prompt(prompt.clone(), 5)).await;
        let m = router_metrics(&router).await;
        if recomputes {
            let c = r.expect("recomputed on the decode worker");
            assert_eq!(c.token_ids, SCRIPT[..5].to_vec(), "the output of an undisturbed run");
            let decodes = d.0.decodes.lock().unwrap().clone();
            assert_eq!(decodes.len(), 1, "{:?}", d.calls());
            assert_eq!((decodes[0].reservation_id, decodes[0].prompt_token_ids.clone()), (0, prompt));
            assert_eq!(d.calls()[0], "Reserve 20");
            eventually("the failed reservation is released", || {
                d.releases().iter().any(|r| r.reservation_id == 7 && r.request_id.is_empty())
            })
            .await;
            assert_eq!(decode_prefills(&m, "kv_transfer_failed"), 1.0);
        } else {
            let err = r.expect_err("--prefill-fallback fail");
            assert!(matches!(err.code(), Code::Aborted | Code::Unavailable), "{err:?}");
            assert!(d.0.decodes.lock().unwrap().is_empty(), "{:?}", d.calls());
            assert_eq!(decode_prefills(&m, "kv_transfer_failed"), 0.0);
        }
        assert_eq!(decode_prefills(&m, "no_prefill_worker"), 0.0);
        assert_eq!(migrations_in(&m, "prefill") + migrations_in(&m, "decode"), 0.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_worker_gets_what_is_left_of_the_context() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, proxy) = start_worker("d-1", Role::Decode, Some(3), true).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    for w in [&d1, &d2] {
        w.0.info.lock().unwrap().max_sequence_len = 30;
    }
    register(&router, &[&p, &d1, &d2]).await;

    // 20 prompt tokens in a context of 30: 10 tokens at most, whatever max_tokens says.
    let mut s = Stream::open(&router, token_prompt((10..30).collect(), 100)).await;
    s.until(3).await;
    proxy.unwrap().kill();
    let c = s.finish().await.expect("the request survives its decode worker");
    assert_eq!(c.token_ids, SCRIPT[..10].to_vec());
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    assert_eq!(c.usage.map(|u| (u.prompt_tokens, u.completion_tokens)), Some((20, 10)));
    let dec = d2.0.decodes.lock().unwrap()[0].clone();
    assert_eq!(dec.prompt_token_ids.len(), 23);
    assert_eq!(dec.params.unwrap().max_tokens, 97, "max_tokens counts the 3 tokens streamed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_worker_lost_mid_stream_hands_over_to_another() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (c1, proxy) = start_worker("c-1", Role::Colocated, Some(3), true).await;
    let (c2, _) = start_worker("c-2", Role::Colocated, None, false).await;
    register(&router, &[&c1, &c2]).await;

    let mut s = Stream::open(&router, token_prompt((10..30).collect(), 8)).await;
    s.until(3).await;
    proxy.unwrap().kill();
    let c = s.finish().await.expect("the request survives its worker");
    assert_eq!(c.token_ids, SCRIPT[..8].to_vec());
    let dec = c2.0.decodes.lock().unwrap()[0].clone();
    assert_eq!((dec.prompt_token_ids.len(), dec.reservation_id, dec.first_token), (23, 0, None));
    assert_eq!(dec.params.unwrap().max_tokens, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_stop_at_max_migrations() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--max-migrations", "1"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let mut decoders = Vec::new();
    for id in ["d-1", "d-2", "d-3"] {
        let (d, _) = start_worker(id, Role::Decode, None, false).await;
        // Each says it is going away after two tokens of a sequence.
        *d.0.fail_after.lock().unwrap() = Some((2, Code::Unavailable));
        decoders.push(d);
    }
    register(&router, &[&p, &decoders[0], &decoders[1], &decoders[2]]).await;

    let err = generate(router.channel().await, token_prompt((10..30).collect(), 8))
        .await
        .expect_err("the second loss ends the request");
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let decodes: Vec<usize> = decoders.iter().map(|d| d.0.decodes.lock().unwrap().len()).collect();
    assert_eq!(decodes, vec![1, 1, 0], "one move, then no more");
    assert_eq!(migrations(&router_metrics(&router).await), 1.0);

    // With moves disabled, the first loss ends the request.
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--max-migrations", "0"]);
    let (d1, proxy) = start_worker("d-1", Role::Decode, Some(2), true).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    register(&router, &[&p, &d1, &d2]).await;
    let mut s = Stream::open(&router, token_prompt((10..30).collect(), 8)).await;
    s.until(2).await;
    proxy.unwrap().kill();
    let err = s.finish().await.expect_err("no move with --max-migrations 0");
    assert!(matches!(err.code(), Code::Aborted | Code::Unavailable), "{err:?}");
    assert!(d2.calls().is_empty(), "{:?}", d2.calls());
    assert_eq!(migrations(&router_metrics(&router).await), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_the_worker_answers_ends_the_request_without_moving_it() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, _) = start_worker("d-1", Role::Decode, None, false).await;
    let (d2, _) = start_worker("d-2", Role::Decode, None, false).await;
    *d1.0.fail_after.lock().unwrap() = Some((3, Code::InvalidArgument));
    register(&router, &[&p, &d1, &d2]).await;

    let err = generate(router.channel().await, token_prompt((10..30).collect(), 8))
        .await
        .expect_err("the worker's answer ends the request");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(d2.calls().is_empty(), "{:?}", d2.calls());
    assert_eq!(migrations(&router_metrics(&router).await), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_another_worker_the_client_gets_the_error() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (d1, proxy) = start_worker("d-1", Role::Decode, Some(2), true).await;
    register(&router, &[&p, &d1]).await;
    let mut s = Stream::open(&router, token_prompt((10..30).collect(), 8)).await;
    s.until(2).await;
    proxy.unwrap().kill();
    let err = s.finish().await.expect_err("nowhere to move");
    assert!(matches!(err.code(), Code::Aborted | Code::Unavailable), "{err:?}");
    assert!(!err.message().is_empty());
    assert_eq!(migrations(&router_metrics(&router).await), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_lost_mid_prefill_hands_the_prompt_to_another() {
    // p-1 is chosen first (equal load, lowest id); it never answers, then its connection dies.
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p1, proxy) = start_worker("p-1", Role::Prefill, None, true).await;
    let (p2, _) = start_worker("p-2", Role::Prefill, None, false).await;
    let (d, _) = start_worker("d-1", Role::Decode, None, false).await;
    p1.0.prefill_hang.store(true, std::sync::atomic::Ordering::SeqCst);
    register(&router, &[&p1, &p2, &d]).await;

    let prompt: Vec<u32> = (10..30).collect();
    // Scoring the prompt too: the second prefill worker is asked to score it again.
    let req = v1::GenerateRequest { prompt_logprobs: Some(1), ..token_prompt(prompt.clone(), 6) };
    let s = Stream::open(&router, req).await;
    eventually("p-1 has the prompt", || p1.0.prefills.lock().unwrap().len() == 1).await;
    proxy.unwrap().kill();
    let c = s.finish().await.expect("the request survives its prefill worker");
    assert_eq!(c.token_ids, SCRIPT[..6].to_vec(), "the output of an undisturbed run");
    assert_eq!(c.usage.unwrap().completion_tokens, 6);
    // p-2 computed the same prompt into a fresh reservation, and the first one was released.
    let pre = p2.0.prefills.lock().unwrap()[0].clone();
    assert_eq!(pre.prompt_token_ids, prompt);
    assert_eq!(pre.params.unwrap().prompt_logprobs, Some(1), "the prompt is still scored");
    assert_eq!(d.0.reserves.lock().unwrap().len(), 2, "a fresh reservation for the second prefill");
    eventually("the first reservation released", || !d.releases().is_empty()).await;
    let m = router_metrics(&router).await;
    assert_eq!((migrations_in(&m, "prefill"), migrations_in(&m, "decode")), (1.0, 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_prefill_worker_is_given_up_and_a_draining_one_is_left() {
    // Frozen: p-1 neither answers nor heartbeats, and its connection stays up.
    let router = RouterProc::start(&["--heartbeat-ms", "100"]);
    let (p1, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (p2, _) = start_worker("p-2", Role::Prefill, None, false).await;
    let (d, _) = start_worker("d-1", Role::Decode, None, false).await;
    p1.0.prefill_hang.store(true, std::sync::atomic::Ordering::SeqCst);
    register(&router, &[&p1, &p2, &d]).await;
    let beating = heartbeats(&router, &["p-1", "p-2", "d-1"]).await;
    let s = Stream::open(&router, token_prompt((10..30).collect(), 5)).await;
    eventually("p-1 has the prompt", || p1.0.prefills.lock().unwrap().len() == 1).await;
    beating.lock().unwrap().retain(|id| id != "p-1");
    let c = s.finish().await.expect("the request moves to p-2");
    assert_eq!(c.token_ids, SCRIPT[..5].to_vec());
    assert_eq!(p2.0.prefills.lock().unwrap().len(), 1);
    assert_eq!(migrations_in(&router_metrics(&router).await, "prefill"), 1.0);

    // Draining: a prefill worker that answers UNAVAILABLE (going away) while the decode worker
    // answers is left for another one.
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let (p1, _) = start_worker("p-1", Role::Prefill, None, false).await;
    let (p2, _) = start_worker("p-2", Role::Prefill, None, false).await;
    let (d, _) = start_worker("d-1", Role::Decode, None, false).await;
    register(&router, &[&p1, &p2, &d]).await;
    *p1.0.prefill_hook.lock().unwrap() =
        Some(Box::new(|| tonic::Status::unavailable("the worker is draining (shutting down)")));
    let c =
        generate(router.channel().await, token_prompt((10..30).collect(), 4)).await.expect("moved to p-2");
    assert_eq!(c.token_ids, SCRIPT[..4].to_vec());
    assert_eq!(p2.0.prefills.lock().unwrap().len(), 1);
    assert_eq!(migrations_in(&router_metrics(&router).await, "prefill"), 1.0);
}
