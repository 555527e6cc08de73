//! Token parity through the real processes: 32 concurrent greedy requests of mixed prompt lengths
//! (1 to 1000+ tokens on SmolLM2, 1 to 300+ on the tiny fixture model) and output lengths through
//! router → prefill → decode, over each KV transport, give exactly the token ids and text of the
//! in-process engine. Afterwards every worker is quiescent (free == total, invariants hold) and the
//! decode worker verified every transfer's checksums.

use std::time::Duration;

use tandem_e2e::*;

/// A paragraph to build prompts of any length from.
const PARAGRAPH: &str = "The river town kept its clocks by the ferry. Every morning the first boat left \
at six, and the baker, the teacher and the harbour master all set their watches by its horn. When \
the fog came in from the estuary the horn sounded twice, and the children counted the seconds \
between the echoes to guess how far the fog reached. Nobody remembered who had started the custom, \
but everybody agreed that the town would be lost without it.";

/// 32 requests: prompt lengths from one word to the model's long prompt (over 1000 tokens on
/// SmolLM2), output lengths 1 to 40, a few chat prompts and stop strings. Prompts are cut to fit
/// the model's context.
fn workload(model: &TestModel) -> Vec<Req> {
    let words: Vec<&str> = PARAGRAPH.split_whitespace().collect();
    // The first `n` words of the paragraph repeated; a counter keeps long prompts distinct.
    let text_of = |n: usize| -> String {
        if n == 1 {
            return "Hello".into();
        }
        let mut text = String::new();
        let mut k = 0;
        while text.split_whitespace().count() < n {
            if k > 0 && k % words.len() == 0 {
                text.push_str(&format!(" ({})", k / words.len()));
            }
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(words[k % words.len()]);
            k += 1;
        }
        text
    };
    let mut reqs = Vec::new();
    let sizes = [1usize, 2, 3, 5, 8, 13, 21, 34, 55, 80, 120, 200, 300, 450, 600];
    for (i, &n) in sizes.iter().enumerate() {
        let max_tokens = [1, 7, 16, 33, 40][i % 5];
        reqs.push(model.fit(n, |k| Req::text(text_of(k), max_tokens)));
        let max_tokens = [24, 3, 40, 12][i % 4];
        reqs.push(model.fit(n, |k| {
            let mut r = Req::text(format!("Question {i}: {}\nAnswer:", text_of(k)), max_tokens);
            r.chat = i % 5 == 2;
            if i % 7 == 3 {
                r.stop = vec!["the".into()];
            }
            r
        }));
    }
    // The long prompt: the paragraph 12 times (over 1000 tokens), or as often as the context takes.
    reqs.push(model.fit(12, |k| Req::text(format!("{PARAGRAPH} ").repeat(k) + "In short,", 20)));
    // One character: one token after BOS on any byte-level vocabulary.
    reqs.push(Req::text("A", 5));
    assert_eq!(reqs.len(), 32);
    reqs
}

fn parity(model: &TestModel, transport: &str) {
    parity_with(model, transport, &[]);
}

/// Over nixl (NIXL's UCX backend), with `env` added to the workers' environment.
fn parity_over_nixl_with(model: &TestModel, test: &str, env: &[(&str, &str)]) {
    if tandem_e2e::external::nixl_library(test) {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        parity_with(model, "nixl", &env);
    }
}

fn parity_with(model: &TestModel, transport: &str, env: &[(String, String)]) {
    let reqs = workload(model);
    let expected = reference(&model.path, &reqs, 1024, 16);
    let lens: Vec<usize> = expected.iter().map(|c| c.prompt_token_ids.len()).collect();
    let (shortest, longest) = (*lens.iter().min().unwrap(), *lens.iter().max().unwrap());
    assert!(shortest <= 2, "shortest prompt has {shortest} tokens");
    assert!(longest >= model.long_prompt, "longest prompt has {longest} tokens");

    let mut spec = ClusterSpec::new(model.path.clone(), transport);
    spec.kv_blocks = 1024;
    spec.worker_env = env.to_vec();
    let cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let got = generate_all(router, &reqs);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        match g {
            Ok(c) => assert_eq!(
                c,
                e,
                "request {i} ({} prompt tokens) differs over {transport}",
                e.prompt_token_ids.len()
            ),
            Err(s) => panic!("request {i} failed over {transport}: {s:?}\n{}", cluster.logs()),
        }
    }
    let stats = cluster.assert_quiescent(Duration::from_secs(10));
    let decode = &stats.iter().find(|(n, _)| n.starts_with("decode")).expect("decode stats").1;
    let tr = decode.transfers.unwrap_or_default();
    // Requests whose first token ends them still transfer (the reservation is filled first).
    assert_eq!(tr.transfers, 32, "decode worker counted {} transfers: {tr:?}", tr.transfers);
    assert_eq!(tr.checksum_failures, 0, "{tr:?}");
    assert_eq!(tr.failures, 0, "{tr:?}");
    assert!(tr.bytes > 0);
}

model_test!(parity_over_tcp, |m| parity(m, "tcp"));

model_test!(parity_over_shm, |m| parity(m, "shm"));

// NIXL's UCX backend picks its own transports on one host (cross-memory attach here); with
// UCX_TLS=tcp it moves the bytes over TCP, as between two hosts without RDMA.
model_test!(parity_over_nixl, |m| parity_over_nixl_with(m, "parity_over_nixl", &[]));

model_test!(parity_over_nixl_ucx_tcp, |m| parity_over_nixl_with(
    m,
    "parity_over_nixl_ucx_tcp",
    &[("UCX_TLS", "tcp")]
));

// Every family beyond Llama through the cluster: the same tokens as its in-process engine.
family_test!(family_parity_over_tcp, |m| parity(m, "tcp"));

family_test!(family_parity_over_shm, |m| parity(m, "shm"));

/// The colocated mode (one worker runs both phases) gives the same output too.
fn colocated(model: &TestModel) {
    let reqs: Vec<Req> = workload(model).into_iter().step_by(4).collect();
    let expected = reference(&model.path, &reqs, 1024, 16);
    let mut spec = ClusterSpec::new(model.path.clone(), "auto");
    spec.kv_blocks = 1024;
    spec.colocated = true;
    let cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let got = generate_all(router, &reqs);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            g.as_ref().unwrap_or_else(|s| panic!("request {i}: {s:?}\n{}", cluster.logs())),
            e,
            "request {i}"
        );
    }
    cluster.assert_quiescent(Duration::from_secs(10));
}

model_test!(parity_colocated, colocated);
