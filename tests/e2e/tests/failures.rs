//! Failure and cancellation through the real processes: a decode worker killed mid-request with
//! migration off ends the client's stream with an error quickly (moved streams are the subject of
//! `migration.rs`), a prefill worker killed mid-prefill hands the prompt to the other one (or,
//! when it was the only one, to the decode worker, which computes it itself), a KV transfer cut
//! mid-way is recomputed on the decode worker, the survivors free everything, and the router keeps serving with the workers that remain; cancelling at random moments leaks nothing; a worker whose
//! compatibility record or transports do not match is refused at registration.

use std::time::{Duration, Instant};

use rand::Rng;
use tandem_e2e::*;
use tandem_proto::v1;

/// A request that keeps the decode worker busy for a while.
fn long_output(prompt: &str) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text(prompt.into())),
        max_tokens: Some(2000),
        ignore_eos: true,
        ..Default::default()
    }
}

fn spec(model: &TestModel, transport: &str) -> ClusterSpec {
    let mut spec = ClusterSpec::new(model.path.clone(), transport);
    spec.kv_blocks = 256;
    spec
}

/// A prompt of about `repeats` times `unit`, cut to leave the model room for some output.
fn fitted_prompt(model: &TestModel, unit: &str, repeats: usize) -> String {
    model.fit(repeats, |k| Req::text(unit.repeat(k), 64)).prompt
}

/// Finds the worker among `procs` that reports work in progress.
async fn busy_worker(procs: &[Proc]) -> Option<usize> {
    for (i, p) in procs.iter().enumerate() {
        let load = stats(p.addr(), false).await.ok().and_then(|s| s.load);
        if load.is_some_and(|l| l.running + l.queued > 0) {
            return Some(i);
        }
    }
    None
}

model_test!(
    with_migration_off_killing_the_decode_worker_mid_stream_fails_the_request_fast_and_the_router_keeps_serving,
    kill_decode
);

fn kill_decode(model: &TestModel) {
    kill_decode_over(model, "tcp");
}

// The same over nixl: a peer that disappears takes the same path as on tcp.
model_test!(killing_the_decode_worker_over_nixl_fails_the_request_fast_and_the_router_keeps_serving, |m| {
    if tandem_e2e::external::nixl_library("killing_the_decode_worker_over_nixl") {
        kill_decode_over(m, "nixl");
    }
});

fn kill_decode_over(model: &TestModel, transport: &str) {
    let mut spec = spec(model, transport);
    spec.decode_workers = 2;
    // With migration on, the stream would move to the other decode worker instead of failing.
    spec.router_args = vec!["--max-migrations".into(), "0".into()];
    let mut cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (err, latency) = rt.block_on(async {
        let mut client = TandemClient::new(channel(router).await.unwrap());
        let mut stream = client.generate(long_output("Once upon a time")).await.unwrap().into_inner();
        // Let a few tokens arrive so the sequence is streaming from a decode worker.
        let mut tokens = 0;
        while tokens < 4 {
            let msg = stream.message().await.unwrap().expect("stream open");
            tokens += msg.token_ids.len();
        }
        let victim = busy_worker(&cluster.decode).await.expect("one decode worker is running the sequence");
        // Frozen first, so a fast model cannot finish the sequence before the kill lands.
        cluster.decode[victim].signal(libc::SIGSTOP);
        let killed_at = Instant::now();
        cluster.decode[victim].kill();
        let dead = cluster.decode.remove(victim);
        drop(dead);
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("stream ended normally after its decode worker was killed"),
                Err(status) => return (status, killed_at.elapsed()),
            }
        }
    });
    assert!(
        matches!(err.code(), tonic::Code::Aborted | tonic::Code::Unavailable),
        "unexpected status {err:?}"
    );
    // A liveness bound from the requirements (a dead peer is noticed at once), not a speed target.
    assert!(latency < Duration::from_secs(2), "error took {latency:?}: {err:?}");
    // The prefill worker and the surviving decode worker hold nothing.
    cluster.assert_quiescent(Duration::from_secs(10));
    // The router keeps serving with the remaining decode worker.
    for i in 0..3 {
        let r = Req::text(format!("Request {i} after the failure:"), 8);
        let c = block_on(generate(router, r.to_proto()))
            .unwrap_or_else(|s| panic!("request {i} after the kill failed: {s:?}\n{}", cluster.logs()));
        assert_eq!(c.token_ids.len(), 8, "{c:?}");
    }
    cluster.assert_quiescent(Duration::from_secs(10));
}

model_test!(killing_the_prefill_worker_mid_prefill_moves_the_prompt_to_the_other_one, kill_prefill);

fn kill_prefill(model: &TestModel) {
    kill_prefill_over(model, "tcp");
}

model_test!(killing_the_prefill_worker_over_nixl_moves_the_prompt_to_the_other_one, |m| {
    if tandem_e2e::external::nixl_library("killing_the_prefill_worker_over_nixl") {
        kill_prefill_over(m, "nixl");
    }
});

fn kill_prefill_over(model: &TestModel, transport: &str) {
    let mut spec = spec(model, transport);
    spec.prefill_workers = 2;
    if model.name == "tiny" {
        // The tiny model computes a whole prompt in one short step: chunk it finely so the prefill
        // worker is still computing when the test looks.
        spec.max_batch_tokens = 4;
    }
    let mut cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    // About 2000 prompt tokens on SmolLM2 (as much as fits on the tiny model): long enough to kill
    // the prefill worker while it computes.
    let prompt = fitted_prompt(model, "The quick brown fox jumps over the lazy dog near the old mill. ", 150);
    let req = v1::GenerateRequest { max_tokens: Some(16), ..long_output(&prompt) };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let moved = rt.block_on(async {
        let call = tokio::spawn(generate(router, req.clone()));
        // Wait until a prefill worker has the prompt.
        let deadline = Instant::now() + Duration::from_secs(30);
        let victim = loop {
            if let Some(i) = busy_worker(&cluster.prefill).await {
                break i;
            }
            assert!(Instant::now() < deadline, "no prefill worker picked up the request\n{}", cluster.logs());
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        cluster.prefill[victim].kill();
        drop(cluster.prefill.remove(victim));
        tokio::time::timeout(Duration::from_secs(120), call)
            .await
            .expect("the client is not left waiting")
            .expect("task")
    });
    let moved = moved.unwrap_or_else(|s| {
        panic!("the request moves to the other prefill worker: {s:?}\n{}", cluster.logs())
    });
    let http = cluster.router.http.expect("the router's HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the router answers /metrics");
    assert_eq!(code, 200, "{text}");
    assert!(
        text.lines().any(|l| l == "tandem_router_migrations_total{phase=\"prefill\"} 1"),
        "one move off the prefill worker counted:\n{text}"
    );
    // The decode worker released the reservation it made for the dead prefill worker.
    cluster.assert_quiescent(Duration::from_secs(10));
    // Greedy: the output of an undisturbed run (the same request on the survivors).
    let again = block_on(generate(router, req)).unwrap_or_else(|s| panic!("rerun failed: {s:?}"));
    assert_eq!(moved.token_ids, again.token_ids);
    assert_eq!(moved.token_ids.len(), 16);
    for i in 0..3 {
        let r = Req::text(format!("Request {i} after the prefill failure:"), 6);
        let c = block_on(generate(router, r.to_proto()))
            .unwrap_or_else(|s| panic!("request {i} after the kill failed: {s:?}\n{}", cluster.logs()));
        assert_eq!(c.token_ids.len(), 6, "{c:?}");
    }
    cluster.assert_quiescent(Duration::from_secs(10));
}

/// `tandem_router_decode_prefills_total{reason}` from the router's `/metrics`.
fn decode_prefills(cluster: &Cluster, reason: &str) -> f64 {
    let http = cluster.router.http.expect("the router's HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the router answers /metrics");
    assert_eq!(code, 200, "{text}");
    sample(&text, &format!("tandem_router_decode_prefills_total{{reason=\"{reason}\"}}"))
        .unwrap_or_else(|| panic!("no decode prefills counter:\n{text}"))
}

model_test!(
    killing_the_only_prefill_worker_mid_prefill_lets_the_decode_worker_compute_the_prompt,
    kill_only_prefill
);

fn kill_only_prefill(model: &TestModel) {
    let mut spec = spec(model, "tcp");
    // No prefix cache: the disturbed run computes the whole prompt again, as the first did.
    for args in [&mut spec.prefill_args, &mut spec.decode_args] {
        args.extend(["--prefix-cache".into(), "false".into()]);
    }
    if model.name == "tiny" {
        spec.max_batch_tokens = 4; // still computing when the test looks (see kill_prefill)
    }
    let mut cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    // About 800 prompt tokens on SmolLM2: a second or more of prefill on one thread, three times.
    let prompt = fitted_prompt(model, "The quick brown fox jumps over the lazy dog near the old mill. ", 60);
    let req = v1::GenerateRequest { max_tokens: Some(16), ..long_output(&prompt) };
    // The undisturbed run: prefill worker, KV transfer, decode worker.
    let undisturbed = block_on(generate(router, req.clone()))
        .unwrap_or_else(|s| panic!("the undisturbed run failed: {s:?}\n{}", cluster.logs()));
    assert_eq!(decode_prefills(&cluster, "no_prefill_worker"), 0.0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let moved = rt.block_on(async {
        let call = tokio::spawn(generate(router, req.clone()));
        let deadline = Instant::now() + Duration::from_secs(30);
        while busy_worker(&cluster.prefill).await.is_none() {
            assert!(
                Instant::now() < deadline,
                "the prefill worker never picked the request up\n{}",
                cluster.logs()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster.prefill[0].kill();
        tokio::time::timeout(Duration::from_secs(120), call)
            .await
            .expect("the client is not left waiting")
            .expect("task")
    });
    let moved = moved.unwrap_or_else(|s| {
        panic!(
            "the decode worker computes the prompt when the only prefill worker dies: {s:?}\n{}",
            cluster.logs()
        )
    });
    assert_eq!(moved.token_ids, undisturbed.token_ids, "greedy output as if nothing happened");
    assert_eq!(decode_prefills(&cluster, "no_prefill_worker"), 1.0);
    // The decode worker alone goes on serving, and holds nothing once idle.
    cluster.prefill.clear();
    for i in 0..2 {
        let r = Req::text(format!("Request {i} with no prefill worker:"), 6);
        let c = block_on(generate(router, r.to_proto())).unwrap_or_else(|s| {
            panic!("request {i} without a prefill worker failed: {s:?}\n{}", cluster.logs())
        });
        assert_eq!(c.token_ids.len(), 6, "{c:?}");
    }
    assert_eq!(decode_prefills(&cluster, "no_prefill_worker"), 3.0);
    cluster.assert_quiescent(Duration::from_secs(10));
}

/// A TCP proxy in front of a decode worker's KV listener that cuts every connection once it has
/// forwarded `cut_after` bytes towards the worker, until told to forward whole.
struct KvCutter {
    addr: std::net::SocketAddr,
    target: std::sync::Arc<std::sync::Mutex<Option<std::net::SocketAddr>>>,
    cutting: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cuts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _rt: tokio::runtime::Runtime,
}

impl KvCutter {
    fn start(cut_after: usize) -> KvCutter {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let k = KvCutter {
            addr,
            target: Default::default(),
            cutting: std::sync::Arc::new(true.into()),
            cuts: Default::default(),
            _rt: rt,
        };
        let (target, cutting, cuts) = (k.target.clone(), k.cutting.clone(), k.cuts.clone());
        k._rt.spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Some(to) = *target.lock().unwrap() else { continue };
                let (cutting, cuts) = (cutting.load(Ordering::SeqCst), cuts.clone());
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(to).await else { return };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let back = tokio::spawn(async move { tokio::io::copy(&mut ro, &mut wi).await });
                    let mut sent = 0usize;
                    let mut buf = vec![0u8; 1024];
                    loop {
                        let n = match ri.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let n = if cutting { n.min(cut_after.saturating_sub(sent)) } else { n };
                        if wo.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        sent += n;
                        if cutting && sent >= cut_after {
                            cuts.fetch_add(1, Ordering::SeqCst);
                            break; // both halves drop: the connection is cut mid-transfer
                        }
                    }
                    back.abort();
                });
            }
        });
        k
    }
}

/// A KV transfer cut mid-way, after the prefill worker computed the prompt: the decode worker
/// computes the prompt itself and the client gets the undisturbed output; once transfers go
/// through again, the split path serves as before.
#[test]
fn a_kv_transfer_cut_midway_is_recomputed_on_the_decode_worker() {
    use std::sync::atomic::Ordering;
    let model = TestModel::tiny();
    // About 77 KB of f16 KV for the prompt below on the tiny model: cut after 4 KiB.
    let cutter = KvCutter::start(4096);
    let mut spec = spec(&model, "tcp");
    spec.decode_args = vec!["--kv-advertise".into(), cutter.addr.to_string()];
    for args in [&mut spec.prefill_args, &mut spec.decode_args] {
        args.extend(["--prefix-cache".into(), "false".into()]);
    }
    let cluster = Cluster::start(spec);
    *cutter.target.lock().unwrap() = Some(cluster.decode[0].kv.expect("the decode worker's KV address"));
    let router = cluster.router.addr();
    let prompt =
        fitted_prompt(&model, "The quick brown fox jumps over the lazy dog near the old mill. ", 150);
    let req = v1::GenerateRequest { max_tokens: Some(16), ..long_output(&prompt) };
    let recomputed = block_on(generate(router, req.clone()))
        .unwrap_or_else(|s| panic!("the request survives a cut transfer: {s:?}\n{}", cluster.logs()));
    assert!(cutter.cuts.load(Ordering::SeqCst) >= 1, "the proxy cut a transfer");
    assert_eq!(decode_prefills(&cluster, "kv_transfer_failed"), 1.0);
    cluster.assert_quiescent(Duration::from_secs(10));
    // Transfers go through again: the same request on the split path, with the same output.
    cutter.cutting.store(false, Ordering::SeqCst);
    let undisturbed = block_on(generate(router, req))
        .unwrap_or_else(|s| panic!("the undisturbed run failed: {s:?}\n{}", cluster.logs()));
    assert_eq!(recomputed.token_ids, undisturbed.token_ids, "greedy output as if nothing happened");
    assert_eq!(recomputed.token_ids.len(), 16);
    assert_eq!(decode_prefills(&cluster, "kv_transfer_failed"), 1.0, "the second run took the split path");
    cluster.assert_quiescent(Duration::from_secs(10));
}

model_test!(random_cancellation_leaks_nothing, cancel_at_random);

/// Requests cancelled at random moments (queued, prefilling, transferring, streaming) leave both
/// workers with every block free, over each transport; the cluster then still gives reference
/// output.
fn cancel_at_random(model: &TestModel) {
    let mut transports = vec!["shm", "tcp"];
    if tandem_e2e::external::nixl_library("random_cancellation_leaks_nothing (over nixl)") {
        transports.push("nixl");
    }
    for transport in transports {
        let cluster = Cluster::start(spec(model, transport));
        let router = cluster.router.addr();
        let mut rng = rand::rng();
        let plans: Vec<(String, u64)> = (0..24)
            .map(|i| {
                let words = [1usize, 10, 60, 200, 400][i % 5];
                let lamp = fitted_prompt(model, "once upon a time there was a lamp ", words / 8 + 1);
                let prompt = format!("Story {i}: {lamp}");
                (prompt, rng.random_range(0..2500u64))
            })
            .collect();
        let finished = block_on(async {
            let tasks: Vec<_> = plans
                .iter()
                .map(|(prompt, cancel_ms)| {
                    let req = long_output(prompt);
                    let cancel = Duration::from_millis(*cancel_ms);
                    tokio::spawn(
                        async move { tokio::time::timeout(cancel, generate(router, req)).await.is_ok() },
                    )
                })
                .collect();
            let mut n = 0;
            for t in tasks {
                n += t.await.expect("task") as usize;
            }
            n
        });
        eprintln!("{transport}: {finished} of {} requests finished before their cancel time", plans.len());
        cluster.assert_quiescent(Duration::from_secs(20));
        let r = Req::text("After the storm of cancellations,", 12);
        let expected = reference(&model.path, std::slice::from_ref(&r), 1024, 16);
        let got = block_on(generate(router, r.to_proto())).expect("cluster still serves");
        assert_eq!(got, expected[0], "{transport}");
        cluster.assert_quiescent(Duration::from_secs(10));
    }
}

/// Starts a router and one prefill worker on the tiny model, then a decode worker with `decode_args`
/// replacing the defaults; returns the decode worker's exit status and log.
fn register_mismatched(
    prefill_extra: &[&str],
    decode_extra: &[&str],
) -> (Option<std::process::ExitStatus>, String) {
    let mut spec = ClusterSpec::new(tiny_model(), "auto");
    spec.kv_blocks = 64;
    let mut router = Proc::spawn(
        "router",
        &bin("tandem-router"),
        &["--listen".into(), "127.0.0.1:0".into(), "--model".into(), tiny_model().display().to_string()],
    );
    let raddr = router.wait_listening(Duration::from_secs(60));
    let override_args = |mut base: Vec<String>, extra: &[&str]| {
        // Later flags would clash with the defaults: drop the defaults the extras replace.
        for pair in extra.chunks(2) {
            if let Some(pos) = base.iter().position(|a| a == pair[0]) {
                base.drain(pos..pos + 2);
            }
        }
        base.extend(extra.iter().map(|s| s.to_string()));
        base
    };
    let pargs = override_args(Cluster::worker_args(&spec, "prefill", raddr, 0), prefill_extra);
    let mut prefill = Proc::spawn("prefill", &bin("tandem-prefill"), &pargs);
    prefill.wait_listening(Duration::from_secs(60));
    // Wait until the prefill worker is registered, so the decode worker is compared with it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while block_on(health(raddr)).map(|h| h.workers.len()).unwrap_or(0) < 1 {
        assert!(Instant::now() < deadline, "prefill worker never registered:\n{}", prefill.log_tail(3000));
        std::thread::sleep(Duration::from_millis(50));
    }
    let dargs = override_args(Cluster::worker_args(&spec, "decode", raddr, 0), decode_extra);
    let mut decode = Proc::spawn("decode", &bin("tandem-decode"), &dargs);
    let status = decode.wait_exit(Duration::from_secs(60));
    let h = block_on(health(raddr)).expect("router still answers");
    assert!(!h.serving, "router serves with a refused worker: {h:?}");
    assert_eq!(h.workers.len(), 1, "{h:?}");
    (status, decode.log_text())
}

#[test]
fn a_worker_with_another_block_size_is_refused_at_registration() {
    let (status, log) = register_mismatched(&[], &["--block-size", "32"]);
    assert_eq!(status.and_then(|s| s.code()), Some(1), "decode worker should exit 1; log:\n{log}");
    assert!(log.contains("block_size") && log.contains("16") && log.contains("32"), "{log}");
}

#[test]
fn a_pair_without_a_common_transport_is_refused_at_registration() {
    let (status, log) = register_mismatched(&["--transport", "shm"], &["--transport", "tcp"]);
    assert_eq!(status.and_then(|s| s.code()), Some(1), "decode worker should exit 1; log:\n{log}");
    assert!(log.contains("shm") && log.contains("tcp"), "{log}");
}

/// A decode worker killed (SIGKILL) five times over shm, each time after a prefill worker has
/// mapped its pool, leaves nothing in the segment directory: not one segment of a killed worker,
/// and none of the live one (its pool is published by descriptor, without a name).
#[test]
fn a_decode_worker_killed_five_times_leaves_no_shared_memory_behind() {
    let model = TestModel::tiny();
    let mut cluster = Cluster::start(spec(&model, "shm"));
    let router = cluster.router.addr();
    let mut killed = Vec::new();
    for round in 0..5 {
        // A transfer, so the prefill worker has the pool mapped when the owner dies.
        let c = block_on(generate(router, Req::text(format!("Round {round} of five:"), 4).to_proto()))
            .unwrap_or_else(|s| panic!("round {round}: {s:?}\n{}", cluster.logs()));
        assert_eq!(c.token_ids.len(), 4);
        let pid = cluster.decode[0].pid();
        assert_eq!(shm_segments_of(&[pid]), Vec::<String>::new(), "the live pool has no name");
        killed.push(pid);
        cluster.decode[0].kill();
        assert_eq!(
            shm_segments_of(&killed),
            Vec::<String>::new(),
            "round {round}: a killed worker left its segment"
        );
        cluster.restart_worker("decode", 0);
        cluster.wait_registered(2, Duration::from_secs(60));
    }
    let c = block_on(generate(router, Req::text("After five kills:", 4).to_proto()))
        .unwrap_or_else(|s| panic!("{s:?}\n{}", cluster.logs()));
    assert_eq!(c.token_ids.len(), 4);
    assert_eq!(shm_segments_of(&killed), Vec::<String>::new());
    // The prefill worker let go of the killed workers' pools (their memory is free).
    let prefill = [cluster.prefill[0].pid()];
    assert_eq!(shm_segments_mapped(&prefill, &killed), Vec::<(i32, String)>::new());
    cluster.assert_quiescent(Duration::from_secs(30));
}
