//! Several routers over one set of workers (`--router A,B` on every worker): each router admits
//! and serves on its own, both give the same greedy output, and when one router is killed its
//! clients get an error while the other router's streams finish, the workers cancel the dead
//! router's work and free every block, and the survivor goes on serving.

use std::time::{Duration, Instant};

use tandem_e2e::*;
use tandem_proto::v1;

fn long(prompt: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text(prompt.into())),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn two_routers_share_the_workers_and_one_dying_leaks_nothing() {
    let model = TestModel::tiny();
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.routers = 2;
    spec.kv_blocks = 256;
    // Short leases, so a reservation the dead router made and never used ends soon.
    spec.decode_args = vec!["--lease-ms".into(), "2000".into()];
    let mut cluster = Cluster::start(spec);
    let (a, b) = (cluster.router.addr(), cluster.more_routers[0].addr());

    // Both routers serve, with the same greedy output.
    for i in 0..3 {
        let r = Req::text(format!("Both routers, request {i}:"), 8);
        let via_a = block_on(generate(a, r.to_proto())).expect("router A serves");
        let via_b = block_on(generate(b, r.to_proto())).expect("router B serves");
        assert_eq!(via_a.token_ids, via_b.token_ids);
        assert_eq!(via_a.token_ids.len(), 8);
    }

    // Streams on both; router B dies mid-stream.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (on_a, on_b) = rt.block_on(async {
        let on_a: Vec<_> =
            (0..3).map(|i| tokio::spawn(generate(a, long(&format!("On A {i}:"), 120)))).collect();
        let mut client = TandemClient::new(channel(b).await.unwrap());
        let mut stream = client.generate(long("On B:", 400)).await.unwrap().into_inner();
        let mut got = 0;
        while got < 3 {
            got += stream.message().await.unwrap().expect("open").token_ids.len();
        }
        // Frozen first, so a fast model cannot finish the stream before the kill lands.
        cluster.more_routers[0].signal(libc::SIGSTOP);
        cluster.more_routers[0].kill();
        let t0 = Instant::now();
        let on_b = loop {
            match tokio::time::timeout(Duration::from_secs(10), stream.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => break Ok(()),
                Ok(Err(st)) => break Err(st),
                Err(_) => panic!("the client of the dead router was left waiting"),
            }
        };
        assert!(t0.elapsed() < Duration::from_secs(10));
        let mut done = Vec::new();
        for h in on_a {
            done.push(h.await.unwrap());
        }
        (done, on_b)
    });
    assert!(on_b.is_err(), "a stream through the killed router cannot finish");
    for (i, r) in on_a.into_iter().enumerate() {
        let c = r.unwrap_or_else(|s| panic!("stream {i} on router A failed: {s:?}\n{}", cluster.logs()));
        assert_eq!(c.token_ids.len(), 120);
    }
    // The workers cancel what the dead router left (its streams broke, its reservations expire).
    cluster.assert_quiescent(Duration::from_secs(30));
    // Router A goes on serving; the workers stay registered with it.
    let c = block_on(generate(a, Req::text("After router B died:", 6).to_proto())).expect("router A serves");
    assert_eq!(c.token_ids.len(), 6);
    let h = block_on(health(a)).unwrap();
    assert!(h.serving && h.workers.iter().filter(|w| w.healthy).count() == 2, "{h:?}");
}
