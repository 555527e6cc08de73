//! Draining through the real processes: SIGTERM to the router while 8 requests stream. Readiness
//! turns off at once, a new request is refused with UNAVAILABLE naming the drain while the
//! listeners stay open, all 8 finish with every token they asked for, the router exits 0, and the
//! workers hold nothing afterwards and drain and exit 0 on their own SIGTERM.

use std::net::SocketAddr;
use std::time::Duration;

use tandem_e2e::*;
use tandem_proto::v1;

const STREAMS: usize = 8;

/// `GET path` over plain HTTP/1.1: (status, body).
async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connecting to the HTTP server");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let out = tokio::time::timeout(Duration::from_secs(10), io).await.expect("HTTP answer in time");
    let code = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("not HTTP: {out:?}"));
    (code, out.split_once("\r\n\r\n").map_or("", |x| x.1).to_owned())
}

fn long_request(i: usize, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text(format!("Story number {i}: once upon a time"))),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

model_test!(sigterm_during_8_streams_refuses_new_requests_finishes_all_8_and_exits_0, drain);

fn drain(model: &TestModel) {
    let max_tokens = model.long_output;
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.kv_blocks = 256;
    // The test is about every stream finishing, not how fast: a slow CPU (one without AVX-512
    // runs the default model at half speed) must not meet the router's drain deadline first.
    spec.router_args.extend(["--drain-timeout-ms".to_string(), "600000".to_string()]);
    let mut cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let http = cluster.router.http.expect("the router announces its HTTP address");
    let rt = tokio::runtime::Runtime::new().unwrap();

    let (streams, first_tokens) = rt.block_on(async {
        assert_eq!(http_get(http, "/ready").await.0, 200, "{}", cluster.logs());
        // Start every stream and wait for each one's first message: all 8 are then in flight.
        let mut streams = Vec::new();
        let mut first_tokens = Vec::new();
        for i in 0..STREAMS {
            let mut client = TandemClient::new(channel(router).await.unwrap());
            let mut s = client.generate(long_request(i, max_tokens)).await.unwrap().into_inner();
            let first = s.message().await.unwrap().expect("first message");
            assert!(first.finish_reason.is_none(), "request {i} finished on its first message");
            first_tokens.push(first.token_ids.len());
            streams.push(s);
        }
        (streams, first_tokens)
    });
    cluster.router.signal(libc::SIGTERM);

    let results = rt.block_on(async {
        // Readiness turns off as soon as the router has the signal.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let body = loop {
            let (code, body) = http_get(http, "/ready").await;
            if code == 503 {
                break body;
            }
            assert!(std::time::Instant::now() < deadline, "/ready still {code} after SIGTERM: {body}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(body.contains("draining"), "{body}");
        // Refused while the 8 still stream: the gRPC listener is open and says why.
        let err =
            generate(router, long_request(99, max_tokens)).await.expect_err("a new request during the drain");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert!(err.message().contains("draining"), "{err:?}");

        let tasks: Vec<_> = streams
            .into_iter()
            .zip(first_tokens)
            .map(|(mut s, first)| {
                tokio::spawn(async move {
                    let mut tokens = first;
                    let mut finish = None;
                    while let Some(m) = s.message().await? {
                        tokens += m.token_ids.len();
                        finish = m.finish_reason.or(finish);
                    }
                    Ok::<_, tonic::Status>((tokens, finish))
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(tokio::time::timeout(Duration::from_secs(600), t).await.expect("stream ends").unwrap());
        }
        out
    });
    for (i, r) in results.into_iter().enumerate() {
        let (tokens, finish) =
            r.unwrap_or_else(|e| panic!("stream {i} failed during the drain: {e:?}\n{}", cluster.logs()));
        assert_eq!(tokens, max_tokens as usize, "stream {i}");
        assert_eq!(finish.as_deref(), Some("length"), "stream {i}");
    }
    let st = cluster
        .router
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("router did not exit\n{}", cluster.logs()));
    assert!(st.success(), "router exit status {st}\n{}", cluster.logs());
    assert!(cluster.router.log_text().contains("drained"), "{}", cluster.logs());

    // Nothing leaked on the workers, and they drain and exit 0 the same way.
    cluster.assert_quiescent(Duration::from_secs(10));
    for p in cluster.prefill.iter_mut().chain(cluster.decode.iter_mut()) {
        let st = p.terminate(Duration::from_secs(60));
        assert!(st.success(), "{} exit status {st}:\n{}", p.name, p.log_tail(3000));
    }
}
