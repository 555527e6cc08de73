//! Decode workers lost mid-stream, through the real processes: streams whose decode worker is
//! killed (SIGKILL) or frozen (SIGSTOP) move to the other decode worker and finish with the output
//! of an uninterrupted greedy run; the survivors free every block; a frozen worker that resumes
//! registers again and takes new requests; a restarted router gets its workers back by itself.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_e2e::*;
use tandem_engine::sampler::SamplingParams;
use tandem_proto::v1;

/// Streams in flight when a decode worker is lost.
const STREAMS: usize = 16;

fn spec(model: &TestModel) -> ClusterSpec {
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.decode_workers = 2;
    spec.kv_blocks = 256;
    spec
}

/// `STREAMS` distinct prompts, as token ids, and how many tokens each request asks for: as many as
/// the context leaves (the tiny model), or the model's long output.
fn workload(model: &TestModel) -> (Vec<Vec<u32>>, u32) {
    let prompts: Vec<Vec<u32>> = (0..STREAMS)
        .map(|i| {
            model.tokenizer().encode(&format!("Story number {i} begins on a quiet morning"), true).unwrap()
        })
        .collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let max_tokens = (model.max_len - longest - 1).min(model.long_output as usize) as u32;
    (prompts, max_tokens)
}

fn request(prompt: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids: prompt.to_vec() })),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

/// Greedy output of an uninterrupted run of each prompt, in process.
fn expected(model: &TestModel, prompts: &[Vec<u32>], max_tokens: u32) -> Vec<Completion> {
    let params =
        SamplingParams { max_tokens: max_tokens as usize, ignore_eos: true, ..SamplingParams::greedy() };
    reference_with(&model.path, prompts, &params, 1024, 16)
}

/// Requests running in the background; each records how many tokens it has so far.
struct InFlight {
    tokens: Arc<Mutex<Vec<usize>>>,
    tasks: Vec<tokio::task::JoinHandle<Result<Completion, tonic::Status>>>,
}

impl InFlight {
    fn start(
        rt: &tokio::runtime::Runtime,
        router: SocketAddr,
        prompts: &[Vec<u32>],
        max_tokens: u32,
    ) -> InFlight {
        let tokens = Arc::new(Mutex::new(vec![0usize; prompts.len()]));
        let tasks = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (req, tokens) = (request(p, max_tokens), tokens.clone());
                rt.spawn(generate_watching(router, req, move |out| {
                    tokens.lock().unwrap()[i] = out.token_ids.len();
                }))
            })
            .collect();
        InFlight { tokens, tasks }
    }

    /// Waits until every request has streamed at least one token: each sequence is then on a
    /// decode worker.
    fn wait_streaming(&self, cluster: &Cluster) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.tokens.lock().unwrap().contains(&0) {
            assert!(Instant::now() < deadline, "requests never started streaming\n{}", cluster.logs());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn finish(self, rt: &tokio::runtime::Runtime) -> Vec<Result<Completion, tonic::Status>> {
        rt.block_on(async {
            let mut out = Vec::new();
            for t in self.tasks {
                let r = tokio::time::timeout(Duration::from_secs(300), t).await.expect("the request ends");
                out.push(r.expect("request task"));
            }
            out
        })
    }
}

/// The decode worker running the most sequences now.
fn busiest_decode(cluster: &Cluster) -> usize {
    let running: Vec<u32> = cluster
        .decode
        .iter()
        .map(|p| block_on(stats(p.addr(), false)).ok().and_then(|s| s.load).map_or(0, |l| l.running))
        .collect();
    (0..running.len()).max_by_key(|&i| running[i]).unwrap()
}

/// `tandem_router_migrations_total{phase="decode"}` from the router's `/metrics`.
fn migrations(cluster: &Cluster) -> f64 {
    let http = cluster.router.http.expect("the router's HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the router answers /metrics");
    assert_eq!(code, 200, "{text}");
    sample(&text, r#"tandem_router_migrations_total{phase="decode"}"#)
        .unwrap_or_else(|| panic!("no migrations counter:\n{text}"))
}

fn assert_reference(got: Vec<Result<Completion, tonic::Status>>, want: &[Completion], cluster: &Cluster) {
    for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
        let g = g.unwrap_or_else(|s| panic!("request {i} failed: {s:?}\n{}", cluster.logs()));
        assert_eq!(&g, w, "request {i} differs from an uninterrupted run");
    }
}

model_test!(killing_a_decode_worker_moves_its_streams_to_the_other, kill_moves_streams);

fn kill_moves_streams(model: &TestModel) {
    let (prompts, max_tokens) = workload(model);
    let want = expected(model, &prompts, max_tokens);
    let mut cluster = Cluster::start(spec(model));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let flight = InFlight::start(&rt, cluster.router.addr(), &prompts, max_tokens);
    flight.wait_streaming(&cluster);
    let victim = busiest_decode(&cluster);
    // Frozen first, so that no sequence finishes between the choice and the kill.
    cluster.decode[victim].signal(libc::SIGSTOP);
    cluster.decode[victim].kill();
    drop(cluster.decode.remove(victim));
    let got = flight.finish(&rt);
    assert_reference(got, &want, &cluster);
    assert!(migrations(&cluster) >= 1.0, "no stream moved\n{}", cluster.logs());
    // The prefill worker and the surviving decode worker hold nothing: free == total.
    cluster.assert_quiescent(Duration::from_secs(20));
}

model_test!(a_frozen_decode_worker_loses_its_streams_and_serves_again_when_thawed, freeze_and_thaw);

fn freeze_and_thaw(model: &TestModel) {
    let (prompts, max_tokens) = workload(model);
    let prompts = &prompts[..8];
    let want = expected(model, prompts, max_tokens);
    let mut spec = spec(model);
    // Missing 3 heartbeats of 500 ms takes a worker out of the table (the default, 1 s, works too;
    // this is only quicker).
    spec.router_args = vec!["--heartbeat-ms".into(), "500".into()];
    let cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let flight = InFlight::start(&rt, router, prompts, max_tokens);
    flight.wait_streaming(&cluster);
    let victim = busiest_decode(&cluster);
    let victim_id = format!("decode-{victim}");
    cluster.decode[victim].signal(libc::SIGSTOP);

    let got = flight.finish(&rt);
    assert_reference(got, &want, &cluster);
    assert!(migrations(&cluster) >= 1.0, "no stream moved\n{}", cluster.logs());
    // The router no longer counts the frozen worker as serving.
    let usable = |h: &v1::HealthResponse| h.workers.iter().any(|w| w.worker_id == victim_id && w.healthy);
    let deadline = Instant::now() + Duration::from_secs(60);
    while block_on(health(router)).is_ok_and(|h| usable(&h)) {
        assert!(Instant::now() < deadline, "{victim_id} still healthy while frozen\n{}", cluster.logs());
        std::thread::sleep(Duration::from_millis(50));
    }

    // Thawed, it registers again, lets go of the sequences that moved, and takes new work.
    cluster.decode[victim].signal(libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !block_on(health(router)).is_ok_and(|h| usable(&h)) {
        assert!(Instant::now() < deadline, "{victim_id} never came back\n{}", cluster.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.assert_quiescent(Duration::from_secs(30));
    let finished = |c: &Cluster| {
        block_on(stats(c.decode[victim].addr(), false)).expect("the thawed worker answers").requests_finished
    };
    let before = finished(&cluster);
    // New prompts (the moved ones are cached on the other worker, which would draw them), a few
    // at a time, until one lands on the thawed worker: the choice goes by load, so it comes soon.
    let mut rounds = 0;
    while finished(&cluster) == before {
        rounds += 1;
        assert!(rounds <= 10, "no later request ran on {victim_id}\n{}", cluster.logs());
        let later: Vec<Vec<u32>> = (0..4)
            .map(|i| {
                model.tokenizer().encode(&format!("Later request {rounds}.{i} after the thaw"), true).unwrap()
            })
            .collect();
        let want = expected(model, &later, 8);
        let got = block_on(async {
            let tasks: Vec<_> = later.iter().map(|p| tokio::spawn(generate(router, request(p, 8)))).collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("request task"));
            }
            out
        });
        assert_reference(got, &want, &cluster);
    }
    cluster.assert_quiescent(Duration::from_secs(20));
}

#[test]
fn killing_the_only_decode_worker_mid_stream_gives_the_client_an_error() {
    let model = TestModel::tiny();
    let (prompts, max_tokens) = workload(&model);
    let mut spec = spec(&model);
    spec.decode_workers = 1;
    let mut cluster = Cluster::start(spec);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let flight = InFlight::start(&rt, cluster.router.addr(), &prompts[..2], max_tokens);
    flight.wait_streaming(&cluster);
    cluster.decode[0].signal(libc::SIGSTOP);
    cluster.decode[0].kill();
    drop(cluster.decode.remove(0));
    for r in flight.finish(&rt) {
        let err = r.expect_err("nowhere to move the stream");
        assert!(matches!(err.code(), tonic::Code::Aborted | tonic::Code::Unavailable), "{err:?}");
        assert!(!err.message().is_empty(), "{err:?}");
    }
    assert_eq!(migrations(&cluster), 0.0);
    cluster.assert_quiescent(Duration::from_secs(20));
}

#[test]
fn a_restarted_router_gets_its_workers_back() {
    let model = TestModel::tiny();
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.kv_blocks = 128;
    spec.router_args = vec!["--heartbeat-ms".into(), "500".into()];
    let mut cluster = Cluster::start(spec.clone());
    let router = cluster.router.addr();
    let reqs: Vec<Req> =
        (0..3).map(|i| Req::text(format!("Request {i} to a router that restarts:"), 12)).collect();
    let want = reference(&model.path, &reqs, 1024, 16);
    let ask = |cluster: &Cluster| {
        for (i, r) in reqs.iter().enumerate() {
            let got = block_on(generate(router, r.to_proto()))
                .unwrap_or_else(|s| panic!("request {i} failed: {s:?}\n{}", cluster.logs()));
            assert_eq!(got, want[i], "request {i}");
        }
    };
    ask(&cluster);

    cluster.router.kill();
    // The same address, so that the workers find it; nobody tells them to register again.
    let mut args =
        vec!["--listen".to_string(), router.to_string(), "--model".into(), model.path.display().to_string()];
    args.extend(spec.router_args.iter().cloned());
    let mut restarted = Proc::spawn("router-2", &bin("tandem-router"), &args);
    restarted.wait_listening(Duration::from_secs(60));
    cluster.router = restarted;
    cluster.wait_registered(2, Duration::from_secs(60));
    ask(&cluster);
    cluster.assert_quiescent(Duration::from_secs(20));
}
