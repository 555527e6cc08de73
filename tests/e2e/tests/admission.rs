//! Admission by free KV blocks through the real processes: a decode worker with room for only a
//! few sequences at a time (32 blocks) gets 16 concurrent requests. None fails: each waits in the router
//! until the decode worker has free blocks for its prompt, then runs, and its greedy output equals
//! the in-process engine's. Afterwards both workers hold nothing.

use std::time::Duration;

use tandem_e2e::*;

/// KV blocks of the decode worker.
const POOL: usize = 32;

model_test!(requests_wait_for_free_kv_blocks_on_a_full_decode_worker_and_all_complete, admission);

fn admission(model: &TestModel) {
    // Prompts of about 50 to 180 tokens on SmolLM2 (4 to 12 blocks of 16) against a 32-block
    // decode pool; each one fits the pool alone.
    let reqs: Vec<Req> = (0..16)
        .map(|i| {
            let req = |words: usize| {
                let text: Vec<String> = (0..words).map(|w| format!("w{}", (w * 7 + i) % 50)).collect();
                Req::text(format!("List {i}: {}. Next:", text.join(" ")), 12 + (i as u32 % 5))
            };
            let r = req(15 + 4 * i);
            assert!(model.prompt_tokens(&r) + 16 < POOL * 16, "request {i} does not fit the decode pool");
            r
        })
        .collect();
    let t0 = std::time::Instant::now();
    let expected = reference(&model.path, &reqs, 1024, 16);
    eprintln!("reference: {:.1} s", t0.elapsed().as_secs_f64());
    let blocks: Vec<usize> = expected.iter().map(|c| c.prompt_token_ids.len().div_ceil(16)).collect();
    let all: usize = blocks.iter().sum();
    eprintln!("prompt blocks: {blocks:?}");
    assert!(all > 2 * POOL, "the workload ({all} prompt blocks) must not fit the decode pool at once");

    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.kv_blocks = 512;
    spec.decode_kv_blocks = Some(POOL);
    spec.router_args = vec!["--kv-wait-ms".into(), "300000".into()];
    let cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let t0 = std::time::Instant::now();
    let got = generate_all(router, &reqs);
    eprintln!("16 requests through the cluster: {:.1} s", t0.elapsed().as_secs_f64());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        match g {
            Ok(c) => assert_eq!(c, e, "request {i} ({} prompt tokens) differs", e.prompt_token_ids.len()),
            Err(s) => panic!("request {i} failed: {s:?}\n{}", cluster.logs()),
        }
    }
    let stats = cluster.assert_quiescent(Duration::from_secs(10));
    let decode = &stats.iter().find(|(n, _)| n.starts_with("decode")).expect("decode stats").1;
    assert_eq!(decode.kv.as_ref().map(|k| k.total), Some(POOL as u32));
    let tr = decode.transfers.unwrap_or_default();
    assert_eq!((tr.transfers, tr.failures, tr.checksum_failures), (16, 0, 0), "{tr:?}");

    // The requests did wait: the decode worker refused Reserves and the router tried again.
    let http = cluster.router.http.expect("the router announces its HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the router answers /metrics");
    assert_eq!(code, 200, "{text}");
    let waits = sample(&text, "tandem_router_kv_waits_total").expect("tandem_router_kv_waits_total");
    assert!(waits > 0.0, "no request had to wait, so this test showed nothing:\n{text}");
    assert_eq!(sample(&text, "tandem_router_queue_depth"), Some(0.0));
    eprintln!("{waits} Reserve calls refused for lack of blocks, all retried");
}
