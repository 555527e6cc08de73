//! The router's side of the worker protocol, against fake workers with scripted tokens: the
//! Reserve → Prefill → Decode sequence and what each call carries, streaming and detokenization,
//! stop strings, a first token that ends the request, cancellation, a worker dying mid-stream,
//! registration refusals, heartbeat expiry and statically listed workers; metrics, the API key
//! and the cluster secret, undecodable requests, and the drain on SIGTERM.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

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

struct Split {
    prefill: FakeWorker,
    decode: FakeWorker,
    decode_proxy: Proxy,
}

/// A fake prefill and a fake decode worker, registered with `router` (the decode worker behind
/// a proxy that can be cut).
async fn split(router: &RouterProc, hold_after: Option<usize>) -> Split {
    split_with_secret(router, hold_after, None).await
}

/// [`split`], registering with the cluster secret `secret`.
async fn split_with_secret(router: &RouterProc, hold_after: Option<usize>, secret: Option<&str>) -> Split {
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
        let mut req = tonic::Request::new(w.0.info.lock().unwrap().clone());
        if let Some(s) = secret {
            req.metadata_mut().insert("x-tandem-cluster-secret", s.parse().unwrap());
        }
        let r = reg.register(req).await.unwrap().into_inner();
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
    assert_eq!(c.usage, Some(v1::Usage { prompt_tokens: 20, completion_tokens: 5, cached_tokens: 0 }));
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
    assert_concealed(&err, &router, &["decode worker d-1"]).await;
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
        .heartbeat(v1::HeartbeatRequest {
            worker_id: "d-1".into(),
            load: None,
            cache: None,
            ..Default::default()
        })
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

    // Another KV dtype: the blocks' bytes mean something else, so the pair is refused by name.
    let mut bf16 = worker_info("p-4", Role::Prefill, addr(1005), 16);
    let c = bf16.compat.as_mut().unwrap();
    let f32_layout = c.kv_layout.clone();
    (c.kv_dtype, c.kv_layout) = ("bf16".into(), "tandem-bf16-lkv-v1".into());
    let err = reg.register(bf16).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let m = err.message();
    assert!(m.contains("p-4") && m.contains("d-1") && m.contains(r#"kv_dtype: "f32" vs "bf16""#), "{m}");
    assert!(m.contains(&format!("kv_layout: {f32_layout:?} vs \"tandem-bf16-lkv-v1\"")), "{m}");

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
    // The decode worker alone serves, computing prompts itself (`--prefill-fallback decode`).
    assert!(h.serving && h.message.contains("--prefill-fallback decode"), "{h:?}");
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
        let hb = reg
            .heartbeat(v1::HeartbeatRequest {
                worker_id: "c-1".into(),
                load: None,
                cache: None,
                ..Default::default()
            })
            .await
            .unwrap();
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
    let hb = reg
        .heartbeat(v1::HeartbeatRequest {
            worker_id: "c-1".into(),
            load: None,
            cache: None,
            ..Default::default()
        })
        .await
        .unwrap();
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

/// `GET path` on the router's HTTP server: (status, body).
async fn http_get(router: &RouterProc, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = router.http.expect("the router announces its HTTP address");
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let out = tokio::time::timeout(Duration::from_secs(10), io).await.expect("HTTP answer in time");
    let code = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |x| x.1).to_owned();
    (code, body)
}

/// The value of the sample `series` (name with its labels, as rendered) in Prometheus text.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

async fn metrics(router: &RouterProc) -> String {
    let (code, body) = http_get(router, "/metrics").await;
    assert_eq!(code, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_after_requests() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let _w = split(&router, None).await;
    let ch = router.channel().await;
    let before = metrics(&router).await;
    assert_eq!(sample(&before, "tandem_router_requests_in_flight"), Some(0.0));
    assert_eq!(sample(&before, "tandem_router_draining"), Some(0.0));
    assert_eq!(sample(&before, r#"tandem_router_workers{role="decode",state="serving"}"#), Some(1.0));
    assert_eq!(sample(&before, r#"tandem_router_workers{role="prefill",state="serving"}"#), Some(1.0));
    assert_eq!(sample(&before, r#"tandem_router_workers{role="decode",state="unhealthy"}"#), Some(0.0));
    assert_eq!(sample(&before, "tandem_router_ttft_seconds_count"), Some(0.0));

    for _ in 0..3 {
        let c = generate(ch.clone(), token_prompt((10..30).collect(), 5)).await.unwrap();
        assert_eq!(c.token_ids.len(), 5);
    }
    let err = generate(ch.clone(), token_prompt(vec![1, 2], 0)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // A request is counted when its run ends, just after its last message.
    let ok = r#"tandem_router_requests_total{api="grpc",outcome="ok"}"#;
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(&text, ok) != Some(3.0) {
        assert!(Instant::now() < deadline, "requests never counted:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        text = metrics(&router).await;
    }
    let get = |series: &str| sample(&text, series).unwrap_or_else(|| panic!("{series} missing:\n{text}"));
    assert_eq!(get(r#"tandem_router_requests_total{api="grpc",outcome="error"}"#), 1.0);
    assert_eq!(get(r#"tandem_router_errors_total{kind="invalid_argument"}"#), 1.0);
    assert_eq!(get("tandem_router_ttft_seconds_count"), 3.0);
    assert_eq!(get("tandem_router_e2e_seconds_count"), 3.0);
    // The first token comes with the prefill answer; the other 4 of each request are decoded.
    assert_eq!(get("tandem_router_inter_token_seconds_count"), 12.0);
    assert_eq!(get("tandem_router_generated_tokens_total"), 15.0);
    assert_eq!(get("tandem_router_prompt_tokens_total"), 60.0);
    // The fake prefill worker reports 100 bytes in 3 ms per transfer.
    assert_eq!(get(r#"tandem_router_kv_transfer_bytes_total{transport="tcp"}"#), 300.0);
    let secs = get(r#"tandem_router_kv_transfer_seconds_total{transport="tcp"}"#);
    assert!((secs - 0.009).abs() < 1e-9, "{secs}");
    assert!(get("tandem_router_e2e_seconds_sum") >= get("tandem_router_ttft_seconds_sum"));
    assert_eq!(get(r#"tandem_router_e2e_seconds_bucket{le="+Inf"}"#), 3.0);
    assert_eq!(get("tandem_router_requests_in_flight"), 0.0);
    assert_eq!(get("tandem_router_queue_depth"), 0.0);
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap();
        assert!(text.contains(&format!("# HELP {name} ")), "{name} has no HELP line");
    }
}

fn with_key<T>(msg: T, key: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_required_on_the_client_api() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--api-key", "k-123"]);
    let _w = split(&router, None).await;
    let ch = router.channel().await;
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());

    let err = client.generate(token_prompt(vec![1, 2, 3], 3)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("missing API key"), "{err:?}");
    let err = client.generate(with_key(token_prompt(vec![1, 2, 3], 3), "k-124")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert_eq!(err.message(), "invalid API key");
    let err = client.health(v1::HealthRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    let mut stream =
        client.generate(with_key(token_prompt(vec![1, 2, 3], 3), "k-123")).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        tokens.extend(m.token_ids);
    }
    assert_eq!(tokens, SCRIPT[..3].to_vec());
    assert!(client.health(with_key(v1::HealthRequest {}, "k-123")).await.unwrap().into_inner().serving);

    // Probes need no key.
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap();
    assert_eq!(http_get(&router, "/ready").await.0, 200);
    let text = metrics(&router).await;
    assert_eq!(sample(&text, r#"tandem_router_errors_total{kind="unauthenticated"}"#), Some(2.0), "{text}");
    assert!(!router.stderr().contains("k-123"), "the key must never be logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_secret_guards_the_registry_and_goes_with_every_call_to_workers() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--cluster-secret", "s3cret"]);
    let ch = router.channel().await;
    let mut reg = RegistryClient::new(ch.clone());
    let info = worker_info("c-9", Role::Colocated, "127.0.0.1:1001".parse().unwrap(), 16);
    let err = reg.register(info.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("cluster secret"), "{err:?}");
    let mut wrong = tonic::Request::new(info.clone());
    wrong.metadata_mut().insert("x-tandem-cluster-secret", "s3cre7".parse().unwrap());
    let err = reg.register(wrong).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("wrong cluster secret"), "{err:?}");
    let err = reg
        .heartbeat(v1::HeartbeatRequest {
            worker_id: "c-9".into(),
            load: None,
            cache: None,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    // The three refusals are counted (the metrics endpoint asks for no secret).
    let text = metrics(&router).await;
    assert_eq!(sample(&text, r#"tandem_router_errors_total{kind="unauthenticated"}"#), Some(3.0), "{text}");
    // grpc.health.v1 stays open.
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap();

    let w = split_with_secret(&router, None, Some("s3cret")).await;
    // One request that decodes, one whose first token ends it (the reservation is released).
    generate(ch.clone(), token_prompt(vec![1, 2, 3], 4)).await.unwrap();
    generate(ch.clone(), token_prompt(vec![1, 2, 3], 1)).await.unwrap();
    eventually("the reservation is released", || !w.decode.releases().is_empty()).await;
    let mut seen = w.decode.secrets();
    seen.extend(w.prefill.secrets());
    let methods: Vec<&str> = seen.iter().map(|(m, _)| m.as_str()).collect();
    for m in ["Reserve", "Prefill", "Decode", "Release"] {
        assert!(methods.contains(&m), "{m} never called: {seen:?}");
    }
    assert!(seen.iter().all(|(_, s)| s.as_deref() == Some("s3cret")), "{seen:?}");

    // A listed worker is asked for its record and polled with the secret too.
    let c = FakeWorker::new(info, SCRIPT.to_vec(), None);
    let addr = serve(c.clone()).await.to_string();
    let listing =
        RouterProc::start(&["--heartbeat-ms", "50", "--cluster-secret", "s3cret", "--worker", &addr]);
    eventually("the listed worker is polled", || c.secrets().iter().any(|(m, _)| m == "Stats")).await;
    let seen = c.secrets();
    assert!(seen.iter().any(|(m, _)| m == "Info"), "{seen:?}");
    assert!(seen.iter().all(|(_, s)| s.as_deref() == Some("s3cret")), "{seen:?}");
    assert!(!listing.stderr().contains("s3cret") && !router.stderr().contains("s3cret"));
}

/// `GenerateRequest` with the prompt text as raw bytes, so a test can send bytes that are not
/// UTF-8 (field numbers as in tandem.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct RawGenerateRequest {
    #[prost(bytes = "vec", tag = "1")]
    text: Vec<u8>,
    #[prost(uint32, optional, tag = "4")]
    max_tokens: Option<u32>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_is_not_utf8_is_invalid_argument_and_the_next_request_succeeds() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    let ch = router.channel().await;
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let raw = RawGenerateRequest { text: b"caf\xe9 \xff".to_vec(), max_tokens: Some(3) };
    let codec = tandem_proto::codec::Codec::<RawGenerateRequest, v1::GenerateResponse>::default();
    let path = http::uri::PathAndQuery::from_static("/tandem.v1.Tandem/Generate");
    let err = match grpc.server_streaming(tonic::Request::new(raw), path, codec).await {
        Err(st) => st,
        Ok(resp) => match resp.into_inner().message().await {
            Err(st) => st,
            Ok(Some(m)) => panic!("the router answered an undecodable request: {m:?}"),
            Ok(None) => panic!("the stream ended without an error"),
        },
    };
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("UTF-8") && err.message().contains("GenerateRequest"), "{err:?}");
    assert!(w.decode.calls().is_empty() && w.prefill.calls().is_empty(), "workers must not be asked");

    let c = generate(ch.clone(), token_prompt(vec![1, 2, 3], 3)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..3].to_vec());
    let mut text_req = token_prompt(vec![], 2);
    text_req.prompt = Some(v1::generate_request::Prompt::Text("café".into()));
    assert_eq!(generate(ch.clone(), text_req).await.unwrap().token_ids.len(), 2);
}

async fn grpc_health(ch: &tonic::transport::Channel) -> i32 {
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    let req = tonic_health::pb::HealthCheckRequest { service: "tandem.v1.Tandem".into() };
    health.check(req).await.unwrap().into_inner().status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_turns_readiness_off_refuses_new_requests_and_finishes_the_rest() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let mut router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    let ch = router.channel().await;
    assert_eq!(http_get(&router, "/ready").await.0, 200);
    assert_eq!(grpc_health(&ch).await, ServingStatus::Serving as i32);

    // The decode worker holds every token until told to go on: the request is in flight for as
    // long as the test needs.
    w.decode.0.paused.send_replace(true);
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());
    let mut stream = client.generate(token_prompt(vec![1, 2, 3], 8)).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("first message");
    router.sigterm();

    let deadline = Instant::now() + Duration::from_secs(10);
    let body = loop {
        let (code, body) = http_get(&router, "/ready").await;
        if code == 503 {
            break body;
        }
        assert!(Instant::now() < deadline, "/ready never turned 503");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(body.contains("draining"), "{body}");
    // gRPC health follows the same switch through its reporter task: a moment later at most.
    while grpc_health(&ch).await != ServingStatus::NotServing as i32 {
        assert!(Instant::now() < deadline, "grpc.health.v1 never turned NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(http_get(&router, "/health").await.0, 200, "still alive while draining");
    assert_eq!(sample(&metrics(&router).await, "tandem_router_draining"), Some(1.0));
    let err = generate(ch.clone(), token_prompt(vec![1], 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("draining"), "{err:?}");
    let h = client.health(v1::HealthRequest {}).await.unwrap().into_inner();
    assert!(!h.serving && h.message.contains("draining"), "{h:?}");

    w.decode.0.paused.send_replace(false);
    let mut tokens = first.token_ids;
    let mut finish = None;
    while let Some(m) = stream.message().await.expect("the stream in flight finishes normally") {
        tokens.extend(m.token_ids);
        finish = m.finish_reason.or(finish);
    }
    assert_eq!(tokens, SCRIPT[..8].to_vec());
    assert_eq!(finish.as_deref(), Some("length"));
    let (st, stderr) =
        tokio::task::spawn_blocking(move || (router.wait(Duration::from_secs(20)), router.stderr()))
            .await
            .unwrap();
    assert!(st.success(), "exit status {st}; stderr:\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_runs_out_of_time_cancels_what_is_left_and_exits_0() {
    let mut router = RouterProc::start(&["--heartbeat-ms", "60000", "--drain-timeout-ms", "300"]);
    let w = split(&router, None).await;
    w.decode.0.paused.send_replace(true); // never resumed
    let ch = router.channel().await;
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());
    let mut stream = client.generate(token_prompt(vec![1, 2, 3], 8)).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("first message");
    // The first token is the prefill worker's: wait until the decode stream is open too.
    eventually("the decode stream is open", || w.decode.calls().iter().any(|s| s.starts_with("Decode")))
        .await;
    router.sigterm();
    let next = tokio::time::timeout(Duration::from_secs(20), stream.message()).await;
    let err = match next.expect("not left hanging") {
        Ok(Some(m)) => panic!("no token can come while the worker holds them: {m:?}"),
        Ok(None) => panic!("the stream ended as if it had finished"),
        Err(e) => e,
    };
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("--drain-timeout-ms"), "{err:?}");
    eventually("the decode stream is dropped", || w.decode.0.decode_dropped.load(Ordering::SeqCst) == 1)
        .await;
    let (st, stderr) =
        tokio::task::spawn_blocking(move || (router.wait(Duration::from_secs(20)), router.stderr()))
            .await
            .unwrap();
    assert!(st.success(), "exit status {st}; stderr:\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_follows_the_worker_table_and_health_stays_up() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--lost-worker-wait-ms", "0"]);
    let (code, body) = http_get(&router, "/ready").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("no workers registered"), "{body}");
    assert_eq!(http_get(&router, "/health").await.0, 200);
    // A request refused for want of workers is named, so its client can quote it: by the id the
    // client gave, or by one the router made.
    let ch = router.channel().await;
    let err = generate(ch.clone(), token_prompt(vec![1, 2], 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let id = err.metadata().get("x-request-id").expect("x-request-id").to_str().unwrap().to_owned();
    assert!(id.starts_with("router-"), "{id}");
    assert!(err.message().ends_with(&format!("(request id {id})")), "{err:?}");
    let mut named = token_prompt(vec![1, 2], 2);
    named.request_id = "client-7".into();
    let err = generate(ch, named).await.unwrap_err();
    assert!(err.message().ends_with("(request id client-7)"), "{err:?}");
    let w = split(&router, None).await;
    assert_eq!(http_get(&router, "/ready").await.0, 200);
    // The decode worker vanishes: a request fails on it, and the router is no longer ready.
    w.decode_proxy.kill();
    let err = generate(router.channel().await, token_prompt(vec![1, 2], 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let (code, body) = http_get(&router, "/ready").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("no usable decode worker"), "{body}");
    let text = metrics(&router).await;
    assert_eq!(
        sample(&text, r#"tandem_router_workers{role="decode",state="unhealthy"}"#),
        Some(1.0),
        "{text}"
    );
    // Two refusals before any worker registered, one after the decode worker vanished.
    assert_eq!(sample(&text, r#"tandem_router_errors_total{kind="unavailable"}"#), Some(3.0), "{text}");
}

/// The router's `tandem_router_kv_waits_total` once its requests are counted.
async fn kv_waits(router: &RouterProc) -> f64 {
    sample(&metrics(router).await, "tandem_router_kv_waits_total").expect("kv_waits metric")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_worker_makes_the_request_wait_for_blocks_instead_of_failing() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    w.decode.0.full_reserves.store(3, Ordering::SeqCst);
    let ch = router.channel().await;
    let c = generate(ch.clone(), token_prompt((10..30).collect(), 5)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..5].to_vec());
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    let calls = w.decode.calls();
    assert_eq!(calls.iter().filter(|c| *c == "Reserve 20").count(), 4, "{calls:?}");
    assert_eq!(calls.last().map(String::as_str), Some("Decode reservation=7 first=Some(300)"));
    assert_eq!(w.prefill.calls(), vec!["Prefill 20".to_string()], "prefill runs once, after the Reserve");
    assert!(w.decode.releases().is_empty(), "refused Reserves hold nothing: {:?}", w.decode.releases());
    assert_eq!(kv_waits(&router).await, 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_that_stays_full_fails_the_request_after_kv_wait() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--kv-wait-ms", "300"]);
    let w = split(&router, None).await;
    w.decode.0.full_reserves.store(usize::MAX, Ordering::SeqCst);
    let ch = router.channel().await;
    let err = generate(ch.clone(), token_prompt((10..30).collect(), 5)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert_eq!(err.metadata().get("retry-after").unwrap(), "1", "{err:?}");
    assert_concealed(&err, &router, &["--kv-wait-ms 300", "decode worker d-1", "out of KV blocks"]).await;
    let reserves = w.decode.calls().iter().filter(|c| *c == "Reserve 20").count();
    assert!(reserves >= 2, "the request tried again while it waited: {:?}", w.decode.calls());
    assert!(w.prefill.calls().is_empty(), "nothing reached the prefill worker");
    assert_eq!(kv_waits(&router).await, (reserves - 1) as f64);

    // With room again, the next request runs.
    w.decode.0.full_reserves.store(0, Ordering::SeqCst);
    let c = generate(ch.clone(), token_prompt((10..30).collect(), 3)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..3].to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_wait_0_fails_at_once_with_the_workers_answer() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000", "--kv-wait-ms", "0"]);
    let w = split(&router, None).await;
    w.decode.0.full_reserves.store(1, Ordering::SeqCst);
    let ch = router.channel().await;
    let err = generate(ch.clone(), token_prompt((10..30).collect(), 5)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert_eq!(err.metadata().get("retry-after").unwrap(), "1", "{err:?}");
    assert_concealed(&err, &router, &["out of KV blocks", "--kv-wait-ms 0"]).await;
    assert_eq!(w.decode.calls(), vec!["Reserve 20".to_string()]);
    assert_eq!(kv_waits(&router).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_by_a_full_decode_worker_moves_to_one_with_room() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    // d-1 is chosen first (equal load, lowest id) and stays full; d-2 has room.
    w.decode.0.full_reserves.store(usize::MAX, Ordering::SeqCst);
    let d2 = FakeWorker::new(
        worker_info("d-2", Role::Decode, "127.0.0.1:1".parse().unwrap(), 16),
        SCRIPT.to_vec(),
        None,
    );
    let d2_addr = serve(d2.clone()).await;
    d2.0.info.lock().unwrap().address = d2_addr.to_string();
    let ch = router.channel().await;
    let info = d2.0.info.lock().unwrap().clone();
    RegistryClient::new(ch.clone()).register(info).await.unwrap();

    let c = generate(ch.clone(), token_prompt((10..30).collect(), 4)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..4].to_vec());
    assert_eq!(w.decode.calls(), vec!["Reserve 20".to_string()], "d-1 was asked once");
    assert_eq!(d2.calls(), vec!["Reserve 20".to_string(), "Decode reservation=7 first=Some(300)".into()]);
    let dest = w.prefill.0.prefills.lock().unwrap()[0].destination.clone().expect("destination");
    assert_eq!(dest.worker_id, "d-2", "the KV blocks went to the worker that reserved them");
    assert_eq!(kv_waits(&router).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_that_began_draining_passes_the_request_to_another() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    // d-1 drains before its next load report says so; d-2 serves.
    w.decode.0.draining.store(true, Ordering::SeqCst);
    let d2 = FakeWorker::new(
        worker_info("d-2", Role::Decode, "127.0.0.1:1".parse().unwrap(), 16),
        SCRIPT.to_vec(),
        None,
    );
    d2.0.info.lock().unwrap().address = serve(d2.clone()).await.to_string();
    let ch = router.channel().await;
    let info = d2.0.info.lock().unwrap().clone();
    RegistryClient::new(ch.clone()).register(info).await.unwrap();

    let c = generate(ch.clone(), token_prompt((10..30).collect(), 4)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..4].to_vec());
    assert_eq!(w.decode.calls(), vec!["Reserve 20".to_string()]);
    assert_eq!(d2.calls().first().map(String::as_str), Some("Reserve 20"));
    // The router now knows d-1 is draining: the next request goes straight to d-2.
    generate(ch.clone(), token_prompt((10..30).collect(), 2)).await.unwrap();
    assert_eq!(w.decode.calls().len(), 1, "{:?}", w.decode.calls());
    // With no other decode worker, the request fails at once with UNAVAILABLE; the log names the
    // worker, the client is not told it.
    d2.0.draining.store(true, Ordering::SeqCst);
    let h = v1::tandem_client::TandemClient::new(ch.clone()).health(v1::HealthRequest {}).await.unwrap();
    assert!(h.into_inner().serving);
    let err = generate(ch.clone(), token_prompt((10..30).collect(), 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_concealed(&err, &router, &["decode worker d-2", "draining"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_kv_blocks_are_served_first_come_first_served() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let w = split(&router, None).await;
    w.decode.0.full_reserves.store(usize::MAX, Ordering::SeqCst);
    let ch = router.channel().await;
    let reserves = |n: u32| w.decode.calls().iter().filter(|c| **c == format!("Reserve {n}")).count();
    // Prompts of 20, 21, 22, 23 tokens arrive in that order while the decode worker is full.
    let mut tasks = Vec::new();
    for n in 20..24u32 {
        tasks.push(tokio::spawn(generate(ch.clone(), token_prompt((10..10 + n).collect(), 2))));
        // Wait until it stands in line, so the arrival order is the order of the loop.
        let want = f64::from(n - 19);
        let deadline = Instant::now() + Duration::from_secs(10);
        while sample(&metrics(&router).await, "tandem_router_kv_waiting") != Some(want) {
            assert!(Instant::now() < deadline, "request {n} never joined the line");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eventually("the head of the line retries", || reserves(20) >= 3).await;
    // Only the head of the line asks; the others wait behind it without overtaking.
    assert_eq!((reserves(21), reserves(22), reserves(23)), (0, 0, 0), "{:?}", w.decode.calls());
    w.decode.0.full_reserves.store(0, Ordering::SeqCst);
    for t in tasks {
        let c = t.await.unwrap().unwrap();
        assert_eq!(c.token_ids, SCRIPT[..2].to_vec());
    }
    assert_eq!(*w.decode.0.granted.lock().unwrap(), vec![20, 21, 22, 23], "served in arrival order");
    assert_eq!(sample(&metrics(&router).await, "tandem_router_kv_waiting"), Some(0.0));
    // The line is empty again: a new request asks the worker directly.
    generate(ch.clone(), token_prompt((10..40).collect(), 2)).await.unwrap();
    assert_eq!(reserves(30), 1);
}
