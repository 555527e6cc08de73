//! The router's side of the worker protocol, against fake workers with scripted tokens: the
//! Reserve → Prefill → Decode sequence and what each call carries, streaming and detokenization,
//! stop strings, a first token that ends the request, cancellation, a worker dying mid-stream,
//! registration refusals, heartbeat expiry and statically listed workers.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use tandem_engine::serve::identity::model_identity;
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::{self, Role};
use tonic::Code;

/// Tokens the fakes generate: ordinary vocabulary entries of the tiny model (no EOS, id 2).
const SCRIPT: [u32; 10] = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309];

fn tok() -> tandem_engine::tokenizer::Tokenizer {
    model_identity(&tiny_model()).unwrap().tokenizer
}

struct Split {
    prefill: FakeWorker,
    decode: FakeWorker,
    decode_proxy: Proxy,
}

/// A fake prefill and a fake decode worker, registered with `router` (the decode worker behind
/// a proxy that can be cut).
async fn split(router: &RouterProc, hold_after: Option<usize>) -> Split {
    let ch = router.channel().await;
    let p = FakeWorker::new(
        worker_info("p-1", Role::Prefill, "127.0.0.1:1".parse().unwrap(), 16),
        SCRIPT.to_vec(),
        None,
    );
    let d = FakeWorker::new(
        worker_info("d-1", Role::Decode, "127.0.0.1:1".parse().unwrap(), 16),
        SCRIPT.to_vec(),
        hold_after,
    );
    let p_addr = serve(p.clone()).await;
    let d_addr = serve(d.clone()).await;
    let decode_proxy = Proxy::start(d_addr).await;
    p.0.info.lock().unwrap().address = p_addr.to_string();
    d.0.info.lock().unwrap().address = decode_proxy.addr.to_string();
    let mut reg = RegistryClient::new(ch);
    for w in [&p, &d] {
        let info = w.0.info.lock().unwrap().clone();
        let r = reg.register(info).await.unwrap().into_inner();
        assert!(r.heartbeat_interval_ms > 0);
    }
    Split { prefill: p, decode: d, decode_proxy }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_request_reserves_prefills_decodes_and_streams_text() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    let ch = router.channel().await;
    let h = v1::tandem_client::TandemClient::new(ch.clone())
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(h.serving, "{h:?}");
    assert_eq!(h.workers.len(), 2);

    let prompt: Vec<u32> = (10..30).collect();
    let mut req = token_prompt(prompt.clone(), 5);
    req.request_id = "tag-1".into();
    let c = generate(ch.clone(), req).await.unwrap();
    assert_eq!(c.prompt_token_ids, prompt);
    assert_eq!(c.request_id, "tag-1");
    assert_eq!(c.token_ids, SCRIPT[..5].to_vec());
    assert_eq!(c.text, tok().decode(&SCRIPT[..5], true).unwrap());
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    assert_eq!(c.usage, Some(v1::Usage { prompt_tokens: 20, completion_tokens: 5 }));
    let t = c.timings.expect("timings on the last message");
    assert_eq!((t.queue_ms, t.prefill_ms, t.transfer_ms), (1.0, 2.0, 3.0));
    assert!(t.ttft_ms > 0.0 && t.total_ms >= t.ttft_ms, "{t:?}");

    assert_eq!(
        w.decode.calls(),
        vec!["Reserve 20".to_string(), "Decode reservation=7 first=Some(300)".into()]
    );
    assert_eq!(w.prefill.calls(), vec!["Prefill 20".to_string()]);
    let pre = w.prefill.0.prefills.lock().unwrap()[0].clone();
    let dest = pre.destination.expect("destination");
    assert_eq!((dest.worker_id.as_str(), dest.transport.as_str()), ("d-1", "tcp"));
    assert_eq!(dest.address, "127.0.0.1:9");
    assert_eq!((dest.reservation_id, dest.block_ids.clone()), (7, vec![0, 1]));
    let params = pre.params.expect("params");
    assert_eq!((params.max_tokens, params.temperature, params.top_p), (5, 0.0, 1.0));
    assert_eq!(params.repetition_penalty, 1.0);
    let dec = w.decode.0.decodes.lock().unwrap()[0].clone();
    assert_eq!(dec.prompt_token_ids, prompt);
    assert_eq!(dec.params.expect("params").seed, params.seed, "both workers sample with one seed");
    assert!(w.decode.releases().is_empty(), "a finished sequence needs no Release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_token_that_ends_the_request_releases_instead_of_decoding() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    let ch = router.channel().await;
    let c = generate(ch.clone(), token_prompt(vec![1, 2, 3], 1)).await.unwrap();
    assert_eq!(c.token_ids, vec![SCRIPT[0]]);
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    assert_eq!(c.messages, 1, "one message carries the token, the prompt and the finish");
    // A stop token as the first token ends it too.
    let mut req = token_prompt(vec![1, 2, 3], 8);
    req.stop_token_ids = vec![SCRIPT[0]];
    let c = generate(ch.clone(), req).await.unwrap();
    assert_eq!((c.token_ids, c.finish_reason.as_deref()), (vec![SCRIPT[0]], Some("stop")));
    assert!(c.text.is_empty(), "a stop token's text is not returned: {:?}", c.text);
    eventually("two reservations released", || w.decode.releases().len() == 2).await;
    assert!(w.decode.releases().iter().all(|r| r.reservation_id == 7));
    assert!(!w.decode.calls().iter().any(|c| c.starts_with("Decode")), "{:?}", w.decode.calls());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_cuts_text_and_cancels_the_decode_stream() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    let ch = router.channel().await;
    let tok = tok();
    let full = tok.decode(&SCRIPT, true).unwrap();
    // A stop string made of the text of tokens 3 and 4.
    let before = tok.decode(&SCRIPT[..3], true).unwrap();
    let upto = tok.decode(&SCRIPT[..5], true).unwrap();
    let stop = upto[before.len()..].to_string();
    assert!(!stop.is_empty() && full.contains(&stop));
    let mut req = token_prompt(vec![1, 2, 3], 10);
    req.stop = vec![stop.clone()];
    let c = generate(ch.clone(), req).await.unwrap();
    assert_eq!(c.text, &full[..full.find(&stop).unwrap()], "stop {stop:?}");
    assert_eq!(c.finish_reason.as_deref(), Some("stop"));
    assert!(c.token_ids.len() < 10 && c.token_ids.len() >= 4, "{:?}", c.token_ids);
    eventually("the decode worker is told to release", || !w.decode.releases().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_cancel_drops_the_decode_stream_and_releases() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, Some(3)).await;
    let ch = router.channel().await;
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());
    let mut stream = client.generate(token_prompt(vec![1, 2, 3], 10)).await.unwrap().into_inner();
    let mut got = 0;
    while got < 3 {
        got += stream.message().await.unwrap().expect("open").token_ids.len();
    }
    drop(stream);
    eventually("decode stream dropped", || w.decode.0.decode_dropped.load(Ordering::SeqCst) == 1).await;
    eventually("release sent", || w.decode.releases().len() == 1).await;
    assert_eq!(w.decode.releases()[0].reservation_id, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_dying_mid_stream_fails_the_request_and_is_avoided() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, Some(3)).await;
    let ch = router.channel().await;
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());
    let mut stream = client.generate(token_prompt(vec![1, 2, 3], 10)).await.unwrap().into_inner();
    let mut got = 0;
    while got < 3 {
        got += stream.message().await.unwrap().expect("open").token_ids.len();
    }
    let t0 = Instant::now();
    w.decode_proxy.kill();
    let err = loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.message()).await.expect("not left hanging")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("stream ended normally"),
            Err(e) => break e,
        }
    };
    assert!(matches!(err.code(), Code::Aborted | Code::Unavailable), "{err:?}");
    assert!(err.message().contains("decode worker d-1"), "{err:?}");
    eprintln!("error after {:?}: {err:?}", t0.elapsed());
    // The dead worker is out of selection: the next request fails fast instead of hanging.
    let h = v1::tandem_client::TandemClient::new(ch.clone())
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!h.serving, "{h:?}");
    assert!(h.workers.iter().any(|x| x.worker_id == "d-1" && !x.healthy), "{h:?}");
    let err = generate(ch.clone(), token_prompt(vec![1], 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // A heartbeat brings it back.
    let mut reg = RegistryClient::new(ch.clone());
    let hb = reg
        .heartbeat(v1::HeartbeatRequest { worker_id: "d-1".into(), load: None })
        .await
        .unwrap()
        .into_inner();
    assert!(hb.known);
    let h = v1::tandem_client::TandemClient::new(ch.clone())
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(h.serving, "{h:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_refuses_mismatched_workers_with_clear_messages() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let ch = router.channel().await;
    let mut reg = RegistryClient::new(ch.clone());
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().unwrap();
    reg.register(worker_info("d-1", Role::Decode, addr(1001), 16)).await.unwrap();

    let err = reg.register(worker_info("p-1", Role::Prefill, addr(1002), 32)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let m = err.message();
    assert!(m.contains("p-1") && m.contains("d-1") && m.contains("block_size: 16 vs 32"), "{m}");

    let mut other = worker_info("p-2", Role::Prefill, addr(1003), 16);
    other.compat.as_mut().unwrap().model_id = "sha256:0000".into();
    let err = reg.register(other).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("p-2") && err.message().contains("sha256:0000"), "{err:?}");

    let mut shm_only = worker_info("p-3", Role::Prefill, addr(1004), 16);
    shm_only.transports =
        vec![v1::TransportOffer { kind: "shm".into(), host_id: "h".into(), ..Default::default() }];
    let err = reg.register(shm_only).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("share no KV transport") && err.message().contains("tcp"), "{err:?}");

    let err = reg.register(v1::WorkerInfo::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    let h = v1::tandem_client::TandemClient::new(ch).health(v1::HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.workers.len(), 1, "refused workers are not listed: {h:?}");
    assert!(!h.serving);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_stop_heartbeating_are_dropped() {
    let router = RouterProc::start(&["--heartbeat-ms", "100"]);
    let ch = router.channel().await;
    let mut reg = RegistryClient::new(ch.clone());
    let r = reg
        .register(worker_info("c-1", Role::Colocated, "127.0.0.1:1001".parse().unwrap(), 16))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.heartbeat_interval_ms, 100);
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let status = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap();
    assert_eq!(status.into_inner().status, serving);
    // Heartbeats keep it; silence drops it.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let hb = reg.heartbeat(v1::HeartbeatRequest { worker_id: "c-1".into(), load: None }).await.unwrap();
        assert!(hb.into_inner().known, "dropped while heartbeating");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = v1::tandem_client::TandemClient::new(ch.clone())
            .health(v1::HealthRequest {})
            .await
            .unwrap()
            .into_inner();
        if h.workers.is_empty() {
            assert!(!h.serving);
            break;
        }
        assert!(Instant::now() < deadline, "never dropped: {h:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap();
    assert_ne!(status.into_inner().status, serving);
    let hb = reg.heartbeat(v1::HeartbeatRequest { worker_id: "c-1".into(), load: None }).await.unwrap();
    assert!(!hb.into_inner().known, "a dropped worker must register again");
    assert!(router.stderr().contains("no heartbeat"), "{}", router.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_colocated_worker_is_polled_and_serves_whole_requests() {
    let c = FakeWorker::new(
        worker_info("c-1", Role::Colocated, "127.0.0.1:1".parse().unwrap(), 16),
        SCRIPT.to_vec(),
        None,
    );
    let addr = serve(c.clone()).await;
    let listed = addr.to_string();
    let router = RouterProc::start(&["--heartbeat-ms", "100", "--worker", &listed]);
    let ch = router.channel().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = v1::tandem_client::TandemClient::new(ch.clone())
            .health(v1::HealthRequest {})
            .await
            .unwrap()
            .into_inner();
        if h.serving {
            assert_eq!(h.workers[0].address, listed, "the router dials the listed address");
            break;
        }
        assert!(Instant::now() < deadline, "listed worker never used: {h:?}\n{}", router.stderr());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = generate(ch.clone(), token_prompt(vec![1, 2, 3], 4)).await.unwrap();
    assert_eq!(out.token_ids, SCRIPT[..4].to_vec());
    assert_eq!(out.finish_reason.as_deref(), Some("length"));
    let dec = c.0.decodes.lock().unwrap()[0].clone();
    assert_eq!((dec.reservation_id, dec.first_token), (0, None), "colocated: the worker runs the prompt");
    assert!(c.calls().iter().any(|x| x == "Info"));
    // Listed workers are polled, not expired: still there after many heartbeat intervals.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let h = v1::tandem_client::TandemClient::new(ch.clone())
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(h.serving && h.workers.len() == 1, "{h:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_streams_in_flight_finish_then_exits_0() {
    let mut router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    *w.decode.0.token_delay.lock().unwrap() = Duration::from_millis(100);
    let ch = router.channel().await;
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());
    let mut stream = client.generate(token_prompt(vec![1, 2, 3], 8)).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("first message");
    assert_eq!(first.token_ids, vec![SCRIPT[0]]);
    router.sigterm();
    let mut tokens = first.token_ids;
    let mut finish = None;
    while let Some(m) = stream.message().await.expect("the stream in flight finishes normally") {
        tokens.extend(m.token_ids);
        finish = m.finish_reason.or(finish);
    }
    assert_eq!(tokens, SCRIPT[..8].to_vec());
    assert_eq!(finish.as_deref(), Some("length"));
    let st = tokio::task::spawn_blocking(move || {
        let st = router.wait(Duration::from_secs(10));
        (st, router.stderr())
    })
    .await
    .unwrap();
    assert!(st.0.success(), "exit status {}; stderr:\n{}", st.0, st.1);
}
