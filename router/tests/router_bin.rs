//! `tandem-router` as an operator meets it: flag and config errors, the listening line, health and
//! reflection with no workers, fast refusals of requests it cannot serve, clean exit on SIGTERM.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tandem_proto::v1;
use tonic::Code;

#[test]
fn bad_flags_and_config_keys_are_clear_errors() {
    let (code, err) = run_router(&["--bogus"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--bogus"), "{err}");

    let (code, err) = run_router(&["--max-queue", "0"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--max-queue"), "{err}");

    let dir = std::env::temp_dir().join(format!("tandem-router-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("router.toml");
    std::fs::write(&cfg, "heartbeat-ms = 500\nmax-qeue = 3\n").unwrap();
    let (code, err) = run_router(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("unknown key `max-qeue`") && err.contains("max-queue"), "{err}");

    let (code, err) = run_router(&["--model", "/nonexistent/model.gguf"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");

    let (code, err) = run_router(&["--listen", "not-an-address"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--listen"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unusable_secrets_and_addresses_are_errors_naming_the_flag() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let (code, err) = run_router(&["--model", m, "--api-key-file", "/nonexistent/api.key"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--api-key-file") && err.contains("/nonexistent/api.key"), "{err}");
    let (code, err) = run_router(&["--model", m, "--cluster-secret", "two words"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--cluster-secret"), "{err}");
    let (code, err) = run_router(&["--model", m, "--api-key", "a", "--api-key-file", "/tmp/x"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--api-key"), "{err}");
    for bad in ["", "  ", "a?b", "line\nbreak", "100%"] {
        let (code, err) = run_router(&["--model", m, "--served-model-name", bad]);
        assert_eq!(code, Some(1), "{bad:?}: {err}");
        assert!(err.contains("--served-model-name"), "{bad:?}: {err}");
    }
    let (code, err) = run_router(&["--model", m, "--http-listen", "nowhere"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--http-listen"), "{err}");
    // A port already taken is named with its flag.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, err) = run_router(&["--model", m, "--listen", "127.0.0.1:0", "--http-listen", &addr]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("binding --http-listen"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_workers_it_listens_reports_not_serving_and_refuses_requests_fast() {
    let mut router = RouterProc::start(&[]);
    let ch = router.channel().await;

    // Tandem.Health.
    let h = v1::tandem_client::TandemClient::new(ch.clone())
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!h.serving);
    assert!(h.workers.is_empty());
    assert_eq!(h.model_id, tiny_model_id());
    assert!(h.message.contains("no workers"), "{}", h.message);

    // grpc.health.v1: NOT_SERVING overall and for the Tandem service.
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    for service in ["", "tandem.v1.Tandem"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest { service: service.into() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::NotServing as i32,
            "service {service:?}"
        );
    }

    // Reflection lists the services.
    let services = list_services(ch.clone()).await;
    for s in ["tandem.v1.Tandem", "tandem.v1.Registry", "grpc.health.v1.Health"] {
        assert!(services.iter().any(|x| x == s), "{s} missing from {services:?}");
    }

    // A valid request with no workers: UNAVAILABLE, at once.
    let t0 = Instant::now();
    let err = generate(ch.clone(), token_prompt(vec![1, 2, 3], 4)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("no worker"), "{err:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());

    // Invalid requests: INVALID_ARGUMENT naming the field (checked before any worker is needed).
    let text = |t: &str| Some(v1::generate_request::Prompt::Text(t.into()));
    let sampling = |s: v1::SamplingParams| v1::GenerateRequest {
        prompt: text("hi"),
        sampling: Some(s),
        ..Default::default()
    };
    let cases: Vec<(v1::GenerateRequest, &str)> = vec![
        (v1::GenerateRequest::default(), "prompt"),
        (v1::GenerateRequest { prompt: text("hi"), max_tokens: Some(0), ..Default::default() }, "max_tokens"),
        (
            sampling(v1::SamplingParams { temperature: Some(-1.0), ..Default::default() }),
            "sampling.temperature",
        ),
        (sampling(v1::SamplingParams { top_p: Some(0.0), ..Default::default() }), "sampling.top_p"),
        (sampling(v1::SamplingParams { min_p: Some(2.0), ..Default::default() }), "sampling.min_p"),
        (
            sampling(v1::SamplingParams { repetition_penalty: Some(0.0), ..Default::default() }),
            "sampling.repetition_penalty",
        ),
        (v1::GenerateRequest { prompt: text("hi"), stop: vec![String::new()], ..Default::default() }, "stop"),
        (
            v1::GenerateRequest { prompt: text("hi"), stop_token_ids: vec![100_000], ..Default::default() },
            "stop_token_ids",
        ),
        (token_prompt(vec![], 4), "prompt"),
        (token_prompt(vec![5, 448], 4), "prompt.token_ids"),
        (
            v1::GenerateRequest {
                prompt: Some(v1::generate_request::Prompt::Chat(v1::ChatPrompt::default())),
                ..Default::default()
            },
            "prompt.chat.messages",
        ),
        (
            v1::GenerateRequest { prompt: text("hi"), request_id: "x".repeat(500), ..Default::default() },
            "request_id",
        ),
        (
            v1::GenerateRequest {
                prompt: text("hi"),
                constraint: Some(v1::OutputConstraint {
                    kind: Some(v1::output_constraint::Kind::JsonSchema(r#"{"type": "intger"}"#.into())),
                }),
                ..Default::default()
            },
            "constraint: invalid json_schema",
        ),
        (
            v1::GenerateRequest {
                prompt: text("hi"),
                constraint: Some(v1::OutputConstraint { kind: None }),
                ..Default::default()
            },
            "constraint",
        ),
        (v1::GenerateRequest { prompt: text("hi"), n: 17, ..Default::default() }, "n: at most 16"),
    ];
    for (req, field) in cases {
        let err = generate(ch.clone(), req.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{req:?}: {err:?}");
        assert!(err.message().starts_with(field), "{req:?}: message should name {field:?}: {err:?}");
    }

    router.sigterm();
    let st = router.wait(Duration::from_secs(10));
    assert!(st.success(), "exit status {st}; stderr:\n{}", router.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_queue_bounds_requests_in_flight() {
    let router = RouterProc::start(&["--max-queue", "1"]);
    let ch = router.channel().await;
    let d = FakeWorker::new(
        worker_info("c", v1::Role::Colocated, "127.0.0.1:1".parse().unwrap(), 16),
        vec![5; 8],
        Some(1),
    );
    let addr = serve(d.clone()).await;
    d.0.info.lock().unwrap().address = addr.to_string();
    let info = d.0.info.lock().unwrap().clone();
    v1::registry_client::RegistryClient::new(ch.clone()).register(info).await.unwrap();

    // One request holds the only slot (the worker stops after one token and keeps the stream open).
    let mut client = v1::tandem_client::TandemClient::new(ch.clone());
    let mut held = client.generate(token_prompt(vec![1, 2], 8)).await.unwrap().into_inner();
    let first = held.message().await.unwrap().expect("first message");
    assert_eq!(first.token_ids, vec![5]);
    let err = generate(ch.clone(), token_prompt(vec![1, 2], 8)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("--max-queue"), "{err:?}");
    // Dropping the held stream frees the slot and cancels the worker's stream.
    drop(held);
    eventually("the held decode stream is dropped", || {
        d.0.decode_dropped.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    eventually("the router releases the cancelled request", || !d.releases().is_empty()).await;
    let mut ok = false;
    for _ in 0..100 {
        match generate(ch.clone(), token_prompt(vec![1, 2], 1)).await {
            Ok(c) => {
                assert_eq!(c.token_ids, vec![5]);
                ok = true;
                break;
            }
            Err(e) if e.code() == Code::ResourceExhausted => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(ok, "the slot was never freed");
}

async fn list_services(ch: tonic::transport::Channel) -> Vec<String> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut client = ServerReflectionClient::new(ch);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client.server_reflection_info(tokio_stream::iter(vec![req])).await.unwrap().into_inner();
    let msg = stream.message().await.unwrap().expect("a reflection answer");
    match msg.message_response {
        Some(MessageResponse::ListServicesResponse(l)) => l.service.into_iter().map(|s| s.name).collect(),
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

/// Starts the router with `args`, waits for its `listening` line, stops it; returns its stderr.
fn start_and_stop(args: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tandem-router"))
        .args(args)
        .env_remove("TANDEM_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting tandem-router");
    let out = child.stdout.take().unwrap();
    let first = BufReader::new(out).lines().next();
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        first.is_some_and(|l| l.is_ok_and(|l| l.contains("listening"))),
        "the router did not start: {err}"
    );
    err
}

#[test]
fn a_registry_reachable_from_other_hosts_needs_a_cluster_secret_or_insecure_cluster() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    // Refused: the registry on every interface with nothing authenticating workers.
    let (code, err) = run_router(&["--model", m, "--listen", "0.0.0.0:0", "--http-listen", "127.0.0.1:0"]);
    assert_eq!(code, Some(1), "{err}");
    for needle in ["--listen 0.0.0.0:0", "--cluster-secret", "--tls-client-ca", "--insecure-cluster"] {
        assert!(err.contains(needle), "{needle:?} missing: {err}");
    }
    // A cluster secret, or the operator's word, lets it start; the client API without an API key
    // on other hosts is a warning.
    let err = start_and_stop(&[
        "--model",
        m,
        "--listen",
        "0.0.0.0:0",
        "--http-listen",
        "127.0.0.1:0",
        "--cluster-secret",
        "s3cret-value",
    ]);
    assert!(err.contains("without an API key") && err.contains("--listen 0.0.0.0:0"), "{err}");
    let err = start_and_stop(&[
        "--model",
        m,
        "--listen",
        "0.0.0.0:0",
        "--http-listen",
        "127.0.0.1:0",
        "--insecure-cluster",
        "--api-key",
        "k",
    ]);
    assert!(!err.contains("without an API key"), "{err}");
    // Loopback needs nothing.
    let err = start_and_stop(&["--model", m, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]);
    assert!(!err.contains("WARN"), "{err}");
}
